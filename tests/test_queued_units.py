"""Units queued behind a held one, on both engines: each keeps its own file calls,
outcome and job, and shutdown ends every one of them and every worker.

Each test holds the lane's only worker in the kernel (a hung first call), queues small
jobs behind it, then lets it go (or shuts down): the worker finds them all queued at once.
"""

from __future__ import annotations

import errno
import threading

import pytest

from faults import Fault, FaultyOsCalls, wait_threads_gone
from kvoffload.vllm_tier import SlotTier
from tests.test_vllm_tier import Primary, finish, tier_config

JOBS = 6  # small jobs queued behind the held one


@pytest.fixture(params=["native", "python"])
def engine(request) -> str:
    if request.param == "native":
        request.getfixturevalue("native_core")
    return request.param


def held_tier(cache_dir, primary: Primary, osc: FaultyOsCalls, engine: str, slots: int = 16) -> SlotTier:
    """A tier with one IO worker per lane, on ``engine``."""
    return SlotTier(primary.view, tier_config(cache_dir, slots=slots, io_threads=1, native_io=engine == "native"),
                    os_calls=osc)


def hold(t: SlotTier, osc: FaultyOsCalls, call: str, job_id: int, key: str) -> threading.Event:
    """Submit job ``job_id`` (``key`` from/to row 0) and hang its ``call`` in the kernel until
    the returned event is set; returns once the call is hanging, its thread busy."""
    go, entered = threading.Event(), threading.Event()
    n = osc.calls[call] + 1
    osc.fail_nth(call, n, Fault.hang(go, timeout=30))
    osc.before(call, lambda info: info.n == n and entered.set())
    (t.submit_store if call == "pwritev" else t.submit_load)(job_id, [key], [0])
    assert entered.wait(10)
    return go


def test_queued_stores_and_loads_each_make_their_own_file_call(cache_dir, engine) -> None:
    primary, osc = Primary(), FaultyOsCalls()
    t = held_tier(cache_dir, primary, osc, engine)
    try:
        go = hold(t, osc, "pwritev", 0, "held")
        writes = osc.calls["pwritev"]
        for i in range(1, JOBS + 1):
            t.submit_store(i, [f"k{i}"], [i])  # one chunk each: consecutive slots, consecutive rows
        go.set()
        done = finish(t)
        assert all(done[i].success for i in range(JOBS + 1))
        assert osc.calls["pwritev"] - writes == JOBS  # one pwritev per unit: one fault, one unit

        primary.rows[:] = 0
        go = hold(t, osc, "preadv", 100, "held")
        reads = osc.calls["preadv"]
        for i in range(1, JOBS + 1):
            t.submit_load(100 + i, [f"k{i}"], [i])
        go.set()
        done = finish(t)
        assert all(done[100 + i].success for i in range(JOBS + 1))
        assert osc.calls["preadv"] - reads == JOBS
        expect = Primary()  # the same seed: the bytes stored
        assert (primary.rows[: JOBS + 1] == expect.rows[: JOBS + 1]).all()
        expect.close()
    finally:
        t.close()
        primary.close()


@pytest.mark.parametrize("call", ["pwritev", "preadv"])
def test_a_fault_in_one_queued_unit_fails_only_its_job(cache_dir, call, engine) -> None:
    primary, osc = Primary(), FaultyOsCalls()
    t = held_tier(cache_dir, primary, osc, engine)
    is_store = call == "pwritev"
    try:
        if not is_store:
            for i in range(JOBS + 1):
                t.submit_store(i, [f"k{i}"], [i])
            assert all(j.success for j in finish(t).values())
            primary.rows[:] = 0
        go = hold(t, osc, call, 10, "k0")
        # The third queued unit's call fails.
        osc.fail_nth(call, osc.calls[call] + 3, Fault.error(errno.EIO))
        submit = t.submit_store if is_store else t.submit_load
        for i in range(1, JOBS + 1):
            submit(10 + i, [f"k{i}"], [i])
        go.set()
        done = finish(t)
        assert [i for i in range(JOBS + 1) if not done[10 + i].success] == [3]
        if is_store:
            assert not t.lookup("k3") and all(t.lookup(f"k{i}") for i in range(JOBS + 1) if i != 3)
        else:
            expect = Primary()
            assert (primary.rows[3] == 0).all()  # a failed load leaves no unverified bytes
            assert all((primary.rows[i] == expect.rows[i]).all() for i in range(JOBS + 1) if i != 3)
            expect.close()
    finally:
        t.close()
        primary.close()


def test_shutdown_with_units_queued_behind_a_held_one_ends_every_job_and_thread(cache_dir, engine) -> None:
    primary, osc = Primary(), FaultyOsCalls()
    t = held_tier(cache_dir, primary, osc, engine)
    go = hold(t, osc, "pwritev", 0, "held")
    for i in range(1, JOBS + 1):
        t.submit_store(i, [f"k{i}"], [i])
    releaser = threading.Timer(0.2, go.set)  # let go while shutdown waits for the threads
    releaser.start()
    try:
        t.close()
        done = {f.job_id: f for f in t.poll()}
        assert sorted(done) == list(range(JOBS + 1))  # every job ended: none is left pending
        assert not any(done[i].success for i in range(1, JOBS + 1))  # queued when shutdown began
        assert not t.pending
        wait_threads_gone(10)
    finally:
        releaser.cancel()
        go.set()
        primary.close()
