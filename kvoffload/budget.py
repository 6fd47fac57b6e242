"""What a pool of slots will cost, checked before any of it exists: disk and host memory.

A capacity is a promise of disk space and of per-slot state in memory (a seal record
per slot, the scheduler's LRU entry per slot under the tier), both proportional to the
slot count. A mistaken capacity (``10000TiB`` at 8 KiB chunks: 1.3e12 slots) must be
refused with the figures, not found out by a ``MemoryError`` in the middle of building
per-slot lists, so ``DiskBackend.init`` and ``SlotTier`` call ``check`` first.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from kvoffload.os_calls import OsCalls
from kvoffload.persist import IDENT_BYTES, INDEX_SUFFIX, RECORDS_OFFSET
from kvoffload.persist import RECORD_BYTES as INDEX_RECORD_BYTES
from kvoffload.slot_file import (
    MIN_DIRECT_ALIGNMENT,
    check_space,
    file_slots,
    slot_bytes_for,
)
from kvoffload.slot_records import record_bytes

# Host memory per slot for its record (slot_records.Records: arrays made whole at init; a
# test keeps the figures at least what tracemalloc measures): valid, and AES-GCM's nonce and
# tag, or xxh3's digest.
RECORD_BYTES = {seal: record_bytes(seal) for seal in ("aes-gcm", "xxh3", "off")}
# Beside each record, the job of the latest store launched to the slot (Run.latest_store).
LATEST_STORE_BYTES = 8
# A persistent pool's record also holds the slot's identity, beside its generation and
# LRU sequence (8 B each).
PERSIST_RECORD_BYTES = IDENT_BYTES + 16


def slot_state_bytes(seal: str, persist: bool = False) -> int:
    """Host memory per slot of a run: its record and its latest store."""
    return RECORD_BYTES[seal] + LATEST_STORE_BYTES + (PERSIST_RECORD_BYTES if persist else 0)
# The tier's SlotPool per slot, every slot cached: its free queue's and both maps'
# entries (the keys themselves are the caller's objects and not counted). Measured
# 209-352 B: dicts grow by doubling, so the figure is the top of that range.
POOL_SLOT_BYTES = 360
# Used where /proc/meminfo cannot be read; large, so that only absurd sizes are refused.
UNKNOWN_MEMORY = 1 << 50


def _kept_bytes(osc: OsCalls, path: str) -> int:
    """Bytes a persistent pool's files at ``path`` take already (regular files only)."""
    total = 0
    for p in (path, path + INDEX_SUFFIX):
        try:
            st = osc.lstat(os.path.abspath(p))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_blocks * 512
    return total


def mem_available(default: int = UNKNOWN_MEMORY) -> int:
    """MemAvailable of /proc/meminfo: what the kernel can hand out without swapping
    (``default`` where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return default


def check(osc: OsCalls, key: str, paths: Sequence[str], num_slots: int, block_bytes: int, use_page_cache: bool,
          memory_bytes: int, persist: bool = False) -> None:
    """Refuse a pool of ``num_slots`` over ``paths`` (slot s in file s % n) whose files
    cannot fit their file systems, or whose ``memory_bytes`` of host memory (per-slot
    state, staging) cannot be had. ``key`` names the setting the size came from.

    The files are checked at the smallest padding they can have (the real alignment is
    known only once a file exists; ``SlotFile.create`` checks the exact size again).
    A persistent pool (``persist``) adds its index, and what its files hold already is
    space it has.
    """
    slot = slot_bytes_for(block_bytes, MIN_DIRECT_ALIGNMENT, use_page_cache)
    for i, path in enumerate(paths):
        n = file_slots(num_slots, len(paths), i)
        need = n * slot
        if persist:
            need += RECORDS_OFFSET + n * INDEX_RECORD_BYTES - _kept_bytes(osc, path)
        check_space(osc, path, max(0, need))
    have = mem_available()
    if memory_bytes > have:
        raise ValueError(f"{key}: not enough memory for the state of {num_slots} slots: need {memory_bytes} bytes, "
                         f"{have} available")
