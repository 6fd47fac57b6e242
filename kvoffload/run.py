"""One ``init``'s worth of state: slot files, lanes, IO threads, jobs and per-slot records.

Everything an IO thread touches belongs to its ``Run``: a thread that outlives
``shutdown`` (hung in the kernel) only ever sees its own run, never a later init's.
``DiskBackend`` is the thin vLLM contract over it. The store path is
``store_path.StoreLane``, the load path ``load_path.LoadLane``.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

import numpy as np

from kvoffload import native_io
from kvoffload.device import BlockLayout, Device, HostDevice, alloc_host
from kvoffload.jobs import BackendFatalError, JobEvent, UnreportedLoadError
from kvoffload.metrics import IoMetrics
from kvoffload.native_io import MAX_RUN_SLOTS, NativeCore, UnitCall
from kvoffload.os_calls import OsCalls, moved
from kvoffload.persist import IDENT_BYTES, Pool, Restored, ident_bytes
from kvoffload.slot_file import SlotFile
from kvoffload.slot_seal import TAG_BYTES, SlotSeal

logger = logging.getLogger("kvoffload")

# Runs whose IO threads outlived shutdown, until their last thread ends. Held for the
# process, not the backend object: their staging memory stays registered with the
# device and a late IO may still write it, so it must not be freed and handed out again.
_ABANDONED: set["Run"] = set()
# Every run with threads, so a fork() child can tell that its copy has none.
_LIVE: "weakref.WeakSet[Run]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for run in list(_LIVE):
        run.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class Job:
    event: JobEvent
    is_store: bool
    pending: int  # units not finished yet
    job_id: int = -1
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    launched: float = field(default_factory=time.perf_counter)  # for the job latency metric


@dataclass
class Unit:
    job: Job
    block_ids: list[int]  # device block ids
    slots: list[int]  # global slot ids, same order
    local: list[int]  # slot index inside this lane's file
    wait_event: Any = None
    io_seconds: float = 0.0  # in its pwritev/preadv calls, for the per-unit latency metric
    parts: tuple["Unit", ...] = ()  # a batch: queued units moved in one call (Lane.gather)
    # A persistent pool's store: each slot's identity (generation and block key), set at submit.
    idents: Optional[list[bytes]] = None


class RateLimitedLog:
    """At most ``burst`` warnings per ``window_s`` per kind, then one summary: a dying
    disk fails every IO, and one line per IO unit would bury the log."""

    def __init__(self, burst: int = 10, window_s: float = 60.0) -> None:
        self.burst, self.window_s = burst, window_s
        self._lock = threading.Lock()
        self._state: dict[str, list[float]] = {}  # kind -> [window start, count, suppressed]

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            st = self._state.setdefault(kind, [now, 0, 0])
            if now - st[0] >= self.window_s:
                if st[2]:
                    logger.warning("kvoffload: %d more %s warning(s) suppressed in the last %.0f s",
                                   st[2], kind, now - st[0])
                st[:] = [now, 0, 0]
            st[1] += 1
            if st[1] > self.burst:
                st[2] += 1
                return
        logger.warning(msg, *args)


class WriteGate:
    """Shutdown's gate over what a load writes into the caller's memory (blocks, or the
    launch of a copy into them), on the Python path: ``close`` as shutdown begins (no new
    file call), ``end`` before it ends the open jobs (no write after it returns; the writes
    under way finish first). A write is a bounded run of memory copies or cipher passes, so
    ``end`` waits for it; a file call that hangs is outside the gate, and what it brings
    back once the gate has ended is never written anywhere."""

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


class NativeWriteGate:
    """``WriteGate`` as an int the native core reads and updates atomically (its calls
    check it without the GIL: ``kvo_gate_*`` in native/unit_io.h)."""

    def __init__(self, core: NativeCore) -> None:
        self.lib = core.lib
        self.ptr = core.ffi.new("int *")

    @property
    def closing(self) -> bool:
        return bool(self.ptr[0] & 1)

    def close(self) -> None:
        self.lib.kvo_gate_close(self.ptr)

    def enter(self) -> bool:
        return bool(self.lib.kvo_gate_enter(self.ptr))

    def leave(self) -> None:
        self.lib.kvo_gate_leave(self.ptr)

    def end(self) -> None:
        self.lib.kvo_gate_end(self.ptr)


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

    def lap_native(self, call: UnitCall) -> None:
        """Charge a native call's time as it measured it (device copy, seal, file calls),
        the rest since the last lap (its Python around it) to ``io``, as the Python path would."""
        io, seal, device = call.seconds
        now = time.perf_counter()
        for stage, sec in (("device", device), ("seal", seal)):
            if sec:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + sec
        self.seconds["io"] = self.seconds.get("io", 0.0) + max(0.0, now - self._t - seal - device)
        self._t = now


class Lane:
    """One direction of one slot file: a queue and the threads that serve it."""

    direction = ""  # "store" or "load"
    buffers_per_thread = 1

    def __init__(self, run: "Run", file: SlotFile, stream: Any, rows: int) -> None:
        self.run = run
        self.file = file
        self.stream = stream
        self.rows = rows  # blocks per unit
        self.path = run.files.index(file)  # the disk path's index: the metrics' label
        self.queue: queue.SimpleQueue[Optional[Unit]] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.clocks: list[StageClock] = []  # one per thread
        # The file IO goes straight between the file and host blocks, with no staging,
        # where O_DIRECT allows it: the blocks' address and size are multiples of the
        # file's alignment, so one block is exactly one slot (no padding to read into,
        # and no byte of the next block, another chunk, is ever touched).
        self.direct = (run.direct_io and file.direct and file.slot_bytes == run.layout.block_bytes
                       and run.layout.caches[0].data_ptr() % file.alignment == 0)
        # Host blocks through the native core: the units queued behind one go in its call
        # too, up to a staging buffer. The tier's jobs are small (16 chunks over all its files:
        # 1 MiB a unit at 256 KiB chunks), and each unit costs its thread a GIL hand-over.
        self.batches = run.native is not None and run.host_blocks is not None
        self._calls = threading.local()  # each IO thread's UnitCall

    def unit_call(self) -> UnitCall:
        """This thread's arrays for the native core's unit calls."""
        call = getattr(self._calls, "call", None)
        if call is None:
            call = self._calls.call = UnitCall(self.run.native, self.rows, self.run.seal.aad_bytes)
        return call

    def fill(self, call: UnitCall, unit: "Unit", bufs: np.ndarray, payloads: np.ndarray,
             idents: Optional[list[bytes]] = None) -> None:
        """A native call's per-slot arrays for ``unit``, row by row: file offsets, buffers,
        payloads, what each slot is authenticated to (``idents``: a persistent pool's
        identities), and the cuts between a batch's units."""
        n = len(unit.slots)
        call.file_off[:n] = np.asarray(unit.local, np.int64) * self.file.slot_bytes
        call.buf[:n] = bufs
        call.payload[:n] = payloads
        call.aad[:n, : self.run.seal.aad_bytes] = self.run.seal.aad_array(unit.slots, idents)
        call.status[:n] = self.run.native.lib.KVO_OK
        call.cut[:n] = 0
        if unit.parts:  # a batch: no run of file IO spans two of its units
            starts = np.cumsum([len(p.slots) for p in unit.parts[:-1]])
            call.cut[starts] = 1

    def call_native(self, call: UnitCall, unit: "Unit", copy: Any, span: Callable[[int, int], list[memoryview]],
                    clock: "StageClock") -> None:
        """The unit's one native call (``store_unit.c`` or ``load_unit.c``)."""
        run = self.run
        try:
            call.run(self.direction == "store", len(unit.slots), self.file.fd, self.file.slot_bytes,
                     run.layout.block_bytes, run.seal_code, run.gcm_key, run.osc, span,
                     run.gate.ptr, copy)
        finally:
            unit.io_seconds += call.seconds[0]
            clock.lap_native(call)

    def native_failures(self, call: UnitCall, unit: "Unit") -> set[int]:
        """The rows a native call failed, counted and logged as the Python path does."""
        n, lib = len(unit.slots), self.run.native.lib
        status = call.status[:n]
        bad = np.flatnonzero((status != lib.KVO_OK) & (status != lib.KVO_SKIP))
        if not len(bad):
            return set()
        run, is_store = self.run, self.direction == "store"
        for cause, code in (("io_error", lib.KVO_IO_ERROR), ("short", lib.KVO_SHORT),
                            ("integrity", lib.KVO_INTEGRITY), ("closing", lib.KVO_CANCELLED)):
            run.metrics.failed(is_store, cause, int((status == code).sum()))
        integrity = [unit.slots[j] for j in bad if status[j] == lib.KVO_INTEGRITY]
        if integrity:
            self.log_integrity(integrity)
        io = [j for j in bad if status[j] in (lib.KVO_IO_ERROR, lib.KVO_SHORT)]
        if io:
            code = int(call.err[io[0]])
            why = (OSError(code, os.strerror(code)) if code else
                   f"short {self.direction}: fewer bytes than slot {unit.slots[io[0]]} holds")
            self.log_io_failure([unit.slots[j] for j in io], why)
        return {int(j) for j in bad}

    def log_integrity(self, slots: list[int]) -> None:
        self.run.log.warning("integrity", "kvoffload: slot(s) %s of %s failed the %s check", slots, self.file.path,
                             self.run.seal.name)

    def log_io_failure(self, slots: list[int], why: Any) -> None:
        self.run.log.warning(f"{self.direction} error", "kvoffload: %s of slots %s of %s failed: %s",
                             self.direction, slots, self.file.path, why)

    def staging_addrs(self, rows: torch.Tensor, n: int) -> np.ndarray:
        """Addresses of staging rows [0, n) (for the native core)."""
        return rows.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(self.file.slot_bytes)

    def block_addrs(self, unit: Unit) -> np.ndarray:
        """Addresses of the unit's host blocks, in its order (host-resident blocks only)."""
        ids = np.asarray(unit.block_ids, np.uint64)
        return self.run.layout.caches[0].data_ptr() + ids * np.uint64(self.run.layout.block_bytes)

    def blocks(self, unit: Unit) -> list[memoryview]:
        """The unit's host blocks, in its order (host-resident blocks only)."""
        host, size = self.run.host_blocks, self.run.layout.block_bytes
        return [host[b * size : (b + 1) * size] for b in unit.block_ids]

    def span(self, unit: Unit, mv: Optional[memoryview]) -> Callable[[int, int], list[memoryview]]:
        """The buffers one file call of rows [a, b) passes, on either path: one slice of
        staging ``mv``, or, on a direct lane, the unit's host blocks, one buffer each.
        Slices of buffers the run owns: a seam that keeps them keeps valid memory."""
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
        run = self.run
        run.thread_started()
        try:
            try:
                stream = run.dev.bind_thread(self.stream, run.layout, self.rows, to_host=self.direction == "store")
                # Per staging buffer: its rows, its bytes and the one event its copies
                # record (a copy on a buffer always waits for the one before, so the
                # event is free again).
                views = [(rows, mv, run.dev.new_event()) for rows, mv in buffers]
            except BaseException as e:
                run.bind_errors.append(e)
                return
            finally:
                ready.set()
            clock = StageClock()
            self.clocks.append(clock)
            self.loop(stream, views, clock)
        finally:
            run.thread_ended()

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        raise NotImplementedError

    def transfer(self, span: Callable[[int, int], list[memoryview]], unit: Unit, j0: int, j1: int) -> set[int]:
        """pwritev/preadv rows [j0, j1) to or from the unit's file slots (consecutive in the
        file); ``span(a, b)`` gives the buffers of rows [a, b) (one staging slice, or one
        block per row). Returns the rows that failed.

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
            error: Any = f"short {self.direction}: {done} of {(j1 - j0) * size} bytes"
        except OSError as e:
            done, error = 0, e
        if done == (j1 - j0) * size:
            unit.io_seconds += time.perf_counter() - t0
            return set()
        if j1 - j0 == 1:
            failed = {j0}
            raised = int(isinstance(error, OSError))
        else:
            failed, raised = set(), 0
            for j in range(j0 + done // size, j1):  # a short transfer still moved the slots before
                try:
                    one = moved(call(f.fd, span(j, j + 1), unit.local[j] * size), call)
                except OSError as e:
                    one, error = 0, e
                    raised += 1
                if one != size:
                    failed.add(j)
        unit.io_seconds += time.perf_counter() - t0
        is_store = self.direction == "store"
        self.run.metrics.failed(is_store, "io_error", raised)
        self.run.metrics.failed(is_store, "short", len(failed) - raised)
        if failed:
            self.log_io_failure([unit.slots[j] for j in sorted(failed)], error)
        return failed

    def gather(self, unit: Unit) -> tuple[Unit, Optional[Unit], bool]:
        """``unit``, or a batch of it and the units queued behind it that fit one staging
        buffer with it; then the unit taken that did not fit (None: none), and whether a stop
        sentinel was taken (this thread then ends after the batch: each thread takes one)."""
        if not self.batches or unit.wait_event is not None:
            return unit, None, False
        parts, n = [unit], len(unit.slots)
        while n < self.rows:
            try:
                nxt = self.queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return self._batch(parts), None, True
            if n + len(nxt.slots) > self.rows or nxt.wait_event is not None:
                return self._batch(parts), nxt, False
            parts.append(nxt)
            n += len(nxt.slots)
        return self._batch(parts), None, False

    @staticmethod
    def _batch(parts: list[Unit]) -> Unit:
        if len(parts) == 1:
            return parts[0]
        idents = None if parts[0].idents is None else [x for p in parts for x in p.idents]
        return Unit(parts[0].job, [b for p in parts for b in p.block_ids], [s for p in parts for s in p.slots],
                    [i for p in parts for i in p.local], parts=tuple(parts), idents=idents)

    def refuse_if_closing(self, unit: Unit) -> bool:
        """A unit dequeued after shutdown began or the device failed ends as failed, without IO."""
        if self.run.closing or self.run.fatal is not None:
            self.run.metrics.failed(self.direction == "store", "closing" if self.run.fatal is None else "device",
                                    len(unit.slots))
            self.finish(unit, set(range(len(unit.slots))))
            return True
        return False

    def finish(self, unit: Unit, failed: set[int]) -> None:
        """One unit (or a batch's every part) is over; ``failed`` holds its row indices that failed."""
        if unit.parts:
            first = 0
            for part in unit.parts:
                end = first + len(part.slots)
                part.io_seconds = unit.io_seconds  # each part waited for the whole call
                self.finish(part, {j - first for j in failed if first <= j < end})
                first = end
            return
        run = self.run
        if failed:
            run.record_failures(self.direction == "store", unit, failed)
        run.metrics.unit_done(self.direction == "store", self.path, len(unit.slots) - len(failed), self.file.slot_bytes,
                              unit.io_seconds)
        job = unit.job
        with job.lock:
            job.pending -= 1
            job.failed |= bool(failed)
            last = job.pending == 0
        if last:
            run.end_job(job, failed=job.failed)


class Run:
    """Everything one ``init`` creates; ``stop``/``close`` retire it as a whole."""

    def __init__(self, osc: OsCalls, dev: Device, layout: BlockLayout, num_slots: int, seal: SlotSeal,
                 report_load_errors: bool, threads_per_lane: int, metrics: IoMetrics,
                 native: Optional[NativeCore] = None) -> None:
        self.osc, self.dev, self.layout, self.seal = osc, dev, layout, seal
        # The native core (whole units in one GIL-free call), or None: the Python path.
        # Chosen once, at init (native_io.choose).
        self.native = native
        self.io_path_detail = ""  # what the start-up line says of the choice
        # What the core reads: its seal, the expanded key (wiped at close; NULL with no
        # cipher), and the gate shutdown closes so that a call back from a hang writes
        # nothing into the caller's memory.
        self.seal_code = self.gcm_key = None
        if native is not None:
            self.seal_code = native_io.seal_code(native, seal)
            self.gcm_key = (native_io.gcm_key(native, seal.key) if self.seal_code == native.lib.KVO_SEAL_AES_GCM
                            else native.ffi.NULL)
        self.gate = WriteGate() if native is None else NativeWriteGate(native)
        # Host-resident blocks (HostDevice) are sealed from and opened into directly,
        # and, where a lane's file allows, read into and written from (Lane.direct).
        self.host_blocks = dev.host_view(layout)
        self.direct_io = isinstance(dev, HostDevice) and dev.direct_io
        self.num_slots = num_slots
        self.threads_per_lane = threads_per_lane
        self.report_load_errors = report_load_errors
        self.files: list[SlotFile] = []
        self.lanes: dict[bool, list[Lane]] = {True: [], False: []}  # is_store -> lanes
        self.pinned: list[torch.Tensor] = []
        self.records: list[Any] = [None] * num_slots  # per slot: its seal record, None = invalid
        # A persistent pool (persist.Pool, set by init), and per slot the generation of its
        # latest store and the LRU sequence of its record.
        self.pool: Optional[Pool] = None
        self.generation: Optional[np.ndarray] = None
        self.seq: Optional[np.ndarray] = None
        self.restored: Optional[Restored] = None  # what init found in the pool (DiskBackend.restored)
        # Per slot, the job of the latest store launched to it: only that store may publish
        # the slot's record, so a slot whose latest store failed never loads an older copy.
        self.latest_store = np.full(num_slots, -1, np.int64)
        self.lock = threading.Lock()  # jobs, errors, counters, fatal
        self.load_errors: set[int] = set()
        self.failed_store_slots: set[int] = set()
        self.open_jobs: dict[int, Job] = {}
        self.job_ids = itertools.count()
        self.closing = False
        self.forked = False
        self.close_lock = threading.Lock()  # one close() at a time: shutdown's, or the last thread's
        # Orders loads' device copies against `closing`: a job that shutdown ended
        # as failed must not get device blocks written afterwards. Held only to
        # check and count, never across the copy, so threads copy side by side.
        self.copy_cond = threading.Condition()
        self.copies = 0
        self.fatal: Optional[BackendFatalError] = None
        self.bind_errors: list[BaseException] = []  # IO threads that could not start
        self.alive = 0  # IO threads running (each counts itself in and out)
        self.abandoned = False  # shutdown gave up on a thread: the last one out closes the run
        self.bytes_written = 0
        self.bytes_read = 0
        self.log = RateLimitedLog()
        self.metrics = metrics

    # -- start ------------------------------------------------------------------

    def start_threads(self, start_timeout: float) -> None:
        """Start every lane's threads; wait until each has bound the device."""
        started = []
        for is_store in (True, False):
            for lane in self.lanes[is_store]:
                for k in range(len(lane.threads), self.threads_per_lane):
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
        _LIVE.add(self)
        # A thread that cannot set up its device state would leave its lane short
        # (or empty, and jobs waiting forever): init fails instead.
        deadline = time.monotonic() + start_timeout
        for t, ready in started:
            if not ready.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"IO thread {t.name} did not start within {start_timeout} s")
        if self.bind_errors:
            err = self.bind_errors[0]
            raise RuntimeError(f"an IO thread could not set up the device: {err!r}") from err

    # -- jobs -------------------------------------------------------------------

    def submit(self, blocks: list[int], slots: list[int], is_store: bool, event_idx: int, events_list: list,
               wait_event: Any, keys: Optional[list[bytes]] = None) -> None:
        """Split a checked job into units and queue them; the event is appended last.
        ``keys``: a persistent pool's store, each block's key (``persist.check_keys``)."""
        if self.forked:
            raise RuntimeError(
                "kvoffload DiskBackend used in a fork()ed child: its IO threads live in the parent; "
                "create a new DiskBackend in this process"
            )
        event = JobEvent()
        lanes = self.lanes[is_store]
        n = len(lanes)
        per_lane: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for b, s in zip(blocks, slots):
            per_lane[s % n].append((b, s))
        job = Job(event, is_store, pending=0, job_id=next(self.job_ids))
        units = []
        for lane, pairs in zip(lanes, per_lane):
            for i in range(0, len(pairs), lane.rows):
                chunk = pairs[i : i + lane.rows]
                units.append((lane, Unit(job, [b for b, _ in chunk], [s for _, s in chunk],
                                         [s // n for _, s in chunk], wait_event)))
        job.pending = len(units)
        queues = [lane.queue for lane, _ in units]
        items = [unit for _, unit in units]
        queued = 0
        try:
            with self.lock:
                if self.fatal is not None:
                    raise BackendFatalError(f"kvoffload backend failed earlier: {self.fatal}") from self.fatal
                if self.closing:
                    raise RuntimeError("DiskBackend is shutting down")
                if is_store:  # invalid from now until this store ends well (publish)
                    self.latest_store[slots] = job.job_id
                    for s in slots:
                        self.records[s] = None
                    if keys is not None:
                        self._identify(units, dict(zip(slots, keys)))
                # Registered before any unit is queued: whatever happens from here on
                # (an interrupt, a shutdown in another thread), shutdown ends it.
                self.open_jobs[job.job_id] = job
            self.metrics.queued(is_store, lanes, queues)
            if not units:  # an empty job
                self.end_job(job, failed=False)
            # Every unit in one C-level loop, counted in the same line: an interrupt
            # (Ctrl-C acts between Python lines) comes before all of them or after.
            queued = len(list(map(queue.SimpleQueue.put, queues, items)))
            # Last: the worker never sees an event whose job is not fully queued.
            events_list.append((event_idx, event))
        except BaseException:
            # Interrupted between registering the job and queueing it: no unit will
            # ever run, so they end now as failed, and the job with them.
            if not queued and self.open_jobs.get(job.job_id) is job:
                for lane, unit in units:
                    lane.finish(unit, failed=set(range(len(unit.slots))))
            raise

    def _identify(self, units: list[tuple["Lane", Unit]], key_of: dict[int, bytes]) -> None:
        """A persistent store's identities: one generation more per slot (under the lock)."""
        for _, unit in units:
            unit.idents = []
            for s in unit.slots:
                self.generation[s] += 1
                unit.idents.append(ident_bytes(int(self.generation[s]), key_of[s]))

    def publish(self, unit: Unit, records: list[Any], failed: set[int]) -> list[tuple[int, Any, int]]:
        """A store unit's outcome, slot by slot: a slot's record is set only by the latest
        store launched to it, or cleared where that store failed. An earlier store ending
        later changes nothing (if its bytes landed last, they fail the record's check).
        Returns what it applied, ``(row, record or None, LRU sequence)``: a persistent
        pool's index gets the same (``write_index``)."""
        jobs = [p.job.job_id for p in unit.parts for _ in p.slots] if unit.parts else None
        job = unit.job.job_id
        applied: list[tuple[int, Any, int]] = []
        if self.pool is None:
            latest, own = self.latest_store, self.records
            # No lock (a contended one costs an IO thread a GIL hand-over per unit). A store
            # launched to the slot meanwhile sets latest_store first, then clears the record
            # (submit): set, then look again, and the newer store's clearing always comes last.
            for j, s in enumerate(unit.slots):
                mine = job if jobs is None else jobs[j]
                if latest[s] == mine:
                    own[s] = None if j in failed else records[j]
                    if latest[s] != mine:
                        own[s] = None
            return applied
        with self.lock:  # a persistent pool: the record and its LRU sequence together
            for j, s in enumerate(unit.slots):
                if self.latest_store[s] == (job if jobs is None else jobs[j]):
                    self.records[s] = rec = None if j in failed else records[j]
                    seq = 0
                    if rec is not None:
                        seq = self.seq[s] = self.pool.next_seq
                        self.pool.next_seq += 1
                    applied.append((j, rec, seq))
        return applied

    def write_index(self, lane: "Lane", unit: Unit, rows: list[tuple[int, Any, int]]) -> None:
        """A persistent pool's index records for ``rows`` of ``unit`` (``publish``'s): the
        record, or an empty one (a failed store, or a block that failed its check). Outside
        the run's lock: an index write may be slow or hang like any other."""
        pool = self.pool
        if pool is None or not rows:
            return
        recs = [r for _, r, _ in rows]
        idents = [r[2] if r is not None else bytes(IDENT_BYTES) for r in recs]
        failed = pool.write(lane.path, np.asarray([unit.local[j] for j, _, _ in rows], np.int64),
                            np.asarray([int.from_bytes(x[:8], "little") for x in idents], np.uint64),
                            np.asarray([seq for _, _, seq in rows], np.uint64),
                            [r[0] if r is not None else 0 for r in recs],
                            [r[1] if r is not None else bytes(TAG_BYTES) for r in recs],
                            [x[9 : 9 + x[8]] for x in idents])
        if failed:
            self.log.warning("index", "kvoffload: writing the index records of slots %s of %s failed; those blocks "
                             "serve now but will not after a restart", failed, lane.file.path)

    def forget(self, lane: "Lane", unit: Unit, rows: set[int], records: list[Any]) -> None:
        """A persistent pool's blocks that failed their check: out of the run and of the index
        (a restart would offer them again), unless a store has replaced them meanwhile."""
        if self.pool is None or not rows:
            return
        with self.lock:
            gone = [j for j in sorted(rows) if records[j] is not None and self.records[unit.slots[j]] is records[j]]
            for j in gone:
                self.records[unit.slots[j]] = None
        self.write_index(lane, unit, [(j, None, 0) for j in gone])

    def record_failures(self, is_store: bool, unit: Unit, failed: set[int]) -> None:
        with self.lock:
            if is_store:
                self.failed_store_slots.update(unit.slots[j] for j in failed)
            else:
                self.load_errors.update(unit.block_ids[j] for j in failed)

    def end_job(self, job: Job, failed: bool, fatal: Optional[BaseException] = None) -> None:
        # Errors are recorded before the event completes: when the worker sees the
        # event, get_block_ids_with_load_errors() already holds the failed blocks.
        error = fatal
        if error is None and failed and not job.is_store and not self.report_load_errors:
            error = UnreportedLoadError(
                "kvoffload: a disk load failed and this caller does not collect load errors "
                "(vLLM's own SimpleCPUOffloadWorker); stopping rather than computing on stale KV. "
                "Run kvoffload through KvoffloadConnector (kv_connector_module_path \"kvoffload.vllm\") "
                "to recompute failed loads instead"
            )
        if job.event.complete(ok=not failed, error=error):
            # Before the job leaves open_jobs: once none is open, every latency is counted.
            self.metrics.job_done(job.is_store, time.perf_counter() - job.launched)
            with self.lock:
                self.open_jobs.pop(job.job_id, None)

    def fail_fatal(self, exc: BaseException, lane: Lane, unit: Unit) -> None:
        """A device failure: recorded once, then every open job ends carrying it."""
        err = BackendFatalError(f"{lane.direction} to {lane.file.path} failed on the device: {exc!r}")
        err.__cause__ = exc
        self.metrics.failed(lane.direction == "store", "device", len(unit.slots))
        with self.lock:
            if self.fatal is None:
                self.fatal = err
                logger.error("%s", err)
            fatal = self.fatal
        self.record_failures(lane.direction == "store", unit, set(range(len(unit.slots))))
        with self.lock:
            jobs = list(self.open_jobs.values())
        for job in jobs:
            self.end_job(job, failed=True, fatal=fatal)

    def stage_seconds(self) -> dict[str, dict[str, float]]:
        """Thread-seconds per stage and direction, summed over the IO threads."""
        out: dict[str, dict[str, float]] = {"store": {}, "load": {}}
        for lanes in self.lanes.values():
            for lane in lanes:
                acc = out[lane.direction]
                for clock in list(lane.clocks):
                    for stage, sec in list(clock.seconds.items()):
                        acc[stage] = acc.get(stage, 0.0) + sec
        return out

    def take(self, name: str) -> set[int]:
        with self.lock:
            out = getattr(self, name)
            setattr(self, name, set())
        return out

    # -- stop -------------------------------------------------------------------

    def begin_close(self) -> None:
        """No job is accepted from now on; queued units end as failed without IO."""
        with self.lock:
            self.closing = True
        self.gate.close()
        with self.copy_cond:
            self.copy_cond.notify_all()

    def signal_stop(self) -> None:
        """``begin_close``, then one sentinel per thread: each thread ends once its queue drains."""
        self.begin_close()
        if not self.forked:  # a fork()ed child's copy has no threads to stop
            for lanes in self.lanes.values():
                for lane in lanes:
                    for _ in lane.threads:
                        lane.queue.put(None)

    def threads(self) -> list[threading.Thread]:
        return [t for lanes in self.lanes.values() for lane in lanes for t in lane.threads]

    def stop(self, deadline: float, clock) -> list[threading.Thread]:
        """Stop the threads by ``deadline``; end every open job. Returns the threads still alive."""
        # Only running threads can be joined. One whose start() was interrupted may
        # begin later: it finds `closing` set and its sentinel queued, and ends
        # without touching the files.
        threads = [t for t in self.threads() if t.is_alive()]
        self.signal_stop()
        if not self.forked:
            for t in threads:
                t.join(max(0.0, deadline - clock()))
        alive = [t for t in threads if t.is_alive() and not self.forked]
        with self.copy_cond:  # copies already under way finish before their jobs end
            self.copy_cond.wait_for(lambda: self.copies == 0, max(0.0, deadline - clock()))
        # From here on nothing is written into the caller's memory for any job, even by a
        # thread that comes back from a hang later. (A fork()ed child's copy has no threads,
        # and may hold a count of writers that were running in the parent.)
        if not self.forked:
            self.gate.end()
        # Jobs still held by a hung thread end as failed now, so no poll waits forever;
        # the thread checks `closing` before any later device copy.
        with self.lock:
            jobs = list(self.open_jobs.values())
        for job in jobs:
            self.end_job(job, failed=True)
        return alive

    def abandon(self) -> None:
        """Shutdown gave up on a live thread: its last thread to end closes the run."""
        with self.lock:
            self.abandoned = True
            last = self.alive == 0
        if last:
            self.close()
        else:
            _ABANDONED.add(self)

    def thread_started(self) -> None:
        with self.lock:
            self.alive += 1

    def thread_ended(self) -> None:
        with self.lock:
            self.alive -= 1
            last = self.alive == 0 and self.abandoned
        if last:
            _ABANDONED.discard(self)
            self.close()

    def close(self) -> None:
        """Release files and staging; only when no IO thread can touch them any more.

        Resumable: a buffer or file leaves its list only once released, so a close cut
        short (an interrupt inside shutdown) is finished by the next one.
        """
        with self.close_lock:
            _LIVE.discard(self)
            while self.pinned:
                if not self.forked:  # a forked child has no device context to unregister from
                    try:
                        self.dev.unpin(self.pinned[-1])
                    except Exception as e:  # noqa: BLE001 - best effort, and the next buffer still goes
                        logger.warning("kvoffload: unpinning staging failed: %s", e)
                # Dropped after the unpin: an interrupt in between repeats the unpin (a
                # no-op for a buffer no longer pinned), never skips it.
                self.pinned.pop()
            for f in self.files:
                f.close(self.osc, discard=not self.forked)
            if self.pool is not None:
                self.pool.close(sync=not self.forked)
            if self.gcm_key:  # no thread can seal any more: the key need not stay in memory
                native_io.wipe(self.native, self.gcm_key)


def units_of(rows: Sequence[int], skip: frozenset[int] | set[int] = frozenset()):
    """Maximal index ranges [j0, j1) of consecutive file slots, leaving out ``skip``, of at
    most ``MAX_RUN_SLOTS`` slots (``unit_runs.c``'s ``kvo_run_end`` is the same rule).

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
