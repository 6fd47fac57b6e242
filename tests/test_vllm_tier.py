"""The secondary tier without vLLM: ``TierConfig`` parsing and ``SlotTier`` on real files.

The primary is an anonymous shared mmap viewed as ``[chunks, bytes]``, as vLLM's
``SharedOffloadRegion`` is; ``SlotTier`` moves its rows to slot files and back.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time

import numpy as np
import pytest

from faults import Fault, FaultyOsCalls, wait_threads_gone
from kvoffload.vllm_tier import FinishedJob, SlotTier, TierConfig

ROW = 8192  # bytes a chunk: page-aligned like vLLM's primary rows
CHUNKS = 16


class Primary:
    """A primary tier's memory: ``CHUNKS`` rows of random bytes in a shared mmap."""

    def __init__(self, rows: int = CHUNKS, row: int = ROW, seed: int = 0) -> None:
        self.mm = mmap.mmap(-1, rows * row)
        self.rows = np.frombuffer(self.mm, dtype=np.int8).reshape(rows, row)
        self.rows[:] = np.random.default_rng(seed).integers(-128, 128, self.rows.shape, dtype=np.int8)
        self.view = memoryview(self.rows)

    def close(self) -> None:
        """What vLLM does at shutdown: release its view, then close the mmap."""
        self.view.release()
        del self.rows
        self.mm.close()


def tier_config(d, slots: int = 8, **kw) -> TierConfig:
    return TierConfig.from_tier_config({"disk_path": str(d / "kv.bin"), "disk_capacity_bytes": slots * ROW, **kw})


def finish(tier: SlotTier) -> dict[int, FinishedJob]:
    assert tier.drain(timeout=30)
    return {f.job_id: f for f in tier.poll()}


@pytest.fixture
def primary():
    p = Primary()
    yield p
    if not p.mm.closed:
        p.close()


@pytest.fixture
def tier(cache_dir, primary):
    t = SlotTier(primary.view, tier_config(cache_dir))
    yield t
    t.close()


# -- configuration -----------------------------------------------------------------


def test_config_reads_sizes_paths_and_flags() -> None:
    cfg = TierConfig.from_tier_config({
        "type": "KvoffloadTier", "module_path": "kvoffload.vllm_tier", "backpressure": {},
        "disk_paths": ["/a/kv", "/b/kv"], "disk_capacity_bytes": "1.5 GiB", "io_unit_bytes": "4MiB",
        "io_threads": 4, "encrypt": False, "checksums": True, "use_page_cache": True, "locality": "LOCAL"})
    assert cfg.disk_paths == ("/a/kv", "/b/kv")
    assert cfg.disk_capacity_bytes == 3 << 29 and cfg.io_unit_bytes == 4 << 20 and cfg.io_threads == 4
    assert (cfg.encrypt, cfg.checksums, cfg.use_page_cache, cfg.locality) == (False, True, True, "LOCAL")
    assert TierConfig.from_tier_config({"disk_path": "/a/kv"}).encrypt  # encrypted unless said otherwise


@pytest.mark.parametrize("tier_cfg, message", [
    ({"disk_path": "/a", "disk_capacity": "1GiB"}, r"unknown key\(s\) 'disk_capacity' \(did you mean 'disk_capacity_bytes'\?\)"),
    ({}, "exactly one of disk_path .* or disk_paths"),
    ({"disk_path": "/a", "disk_paths": ["/b"]}, "exactly one of disk_path"),
    ({"disk_path": ""}, "disk_path='': expected a non-empty file path"),
    ({"disk_paths": "/a"}, "disk_paths='/a': expected a non-empty file path or a non-empty list"),
    ({"disk_paths": ["/a", "/a"]}, "names a path twice"),
    ({"disk_path": "/a", "encrypt": "false"}, r"encrypt='false': expected a JSON boolean"),
    ({"disk_path": "/a", "disk_capacity_bytes": "10 parsecs"}, "disk_capacity_bytes='10 parsecs': expected"),
    ({"disk_path": "/a", "disk_capacity_bytes": 0}, "disk_capacity_bytes=0: must be > 0"),
    ({"disk_path": "/a", "io_threads": 0}, r"io_threads=0: expected an integer >= 1"),
    ({"disk_path": "/a", "locality": "local"}, r"locality='local': expected one of \('LOCAL', 'REMOTE'\)"),
])
def test_bad_config_is_one_clear_error(tier_cfg, message) -> None:
    with pytest.raises(ValueError, match=message):
        TierConfig.from_tier_config(tier_cfg)


