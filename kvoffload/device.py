"""The device seam: streams, events, batched block copies and host pinning.

The backend never calls CUDA directly. ``CudaDevice`` drives real streams and
events; ``CpuDevice`` runs the same pipeline on CPU tensors (CI exercises the real
file path with it, it is not a mock); kvsim's ``SimDevice`` completes copies on a
clock the test controls. All three implement ``Device``.

Copies move whole blocks between the device caches and a host buffer viewed as
``[rows, slot_bytes]``: block ``block_ids[j]`` of every cache tensor lands in row
``rows[j]`` at that tensor's offset within the slot (the packed slot layout, so
each slot is one aligned span however odd the per-tensor sizes are).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class BlockLayout:
    """Where each cache tensor's block lives, and where it goes in a packed slot."""

    caches: tuple[torch.Tensor, ...]  # int8 [num_blocks, bytes_k] views of the device caches
    offsets: tuple[int, ...]  # byte offset of cache k inside a slot
    block_bytes: int  # sum of bytes_k: the payload of one slot
    num_blocks: int

    @classmethod
    def from_caches(cls, gpu_caches: dict[str, torch.Tensor]) -> "BlockLayout":
        if not gpu_caches:
            raise ValueError("gpu_caches is empty: nothing to offload")
        views, offsets, total, num_blocks = [], [], 0, None
        for name, t in gpu_caches.items():
            if t.dim() < 1 or t.shape[0] == 0:
                raise ValueError(f"cache {name!r} has shape {tuple(t.shape)}: need [num_blocks, ...]")
            if num_blocks is not None and t.shape[0] != num_blocks:
                raise ValueError(
                    f"cache {name!r} has {t.shape[0]} blocks, others have {num_blocks}"
                )
            num_blocks = t.shape[0]
            bpb = t.stride(0) * t.element_size()
            # Re-view the storage as int8 [num_blocks, bpb] (as vLLM's worker does):
            # block i is t[i] with stride(0) * element_size() bytes.
            byte_off = t.storage_offset() * t.element_size()
            if byte_off + num_blocks * bpb > t.untyped_storage().nbytes():
                raise ValueError(f"cache {name!r}: {num_blocks} blocks of {bpb} B overrun its storage")
            v = torch.empty(0, dtype=torch.int8, device=t.device)
            v.set_(t.untyped_storage(), byte_off, (num_blocks, bpb), (bpb, 1))
            views.append(v)
            offsets.append(total)
            total += bpb
        return cls(tuple(views), tuple(offsets), total, int(num_blocks))

    @functools.cached_property
    def pointer_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(base address, bytes per block, offset in slot) per cache, for copy descriptors."""
        bases = np.array([c.data_ptr() for c in self.caches], dtype=np.uint64)
        bpb = np.array([c.shape[1] for c in self.caches], dtype=np.uint64)
        return bases, bpb, np.array(self.offsets, dtype=np.uint64)


def alloc_host(nbytes: int, alignment: int) -> torch.Tensor:
    """An ``alignment``-aligned uint8 host tensor of ``nbytes`` (a view that keeps its
    over-sized allocation alive).

    The CPU allocator only guarantees 64-byte alignment, and O_DIRECT rejects a
    buffer that is not aligned to the file system's DIO memory alignment, so we
    over-allocate and slice (vLLM's ``_alloc_aligned`` does the same).
    """
    backing = torch.empty(nbytes + alignment, dtype=torch.uint8)
    skew = (-backing.data_ptr()) % alignment
    return backing[skew : skew + nbytes]


class Device(Protocol):
    """What the backend needs from a device. Streams may be None on CPU."""

    def bind_thread(self, stream: Any, layout: Optional[BlockLayout] = None, rows: int = 0) -> Any:
        """Prepare a worker thread for device work; return the stream its copies go on.

        ``stream`` is the lane's stream (vLLM's load or store stream). ``layout`` and
        ``rows`` (the most rows one copy moves) let the device set up per-thread
        state for that shape; raises if it cannot (device memory).
        """

    def new_event(self) -> Any:
        """An event for ``copy_to_*``'s ``event=``, or None where copies make their own."""

    def pin(self, host: torch.Tensor) -> None:
        """Page-lock a host buffer for async copies; undone by ``unpin``."""

    def unpin(self, host: torch.Tensor) -> None: ...

    def copy_to_host(
        self,
        stream: Any,
        layout: BlockLayout,
        block_ids: Sequence[int],
        host: torch.Tensor,
        rows: Sequence[int],
        wait_event: Optional[DeviceEvent] = None,
        event: Any = None,
    ) -> DeviceEvent:
        """Copy device blocks into host rows, after ``wait_event``; return the copy's event.

        ``event`` (from ``new_event``) is recorded again instead of making a new one;
        the caller must be done waiting on its previous record.
        """

    def copy_to_device(
        self,
        stream: Any,
        layout: BlockLayout,
        host: torch.Tensor,
        rows: Sequence[int],
        block_ids: Sequence[int],
        event: Any = None,
    ) -> DeviceEvent:
        """Copy host rows into device blocks; return the copy's event (``event`` as above)."""


