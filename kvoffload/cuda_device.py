"""``CudaDevice``: the device seam on real CUDA streams and events.

One stream per IO thread, one batched driver copy (``cuda_driver.Driver``) per unit,
events made and recorded through the driver with the GIL held (``DriverEvent``), and
device staging rows for layouts made of small pieces. ``copy_plan`` hands the native
engine the same copy as plain descriptors and driver function addresses.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

import numpy as np
import torch

from kvoffload.block_layout import BlockLayout, CopyPlan, copy_rows, piece_descriptors
from kvoffload.cuda_driver import (
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    Driver,
    DriverEvent,
    MemcpyAttributes,
)
from kvoffload.cuda_gather import FusedPieces, load_fused

# Mean bytes per (tensor, block) piece under which a copy goes through a device
# staging buffer (one DMA descriptor per row, then a gather or scatter between those
# rows and the caches) instead of one DMA descriptor per piece. The driver handles
# about 1.6 M descriptors/s whatever their size: 8 KiB pieces top out near 13 GiB/s,
# 18 KiB near 28. With one gather kernel per tensor the staged path pays a launch per
# tensor per copy, so it only wins for tiny pieces. H200, 8 threads, 16 MiB units,
# H2D / D2H GiB/s: 1 KiB pieces: descriptors 1.4 / 1.9, per-tensor kernels 3.8 / 6.9;
# 8 KiB pieces: descriptors 11.4 / 17.1, per-tensor kernels 2.2 / 4.9 (128 tensors).
# With the fused kernel (cuda_gather.py: one launch per copy) staging pays off for loads
# up to pieces of llama's 32 KiB, which descriptors already move at 0.96 of pinned. Stores
# (device to host) take descriptors far better: MLA's 18 KiB pieces moved at 37.4 GiB/s
# as descriptors, 17.9-19.7 staged; 8 KiB pieces 17.1 as descriptors, 23.5 staged.
STAGE_BELOW_BYTES = 4096
FUSED_STAGE_BELOW_BYTES = {False: 32 << 10, True: 16 << 10}  # to_host -> mean piece bytes


class _ThreadStream(torch.cuda.Stream):
    """An IO thread's stream, with its device staging rows when the layout needs them."""

    stage: Optional[torch.Tensor] = None


