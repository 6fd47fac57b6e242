"""How the KV blocks lie in memory and in a slot, and the copies between them.

``BlockLayout`` views each device cache as ``[num_blocks, bytes]`` and packs one block of
every cache into a slot; ``copy_rows`` moves blocks between the caches and host rows
(``[rows, slot_bytes]``); ``piece_descriptors`` and ``CopyPlan`` describe the same copies
as addresses for a batched driver copy or the native engine. Every device implementation
(``device.py``'s CPU ones, ``cuda_device.py``, ``faults.SimDevice``) copies through these,
so they sit below all of them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


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
        spans = []  # (device, first byte, end byte, name) of each cache's blocks
        for name, t in gpu_caches.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"cache {name!r} is a {type(t).__name__}, not a torch.Tensor")
            if t.dim() < 1 or t.shape[0] == 0:
                raise ValueError(f"cache {name!r} has shape {tuple(t.shape)}: need [num_blocks, ...]")
            if num_blocks is not None and t.shape[0] != num_blocks:
                raise ValueError(
                    f"cache {name!r} has {t.shape[0]} blocks, others have {num_blocks}"
                )
            if not t.is_contiguous():
                # A strided view's block i is not the span [i * stride(0), (i + 1) * stride(0))
                # of its own bytes alone (a transpose, or the K half of a [blocks, 2, ...] KV
                # tensor): copying that span would move, and on load overwrite, other bytes.
                raise ValueError(
                    f"cache {name!r} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}): each "
                    "block must be one dense span of bytes; pass the cache tensor itself, not a strided view"
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
            spans.append((str(t.device), v.data_ptr(), v.data_ptr() + num_blocks * bpb, name))
        # Caches that share bytes (one tensor twice, or views that overlap) would copy
        # those bytes twice per block, and a load of one block would write into the
        # block next to it. vLLM's worker passes each storage once.
        spans.sort()
        for (dev_a, _, end_a, a), (dev_b, start_b, _, b) in zip(spans, spans[1:]):
            if dev_a == dev_b and start_b < end_a:
                raise ValueError(f"caches {a!r} and {b!r} overlap in memory: pass each cache tensor once")
        return cls(tuple(views), tuple(offsets), total, int(num_blocks))

    @functools.cached_property
    def pointer_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(base address, bytes per block, offset in slot) per cache, for copy descriptors."""
        bases = np.array([c.data_ptr() for c in self.caches], dtype=np.uint64)
        bpb = np.array([c.shape[1] for c in self.caches], dtype=np.uint64)
        return bases, bpb, np.array(self.offsets, dtype=np.uint64)


def alloc_host(nbytes: int, alignment: int) -> torch.Tensor:
    """An ``alignment``-aligned, zeroed uint8 host tensor of ``nbytes`` (a view that
    keeps its over-sized allocation alive).

    The CPU allocator only guarantees 64-byte alignment, and O_DIRECT rejects a
    buffer that is not aligned to the file system's DIO memory alignment, so we
    over-allocate and slice (vLLM's ``_alloc_aligned`` does the same). Zeroed, so
    slot padding that no copy writes never carries old process memory to disk.
    """
    backing = torch.zeros(nbytes + alignment, dtype=torch.uint8)
    skew = (-backing.data_ptr()) % alignment
    return backing[skew : skew + nbytes]


def copy_rows(layout: BlockLayout, block_ids: Any, host: torch.Tensor, rows: Optional[Any], to_host: bool) -> None:
    """Copy blocks ``block_ids`` of every cache to or from rows of ``host`` ([rows, slot]).

    ``rows`` None means rows 0..n-1 in order (no scatter). Ids and rows are sequences of
    ints or long tensors on the caches' device. The one block<->row loop: the CPU device,
    the CUDA device's staging rows and the simulated device all copy through it.
    """
    if layout.caches[0].device.type == "cpu":
        _copy_rows_numpy(layout, np.asarray(block_ids, dtype=np.int64), host,
                         None if rows is None else np.asarray(rows, dtype=np.int64), to_host)
        return
    buf = host.view(torch.int8)
    n = len(block_ids)
    for cache, off in zip(layout.caches, layout.offsets):
        b = cache.shape[1]
        if rows is None:
            part = buf[:n, off : off + b]
            if to_host:
                torch.index_select(cache, 0, block_ids, out=part)
            else:
                cache.index_copy_(0, block_ids, part)
        elif to_host:
            buf[:, off : off + b].index_copy_(0, rows, cache.index_select(0, block_ids))
        else:
            cache.index_copy_(0, block_ids, buf[:, off : off + b].index_select(0, rows))