class DoneEvent:
    """An event that has already happened (synchronous CPU copies)."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


class CpuDevice:
    """CPU tensors stand in for device memory; copies are synchronous."""

    def bind_thread(self, stream: Any, layout: Optional[BlockLayout] = None, rows: int = 0) -> Any:
        return stream

    def new_event(self) -> Any:
        return None  # copies are synchronous and return DONE

    def pin(self, host: torch.Tensor) -> None:
        return None

    def unpin(self, host: torch.Tensor) -> None:
        return None

    def copy_to_host(self, stream, layout, block_ids, host, rows, wait_event=None, event=None) -> DeviceEvent:
        if wait_event is not None:
            wait_event.synchronize()
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        rows_t = torch.as_tensor(list(rows), dtype=torch.long)
        dst = host.view(torch.int8)
        for cache, off in zip(layout.caches, layout.offsets):
            b = cache.shape[1]
            dst[:, off : off + b].index_copy_(0, rows_t, cache.index_select(0, ids))
        return DONE

    def copy_to_device(self, stream, layout, host, rows, block_ids, event=None) -> DeviceEvent:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        rows_t = torch.as_tensor(list(rows), dtype=torch.long)
        src = host.view(torch.int8)
        for cache, off in zip(layout.caches, layout.offsets):
            b = cache.shape[1]
            cache.index_copy_(0, ids, src[:, off : off + b].index_select(0, rows_t))
        return DONE


# --- CUDA -------------------------------------------------------------------------

_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _CUmemLocation),
        ("dstLocHint", _CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


def _load_memcpy_batch() -> Optional[Any]:
    """cuMemcpyBatchAsync with the CUDA 12.8 ABI (the one with failIdx), or None.

    Resolved through cuGetProcAddress at version 12080 so the signature is fixed
    whatever the driver's own version (CUDA 13 renamed the default to a _v2 ABI
    without failIdx). Called through ctypes with numpy descriptor arrays: building
    one Python object per descriptor (cuda.bindings' list API) costs more than the
    copy for small blocks.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_proc = libcuda.cuGetProcAddress_v2
    except (OSError, AttributeError):
        return None
    fn = ctypes.c_void_p()
    status = ctypes.c_int()
    get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                         ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    rc = get_proc(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(status))
    if rc != 0 or not fn.value:
        return None
    proto = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.POINTER(_CUmemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
    )
    return proto(fn.value)


# Mean bytes per (tensor, block) piece under which a copy goes through a device
# staging buffer (one DMA descriptor per row, then one scatter or gather kernel per
# tensor) instead of one DMA descriptor per piece. The driver handles about 1.6 M
# descriptors/s whatever their size, while the staged path pays one kernel launch
# per tensor per copy. H200, 8 threads, 16 MiB units, H2D / D2H GiB/s:
# 1 KiB pieces: descriptors 1.4 / 1.9, staged 3.8 / 6.9;
# 8 KiB pieces: descriptors 11.4 / 17.1, staged 2.2 / 4.9 (128 tensors).
STAGE_BELOW_BYTES = 4096


class _ThreadStream(torch.cuda.Stream):
    """An IO thread's stream, with its device staging rows when the layout needs them."""

    stage: Optional[torch.Tensor] = None


class CudaDevice:
    """Real CUDA streams and events; one batched driver call per copy where available."""

    def __init__(self, device: torch.device, use_batch_memcpy: bool = True) -> None:
        self.device = device
        self._batch = _load_memcpy_batch() if use_batch_memcpy else None
        self._attr_store = _CUmemcpyAttributes(srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self._attr_load = _CUmemcpyAttributes(srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
        self._pinned: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def batched(self) -> bool:
        return self._batch is not None

    def bind_thread(self, stream: Any, layout: Optional[BlockLayout] = None, rows: int = 0) -> Any:
        torch.cuda.set_device(self.device)
        # One stream per IO thread, at the lane stream's priority: on one shared
        # stream the threads' copies run one after another, and a copy of many
        # small descriptors is bound by per-descriptor DMA cost, not PCIe. Measured
        # on the H200 (64 x 32 KiB tensors, 16 MiB units, 8 threads): 28 GiB/s
        # shared, 44 GiB/s per thread, against 51.5 GiB/s contiguous pinned H2D.
        own = _ThreadStream(self.device, priority=getattr(stream, "priority", 0))
        if layout is not None and rows > 0 and self.stages(layout):
            # One buffer serves both staging halves of a load thread: its copies are
            # ordered on this stream, so a row DMA never overtakes the last scatter.
            with torch.cuda.stream(own):  # allocated for, and freed after, this stream's work
                own.stage = torch.empty((rows, layout.block_bytes), dtype=torch.int8, device=self.device)
        return own

    def stages(self, layout: BlockLayout) -> bool:
        """Whether copies of this layout go through device staging rows."""
        return self._batch is not None and layout.block_bytes / len(layout.caches) < STAGE_BELOW_BYTES

    def new_event(self) -> torch.cuda.Event:
        # Recorded again for every copy of one staging buffer: creating and destroying
        # an event per copy takes driver locks the IO threads then queue on (H200, 16
        # MiB units: 40-45 GiB/s H2D with a new event per copy, 50 GiB/s reused).
        return torch.cuda.Event()

    def pin(self, host: torch.Tensor) -> None:
        # cudaHostRegister pins exactly this range; PyTorch's pinned allocator would
        # round the size up to a power of two.
        ptr, n = host.data_ptr(), host.numel() * host.element_size()
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

    def _descriptors(self, layout, block_ids, host, rows):
        ids = np.asarray(block_ids, dtype=np.uint64)
        rows_a = np.asarray(rows, dtype=np.uint64)
        slot = host.stride(0) * host.element_size()
        bases, bpb, offs = layout.pointer_arrays
        dev = (bases[:, None] + ids[None, :] * bpb[:, None]).ravel()
        hst = (np.uint64(host.data_ptr()) + rows_a[None, :] * np.uint64(slot) + offs[:, None]).ravel()
        sizes = np.repeat(bpb, len(ids))
        return dev, hst, sizes

    def _batch_copy(self, dsts, srcs, sizes, attr, stream) -> None:
        fail_idx = ctypes.c_size_t(0)
        attr_idx = ctypes.c_size_t(0)
        rc = self._batch(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
            ctypes.byref(attr), ctypes.byref(attr_idx), 1, ctypes.byref(fail_idx),
            ctypes.c_void_p(stream.cuda_stream),
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail_idx.value}")

    def _staged_copy(self, stream, stage, layout, block_ids, host, rows, to_host: bool) -> None:
        """Packed host rows <-> device rows in one descriptor each; per tensor, one
        gather (store) or scatter (load) kernel between those rows and the caches."""
        n, row_bytes = stage.shape
        slot = host.stride(0) * host.element_size()
        hst = np.uint64(host.data_ptr()) + np.asarray(rows, dtype=np.uint64) * np.uint64(slot)
        dev = np.uint64(stage.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(row_bytes)
        sizes = np.full(n, row_bytes, dtype=np.uint64)
        with torch.cuda.stream(stream):
            # Pinned, so the index upload is async; the host allocator keeps the
            # buffer until the copy on this stream is done.
            idx = torch.tensor(list(block_ids), dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            if to_host:
                for cache, off in zip(layout.caches, layout.offsets):
                    torch.index_select(cache, 0, idx, out=stage[:, off : off + cache.shape[1]])
                self._batch_copy(hst, dev, sizes, self._attr_store, stream)
            else:
                self._batch_copy(dev, hst, sizes, self._attr_load, stream)
                for cache, off in zip(layout.caches, layout.offsets):
                    cache.index_copy_(0, idx, stage[:, off : off + cache.shape[1]])

    def _per_tensor_copy(self, layout, block_ids, host, rows, to_host: bool) -> None:
        dst_all = host.view(torch.int8)
        for cache, off in zip(layout.caches, layout.offsets):
            b = cache.shape[1]
            for i, r in zip(block_ids, rows):
                h = dst_all[r, off : off + b]
                if to_host:
                    h.copy_(cache[i], non_blocking=True)
                else:
                    cache[i].copy_(h, non_blocking=True)

    def copy_to_host(self, stream, layout, block_ids, host, rows, wait_event=None, event=None) -> DeviceEvent:
        if wait_event is not None:
            stream.wait_event(wait_event)
        return self._copy(stream, layout, block_ids, host, rows, True, event)

    def copy_to_device(self, stream, layout, host, rows, block_ids, event=None) -> DeviceEvent:
        return self._copy(stream, layout, block_ids, host, rows, False, event)

    def _copy(self, stream, layout, block_ids, host, rows, to_host: bool, event) -> torch.cuda.Event:
        stage = getattr(stream, "stage", None)
        if stage is not None and len(block_ids) <= stage.shape[0]:
            self._staged_copy(stream, stage[: len(block_ids)], layout, block_ids, host, rows, to_host)
        elif self._batch is not None:
            dev, hst, sizes = self._descriptors(layout, block_ids, host, rows)
            if to_host:
                self._batch_copy(hst, dev, sizes, self._attr_store, stream)
            else:
                self._batch_copy(dev, hst, sizes, self._attr_load, stream)
        else:
            with torch.cuda.stream(stream):
                self._per_tensor_copy(layout, block_ids, host, rows, to_host)
        ev = event if event is not None else torch.cuda.Event()
        ev.record(stream)
        return ev


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index (``cuda`` means the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_device(device: torch.device) -> Device:
    """The device implementation for ``device``: CUDA for cuda devices, else CPU."""
    if device.type == "cuda":
        return CudaDevice(device)
    if device.type == "cpu":
        return CpuDevice()
    raise ValueError(f"device {device} is not supported: use a cuda device or cpu")