def test_capacity_below_one_chunk_is_refused(cache_dir, primary) -> None:
    with pytest.raises(ValueError, match=r"disk_capacity_bytes=4096 is smaller than one disk slot \(8192 bytes\)"):
        SlotTier(primary.view, TierConfig.from_tier_config({"disk_path": str(cache_dir / "kv"),
                                                            "disk_capacity_bytes": 4096}))


def test_non_contiguous_primary_is_refused(cache_dir, primary) -> None:
    with pytest.raises(ValueError, match="C-contiguous"):
        SlotTier(primary.view[::2], tier_config(cache_dir))


# -- data path ---------------------------------------------------------------------


def test_read_only_primary_is_refused(cache_dir) -> None:
    ro = memoryview(bytes(2 * ROW)).cast("B", (2, ROW))
    with pytest.raises(ValueError, match="the primary view is read-only; loads write into it"):
        SlotTier(ro, tier_config(cache_dir))
    assert os.listdir(cache_dir) == []


def test_store_then_load_returns_exact_bytes(tier, primary) -> None:
    want = primary.rows[[3, 1, 4]].copy()
    tier.submit_store(1, ["a", "b", "c"], np.array([3, 1, 4]))
    assert finish(tier) == {1: FinishedJob(1, True, None, 3 * ROW)}
    assert [tier.lookup(k) for k in ("a", "b", "c", "d")] == [True, True, True, False]
    primary.rows[:] = 0
    tier.submit_load(2, ["c", "a", "b"], np.array([10, 11, 12]))
    assert finish(tier) == {2: FinishedJob(2, True, None, 3 * ROW)}
    assert np.array_equal(primary.rows[[11, 12, 10]], want)
    assert not primary.rows[:10].any()  # nothing else written


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "checksums"])
def test_slots_are_encrypted_at_rest(cache_dir, primary, encrypt) -> None:
    t = SlotTier(primary.view, tier_config(cache_dir, encrypt=encrypt))
    try:
        t.submit_store(1, ["a", "b"], [0, 1])
        finish(t)
        f = t.backend.files[0]
        # Read the anonymous file without O_DIRECT through /proc: what the disk holds.
        with open(f"/proc/self/fd/{f.fd}", "rb") as fh:
            disk = fh.read(2 * f.slot_bytes)
        assert len(disk) == 2 * ROW and any(disk)
        for row in (0, 1):
            assert (primary.rows[row].tobytes() in disk) is not encrypt
    finally:
        t.close()


def test_key_already_stored_is_not_written_again(tier) -> None:
    tier.submit_store(1, ["a"], [0])
    finish(tier)
    written = tier.backend.stats()["bytes_written"]
    tier.submit_store(2, ["a", "b"], [0, 1])
    assert finish(tier) == {2: FinishedJob(2, True, None, ROW)}
    assert tier.backend.stats()["bytes_written"] == written + ROW


def test_full_tier_evicts_least_recently_used(cache_dir, primary) -> None:
    t = SlotTier(primary.view, tier_config(cache_dir, slots=4))
    try:
        for i, key in enumerate("abcd"):
            t.submit_store(i, [key], [i])
            finish(t)
        assert t.lookup("a")  # a hit is most recently used: b is now the oldest
        want = primary.rows[4].copy()
        t.submit_store(9, ["e"], [4])
        finish(t)
        assert [t.lookup(k) for k in "abcde"] == [True, False, True, True, True]
        primary.rows[8] = 0
        t.submit_load(10, ["e"], [8])
        assert finish(t)[10].success and np.array_equal(primary.rows[8], want)
    finally:
        t.close()


def test_key_evicted_after_its_lookup_fails_only_itself(cache_dir, primary) -> None:
    t = SlotTier(primary.view, tier_config(cache_dir, slots=2))
    try:
        t.submit_store(1, ["a", "b"], [0, 1])
        finish(t)
        assert t.lookup("a") and t.lookup("b")
        t.submit_store(2, ["c"], [2])  # same scheduler step: evicts a before its load is submitted
        t.submit_load(3, ["a", "b"], [5, 6])
        done = finish(t)
        assert done[2].success
        assert done[3] == FinishedJob(3, False, ("b",), ROW)
        assert np.array_equal(primary.rows[6], primary.rows[1])
    finally:
        t.close()