def _copy_rows_numpy(layout: BlockLayout, ids: np.ndarray, host: torch.Tensor, rows: Optional[np.ndarray],
                     to_host: bool) -> None:
    """``copy_rows`` for CPU tensors, through numpy indexing: torch's int8 ``index_copy_``
    copies element by element (0.4 GiB/s for 2 MiB rows on the 2-core VM, numpy's
    indexing 7-18 GiB/s), and on the CPU device (CI, and vLLM's secondary tier,
    ``kvoffload.vllm_tier``) every copy goes through here."""
    buf = host.view(torch.int8).numpy()
    n = len(ids)
    # Rows 0..n-1 (every store, and a load with no failed slot) are a slice: no temporary.
    dense = rows is None or n == 0 or (rows[0] == 0 and bool((np.diff(rows) == 1).all()))
    for cache, off in zip(layout.caches, layout.offsets):
        c = cache.numpy()
        span = slice(off, off + c.shape[1])
        if to_host and dense:
            np.take(c, ids, axis=0, out=buf[:n, span], mode="clip")  # ids are checked at launch
        elif to_host:
            buf[rows, span] = c[ids]
        else:
            c[ids] = buf[:n, span] if dense else buf[rows, span]


def piece_descriptors(layout: BlockLayout, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int],
                      to_host: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One copy descriptor per (tensor, block) piece between blocks ``block_ids`` and host
    rows ``rows``: (destination addresses, source addresses, sizes), uint64 arrays."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    bases, bpb, offs = layout.pointer_arrays
    slot = host.stride(0) * host.element_size()
    host_rows = np.uint64(host.data_ptr()) + np.asarray(rows, dtype=np.uint64) * np.uint64(slot)
    dev = (bases[:, None] + ids[None, :] * bpb[:, None]).ravel()
    hst = (host_rows[None, :] + offs[:, None]).ravel()
    sizes = np.repeat(bpb, len(ids))
    return (hst, dev, sizes) if to_host else (dev, hst, sizes)


def random_caches(device: torch.device | str, num_blocks: int, tensor_bytes: Sequence[int],
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Random int8 caches ``layer{i}: [num_blocks, tensor_bytes[i]]`` on ``device``: the
    blocks ``python -m kvoffload``, the benchmark and the tests move and compare."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": torch.randint(-128, 128, (num_blocks, b), dtype=torch.int8, generator=g).to(device)
        for i, b in enumerate(tensor_bytes)
    }


@dataclass(frozen=True)
class CopyPlan:
    """A device's copies as plain descriptors (``Device.copy_plan``): a copy between blocks
    ``ids`` and host rows moves, per cache tensor ``t`` and row ``j``, ``bpb[t]`` bytes
    between ``base[t] + ids[j] * bpb[t]`` and the row's start plus ``offset[t]``."""

    kind: str  # "memcpy": host memory on both sides; "cuda": the driver's batched copy
    base: np.ndarray  # uint64 per tensor: address of block 0
    bpb: np.ndarray  # uint64 per tensor: bytes per block
    offset: np.ndarray  # uint64 per tensor: where its piece sits in a slot
    # cuda only: the driver functions' addresses (batch: cuMemcpyBatchAsync at the 12.8 ABI,
    # record, sync, stream_wait), this direction's CUmemcpyAttributes, the stream and events.
    functions: dict[str, int] = field(default_factory=dict)
    attrs: int = 0
    stream: int = 0
    events: tuple[int, ...] = ()
    keep: tuple[Any, ...] = ()  # what the addresses point into, alive as long as the plan
