"""DRAM backend: the same contract as ``DiskBackend`` over pinned host slots.

The benchmark's DRAM row: DRAM offload and disk offload on the same calls. Copies go straight
between device blocks and the slot rows (no staging): on CUDA they are enqueued on
the streams and the job's CUDA event is appended at once, as vLLM's DMA backend
does; on CPU they run inside ``launch_copy``.

``streams``: jobs of one direction go round-robin over that many streams. One (the
default) is vLLM's DMA backend; a block of many tensors is one DMA descriptor per
tensor, and one stream works through descriptors one copy at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from kvoffload.device import BlockLayout, Device, alloc_host, make_device, resolve_device
from kvoffload.jobs import check_job


class CpuBackend:
    def __init__(self) -> None:
        self._pool: Optional[torch.Tensor] = None

    def init(
        self,
        gpu_caches: dict[str, torch.Tensor],
        device: torch.device,
        load_stream: Any,
        store_stream: Any,
        num_slots: int,
        total_block_bytes: int,
        *,
        device_impl: Optional[Device] = None,
        streams: int = 1,
    ) -> None:
        if self._pool is not None:
            raise RuntimeError("CpuBackend.init called twice without shutdown")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        layout = BlockLayout.from_caches(gpu_caches)
        if layout.block_bytes != total_block_bytes:
            raise ValueError(
                f"total_block_bytes={total_block_bytes} but the caches hold {layout.block_bytes} bytes per block"
            )
        device = resolve_device(device)
        if device_impl is None and device.type == "cuda":
            from kvoffload.cuda_device import CudaDevice

            # Its job events go to the caller, who polls them (vLLM's DMA backend hands
            # out plain torch.Event()s): no IO thread waits, so nothing gains from a
            # sleeping wait. Suspected, not re-measured: the H200 DRAM rows fell from
            # 46-47 GiB/s (spinning events, 2026-11-29) to 30-31 once every event of the
            # CUDA device was blocking (2026-12-01, with other bench changes too).
            device_impl = CudaDevice(device, blocking_events=False)
        self._dev = device_impl if device_impl is not None else make_device(device)
        # Copies run on the calling thread: bind it, ``streams`` streams per direction.
        self._streams = {True: [self._dev.bind_thread(store_stream) for _ in range(streams)],
                         False: [self._dev.bind_thread(load_stream) for _ in range(streams)]}
        self._turn = itertools.count()
        self._layout = layout
        self._num_slots = num_slots
        flat = alloc_host(num_slots * total_block_bytes, 4096)
        self._dev.pin(flat)
        self._flat = flat
        self._pool = flat.view(num_slots, total_block_bytes)

    def launch_copy(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        is_store: bool,
        event_idx: int,
        events_list: list,
        wait_event: Any = None,
    ) -> None:
        if self._pool is None:
            raise RuntimeError("CpuBackend is not initialised (call init, or it was shut down)")
        blocks, slots = check_job(src_blocks, dst_blocks, is_store, self._layout.num_blocks, self._num_slots)
        lane = self._streams[is_store]
        stream = lane[next(self._turn) % len(lane)]
        if is_store:
            ev = self._dev.copy_to_host(stream, self._layout, blocks, self._pool, slots, wait_event)
        else:
            ev = self._dev.copy_to_device(stream, self._layout, self._pool, slots, blocks)
        events_list.append((event_idx, ev))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # DRAM copies fail only with the device, which is fatal

    def get_failed_store_slots(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        if self._pool is None:
            return
        self._dev.unpin(self._flat)
        self._pool = self._flat = None
