"""What the Python engine's store and load lanes share: units, the queue and its threads,
runs of file calls with their retries, shutdown's gate, and the end of a unit
(``Run.settle``)."""

from __future__ import annotations

import errno
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from kvoffload.device import alloc_host
from kvoffload.engine import CANCELLED, DEVICE, IO_ERROR, SHORT
from kvoffload.os_calls import moved
from kvoffload.slot_file import SlotFile
from kvoffload.slot_records import Records
from kvoffload.slot_seal import TAG_BYTES

if TYPE_CHECKING:
    from kvoffload.python_engine import PythonEngine
    from kvoffload.run import Job

# Most slots one file call moves: the kernel takes at most IOV_MAX buffers a call, and a
# direct lane passes one per block. The native engine's max_run is the same.
MAX_RUN_SLOTS = 1024


@dataclass
class Unit:
    job: "Job"
    block_ids: list[int]  # device block ids
    slots: list[int]  # global slot ids, same order
    local: list[int]  # slot index inside this lane's file
    wait_event: Any = None
    # A load's: what each slot is checked against; a persistent store's: each slot's identity.
    records: Optional[Records] = None
    io_seconds: float = 0.0  # in its pwritev/preadv calls, for the per-unit latency metric


class WriteGate:
    """Shutdown's gate over what a load writes into the caller's memory (blocks, or the
    launch of a copy into them): ``close`` as shutdown begins (no new file call), ``end``
    before it ends the open jobs (no write after it returns; the writes under way finish
    first). A write is a bounded run of memory copies or cipher passes, so ``end`` waits
    for it; a file call that hangs is outside the gate, and what it brings back once the
    gate has ended is never written anywhere. (The native engine's is ``kvo_gate_*``.)"""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.closing = False
        self._ended = False
        self._writers = 0

    def close(self) -> None:
        with self._cond:
            self.closing = True

    def enter(self) -> bool:
        """Whether a write may start (then ``leave`` when it is done): not once ended."""
        with self._cond:
            if self._ended:
                return False
            self._writers += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._writers -= 1
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.closing = self._ended = True
            self._cond.wait_for(lambda: self._writers == 0)