def test_failed_load_reports_the_keys_that_loaded_and_drops_the_bad_one(cache_dir, primary, faulty_os) -> None:
    t = SlotTier(primary.view, tier_config(cache_dir), os_calls=faulty_os)
    try:
        t.submit_store(1, ["a"], [0])
        finish(t)
        t.submit_store(2, ["b"], [1])
        finish(t)
        faulty_os.fail_nth("preadv", faulty_os.calls["preadv"] + 1, Fault.error(errno.EIO))
        t.submit_load(3, ["a"], [8])
        t.submit_load(4, ["b"], [9])
        done = finish(t)
        assert faulty_os.fired["preadv"] == 1
        failed = [j for j in done.values() if not j.success]
        assert len(failed) == 1 and failed[0].successful_keys is None and failed[0].transfer_bytes == 0
        lost = {3: "a", 4: "b"}[failed[0].job_id]
        assert not t.lookup(lost)  # the next request recomputes it instead of failing again
        assert t.lookup({"a": "b", "b": "a"}[lost])
    finally:
        t.close()


def test_failed_store_leaves_the_key_absent(cache_dir, primary, faulty_os) -> None:
    t = SlotTier(primary.view, tier_config(cache_dir), os_calls=faulty_os)
    try:
        faulty_os.fail_nth("pwritev", 1, Fault.error(errno.EIO))
        t.submit_store(1, ["a"], [0])
        assert finish(t) == {1: FinishedJob(1, False, None, 0)}
        assert not t.lookup("a")
        t.submit_store(2, ["a"], [0])  # the slot is usable again
        assert finish(t)[2].success and t.lookup("a")
    finally:
        t.close()


# -- the scheduler is never blocked; drain and shutdown ----------------------------


def test_submit_and_poll_never_wait_for_io(cache_dir, primary, faulty_os) -> None:
    gate = threading.Event()
    faulty_os.fail_nth("pwritev", 1, Fault.hang(gate, timeout=30))
    t = SlotTier(primary.view, tier_config(cache_dir), os_calls=faulty_os)
    try:
        start = time.monotonic()
        t.submit_store(1, ["a"], [0])
        assert faulty_os.hang_entered.wait(10)
        assert t.poll() == [] and t.pending
        assert time.monotonic() - start < 5  # returned while the write hangs
        assert not t.drain(timeout=0.2)
        gate.set()
        assert finish(t) == {1: FinishedJob(1, True, None, ROW)}
        assert not t.pending
    finally:
        t.close()


def test_close_ends_queued_jobs_failed_and_frees_everything(cache_dir, primary, faulty_os, fd_guard) -> None:
    gate = threading.Event()
    faulty_os.fail_nth("pwritev", 1, Fault.hang(gate, timeout=30))
    t = SlotTier(primary.view, tier_config(cache_dir, io_threads=1), os_calls=faulty_os)
    t.submit_store(1, ["a"], [0])
    assert faulty_os.hang_entered.wait(10)
    t.submit_store(2, ["b"], [1])  # queued behind the hung write
    closer = threading.Thread(target=t.close)
    closer.start()
    time.sleep(0.2)
    gate.set()  # the hung write returns; close then joins the thread
    closer.join(30)
    assert not closer.is_alive()
    done = {f.job_id: f for f in t.poll()}
    assert done[2] == FinishedJob(2, False, None, 0)
    assert not t.pending
    wait_threads_gone()
    t.submit_store(3, ["c"], [2])  # after close: a failed job, never an exception
    assert t.poll() == [FinishedJob(3, False, None, 0)]
    primary.close()  # vLLM releases the primary after the tiers: nothing of ours holds it


def test_two_disk_paths_stripe_the_slots(cache_dir, primary) -> None:
    cfg = TierConfig.from_tier_config({"disk_paths": [str(cache_dir / "a"), str(cache_dir / "b")],
                                       "disk_capacity_bytes": 8 * ROW})
    t = SlotTier(primary.view, cfg)
    try:
        assert len(t.backend.files) == 2
        want = primary.rows[:6].copy()
        t.submit_store(1, list("abcdef"), range(6))
        finish(t)
        primary.rows[:6] = 0
        t.submit_load(2, list("abcdef"), range(6))
        assert finish(t)[2].success and np.array_equal(primary.rows[:6], want)
        assert [os.fstat(f.fd).st_size for f in t.backend.files] == [4 * ROW, 4 * ROW]
    finally:
        t.close()


def test_importing_the_tier_module_imports_no_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, kvoffload.vllm_tier as t; assert 'vllm' not in sys.modules; print(t.TIER_TYPE)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "KvoffloadTier", out.stderr
