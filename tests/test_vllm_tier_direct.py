"""The tier's direct path: file IO straight between the slot file and the primary's rows.

Where the rows are page-aligned and a multiple of the file's O_DIRECT alignment (vLLM's
CPU primary: shared memory, chunk-sized rows), a load reads each slot into its row and
opens it there, and a store whose disk form is the payload (checksums) writes from the
row. The seam (``FaultyOsCalls``) sees which buffers every ``preadv``/``pwritev`` moves,
so the tests check where the bytes went, and inject every fault class into the direct
reads: a row ends holding exactly what was stored or zeros, and no byte outside the
job's rows changes.
"""

from __future__ import annotations

import errno
import mmap
import threading

import numpy as np
import pytest

from faults import Fault, FaultyOsCalls, wait_threads_gone
from kvoffload import LeakedFdWarning
from kvoffload.vllm_tier import SlotTier, TierConfig

ROW, CHUNKS = 8192, 24
SEALS = {"aes-gcm": {}, "xxh3": {"encrypt": False}, "off": {"encrypt": False, "checksums": False}}


class Primary:
    """``CHUNKS`` rows of random bytes in anonymous shared memory at ``skew`` bytes past a page."""

    def __init__(self, row: int = ROW, skew: int = 0) -> None:
        self.mm = mmap.mmap(-1, CHUNKS * row + skew)
        self.rows = np.frombuffer(self.mm, np.int8, CHUNKS * row, skew).reshape(CHUNKS, row)
        self.rows[:] = np.random.default_rng(0).integers(-128, 128, self.rows.shape, dtype=np.int8)
        self.view = memoryview(self.rows)
        self.base = self.rows.ctypes.data

    def row_of(self, buf) -> tuple[int, int]:
        """(row, byte in row) where ``buf`` starts, or (-1, -1) outside the primary."""
        addr = np.frombuffer(buf, np.uint8).ctypes.data - self.base
        return divmod(addr, self.rows.shape[1]) if 0 <= addr < self.rows.nbytes else (-1, -1)


def tier_config(d, row: int = ROW, slots: int = 8, **kw) -> TierConfig:
    """A tier with ``direct_io`` on unless ``kw`` says otherwise (the tier's default is off)."""
    return TierConfig.from_tier_config({"disk_path": str(d / "kv.bin"), "disk_capacity_bytes": slots * row,
                                        "direct_io": True, **kw})


def finish(tier: SlotTier) -> dict:
    assert tier.drain(timeout=30)
    return {f.job_id: f for f in tier.poll()}


def record_buffers(osc: FaultyOsCalls, p: Primary) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """Every data call's buffers as (row, byte in row, length); row -1 is outside the primary."""
    seen: list = []
    for call in ("pwritev", "preadv"):
        osc.before(call, lambda info: seen.append(
            (info.call, [(*p.row_of(b), len(b)) for b in info.args[1]])))
    return seen


@pytest.mark.parametrize("seal", SEALS)
def test_loads_read_into_the_rows_and_stores_copy_only_ciphertext(cache_dir, faulty_os, seal) -> None:
    p = Primary()
    seen = record_buffers(faulty_os, p)
    t = SlotTier(p.view, tier_config(cache_dir, **SEALS[seal]), os_calls=faulty_os)
    try:
        before = p.rows.copy()
        t.submit_store(1, ["a", "b", "c"], [3, 1, 4])
        assert finish(t)[1].success
        assert np.array_equal(p.rows, before)  # a store never changes a row: vLLM may be reading it
        stores = [bufs for call, bufs in seen if call == "pwritev"]
        if seal == "aes-gcm":  # ciphertext is a copy: written from staging, outside the primary
            assert stores and all(r == -1 for bufs in stores for r, _, _ in bufs)
        else:  # the disk form is the row itself: written from it, one whole row a buffer
            assert sorted(b for bufs in stores for b in bufs) == [(1, 0, ROW), (3, 0, ROW), (4, 0, ROW)]
        seen.clear()
        p.rows[10:13] = 0
        t.submit_load(2, ["c", "a", "b"], [10, 11, 12])
        assert finish(t)[2].success
        assert np.array_equal(p.rows[[11, 12, 10]], before[[3, 1, 4]])
        assert sorted(b for _, bufs in seen for b in bufs) == [(10, 0, ROW), (11, 0, ROW), (12, 0, ROW)]
        # Loads need no staging at all; only AES-GCM's stores keep theirs.
        assert (t.backend.stats()["staging_bytes"] > 0) is (seal == "aes-gcm")
    finally:
        t.close()


