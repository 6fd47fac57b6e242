"""One ``init``'s worth of state: slot files, jobs, per-slot records, and the engine.

Everything an engine's worker touches belongs to its ``Run``: a worker that outlives
``shutdown`` (hung in the kernel) only ever sees its own run, never a later init's.
``DiskBackend`` is the thin vLLM contract over it. ``submit`` checks and registers a job
and hands it to the engine (``engine.py``); the engine reports each finished part of it
to ``settle``, which counts, publishes records and ends the job: the same code whichever
engine moved the bytes.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from kvoffload.device import BlockLayout, Device, HostDevice
from kvoffload.engine import CAUSES, INTEGRITY, IO_ERROR, OK, SHORT, Engine
from kvoffload.jobs import BackendFatalError, JobEvent, UnreportedLoadError
from kvoffload.metrics import IoMetrics
from kvoffload.os_calls import OsCalls
from kvoffload.slot_file import SlotFile
from kvoffload.slot_keeper import Ephemeral, Keeper
from kvoffload.slot_records import Records
from kvoffload.slot_seal import SlotSeal

logger = logging.getLogger("kvoffload")

# Runs whose workers outlived shutdown, until their last worker ends. Held for the
# process, not the backend object: their staging memory stays registered with the
# device and a late IO may still write it, so it must not be freed and handed out again.
_ABANDONED: set["Run"] = set()
# Every run with workers, so a fork() child can tell that its copy has none.
_LIVE: "weakref.WeakSet[Run]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for run in list(_LIVE):
        run.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class Job:
    event: JobEvent
    is_store: bool
    pending: int = 0  # parts the engine has not settled yet
    job_id: int = -1
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    launched: float = field(default_factory=time.perf_counter)  # for the job latency metric


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


class Run:
    """Everything one ``init`` creates; ``stop``/``close`` retire it as a whole."""

    def __init__(self, osc: OsCalls, dev: Device, layout: BlockLayout, num_slots: int, seal: SlotSeal,
                 report_load_errors: bool, threads_per_lane: int, metrics: IoMetrics,
                 io_unit_bytes: int) -> None:
        self.osc, self.dev, self.layout, self.seal = osc, dev, layout, seal
        self.engine: Optional[Engine] = None  # made once the files are (DiskBackend.init)
        self.io_path_detail = ""  # what the start-up line says of the engine
        # Host-resident blocks (HostDevice) are sealed from and opened into directly,
        # and, where a lane's file allows, read into and written from (no staging).
        self.host_blocks = dev.host_view(layout)
        self.direct_io = isinstance(dev, HostDevice) and dev.direct_io
        self.num_slots = num_slots
        self.threads_per_lane = threads_per_lane
        self.io_unit_bytes = io_unit_bytes
        self.report_load_errors = report_load_errors
        self.streams: dict[bool, Any] = {True: None, False: None}  # vLLM's store and load streams
        self.files: list[SlotFile] = []
        self.pinned: list[Any] = []  # staging the engine pinned (host tensors), unpinned at close
        self.records = Records.empty(num_slots, seal.name)  # per slot: its latest completed store's
        # Where a store's record goes besides ``records`` (slot_keeper): chosen by init.
        self.keeper: Keeper = Ephemeral()
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
        self.close_lock = threading.Lock()  # one close() at a time: shutdown's, or the last worker's
        self.fatal: Optional[BackendFatalError] = None
        self.bytes_written = 0
        self.bytes_read = 0
        self.log = RateLimitedLog()
        self.metrics = metrics

    def rows_per_unit(self, file: SlotFile) -> int:
        """Slots one IO unit of ``file`` holds (``unit_rows``)."""
        return unit_rows(self.io_unit_bytes, file.slot_bytes, file.num_slots, self.layout.num_blocks)

    def direct_lane(self, file: SlotFile, is_store: bool) -> bool:
        """Whether ``file``'s IO in this direction goes straight between the file and host
        blocks, with no staging: where O_DIRECT allows it (the blocks' address and size are
        multiples of the file's alignment, so one block is exactly one slot: no padding to
        read into, and no byte of the next block, another chunk, is ever touched), and for a
        store only where the disk form is the payload itself (ciphertext is a copy: the
        block must not change)."""
        return (self.direct_io and file.direct and file.slot_bytes == self.layout.block_bytes
                and self.layout.caches[0].data_ptr() % file.alignment == 0
                and (not is_store or self.seal.disk_form_is_payload))

    def start(self, engine: Engine, start_timeout: float) -> None:
        """Start ``engine``'s workers (each binds the device); init fails if one cannot."""
        self.engine = engine
        _LIVE.add(self)
        engine.start(start_timeout)

    # -- jobs -------------------------------------------------------------------

    def submit(self, blocks: list[int], slots: list[int], is_store: bool, event_idx: int, events_list: list,
               wait_event: Any, keys: Optional[list[bytes]] = None) -> None:
        """Register a checked job and queue it; the event is appended last. ``keys``: a
        store's block keys, as the keeper takes them (``Keeper.store_keys``)."""
        if self.forked:
            raise RuntimeError(
                "kvoffload DiskBackend used in a fork()ed child: its IO threads live in the parent; "
                "create a new DiskBackend in this process"
            )
        job = Job(JobEvent(), is_store, job_id=next(self.job_ids))
        slot_arr, block_arr = np.asarray(slots, np.int64), np.asarray(blocks, np.int64)
        records = None
        queued = False
        try:
            with self.lock:
                if self.fatal is not None:
                    raise BackendFatalError(f"kvoffload backend failed earlier: {self.fatal}") from self.fatal
                if self.closing:
                    raise RuntimeError("DiskBackend is shutting down")
                if is_store:  # invalid from now until this store ends well (publish)
                    self.latest_store[slot_arr] = job.job_id
                    self.records.clear(slot_arr)
                    records = self.keeper.identities(self, slot_arr, keys)
                else:  # what each slot is checked against, as of now
                    records = self.records.take(slot_arr)
                # Registered before any unit is queued: whatever happens from here on
                # (an interrupt, a shutdown in another thread), shutdown ends it.
                self.open_jobs[job.job_id] = job
            if not slots:  # an empty job
                self.end_job(job, failed=False)
            else:
                self.engine.submit(job, block_arr, slot_arr, wait_event, records)
                queued = True
            # Last: the worker never sees an event whose job is not fully queued.
            events_list.append((event_idx, job.event))
        except BaseException:
            # Interrupted between registering the job and queueing it: no unit will ever
            # run, so the job ends now as failed.
            if not queued and self.open_jobs.get(job.job_id) is job:
                self.end_job(job, failed=True)
            raise

    def settle(self, job: Job, slots: np.ndarray, blocks: np.ndarray, status: np.ndarray, err: np.ndarray,
               records: Optional[Records], unit_seconds: np.ndarray, parts: int = 1) -> None:
        """``parts`` finished parts of ``job`` (units, or all of them), one outcome per slot
        (``engine.OK`` and the failure codes), in any order: count them, record failures,
        hand the keeper a store's ``records`` (what it sealed) or a load's blocks that failed
        their check against ``records`` (what they were checked against), and end the job
        once every part is settled. Array operations, whatever the slot count."""
        is_store = job.is_store
        bad = status != OK
        files = slots % len(self.files)
        slot_bytes = np.array([f.slot_bytes for f in self.files], np.int64)
        if bad.any():
            counts = np.bincount(status, minlength=len(CAUSES) + 1)
            for code, cause in CAUSES.items():
                self.metrics.failed(is_store, cause, int(counts[code]))
            self._log_failures(is_store, slots, files, status, err)
        moved = np.bincount(files[~bad], minlength=len(self.files))
        self.metrics.units_done(is_store, moved, slot_bytes, unit_seconds)
        if is_store:
            with self.lock:
                self.failed_store_slots.update(slots[bad].tolist())
                self.bytes_written += int(moved @ slot_bytes)
            self.keeper.publish(self, job.job_id, slots, files, ~bad, records)
        else:
            read = np.bincount(files[(status == OK) | (status == INTEGRITY)], minlength=len(self.files))
            with self.lock:
                self.load_errors.update(blocks[bad].tolist())
                self.bytes_read += int(read @ slot_bytes)
            if records is not None:
                self.keeper.failed_check(self, slots, files, status == INTEGRITY, records)
        with job.lock:
            job.pending -= parts
            job.failed |= bool(bad.any())
            last = job.pending == 0
        if last:
            self.end_job(job, failed=job.failed)

    def _log_failures(self, is_store: bool, slots: np.ndarray, files: np.ndarray, status: np.ndarray,
                      err: np.ndarray) -> None:
        direction = "store" if is_store else "load"
        bad = np.flatnonzero(status == INTEGRITY)
        if len(bad):
            self.log.warning("integrity", "kvoffload: slot(s) %s of %s failed the %s check", slots[bad].tolist(),
                             self.files[files[bad[0]]].path, self.seal.name)
        bad = np.flatnonzero((status == IO_ERROR) | (status == SHORT))
        if len(bad):
            code = int(err[bad[0]])
            why: Any = (OSError(code, os.strerror(code)) if code else
                        f"short {direction}: fewer bytes than slot {int(slots[bad[0]])} holds")
            self.log.warning(f"{direction} error", "kvoffload: %s of slots %s of %s failed: %s", direction,
                             slots[bad].tolist(), self.files[files[bad[0]]].path, why)

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

    def fail_fatal(self, exc: BaseException, what: str) -> None:
        """A device failure (or a fault seam's own exception): recorded once, then every open
        job ends carrying it; the engine takes no unit any more."""
        err = BackendFatalError(f"{what} failed on the device: {exc!r}")
        err.__cause__ = exc
        with self.lock:
            if self.fatal is None:
                self.fatal = err
                logger.error("%s", err)
            fatal = self.fatal
            jobs = list(self.open_jobs.values())
        self.engine.fail()
        for job in jobs:
            self.end_job(job, failed=True, fatal=fatal)

    def take(self, name: str) -> set[int]:
        with self.lock:
            out = getattr(self, name)
            setattr(self, name, set())
        return out

    # -- stop -------------------------------------------------------------------

    def begin_close(self) -> None:
        """No job is accepted from now on; units taken from now on end as failed without IO."""
        with self.lock:
            self.closing = True
        if self.engine is not None and not self.forked:  # a fork()ed child's copy has no workers
            self.engine.begin_close()

    def stop(self, deadline: float, clock: Callable[[], float]) -> list[str]:
        """Stop the workers by ``deadline``; end every open job. Returns the workers still alive."""
        self.begin_close()
        alive: list[str] = []
        if self.engine is not None and not self.forked:
            alive = self.engine.join(deadline, clock)
            self.engine.wait_copies(deadline, clock)  # copies under way finish before their jobs end
            # From here on nothing is written into the caller's memory for any job, even by
            # a worker that comes back from a hang later.
            self.engine.end_writes()
        # Jobs still held by a hung worker end as failed now, so no poll waits forever.
        with self.lock:
            jobs = list(self.open_jobs.values())
        for job in jobs:
            self.end_job(job, failed=True)
        return alive

    def abandon(self) -> None:
        """Shutdown gave up on a live worker: its last worker to end closes the run."""
        if self.engine is None:
            self.close()
            return
        _ABANDONED.add(self)
        self.engine.abandon(self._close_abandoned)

    def _close_abandoned(self) -> None:
        _ABANDONED.discard(self)
        self.close()

    def close(self) -> None:
        """Release files and staging; only when no worker can touch them any more.

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
            self.keeper.close(sync=not self.forked)
            if self.engine is not None and not self.forked:
                self.engine.close()


def unit_rows(io_unit_bytes: int, slot_bytes: int, file_slots: int, num_blocks: int) -> int:
    """Slots one IO unit (and one staging buffer) holds.

    Never more than the device has blocks or the file has slots, so staging is never
    larger than a job can fill (a mistaken io_unit_bytes of 1 TiB would otherwise
    allocate 1 TiB per buffer)."""
    return max(1, min(io_unit_bytes // slot_bytes, file_slots, num_blocks))
