"""One Triton kernel per copy that moves the pieces of every cache tensor between a
thread's device staging rows and the caches.

Layouts of many small pieces (128 tensors of 8 KiB per block; DeepSeek MLA's 61 x 18 KiB)
are bound by the driver's per-descriptor cost when each (tensor, block) piece is its own
DMA descriptor (about 1.6 M descriptors/s on the H200), and by launches when each tensor
gets its own gather kernel (128 launches per copy). Here the DMA moves whole staging rows
and one kernel moves every piece. ``CudaDevice`` uses it only where Triton imports and the
kernel agrees with ``block_layout.copy_rows`` on a check at first use; otherwise it keeps the
per-tensor kernels.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kvoffload.block_layout import BlockLayout, copy_rows

logger = logging.getLogger("kvoffload")

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path and CI never need it
    triton = None

# Words (4 bytes) each program moves per loop step.
_BLOCK = 2048

if triton is not None:

    # row_words is not specialised on: Triton compiles one kernel per value class of each
    # int argument, and a compile takes seconds; so the check at first use compiles
    # exactly the kernels every later layout runs (H200 profile: repeated compiles inside
    # the first copies cost more than the copies).
    @triton.jit(do_not_specialize=["row_words"])
    def _move_pieces(anchor, rel_words, piece_words, row_off_words, ids, stage, row_words,
                     TO_STAGE: tl.constexpr, BLOCK: tl.constexpr):
        # Program (i, t): piece of tensor t for row i of this copy. Cache addresses are
        # word offsets from cache 0 (`anchor`), so one pointer argument reaches them all.
        i = tl.program_id(0)
        t = tl.program_id(1)
        n = tl.load(piece_words + t)
        cache_start = tl.load(rel_words + t) + tl.load(ids + i) * n
        stage_start = i.to(tl.int64) * row_words + tl.load(row_off_words + t)
        for w in range(0, n, BLOCK):
            offs = w + tl.arange(0, BLOCK)
            mask = offs < n
            if TO_STAGE:
                tl.store(stage + stage_start + offs, tl.load(anchor + cache_start + offs, mask=mask), mask=mask)
            else:
                tl.store(anchor + cache_start + offs, tl.load(stage + stage_start + offs, mask=mask), mask=mask)


class FusedPieces:
    """The kernel's per-layout tables (on the device), made once per layout."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @staticmethod
    def fits(layout: BlockLayout) -> bool:
        """Whether every address, piece size and offset is a whole number of 4-byte words."""
        return all(c.data_ptr() % 4 == 0 and c.shape[1] % 4 == 0 for c in layout.caches) and all(
            o % 4 == 0 for o in layout.offsets) and layout.block_bytes % 4 == 0

    def _table(self, layout: BlockLayout) -> tuple[torch.Tensor, ...]:
        # Keyed by the addresses themselves: a layout of a later init may reuse an old
        # one's id, never its live addresses.
        key = (tuple(c.data_ptr() for c in layout.caches), tuple(c.shape[1] for c in layout.caches), layout.offsets)
        t = self._tables.get(key)
        if t is None:
            base = layout.caches[0].data_ptr()
            rel = [(c.data_ptr() - base) // 4 for c in layout.caches]
            words = [c.shape[1] // 4 for c in layout.caches]
            offs = [o // 4 for o in layout.offsets]
            anchor = layout.caches[0].view(torch.int32)
            t = (anchor, *(torch.tensor(x, dtype=torch.int64, device=self.device) for x in (rel, words, offs)))
            self._tables[key] = t
        return t

    def move(self, layout: BlockLayout, ids: torch.Tensor, stage: torch.Tensor, to_stage: bool) -> None:
        """Rows 0..n-1 of ``stage`` ([rows, block_bytes] int8) <-> blocks ``ids`` of every cache,
        on the current stream."""
        anchor, rel, words, offs = self._table(layout)
        n = len(ids)
        stage32 = stage.view(torch.int32)
        _move_pieces[(n, len(layout.caches))](anchor, rel, words, offs, ids, stage32, stage32.shape[1],
                                              TO_STAGE=to_stage, BLOCK=_BLOCK)


def load_fused(device: torch.device) -> Optional[FusedPieces]:
    """A checked ``FusedPieces``, or None (no Triton, or the kernel disagrees with
    ``copy_rows`` on a small layout of odd sizes: then the per-tensor kernels stay)."""
    if triton is None:
        return None
    try:
        g = torch.Generator(device="cpu").manual_seed(7)
        caches = {f"c{i}": torch.randint(-128, 128, (9, b), dtype=torch.int8, generator=g).to(device)
                  for i, b in enumerate((4, 8196, 36, 18432))}
        layout = BlockLayout.from_caches(caches)
        fused = FusedPieces(device)
        ids = torch.tensor([7, 2, 5], dtype=torch.long, device=device)
        got = torch.zeros((3, layout.block_bytes), dtype=torch.int8, device=device)
        want = torch.zeros_like(got)
        fused.move(layout, ids, got, to_stage=True)
        copy_rows(layout, ids, want, None, to_host=True)
        ok = torch.equal(got, want)
        for c in caches.values():
            c[ids] = 0
        fused.move(layout, ids, want, to_stage=False)
        back = torch.zeros_like(want)
        copy_rows(layout, ids, back, None, to_host=True)
        ok = ok and torch.equal(back, want)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the proven path
        logger.warning("kvoffload: the fused gather kernel is unavailable (%s); using per-tensor kernels", e)
        return None
    if not ok:
        logger.warning("kvoffload: the fused gather kernel disagrees with torch's gather; using per-tensor kernels")
        return None
    return fused