class StageClock:
    """Seconds one IO thread spends in each stage (waiting for work, device copy, seal or
    open, file IO): where the time goes, per direction, in ``DiskBackend.stats()``."""

    __slots__ = ("seconds", "_t")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        """Charge the time since the last lap to ``stage``."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._t
        self._t = now


class Lane:
    """One direction of one slot file: a queue and the threads that serve it."""

    direction = ""  # "store" or "load"
    buffers_per_thread = 1

    def __init__(self, engine: "PythonEngine", file: SlotFile, stream: Any, rows: int) -> None:
        run = engine.run
        self.engine, self.run = engine, run
        self.file = file
        self.stream = stream
        self.rows = rows  # blocks per unit
        self.path = run.files.index(file)  # the disk path's index: the metrics' label
        self.queue: queue.SimpleQueue[Optional[Unit]] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.clocks: list[StageClock] = []  # one per thread
        self.direct = run.direct_lane(file, self.direction == "store")

    def blocks(self, unit: Unit) -> list[memoryview]:
        """The unit's host blocks, in its order (host-resident blocks only)."""
        host, size = self.run.host_blocks, self.run.layout.block_bytes
        return [host[b * size : (b + 1) * size] for b in unit.block_ids]

    def span(self, unit: Unit, mv: Optional[memoryview]) -> Callable[[int, int], list[memoryview]]:
        """The buffers one file call of rows [a, b) passes: one slice of staging ``mv``,
        or, on a direct lane, the unit's host blocks, one buffer each. Slices of buffers
        the run owns: a seam that keeps them keeps valid memory."""
        if self.direct:
            host, size = self.run.host_blocks, self.run.layout.block_bytes
            return lambda a, b: [host[x * size : (x + 1) * size] for x in unit.block_ids[a:b]]
        size = self.file.slot_bytes
        return lambda a, b: [mv[a * size : b * size]]

    def file_call(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        """This direction's file call through the seam (``pwritev`` or ``preadv``)."""
        raise NotImplementedError

    def staging(self) -> list[tuple[torch.Tensor, memoryview]]:
        """One thread's staging buffers as ([rows, slot_bytes] tensor, bytes with the spare
        tail), none for a direct lane; each is registered with the run before it is pinned."""
        out = []
        slot = self.file.slot_bytes
        for _ in range(0 if self.direct else self.buffers_per_thread):
            # TAG_BYTES spare: sealing the last row borrows the 16 bytes after it.
            buf = alloc_host(self.rows * slot + TAG_BYTES, max(self.file.alignment, 4096))
            self.run.pinned.append(buf)
            self.run.dev.pin(buf)
            out.append((buf[: self.rows * slot].view(self.rows, slot), memoryview(buf.numpy()).cast("B")))
        return out

    def serve(self, buffers: list[tuple[torch.Tensor, memoryview]], ready: threading.Event) -> None:
        engine, run = self.engine, self.run
        engine.thread_started()
        try:
            try:
                stream = run.dev.bind_thread(self.stream, run.layout, self.rows, to_host=self.direction == "store")
                # Per staging buffer: its rows, its bytes and the one event its copies
                # record (a copy on a buffer always waits for the one before, so the
                # event is free again).
                views = [(rows, mv, run.dev.new_event()) for rows, mv in buffers]
            except BaseException as e:
                engine.bind_errors.append(e)
                return
            finally:
                ready.set()
            clock = StageClock()
            self.clocks.append(clock)
            self.loop(stream, views, clock)
        finally:
            engine.thread_ended()

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        raise NotImplementedError

    def transfer(self, span: Callable[[int, int], list[memoryview]], unit: Unit, j0: int, j1: int,
                 status: np.ndarray, err: np.ndarray) -> set[int]:
        """pwritev/preadv rows [j0, j1) to or from the unit's file slots (consecutive in the
        file); ``span(a, b)`` gives the buffers of rows [a, b). Returns the rows that failed
        (their ``status`` and ``err`` set).

        One IO error fails only the slots it touched: after a failed or short transfer
        of several slots, the slots a short one fully moved count as done and the
        others are tried one by one. A failed slot is never trusted again until a
        later store rewrites it whole (old, new or mixed bytes: fsyncgate).
        """
        f = self.file
        size = f.slot_bytes
        call = self.file_call
        t0 = time.perf_counter()
        try:
            done = moved(call(f.fd, span(j0, j1), unit.local[j0] * size), call)
        except OSError as e:
            done = -(e.errno or errno.EIO)
        if done == (j1 - j0) * size:
            unit.io_seconds += time.perf_counter() - t0
            return set()
        failed = set()
        if j1 - j0 == 1:
            self._fail(j0, done, status, err)
            failed.add(j0)
        else:
            for j in range(j0 + max(done, 0) // size, j1):  # a short transfer still moved the slots before
                try:
                    one = moved(call(f.fd, span(j, j + 1), unit.local[j] * size), call)
                except OSError as e:
                    one = -(e.errno or errno.EIO)
                if one != size:
                    self._fail(j, one, status, err)
                    failed.add(j)
        unit.io_seconds += time.perf_counter() - t0
        return failed

    @staticmethod
    def _fail(j: int, got: int, status: np.ndarray, err: np.ndarray) -> None:
        status[j] = IO_ERROR if got < 0 else SHORT
        err[j] = -got if got < 0 else 0

    def refuse_if_closing(self, unit: Unit) -> bool:
        """A unit dequeued after shutdown began or the device failed ends as failed, without IO."""
        run = self.run
        if run.closing or run.fatal is not None:
            n = len(unit.slots)
            self.finish(unit, np.full(n, CANCELLED if run.fatal is None else DEVICE, np.int32),
                        np.zeros(n, np.int32), None)
            return True
        return False

    def fail_fatal(self, exc: BaseException, unit: Unit) -> None:
        """A device failure (or the seam's own exception): fatal for the run; the unit ends."""
        self.run.fail_fatal(exc, f"{self.direction} to {self.file.path}")
        n = len(unit.slots)
        self.finish(unit, np.full(n, DEVICE, np.int32), np.zeros(n, np.int32), None)

    def finish(self, unit: Unit, status: np.ndarray, err: np.ndarray, records: Optional[Records]) -> None:
        """The unit is over: one outcome per row, and for a store the records it made (a
        load's: what it checked against, ``unit.records``)."""
        self.run.settle(unit.job, np.asarray(unit.slots, np.int64), np.asarray(unit.block_ids, np.int64), status,
                        err, records if self.direction == "store" else unit.records, np.array([unit.io_seconds]))


def outcome_arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A unit's status (all OK) and errno per row."""
    return np.zeros(n, np.int32), np.zeros(n, np.int32)


def units_of(rows: Sequence[int], skip: frozenset[int] | set[int] = frozenset()):
    """Maximal index ranges [j0, j1) of consecutive file slots, leaving out ``skip``, of at
    most ``MAX_RUN_SLOTS`` slots (the native engine's ``kvo_run_end`` is the same rule).

    One range is one pwritev/preadv: its staging rows are contiguous too.
    """
    j = 0
    n = len(rows)
    while j < n:
        if j in skip:
            j += 1
            continue
        j1 = j + 1
        while j1 < n and j1 - j < MAX_RUN_SLOTS and j1 not in skip and rows[j1] == rows[j1 - 1] + 1:
            j1 += 1
        yield j, j1
        j = j1

