"""The device seam: streams, events, batched block copies and host pinning.

The backend never calls CUDA directly. ``CudaDevice`` (``cuda_device.py``) drives
real streams and events; ``CpuDevice`` runs the same pipeline on CPU tensors (CI
exercises the real file path with it, it is not a mock); ``faults.SimDevice``
completes copies when a test says; ``HostDevice`` is for blocks that are host memory
in deployment (vLLM's CPU tier, ``vllm_slot_tier.py``). All implement ``Device``.

Copies move whole blocks between the device caches and a host buffer viewed as
``[rows, slot_bytes]``: block ``block_ids[j]`` of every cache tensor lands in row
``rows[j]`` at that tensor's offset within the slot (the packed slot layout, so
each slot is one aligned span however odd the per-tensor sizes are; ``block_layout.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch

# The layout and copy descriptions every implementation shares, part of the seam's surface.
from kvoffload.block_layout import (  # noqa: F401
    BlockLayout,
    CopyPlan,
    alloc_host,
    copy_rows,
    piece_descriptors,
    random_caches,
)


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Device(Protocol):
    """What the backend needs from a device. Streams may be None on CPU."""

    def bind_thread(self, stream: Any, layout: Optional[BlockLayout] = None, rows: int = 0,
                    to_host: Optional[bool] = None) -> Any:
        """Prepare the calling thread for device work; return the stream its copies go on.

        ``stream`` is the lane's stream (vLLM's load or store stream, or None): only
        its priority is used. ``layout``, ``rows`` (the most rows one copy moves) and
        ``to_host`` (the direction the thread copies in; None: both) let the device set
        up per-thread state for that shape; raises if it cannot (device memory).
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

    def host_view(self, layout: BlockLayout) -> Optional[memoryview]:
        """The blocks' bytes as one flat host memoryview (block ``i`` at ``i * block_bytes``)
        when the lanes should seal straight from and open straight into them; None: every
        block goes through ``copy_to_*`` and staging."""

    def copy_plan(self, stream: Any, layout: BlockLayout, to_host: bool, events: Sequence[Any]) -> Optional[CopyPlan]:
        """How a thread that holds no GIL (the native engine's worker, bound to ``stream``)
        makes this device's copies in direction ``to_host``, recording ``events`` (from
        ``new_event``, one per staging buffer): plain descriptors, or None where the copies
        need Python (then the engine calls ``copy_to_*`` for each)."""

    def event_handle(self, event: Any) -> Optional[int]:
        """``event`` (a store's ``wait_event``) as a handle a ``cuda`` plan's stream can wait
        on (0: never recorded, nothing to wait for); None where only Python can wait on it."""


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

    def bind_thread(self, stream: Any, layout: Optional[BlockLayout] = None, rows: int = 0,
                    to_host: Optional[bool] = None) -> Any:
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
        copy_rows(layout, block_ids, host, rows, to_host=True)
        return DONE

    def copy_to_device(self, stream, layout, host, rows, block_ids, event=None) -> DeviceEvent:
        copy_rows(layout, block_ids, host, rows, to_host=False)
        return DONE

    def host_view(self, layout: BlockLayout) -> Optional[memoryview]:
        return None  # it stands in for a GPU: blocks go through staging, as there

    def copy_plan(self, stream, layout, to_host: bool, events) -> Optional[CopyPlan]:
        # The CUDA copy's descriptors, made with memcpy by the engine's worker.
        return CopyPlan("memcpy", *layout.pointer_arrays)

    def event_handle(self, event: Any) -> Optional[int]:
        return None  # CPU events are Python's to wait on


class HostDevice(CpuDevice):
    """Blocks that are host memory in deployment: one CPU tensor of whole blocks.

    A block is then already where the file IO can reach it, so the lanes skip the
    copy to staging: a store seals straight from the block into its staging row
    (AES-GCM encrypts out of place) and a load opens its staging row straight into
    the block. That saves a pass over host memory per byte each way, which on the
    CPU tier is most of what is not the cipher or the drive.

    With ``direct_io`` the file IO itself goes straight into the blocks where O_DIRECT
    allows it (the blocks' address and size multiples of the file's alignment): a
    load reads a slot into its block and opens it there, a store whose disk form is
    the payload (checksums) writes from the block. No staging at all for those. Off by
    default (``vllm_slot_tier.TierConfig.direct_io`` says why).
    """

    def __init__(self, direct_io: bool = False) -> None:
        self.direct_io = direct_io

    def host_view(self, layout: BlockLayout) -> Optional[memoryview]:
        if len(layout.caches) != 1 or layout.caches[0].device.type != "cpu":
            raise ValueError(f"HostDevice needs the blocks as one CPU tensor, got {len(layout.caches)} cache(s) "
                             f"on {layout.caches[0].device}")
        return memoryview(layout.caches[0].numpy()).cast("B")


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index (``cuda`` means the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_device(device: torch.device) -> Device:
    """The device implementation for ``device``: CUDA for cuda devices, else CPU."""
    if device.type == "cuda":
        from kvoffload.cuda_device import CudaDevice

        return CudaDevice(device)
    if device.type == "cpu":
        return CpuDevice()
    raise ValueError(f"device {device} is not supported: use a cuda device or cpu")
