"""Failure granularity (class 10 of issue 13): an IO error fails only the slots it
touched, not every slot of its IO unit, and a dying disk does not flood the log."""

from __future__ import annotations

import errno
import logging
import time

import pytest

from faults import Fault, FaultyOsCalls, block_data, make_caches
from kvoffload import DiskBackend
from kvoffload.run import RateLimitedLog

pytestmark = pytest.mark.faults

NSLOTS = 64
BLOCK = 4096
BAD = {3, 4, 5, 17, 30, 31, 32, 47, 60, 63}  # 10 slots, some adjacent, some alone


def covers_bad(args) -> bool:
    """A pwritev/preadv whose byte range holds one of the BAD slots."""
    _, bufs, offset = args
    length = sum(len(b) for b in bufs)
    return any(offset < (s + 1) * BLOCK and s * BLOCK < offset + length for s in BAD)


def start(d, osc, named=False):
    caches = make_caches("cpu", NSLOTS, [BLOCK], seed=13)
    b = DiskBackend()
    # One unit, one pwritev for all 64 slots: the error lands on a whole-job transfer.
    b.init(caches, "cpu", None, None, str(d / "kv.bin"), NSLOTS, BLOCK, named_file=named, io_threads=1,
           io_unit_bytes=NSLOTS * BLOCK, os_calls=osc, report_load_errors=True)
    return b, caches


# A short write really writes its first half: those slots are stored, whatever else failed.
SHORT_WROTE = set(range(NSLOTS // 2))


@pytest.mark.parametrize("fault,failed", [(Fault.error(errno.ENOSPC), BAD), (Fault.error(errno.EIO), BAD),
                                          (Fault.short(0.5), BAD - SHORT_WROTE)], ids=["enospc", "eio", "short"])
def test_a_store_error_fails_only_the_slots_it_touched(fd_guard, cache_dir, fault, failed):
    osc = FaultyOsCalls().fail_from("pwritev", 1, fault, where=covers_bad)
    b, caches = start(cache_dir, osc)
    try:
        want = [block_data(caches, i) for i in range(NSLOTS)]
        ev: list = []
        b.launch_copy(list(range(NSLOTS)), list(range(NSLOTS)), True, 0, ev)
        assert ev[0][1].wait(10) and ev[0][1].ok is False
        assert b.get_failed_store_slots() == failed
        osc.clear()
        for t in caches.values():
            t.zero_()
        b.launch_copy(list(range(NSLOTS)), list(range(NSLOTS)), False, 1, ev)
        assert ev[1][1].wait(10)
        assert b.get_block_ids_with_load_errors() == failed  # never stored whole: never served
        good = [i for i in range(NSLOTS) if i not in failed]
        assert all(block_data(caches, i) == want[i] for i in good), "a good slot of the failed unit was lost"
    finally:
        b.shutdown()


def test_a_read_error_fails_only_the_slots_it_touched(fd_guard, cache_dir):
    osc = FaultyOsCalls()
    b, caches = start(cache_dir, osc)
    try:
        want = [block_data(caches, i) for i in range(NSLOTS)]
        ev: list = []
        b.launch_copy(list(range(NSLOTS)), list(range(NSLOTS)), True, 0, ev)
        assert ev[0][1].wait(10) and ev[0][1].ok
        osc.fail_from("preadv", 1, Fault.error(errno.EIO), where=covers_bad)
        for t in caches.values():
            t.zero_()
        b.launch_copy(list(range(NSLOTS)), list(range(NSLOTS)), False, 1, ev)
        assert ev[1][1].wait(10) and ev[1][1].ok is False
        assert b.get_block_ids_with_load_errors() == BAD
        assert all(block_data(caches, i) == want[i] for i in range(NSLOTS) if i not in BAD)
    finally:
        b.shutdown()


def test_a_dead_disk_logs_a_bounded_number_of_warnings(fd_guard, cache_dir, caplog):
    osc = FaultyOsCalls().fail_from("pwritev", 1, Fault.error(errno.EIO))
    caches = make_caches("cpu", 4, [BLOCK], seed=14)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(cache_dir / "kv.bin"), NSLOTS, BLOCK, io_threads=1, io_unit_bytes=BLOCK,
           os_calls=osc, report_load_errors=True)
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            ev: list = []
            for i in range(50):  # 50 failing units
                b.launch_copy([i % 4], [i], True, i, ev)
            assert all(e.wait(10) and not e.ok for _, e in ev)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "store of slots" in r.getMessage()]
        assert 1 <= len(warnings) <= RateLimitedLog().burst, f"{len(warnings)} warnings for 50 failed units"
    finally:
        b.shutdown()


def test_rate_limited_log_says_how_many_it_dropped(caplog):
    log = RateLimitedLog(burst=3, window_s=0.05)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        for i in range(10):
            log.warning("store error", "failure %d", i)
        time.sleep(0.06)
        log.warning("store error", "failure %d", 10)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["failure 0", "failure 1", "failure 2",
                        "kvoffload: 7 more store error warning(s) suppressed in the last 0 s", "failure 10"]