@pytest.mark.parametrize("why, row, skew, cfg", [
    ("row not a multiple of the alignment", 6144, 0, {"direct_io": True}),
    ("primary not page-aligned", ROW, 512, {"direct_io": True}),
    ("page cache", ROW, 0, {"use_page_cache": True, "direct_io": True}),
    ("direct_io off", ROW, 0, {"direct_io": False}),
    ("the tier's default", ROW, 0, {}),
])
@pytest.mark.parametrize("seal", ["aes-gcm", "xxh3"])
def test_the_staging_path_where_the_direct_one_does_not_apply(cache_dir, faulty_os, why, row, skew, cfg,
                                                              seal) -> None:
    p = Primary(row, skew)
    seen = record_buffers(faulty_os, p)
    given = TierConfig.from_tier_config({"disk_path": str(cache_dir / "kv.bin"), "disk_capacity_bytes": 8 * row,
                                         **cfg, **SEALS[seal]})
    t = SlotTier(p.view, given, os_calls=faulty_os)
    try:
        want = p.rows[[0, 1]].copy()
        t.submit_store(1, ["a", "b"], [0, 1])
        assert finish(t)[1].success
        p.rows[5:7] = 0
        t.submit_load(2, ["a", "b"], [5, 6])
        assert finish(t)[2].success and np.array_equal(p.rows[5:7], want)
        assert seen and all(r == -1 for _, bufs in seen for r, _, _ in bufs), why  # every byte through staging
    finally:
        t.close()


FAULTS = [Fault.error(errno.EIO), Fault.error(errno.EIO, after=True), Fault.short(), Fault.short(0.3),
          Fault.bitflip(100, 3), Fault.bitflip(ROW + 5, 0)]
LOAD_ROWS = [9, 11, 12, 13, 15, 17]  # not consecutive: one preadv, one buffer per row


@pytest.mark.parametrize("persistent", [False, True], ids=["first-and-nth", "dead-disk"])
@pytest.mark.parametrize("fault", FAULTS, ids=repr)
@pytest.mark.parametrize("seal", ["aes-gcm", "xxh3"])
def test_a_failed_direct_read_leaves_zeros_and_touches_no_other_byte(tmp_path, fault, persistent, seal) -> None:
    """The six slots are one read (read 1); a fault there makes the slots it did not move
    whole be read again one by one (reads 2 and on), where a second fault, at read n,
    fails one slot. Dead disk: every read from the first fails."""
    points = 0
    for n in range(1, 12):
        osc = FaultyOsCalls()
        p = Primary()
        d = tmp_path / str(n)
        d.mkdir(mode=0o700)
        t = SlotTier(p.view, tier_config(d, **SEALS[seal]), os_calls=osc)
        try:
            stored = p.rows[:6].copy()
            t.submit_store(1, list("abcdef"), range(6))
            assert finish(t)[1].success
            p.rows[6:] = np.arange(CHUNKS - 6, dtype=np.int8)[:, None]  # a mark per row the load must keep
            before = p.rows.copy()
            if persistent:
                osc.fail_from("preadv", n, fault)
            else:
                osc.fail_nth("preadv", 1, fault)
                if n > 1:
                    osc.fail_nth("preadv", n, fault)
            t.submit_load(2, list("abcdef"), LOAD_ROWS)
            done = finish(t)
            assert list(done) == [2]  # ended once
            if osc.calls["preadv"] < n:
                break
            assert osc.fired["preadv"] >= 1
            points += 1
            job = done[2]
            loaded = set("abcdef") if job.success else set(job.successful_keys or ())
            assert job.transfer_bytes == len(loaded) * ROW
            for k, r in zip("abcdef", LOAD_ROWS):
                if k in loaded:
                    assert np.array_equal(p.rows[r], stored["abcdef".index(k)]), f"{k}: wrong bytes"
                else:
                    assert not p.rows[r].any(), f"{k}: failed, but its row holds unverified bytes"
                    assert not t.lookup(k)
            others = [r for r in range(CHUNKS) if r not in LOAD_ROWS]
            assert np.array_equal(p.rows[others], before[others]), "a byte outside the job's rows changed"
            if not persistent:  # a flipped bit fails the slot it is in; a second fault, one retried slot
                assert len(loaded) == 6 - (fault.kind == "bitflip" or n > 1), (n, loaded)
        finally:
            t.close()
        wait_threads_gone()
    else:
        raise AssertionError(f"the load still reached preadv #{n}")
    # Bit flips cause no retries, and a dead disk leaves no later read to fail.
    assert points >= (1 if fault.kind == "bitflip" or persistent else 2)


