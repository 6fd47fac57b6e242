"""External tampering with a live slot file through /proc/self/fd: truncated, overwritten,
hole-punched, one slot's bytes copied over another's, or extended. Every load of a
damaged slot fails and leaves its device block as it was, every intact slot in the
same job (the same preadv) is still served exactly, nothing hangs, and a store
repairs the slot."""

from __future__ import annotations

import pytest

from faults import Tamper, block_data, make_caches
from kvoffload import DiskBackend

pytestmark = pytest.mark.faults

NBLOCKS = 6
TENSORS = [576 * 2, 3072]  # 4224 B a block: padded to 8192 under O_DIRECT
SEALS = pytest.mark.parametrize("encrypt", [True, False], ids=["aes-gcm", "xxh3"])
NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
MODES = pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
ATTACKS = ["truncate", "scribble", "punch", "copy", "extend"]


def attack(kind: str, t: Tamper, slot: int, size: int) -> set[int]:
    """Damage the file; returns the slots whose bytes are no longer what was stored."""
    if kind == "truncate":  # slot 2 cut in half, 3.. gone: every read of them comes up short
        t.truncate(2 * slot + slot // 2)
        return {2, 3, 4, 5}
    if kind == "scribble":
        t.scribble(3 * slot + 100, 64)
        return {3}
    if kind == "punch":
        t.punch(4 * slot, slot)
        return {4}
    if kind == "copy":  # a well-formed slot replayed at another index
        t.write(1 * slot, t.read(5 * slot, slot))
        return {1}
    if kind == "extend":  # bytes added past the end are never read
        t.truncate(size + 3 * slot)
        return set()
    raise AssertionError(kind)


def load_all(b, events: list, idx: int) -> None:
    b.launch_copy(list(range(NBLOCKS)), list(range(NBLOCKS)), False, idx, events)
    assert events[-1][1].wait(10), "a load of a tampered file hung"


@pytest.mark.parametrize("kind", ATTACKS)
@SEALS
@MODES
@NAMED
def test_tampered_slots_fail_and_intact_ones_load(fd_guard, cache_dir, device, named, use_page_cache, encrypt, kind):
    caches = make_caches(device, NBLOCKS, TENSORS, seed=5)
    b = DiskBackend()
    # One unit for the whole job: a single preadv reads all six slots, so a short or
    # failed read must still serve the intact ones (class 10 of issue 13).
    b.init(caches, device, None, None, str(cache_dir / "kv.bin"), NBLOCKS, sum(TENSORS), use_page_cache=use_page_cache,
           named_file=named, encrypt=encrypt, io_threads=1, io_unit_bytes=NBLOCKS * 8192, report_load_errors=True,
           capacity_bytes=NBLOCKS * 8192)
    try:
        ev: list = []
        b.launch_copy(list(range(NBLOCKS)), list(range(NBLOCKS)), True, 0, ev)
        assert ev[0][1].wait(10) and ev[0][1].ok
        want = [block_data(caches, i) for i in range(NBLOCKS)]
        f = b.files[0]
        damaged = attack(kind, Tamper(f.fd), f.slot_bytes, f.size)

        for t in caches.values():
            t.fill_(7)
        stale = block_data(caches, 0)
        load_all(b, ev, 1)
        assert b.get_block_ids_with_load_errors() == damaged
        assert ev[1][1].ok == (not damaged)
        for i in range(NBLOCKS):
            got = block_data(caches, i)
            if i in damaged:
                assert got == stale, f"{kind}: damaged slot {i} changed device block {i}"
            else:
                assert got == want[i], f"{kind}: intact slot {i} was not served exactly"

        # A store rewrites a damaged slot whole, and it loads again.
        for t, (name, c) in zip(caches.values(), make_caches(device, NBLOCKS, TENSORS, seed=6).items()):
            t.copy_(c)
        want = [block_data(caches, i) for i in range(NBLOCKS)]
        b.launch_copy(sorted(damaged), sorted(damaged), True, 2, ev)
        assert ev[2][1].wait(10) and ev[2][1].ok
        b.launch_copy(sorted(damaged), sorted(damaged), False, 3, ev)
        assert ev[3][1].wait(10) and ev[3][1].ok
        assert all(block_data(caches, i) == want[i] for i in damaged)
    finally:
        b.shutdown()
