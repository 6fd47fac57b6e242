"""Ctrl-C at every line of init, launch_copy and shutdown, and of everything they call in
the calling thread; shutdown() from another thread at every line of launch_copy.

After each point: no fd, IO thread, file, pinned staging buffer or open job is left,
every event appended to events_list completes, a second shutdown() finishes what an
interrupted one began, and the backend object can start again. The sweep also checks
that it interrupted every backend line an untouched run executes (so it is not vacuous).
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from faults import (
    FdWatch,
    LineInterrupt,
    PinWatch,
    Where,
    assert_dir_clean,
    make_caches,
    sweep_lines,
    wait_threads_gone,
)
from kvoffload import DiskBackend

pytestmark = pytest.mark.faults

NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
BLOCK = 4224  # padded to 8192 under O_DIRECT
SLOT = 8192
NUM_BLOCKS, NUM_SLOTS = 4, 8
JOB = ([0, 1, 2], [5, 3, 4])  # three units (one slot each), not in file order


def init(b: DiskBackend, directory: Path, named: bool, dev: PinWatch, caches, osc=None) -> None:
    b.init(caches, "cpu", None, None, str(directory / "kv.bin"), NUM_SLOTS, BLOCK, named_file=named,
           io_threads=1, io_unit_bytes=SLOT, report_load_errors=True, capacity_bytes=NUM_SLOTS * SLOT,
           join_timeout=10.0, device_impl=dev, os_calls=osc)


class Point:
    """What one interrupt point starts from, and the check that nothing is left."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fds = FdWatch()
        self.dev = PinWatch()
        self.caches = make_caches("cpu", NUM_BLOCKS, [BLOCK], seed=7)
        self.events: list = []

    def assert_clean(self) -> None:
        wait_threads_gone()
        self.fds.check(near=self.directory)
        assert_dir_clean(self.directory)
        self.dev.assert_unpinned()
        pending = [idx for idx, ev in self.events if not ev.done]
        assert not pending, f"appended event(s) {pending} never completed"


def round_trip(b: DiskBackend, caches) -> None:
    """The backend works: a store and a load move exactly the stored bytes."""
    want = caches["layer0"][[1, 3]].clone()
    ev: list = []
    b.launch_copy([1, 3], [6, 7], True, 0, ev)
    assert ev[0][1].wait(10) and ev[0][1].ok
    caches["layer0"][[1, 3]] = 0
    b.launch_copy([6, 7], [1, 3], False, 1, ev)
    assert ev[1][1].wait(10) and ev[1][1].ok
    assert torch.equal(caches["layer0"][[1, 3]], want)


def open_jobs(b: DiskBackend) -> int:
    run = b._run
    return 0 if run is None else len(run.open_jobs)


