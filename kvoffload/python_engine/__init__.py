"""The Python engine, the reference: per lane (one slot file, one direction) a queue and
Python IO threads that copy, seal and move each unit slot by slot in Python.

How a store reaches the disk: ``store_path.py``; how a load comes back: ``load_path.py``;
what they share (units, threads, retries, shutdown's gate): ``lanes.py``. The native
engine (``kvoffload.native_engine``) does the same in C and is held to it by
``tests/test_native_differential.py``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from kvoffload.python_engine.lanes import Lane, Unit, WriteGate
from kvoffload.python_engine.load_path import LoadLane
from kvoffload.python_engine.store_path import StoreLane
from kvoffload.slot_records import Records

if TYPE_CHECKING:
    from kvoffload.run import Job, Run


class PythonEngine:
    """``engine.Engine`` on Python threads (``io_threads`` per lane)."""

    name = "python"

    def __init__(self, run: "Run") -> None:

        self.run = run
        self.gate = WriteGate()
        self.lanes: dict[bool, list[Lane]] = {True: [], False: []}
        for f in run.files:
            rows = run.rows_per_unit(f)
            self.lanes[True].append(StoreLane(self, f, run.streams[True], rows))
            self.lanes[False].append(LoadLane(self, f, run.streams[False], rows))
        self.lock = threading.Lock()
        # Loads' device copies under way (shutdown waits for them before it ends their jobs).
        self.copy_cond = threading.Condition()
        self.copies = 0
        self.bind_errors: list[BaseException] = []  # IO threads that could not start
        self.alive = 0  # IO threads running (each counts itself in and out)
        self.on_last: Optional[Callable[[], None]] = None  # abandoned: what the last thread out runs

    def threads(self) -> list[threading.Thread]:
        return [t for lanes in self.lanes.values() for lane in lanes for t in lane.threads]

    def start(self, start_timeout: float) -> None:
        import time

        started = []
        for is_store in (True, False):
            for lane in self.lanes[is_store]:
                for k in range(len(lane.threads), self.run.threads_per_lane):
                    ready = threading.Event()
                    t = threading.Thread(target=lane.serve, args=(lane.staging(), ready),
                                         name=f"kvoffload-{lane.direction}-{k}", daemon=True)
                    # Listed before start, so stop() finds it however start() ends: an
                    # interrupt inside Thread.start() may come after the thread exists.
                    # The thread counts itself (thread_started), so it is never counted
                    # twice or not at all.
                    lane.threads.append(t)
                    t.start()
                    started.append((t, ready))
        # A thread that cannot set up its device state would leave its lane short
        # (or empty, and jobs waiting forever): init fails instead.
        deadline = time.monotonic() + start_timeout
        for t, ready in started:
            if not ready.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"IO thread {t.name} did not start within {start_timeout} s")
        if self.bind_errors:
            err = self.bind_errors[0]
            raise RuntimeError(f"an IO thread could not set up the device: {err!r}") from err

    def submit(self, job: "Job", blocks: np.ndarray, slots: np.ndarray, wait_event: Any,
               records: Optional[Records]) -> None:
        lanes = self.lanes[job.is_store]
        n = len(lanes)
        queues, units, depth = [], [], {}
        for i, lane in enumerate(lanes):
            rows = np.flatnonzero(slots % n == i)
            for a in range(0, len(rows), lane.rows):
                r = rows[a:a + lane.rows]
                queues.append(lane.queue)
                units.append(Unit(job, blocks[r].tolist(), slots[r].tolist(), (slots[r] // n).tolist(), wait_event,
                                  None if records is None else records.take(r)))
            depth[lane.path] = lane.queue.qsize() + -(-len(rows) // lane.rows)
        job.pending = len(units)
        self.run.metrics.queued(job.is_store, depth)
        # Every unit in one C-level loop: an interrupt (Ctrl-C acts between Python lines)
        # comes before all of them or after.
        list(map(type(queues[0]).put, queues, units))

    def begin_close(self) -> None:
        self.gate.close()
        with self.copy_cond:
            self.copy_cond.notify_all()
        for lanes in self.lanes.values():
            for lane in lanes:
                for _ in lane.threads:  # one sentinel per thread: each ends once its queue drains
                    lane.queue.put(None)

    def fail(self) -> None:
        return None  # the lanes look at run.fatal before each unit

    def join(self, deadline: float, clock: Callable[[], float]) -> list[str]:
        # Only running threads can be joined. One whose start() was interrupted may begin
        # later: it finds `closing` set and its sentinel queued, and ends without IO.
        threads = [t for t in self.threads() if t.is_alive()]
        for t in threads:
            t.join(max(0.0, deadline - clock()))
        return [t.name for t in threads if t.is_alive()]

    def wait_copies(self, deadline: float, clock: Callable[[], float]) -> None:
        with self.copy_cond:
            self.copy_cond.wait_for(lambda: self.copies == 0, max(0.0, deadline - clock()))

    def end_writes(self) -> None:
        self.gate.end()

    def abandon(self, close: Callable[[], None]) -> None:
        with self.lock:
            self.on_last = close
            last = self.alive == 0
        if last:
            close()

    def close(self) -> None:
        return None  # nothing beyond what the run releases

    def thread_started(self) -> None:
        with self.lock:
            self.alive += 1

    def thread_ended(self) -> None:
        with self.lock:
            self.alive -= 1
            last = self.on_last if self.alive == 0 else None
        if last is not None:
            last()

    def queued(self) -> dict[tuple[str, int], int]:
        return {(lane.direction, lane.path): lane.queue.qsize() for lanes in self.lanes.values() for lane in lanes}

    def stage_seconds(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {"store": {}, "load": {}}
        for lanes in self.lanes.values():
            for lane in lanes:
                acc = out[lane.direction]
                for clock in list(lane.clocks):
                    for stage, sec in list(clock.seconds.items()):
                        acc[stage] = acc.get(stage, 0.0) + sec
        return out