class CudaDevice:
    """Real CUDA streams and events; one batched driver call per copy."""

    def __init__(self, device: torch.device, blocking_events: bool = True) -> None:
        self.device = device
        # A blocking event makes a waiting thread sleep instead of spin: with many IO
        # threads on few cores, spinning waiters take the CPU the others encrypt with.
        # H200, 4 RAM-backed drives, 8 threads per lane: store 10.7 GiB/s blocking,
        # 4.9 spinning (scripts/probe_fast_storage.py).
        self.blocking_events = blocking_events
        self._driver = Driver()
        # Stores read the cache in stream order (after wait_event: compute may still
        # write it, vLLM #45704); loads read staging rows that do not change until the
        # copy's event completes, so the driver may reorder them (ANY, vLLM #39306).
        self._attr_store = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._attr_load = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_ANY)
        self._pinned: dict[int, int] = {}
        self._lock = threading.Lock()
        self._fused: Optional[FusedPieces] = None
        self._fused_checked = False

    def bind_thread(self, stream: Any, layout: Optional[BlockLayout] = None, rows: int = 0,
                    to_host: Optional[bool] = None) -> Any:
        torch.cuda.set_device(self.device)
        # One stream per IO thread, at the lane stream's priority (vLLM's offload
        # streams: lowest, so copies yield to compute): on one shared stream the
        # threads' copies run one after another, and a copy of many small
        # descriptors is bound by per-descriptor DMA cost, not PCIe. Measured on the
        # H200 (64 x 32 KiB tensors, 16 MiB units, 8 threads): 28 GiB/s shared,
        # 44 GiB/s per thread, against 51.5 GiB/s contiguous pinned H2D.
        own = _ThreadStream(self.device, priority=getattr(stream, "priority", 0))
        if layout is not None and rows > 0 and self.stages(layout, to_host):
            # One buffer serves both staging halves of a load thread: its copies are
            # ordered on this stream, so a row DMA never overtakes the last scatter.
            with torch.cuda.stream(own):  # allocated for, and freed after, this stream's work
                own.stage = torch.empty((rows, layout.block_bytes), dtype=torch.int8, device=self.device)
        return own

    def fused(self, layout: BlockLayout) -> Optional[FusedPieces]:
        """The fused gather kernel for this layout, or None (checked once per device)."""
        with self._lock:
            if not self._fused_checked:
                self._fused = load_fused(self.device)
                self._fused_checked = True
        return self._fused if self._fused is not None and FusedPieces.fits(layout) else None

    def stages(self, layout: BlockLayout, to_host: Optional[bool] = None) -> bool:
        """Whether copies of this layout in this direction (None: either) go through device
        staging rows."""
        piece = layout.block_bytes / len(layout.caches)
        below = max(FUSED_STAGE_BELOW_BYTES.values()) if to_host is None else FUSED_STAGE_BELOW_BYTES[to_host]
        if len(layout.caches) > 1 and piece < below and self.fused(layout) is not None:
            return True
        return piece < STAGE_BELOW_BYTES

    def new_event(self) -> DriverEvent:
        # Recorded again for every copy of one staging buffer: creating and destroying
        # an event per copy takes driver locks the IO threads then queue on (H200, 16
        # MiB units: 40-45 GiB/s H2D with a new event per copy, 50 GiB/s reused).
        return DriverEvent(self._driver, self.blocking_events)

    def pin(self, host: torch.Tensor) -> None:
        # cudaHostRegister pins exactly this range; PyTorch's pinned allocator would
        # round the size up to a power of two.
        ptr, n = host.data_ptr(), host.numel() * host.element_size()
        with torch.cuda.device(self.device):
            err = torch.cuda.cudart().cudaHostRegister(ptr, n, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {n} bytes failed: error {int(err)}")
        with self._lock:
            self._pinned[ptr] = n

    def unpin(self, host: torch.Tensor) -> None:
        # Unregister what we registered, so init -> shutdown -> init works (vLLM 0.33
        # leaks the registration and the second init fails in cudaHostRegister).
        ptr = host.data_ptr()
        with self._lock:
            if self._pinned.pop(ptr, None) is None:
                return
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister failed: error {int(err)}")

    def copy_to_host(self, stream, layout, block_ids, host, rows, wait_event=None, event=None) -> DriverEvent:
        if wait_event is not None:
            self._driver.stream_wait(stream, wait_event)
        return self._copy(stream, layout, block_ids, host, rows, True, event)

    def copy_to_device(self, stream, layout, host, rows, block_ids, event=None) -> DriverEvent:
        return self._copy(stream, layout, block_ids, host, rows, False, event)

    def host_view(self, layout: BlockLayout) -> Optional[memoryview]:
        return None  # device memory: the file IO reaches it only through pinned staging

    def copy_plan(self, stream, layout, to_host: bool, events) -> Optional[CopyPlan]:
        """``Device.copy_plan``: the batched driver copy of ``copy_to_*``, as descriptors the
        native engine's worker launches itself; None where the copy needs torch (device
        staging rows and their kernels)."""
        if getattr(stream, "stage", None) is not None and self.stages(layout, to_host):
            return None
        fn = self._driver.addresses
        attr = self._attr_store if to_host else self._attr_load
        return CopyPlan("cuda", *layout.pointer_arrays,
                        functions={"batch": fn["cuMemcpyBatchAsync"], "record": fn["cuEventRecord"],
                                   "sync": fn["cuEventSynchronize"], "stream_wait": fn["cuStreamWaitEvent"]},
                        attrs=ctypes.addressof(attr), stream=stream.cuda_stream,
                        events=tuple(e.handle for e in events), keep=(attr, stream, *events))

    def event_handle(self, event: Any) -> Optional[int]:
        if isinstance(event, DriverEvent):
            return event.handle
        handle = getattr(event, "cuda_event", None)  # a torch.cuda.Event (0 until recorded)
        return None if handle is None else int(handle)

    def _staged(self, stream, layout: BlockLayout, n: int, to_host: bool) -> bool:
        stage = getattr(stream, "stage", None)
        return stage is not None and n <= stage.shape[0] and self.stages(layout, to_host)

    @staticmethod
    def _host_rows(host: torch.Tensor, rows) -> np.ndarray:
        slot = host.stride(0) * host.element_size()
        return np.uint64(host.data_ptr()) + np.asarray(rows, dtype=np.uint64) * np.uint64(slot)

    def _copy(self, stream, layout, block_ids, host, rows, to_host: bool, event) -> DriverEvent:
        attr = self._attr_store if to_host else self._attr_load
        if self._staged(stream, layout, len(block_ids), to_host):
            # Packed host rows <-> device rows, one descriptor each; per tensor one gather
            # (store) or scatter (load) kernel between those rows and the caches.
            stage = stream.stage
            hst_rows = self._host_rows(host, rows)
            n, row_bytes = len(block_ids), stage.shape[1]
            dev_rows = np.uint64(stage.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(row_bytes)
            sizes = np.full(n, row_bytes, dtype=np.uint64)
            with torch.cuda.stream(stream):
                # Pinned, so the index upload is async; the host allocator keeps the
                # buffer until the copy on this stream is done.
                idx = torch.tensor(list(block_ids), dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
                fused = self.fused(layout)
                if to_host:
                    if fused is not None:
                        fused.move(layout, idx, stage, to_stage=True)
                    else:
                        copy_rows(layout, idx, stage, None, to_host=True)
                    self._driver.memcpy_batch(hst_rows, dev_rows, sizes, attr, stream)
                else:
                    self._driver.memcpy_batch(dev_rows, hst_rows, sizes, attr, stream)
                    if fused is not None:
                        fused.move(layout, idx, stage, to_stage=False)
                    else:
                        copy_rows(layout, idx, stage, None, to_host=False)
        else:
            self._driver.memcpy_batch(*piece_descriptors(layout, block_ids, host, rows, to_host), attr, stream)
        ev = event if event is not None else self.new_event()
        ev.record(stream)
        return ev