def test_a_read_hung_past_shutdown_writes_nothing_more_into_its_rows(cache_dir, faulty_os) -> None:
    """A direct lane reads into the blocks themselves, so a read the kernel completes after
    shutdown lands there (ciphertext: it is never opened); kvoffload writes nothing after it,
    not even zeros (docs/design.md, the failure model)."""
    p = Primary()
    t = SlotTier(p.view, tier_config(cache_dir), os_calls=faulty_os, join_timeout=0.3)
    t.submit_store(1, ["a", "b"], [0, 1])
    assert finish(t)[1].success
    p.rows[6:] = 7
    before = p.rows.copy()
    gate = threading.Event()
    faulty_os.fail_nth("preadv", 1, Fault.hang(gate, timeout=30))
    t.submit_load(2, ["a", "b"], [8, 9])
    assert faulty_os.hang_entered.wait(10)
    with pytest.warns(LeakedFdWarning):
        t.close()  # gives up on the hung thread after join_timeout
    done = t.poll()
    assert [(f.job_id, f.success, f.transfer_bytes) for f in done] == [(2, False, 0)]  # ended by shutdown
    gate.set()  # the read now really happens, into rows of a job that already failed
    wait_threads_gone()
    late = p.rows[[8, 9]]
    assert late.any(), "rows zeroed after shutdown ended their job"
    assert all(p.rows[r].tobytes()[i:i + 64] not in late.tobytes() for r in (0, 1) for i in (0, ROW // 2, ROW - 64)), \
        "plaintext opened into the rows of a job shutdown had ended"
    others = [r for r in range(CHUNKS) if r not in (8, 9)]
    assert np.array_equal(p.rows[others], before[others])
    assert t.poll() == []  # never reported twice


def test_at_rest_direct_io_changes_nothing(cache_dir) -> None:
    """Ciphertext only, nothing named, nothing left: as without direct_io."""
    p = Primary()
    t = SlotTier(p.view, tier_config(cache_dir))
    try:
        t.submit_store(1, ["a", "b"], [0, 1])
        assert finish(t)[1].success
        f = t.backend.files[0]
        with open(f"/proc/self/fd/{f.fd}", "rb") as fh:  # what the disk holds, read past O_DIRECT
            disk = fh.read(2 * f.slot_bytes)
        assert len(disk) == 2 * ROW and any(disk)
        assert all(p.rows[r].tobytes()[i:i + 64] not in disk for r in (0, 1) for i in (0, ROW // 2, ROW - 64))
        p.rows[4:6] = 0
        t.submit_load(2, ["a", "b"], [4, 5])
        assert finish(t)[2].success and np.array_equal(p.rows[4:6], p.rows[0:2])
        assert list(cache_dir.iterdir()) == []
    finally:
        t.close()
    assert list(cache_dir.iterdir()) == []
