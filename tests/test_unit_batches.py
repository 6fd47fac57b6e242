"""Batches: an IO thread moves the host-block units queued behind its unit in the same
native call (``Lane.gather``), while every unit keeps its own file calls, outcome and job.

Each test holds the lane's only thread in the kernel (a hung first call), queues small
jobs behind it, then lets it go: the thread finds them all queued at once.
"""

from __future__ import annotations

import dataclasses
import errno
import threading

import pytest

from faults import Fault, FaultyOsCalls, wait_threads_gone
from kvoffload.vllm_tier import SlotTier
from tests.test_vllm_tier import Primary, finish, tier_config

JOBS = 6  # small jobs queued behind the held one


class CountingLib:
    """The native core's library, counting its unit calls: (function, slots) per call."""

    def __init__(self, lib) -> None:
        self.lib, self.calls = lib, []

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)
        if name not in ("kvo_store_unit", "kvo_load_unit"):
            return fn

        def call(unit, slots):
            self.calls.append((name, unit.n))
            return fn(unit, slots)

        return call

    def direction(self, is_store: bool) -> "CountingLib":
        """The calls of one direction only."""
        view = CountingLib(self.lib)
        name = "kvo_store_unit" if is_store else "kvo_load_unit"
        view.calls = _Filtered(self.calls, name)
        return view


class _Filtered:
    def __init__(self, calls: list, name: str) -> None:
        self.all, self.name = calls, name

    def __iter__(self):
        return iter([c for c in self.all if c[0] == self.name])

    def __getitem__(self, i):
        return [c for c in self.all if c[0] == self.name][i]


def held_tier(cache_dir, primary: Primary, osc: FaultyOsCalls, slots: int = 16) -> tuple[SlotTier, dict]:
    t = SlotTier(primary.view, tier_config(cache_dir, slots=slots, io_threads=1), os_calls=osc)
    run = t.backend._run
    lanes = {is_store: run.lanes[is_store][0] for is_store in (True, False)}
    if run.native is None:
        t.close()
        pytest.skip("the native path is off or unavailable: batches are the native path's")
    lib = CountingLib(run.native.lib)
    run.native = dataclasses.replace(run.native, lib=lib)  # before any thread made its first call
    return t, {True: lib.direction(True), False: lib.direction(False)}


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


def test_queued_stores_and_loads_go_in_one_call_each_with_a_file_call_per_unit(cache_dir) -> None:
    primary, osc = Primary(), FaultyOsCalls()
    t, libs = held_tier(cache_dir, primary, osc)
    try:
        go = hold(t, osc, "pwritev", 0, "held")
        writes = osc.calls["pwritev"]
        for i in range(1, JOBS + 1):
            t.submit_store(i, [f"k{i}"], [i])  # one chunk each: consecutive slots, consecutive rows
        go.set()
        done = finish(t)
        assert all(done[i].success for i in range(JOBS + 1))
        # The held unit alone, then everything queued behind it in one call ...
        assert [n for _, n in libs[True].calls] == [1, JOBS]
        # ... with one pwritev per unit, as each would have made alone (one fault, one unit).
        assert osc.calls["pwritev"] - writes == JOBS

        primary.rows[:] = 0
        go = hold(t, osc, "preadv", 100, "held")
        reads = osc.calls["preadv"]
        for i in range(1, JOBS + 1):
            t.submit_load(100 + i, [f"k{i}"], [i])
        go.set()
        done = finish(t)
        assert all(done[100 + i].success for i in range(JOBS + 1))
        assert (primary.rows[: JOBS + 1] != 0).any(axis=1).all()
        assert [n for _, n in libs[False].calls] == [1, JOBS]
        assert osc.calls["preadv"] - reads == JOBS
        expect = Primary()  # the same seed: the bytes stored
        assert (primary.rows[: JOBS + 1] == expect.rows[: JOBS + 1]).all()
        expect.close()
    finally:
        t.close()
        primary.close()


@pytest.mark.parametrize("call", ["pwritev", "preadv"])
def test_a_fault_in_one_unit_of_a_batch_fails_only_its_job(cache_dir, call) -> None:
    primary, osc = Primary(), FaultyOsCalls()
    t, libs = held_tier(cache_dir, primary, osc)
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
        assert libs[is_store].calls[-1][1] == JOBS  # the six behind the held one went together
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


def test_shutdown_with_units_queued_behind_a_held_one_ends_every_job_and_thread(cache_dir) -> None:
    primary, osc = Primary(), FaultyOsCalls()
    t, _ = held_tier(cache_dir, primary, osc)
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
