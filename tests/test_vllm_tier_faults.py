"""Fault sweep of the secondary tier through the OS seam (no vLLM).

Every pwritev and preadv of a small tier workload is failed in turn (once, or from
then on: a dead disk), with each fault the seam can inject on it. Whatever fails,
the tier must: end every job exactly once; never report wrong bytes as loaded (a
load's successful keys hold exactly what was stored); make a failed load's key a
miss; and close without leaking a thread or an fd.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from faults import Fault, FaultyOsCalls, FdWatch, wait_threads_gone
from kvoffload.vllm_tier import SlotTier, TierConfig

pytestmark = pytest.mark.faults
ROW, CHUNKS, SLOTS = 8192, 24, 6
FAULTS = [
    ("pwritev", Fault.error(errno.EIO)), ("pwritev", Fault.short()), ("pwritev", Fault.lie()),
    ("preadv", Fault.error(errno.EIO)), ("preadv", Fault.short()), ("preadv", Fault.bitflip(100, 3)),
]
# (job id, store?, keys, primary rows): stores from rows 0-5, loads into rows 8 and up.
WORKLOAD = [
    (1, True, "abc", [0, 1, 2]),
    (2, True, "de", [3, 4]),
    (3, False, "abcde", [8, 9, 10, 11, 12]),
    (4, True, "f", [5]),
    (5, False, "ea", [13, 14]),
    (6, True, "g", [6]),  # evicts the least recently used key
    (7, False, "fb", [15, 16]),
]


def run(directory, osc: FaultyOsCalls) -> None:
    rng = np.random.default_rng(7)
    rows = rng.integers(-128, 128, (CHUNKS, ROW), dtype=np.int8)
    stored = {k: rows[i].copy() for job in WORKLOAD if job[1] for k, i in zip(job[2], job[3])}
    fds = FdWatch()
    tier = SlotTier(memoryview(rows), TierConfig.from_tier_config(
        {"disk_path": str(directory / "kv.bin"), "disk_capacity_bytes": SLOTS * ROW, "io_threads": 1}),
        os_calls=osc)
    try:
        seen: dict[int, object] = {}
        for job_id, is_store, keys, chunks in WORKLOAD:
            if not is_store:
                rows[8:] = 0
            (tier.submit_store if is_store else tier.submit_load)(job_id, list(keys), chunks)
            assert tier.drain(timeout=30)
            for f in tier.poll():
                assert f.job_id not in seen, f"job {f.job_id} reported twice"
                seen[f.job_id] = f
            f = seen[job_id]
            if is_store:
                assert f.successful_keys is None  # what a failed store left is checked below
                continue
            loaded = keys if f.success else (f.successful_keys or ())
            for k, i in zip(keys, chunks):
                if k in loaded:
                    assert np.array_equal(rows[i], stored[k]), f"job {job_id}: key {k} loaded wrong bytes"
                else:
                    assert not tier.lookup(k), f"job {job_id}: failed key {k} still a hit"
        assert sorted(seen) == [j[0] for j in WORKLOAD] and not tier.pending
        # Fault-free check of everything the tier still claims: exact bytes or a reported failure.
        osc.enabled = False
        present = [k for k in "abcdefg" if tier.lookup(k)]
        rows[8:] = 0
        tier.submit_load(99, present, list(range(8, 8 + len(present))))
        assert tier.drain(timeout=30)
        (f,) = tier.poll()
        ok = present if f.success else (f.successful_keys or ())
        if osc.fired["pwritev"] == 0 and osc.fired["preadv"] == 0:
            assert f.success  # nothing fired: nothing may fail
        for j, k in enumerate(present):
            if k in ok:
                assert np.array_equal(rows[8 + j], stored[k]), f"key {k} served wrong bytes"
    finally:
        tier.close()
    wait_threads_gone()
    fds.check(near=directory)


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "dead-disk"])
@pytest.mark.parametrize("call, fault", FAULTS, ids=[f"{c}-{f!r}" for c, f in FAULTS])
def test_tier_sweep(tmp_path, call, fault, persistent) -> None:
    points = 0
    for n in range(1, 40):
        osc = FaultyOsCalls()
        (osc.fail_from if persistent else osc.fail_nth)(call, n, fault)
        d = tmp_path / f"{n}"
        d.mkdir(mode=0o700)
        run(d, osc)
        if osc.calls[call] < n:
            assert osc.fired[call] == 0
            break
        assert osc.fired[call] >= 1, f"{call} #{n} was reached but no fault fired"
        points += 1
    else:
        raise AssertionError(f"the workload still reached {call} #{n}")
    assert points >= 3  # the workload reaches several calls of each kind
