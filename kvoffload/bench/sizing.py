"""How much data each benchmark case moves, so that the files of a run fit the drives.

At the peak of a run these files exist at once:
- on the first directory: the raw scratch file (kept for the whole run, sized for the
  largest layout) plus the largest slot file (or the two of "stripe 2 paths 1 disk");
- on every directory of a striped run: its share of the raw scratch for the aggregate
  ceiling, then its share of the striped slot file (one after the other).
Slots are padded to 4096 B (O_DIRECT), as the backend pads them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

from kvoffload import budget
from kvoffload.slot_file import round_up

MiB = 2**20
GiB = 2**30
# The raw scratch file is rounded to its fill IO size (ceilings.FILL_IO_BYTES).
RAW_ROUND = 4 * MiB
RAW_SLACK = 8192
# Kept free on each file system for extent trees and the like.
FS_MARGIN_BYTES = 16 * MiB
FS_MARGIN_SHARE = 0.01
SLOT_ALIGN = 4096


def blocks_for(nbytes: int, block_bytes: int, max_blocks: int) -> int:
    """Blocks one case of this layout moves: ``nbytes`` worth, at least 1, at most ``max_blocks``."""
    return max(1, min(nbytes // block_bytes, max_blocks))


def raw_bytes(blocks: int, block_bytes: int) -> int:
    """Size of a raw scratch file whose random slot IOs cover ``blocks`` padded slots."""
    return round_up(round_up(blocks * round_up(block_bytes, SLOT_ALIGN), SLOT_ALIGN) + RAW_SLACK, RAW_ROUND)


def disk_needs(nbytes: int, block_sizes: Sequence[int], ndirs: int, max_blocks: int) -> list[int]:
    """Peak bytes the run's files take on each directory (index 0: the first ``--dir``)."""
    raw = slot_file = share = 0
    for bb in block_sizes:
        n = blocks_for(nbytes, bb, max_blocks)
        slot = round_up(bb, SLOT_ALIGN)
        raw = max(raw, raw_bytes(n, bb))
        slot_file = max(slot_file, (n + 1) * slot)  # + 1: two files of ceil(n / 2) slots
        if ndirs > 1:
            per = -(-n // ndirs)
            share = max(share, raw_bytes(per, bb), per * slot)
    return [raw + max(slot_file, share)] + [share] * (ndirs - 1)


def usable_bytes(directory: str) -> int:
    """Free bytes of ``directory``'s file system (as an unprivileged user sees them) less a margin."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    return max(0, int(free * (1 - FS_MARGIN_SHARE)) - FS_MARGIN_BYTES)


def misfit(nbytes: int, block_sizes: Sequence[int], dirs: Sequence[str], usable: Sequence[int],
           max_blocks: int) -> Optional[str]:
    """Why cases of ``nbytes`` do not fit (the first directory short of room), or None."""
    for d, need, have in zip(dirs, disk_needs(nbytes, block_sizes, len(dirs), max_blocks), usable):
        if need > have:
            return f"the files of a run need {need / GiB:.2f} GiB at once on {d} but it has {have / GiB:.2f} GiB free"
    return None


def largest_fit(block_sizes: Sequence[int], dirs: Sequence[str], usable: Sequence[int], max_blocks: int,
                upto: int) -> int:
    """The most bytes per case (a multiple of 1 MiB, at most ``upto``) that fit; 0 if none."""
    lo, hi = 0, upto // MiB
    while lo < hi:  # the needs grow with the case size
        mid = (lo + hi + 1) // 2
        if misfit(mid * MiB, block_sizes, dirs, usable, max_blocks) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo * MiB


def case_memory(nbytes: int, on_cpu: bool) -> int:
    """Host memory a run needs per byte of case size (a rough bound, not a measurement).

    On CPU the caches and their reference copy are host memory (2x), the DRAM
    backend's slots another 1x, with page cache and staging on top; on CUDA only
    the DRAM slots, staging and page cache are.
    """
    return nbytes * (6 if on_cpu else 3)


def mem_available() -> int:
    """MemAvailable of /proc/meminfo; 8 GiB where it cannot be read (cases are sized
    from it, so an unknown figure must be a modest one)."""
    return budget.mem_available(default=8 * GiB)
