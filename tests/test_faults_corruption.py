"""Corruption: a flipped bit, read back (injected on preadv) or really on disk, is
detected at load and reported as a load error for exactly that block, never served."""

from __future__ import annotations

import mmap
import os
import random

import pytest

from faults import Fault, FaultyOsCalls, KvChecker, block_data, make_caches
from kvoffload import DiskBackend

pytestmark = pytest.mark.faults
NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
MODES = pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
TENSORS = [576 * 2, 3072]  # 4224 B a block: padded to 8192 under O_DIRECT
NBLOCKS = 4
FLIPS = 24


def start(d, named, use_page_cache, device, osc=None):
    caches = make_caches(device, NBLOCKS, TENSORS, seed=21)
    b = DiskBackend()
    b.init(caches, device, None, None, str(d / "kv.bin"), NBLOCKS, sum(TENSORS), use_page_cache=use_page_cache,
           named_file=named, io_threads=1, io_unit_bytes=1 << 20, os_calls=osc, report_load_errors=True,
           capacity_bytes=NBLOCKS * 8192)
    return b, caches


def positions(seed, slot_bytes, payload):
    """Flip positions over the whole 4-slot transfer: both ends of each payload, plus random ones."""
    rng = random.Random(seed)
    fixed = [s * slot_bytes + p for s in range(NBLOCKS) for p in (0, payload - 1)]
    return fixed + [rng.randrange(NBLOCKS * slot_bytes) for _ in range(FLIPS)]


@NAMED
@MODES
def test_injected_bit_flip_on_read_is_a_load_error(fd_guard, cache_dir, device, fault_seed, named, use_page_cache):
    osc = FaultyOsCalls()
    b, caches = start(cache_dir, named, use_page_cache, device, osc)
    try:
        f = b.files[0]
        ck = KvChecker(b, caches, osc, NBLOCKS)
        ck.attach()
        ck.store(list(range(NBLOCKS)), list(range(NBLOCKS)))
        ck.drain()
        want = [block_data(caches, i) for i in range(NBLOCKS)]
        payload = sum(TENSORS)
        for pos in positions(fault_seed, f.slot_bytes, payload):
            osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.bitflip(pos, pos % 8))
            for t in caches.values():
                t.zero_()
            op = ck.ledger.launch(b, list(range(NBLOCKS)), list(range(NBLOCKS)), False)  # one preadv
            ck.ledger.wait([op])
            slot, within = divmod(pos, f.slot_bytes)
            errors = b.get_block_ids_with_load_errors()
            expect = {slot} if within < payload else set()  # padding is never served: harmless
            assert errors == expect, f"flip at {pos} (slot {slot}+{within}): errors {errors}, want {expect}"
            for i in range(NBLOCKS):
                if i not in errors:
                    assert block_data(caches, i) == want[i]
        assert osc.fired["preadv"] == len(positions(fault_seed, f.slot_bytes, payload))
    finally:
        b.shutdown()


@NAMED
@MODES
def test_real_bit_flip_on_disk_is_a_load_error(fd_guard, cache_dir, device, fault_seed, named, use_page_cache):
    b, caches = start(cache_dir, named, use_page_cache, device)
    try:
        f = b.files[0]
        ck = KvChecker(b, caches, None, NBLOCKS)
        ck.attach()
        ck.store(list(range(NBLOCKS)), list(range(NBLOCKS)))
        ck.drain()
        want = [block_data(caches, i) for i in range(NBLOCKS)]
        payload = sum(TENSORS)
        page = mmap.mmap(-1, 4096)  # aligned bounce buffer: the fd may be O_DIRECT
        for pos in positions(fault_seed + 1, f.slot_bytes, payload):
            if use_page_cache:
                base = pos  # page-cache fd: any offset works
                raw = bytearray(os.pread(f.fd, 1, base))
                raw[0] ^= 1 << (pos % 8)
                os.pwrite(f.fd, bytes(raw), base)
            else:
                base = pos - pos % 4096
                assert os.preadv(f.fd, [page], base) == 4096
                page[pos - base] ^= 1 << (pos % 8)
                assert os.pwritev(f.fd, [page], base) == 4096
            for t in caches.values():
                t.zero_()
            op = ck.ledger.launch(b, list(range(NBLOCKS)), list(range(NBLOCKS)), False)
            ck.ledger.wait([op])
            slot, within = divmod(pos, f.slot_bytes)
            errors = b.get_block_ids_with_load_errors()
            expect = {slot} if within < payload else set()
            assert errors == expect, f"flip at {pos}: errors {errors}, want {expect}"
            for i in range(NBLOCKS):
                if i not in errors:
                    assert block_data(caches, i) == want[i]
            # Heal: flip the bit back on disk.
            if use_page_cache:
                raw[0] ^= 1 << (pos % 8)
                os.pwrite(f.fd, bytes(raw), base)
            else:
                page[pos - base] ^= 1 << (pos % 8)
                assert os.pwritev(f.fd, [page], base) == 4096
    finally:
        b.shutdown()


def test_without_encryption_or_checksums_a_flip_is_served(fd_guard, cache_dir):
    """The documented limit: encrypt=False, checksums=False trades detection for speed; a flip is then served."""
    osc = FaultyOsCalls()
    caches = make_caches("cpu", 2, [4096], seed=22)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(cache_dir / "kv.bin"), 2, 4096, io_threads=1, encrypt=False,
           checksums=False, os_calls=osc, report_load_errors=True)
    try:
        ev = []
        b.launch_copy([0], [0], True, 0, ev)
        ev[0][1].synchronize(10)
        want = block_data(caches, 0)
        osc.fail_nth("preadv", 1, Fault.bitflip(10, 1))
        b.launch_copy([0], [1], False, 1, ev)
        ev[1][1].synchronize(10)
        assert ev[1][1].ok and block_data(caches, 1) != want
    finally:
        b.shutdown()