def wait_jobs_ended(b: DiskBackend, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while open_jobs(b):
        assert time.monotonic() < deadline, f"{open_jobs(b)} job(s) still open {timeout} s after launch"
        time.sleep(0.002)


def in_backend(w: Where) -> bool:
    return "/kvoffload/" in w.file


def report(what: str, fired: list[Where]) -> None:
    lines = {(w.file, w.line) for w in fired if in_backend(w)}
    print(f"{what}: {len(fired)} interrupt points, every one of the {len(lines)} backend lines it runs")


def warm_up(directory: Path, named: bool) -> None:
    """One full run first: imports and first-call caches do not shift the line count."""
    p = Point(directory)
    b = DiskBackend()
    init(b, directory, named, p.dev, p.caches)
    round_trip(b, p.caches)
    b.shutdown()
    p.assert_clean()


# One point per line init runs (hundreds, each a full init and round trip): 50 s under
# load on 2 shared cores, near the suite's 120 s for one test. Each point's own waits
# catch a hang; the whole test's limit only has to outlast a slow machine.
@pytest.mark.timeout(600)
@NAMED
def test_interrupt_at_every_line_of_init(cache_dir, named):
    warm_up(cache_dir, named)

    def point(it: LineInterrupt) -> None:
        p = Point(cache_dir)
        b = DiskBackend()
        try:
            it.run(init, b, cache_dir, named, p.dev, p.caches)
        except BaseException as e:
            assert it.caused(e), f"init raised {e!r}, not the interrupt {it.label} at {it.fired}: " + "".join(traceback.format_exception(e))
        else:
            assert it.fired is None or it.swallowed_by_python, f"the interrupt at {it.fired} was swallowed"
            round_trip(b, p.caches)
            b.shutdown()
            p.assert_clean()
            return
        with it.blame():
            # init raised: the backend is not initialised and nothing is left, without a shutdown.
            assert b.closing
            with pytest.raises(RuntimeError, match="not initialised"):
                b.launch_copy([0], [0], True, 0, [])
            p.assert_clean()
            b.shutdown()  # a no-op now
            init(b, cache_dir, named, p.dev, p.caches)  # and the object starts again
            round_trip(b, p.caches)
            b.shutdown()
            p.assert_clean()

    report(f"init ({'named' if named else 'anonymous'})", sweep_lines(point, in_backend))


def test_interrupt_at_every_line_of_launch_copy(cache_dir):
    warm_up(cache_dir, False)
    p = Point(cache_dir)
    b = DiskBackend()
    init(b, cache_dir, False, p.dev, p.caches)

    def point(it: LineInterrupt) -> None:
        before = len(p.events)
        try:
            it.run(b.launch_copy, *JOB, True, it.n, p.events)
        except BaseException as e:
            assert it.caused(e), f"launch_copy raised {e!r}, not the interrupt"
            assert len(p.events) == before, "launch_copy raised yet appended its event"
        else:
            assert it.fired is None or it.swallowed_by_python, f"the interrupt at {it.fired} was swallowed"
            assert len(p.events) == before + 1
        with it.blame():
            # Whatever was queued ends (the part never queued ended as failed), so no job
            # stays open and every appended event completes, without waiting for shutdown.
            wait_jobs_ended(b)
            assert all(ev.wait(10) for _, ev in p.events[before:])
            round_trip(b, p.caches)

    try:
        fired = sweep_lines(point, in_backend)
    finally:
        b.shutdown()
    p.assert_clean()
    report("launch_copy", fired)


class SlowPinWatch(PinWatch):
    """Device copies that take 2 ms: jobs are still running when shutdown comes. (Slow
    here, not in the OS seam: the seam's own lines would split the one-line close.)"""

    def copy_to_host(self, *args, **kwargs):
        time.sleep(0.002)
        return super().copy_to_host(*args, **kwargs)


def start_with_jobs_in_flight(p: Point, directory: Path) -> DiskBackend:
    """A backend with a store and a load queued behind slow copies when shutdown comes."""
    p.dev = SlowPinWatch()
    b = DiskBackend()
    init(b, directory, False, p.dev, p.caches)
    b.launch_copy(*JOB, True, 0, p.events)
    b.launch_copy([5, 3], [3, 0], False, 1, p.events)
    return b


def test_interrupt_at_every_line_of_shutdown(cache_dir):
    warm_up(cache_dir, False)

    def point(it: LineInterrupt) -> None:
        p = Point(cache_dir)
        b = start_with_jobs_in_flight(p, cache_dir)
        try:
            it.run(b.shutdown)
        except BaseException as e:
            assert it.caused(e), f"shutdown raised {e!r}, not the interrupt"
        else:
            assert it.fired is None or it.swallowed_by_python, f"the interrupt at {it.fired} was swallowed"
        with it.blame():
            b.shutdown()  # finishes what the interrupted one began
            assert b.closing
            with pytest.raises(RuntimeError, match="not initialised"):
                b.launch_copy([0], [0], True, 0, [])
            p.assert_clean()

    report("shutdown", sweep_lines(point, in_backend))


def test_shutdown_from_another_thread_at_every_line_of_launch_copy(cache_dir):
    """vLLM's engine may shut down while the worker thread is inside launch_copy: the
    launch is either refused with a clear error or its event completes."""
    warm_up(cache_dir, False)
    outcomes = {"refused": 0, "accepted": 0}

    def point(it: LineInterrupt) -> None:
        p = Point(cache_dir)
        b = DiskBackend()
        init(b, cache_dir, False, p.dev, p.caches)
        closer = threading.Thread(target=b.shutdown, name="test-closer")

        def shut_down_now() -> None:
            closer.start()
            closer.join(0.05)  # let it get as far as it can while launch_copy waits here

        it.action = shut_down_now
        try:
            it.run(b.launch_copy, *JOB, True, 0, p.events)
        except RuntimeError as e:
            with it.blame():
                assert it.fired is not None
                assert "shutting down" in str(e) or "not initialised" in str(e), f"unclear refusal: {e}"
                assert p.events == [], "a refused launch appended its event"
            outcomes["refused"] += 1
        else:
            assert len(p.events) == 1
            outcomes["accepted"] += 1
        with it.blame():
            if it.fired is not None:
                closer.join(30)
                assert not closer.is_alive()
            b.shutdown()
            p.assert_clean()

    fired = sweep_lines(point, in_backend)
    report(f"shutdown during launch_copy ({outcomes})", fired)
    assert outcomes["refused"] >= 1 and outcomes["accepted"] >= 1
