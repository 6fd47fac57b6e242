"""Disk backend: moves KV blocks between device memory and preallocated slot files.

A drop-in for vLLM's ``simple_kv_offload`` ``DiskBackend``. Each disk path gets a
store lane and a load lane, each a queue served by ``io_depth`` threads with one
pinned staging buffer per thread (two per load thread), so loads never wait behind stores and several
IOs are in flight per direction (vLLM 0.33 keeps one). A thread takes one unit
(a few blocks of one job), does the device copy and the file IO for it, and the
device copy of one unit overlaps the IO of the others.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import xxhash

from kvoffload.device import BlockLayout, Device, alloc_host, make_device, resolve_device
from kvoffload.jobs import BackendFatalError, JobEvent, check_job
from kvoffload.os_calls import OsCalls
from kvoffload.slot_file import SlotFile

logger = logging.getLogger(__name__)

DEFAULT_IO_DEPTH = 8
# Large units: each (tensor, block) piece is one DMA descriptor, and descriptors
# of a few KiB cost more than their bytes; 16 MiB units halve the per-byte cost
# of 4 MiB ones (H200: 22 vs 44 GiB/s H2D with 8 threads).
DEFAULT_IO_UNIT_BYTES = 16 << 20
DEFAULT_JOIN_TIMEOUT_S = 10.0
# How long init waits for its IO threads to bind the device (make a stream, maybe a
# staging buffer): a bounded wait, so a wedged driver fails init instead of hanging it.
START_TIMEOUT_S = 60.0
# Stands in for a checksum when checksums are off: the slot holds a completed store.
_VALID = -1


# Runs whose IO threads outlived shutdown. Held for the life of the process, not of
# the backend object: their staging memory stays registered with the device and a
# late IO may still write it, so it must never be freed and handed out again.
_LEAKED_RUNS: list["_Run"] = []


class LeakedFdWarning(RuntimeWarning):
    """An IO thread outlived shutdown, so its file descriptor was kept open on purpose."""


class _ShortIO(OSError):
    pass


@dataclass
class _Job:
    event: JobEvent
    pending: int  # units not finished yet
    job_id: int = -1
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Unit:
    job: _Job
    block_ids: list[int]  # device block ids
    slots: list[int]  # global slot ids, same order
    local: list[int]  # slot index inside this lane's file
    wait_event: Any = None


class _Lane:
    """One direction of one slot file: a queue and the threads that serve it."""

    def __init__(self, file: SlotFile, is_store: bool, stream: Any) -> None:
        self.file = file
        self.is_store = is_store
        self.stream = stream
        self.queue: queue.SimpleQueue[Optional[_Unit]] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.rows = 1  # blocks per unit
        # Per thread, its [rows, slot_bytes] staging buffers: one for a store
        # thread, two for a load thread, which reads its next unit into one while
        # the copy of the previous unit to the device still reads the other.
        self.staging: list[list[torch.Tensor]] = []


class _Run:
    """Everything one ``init`` creates; ``shutdown`` retires it as a whole.

    Kept apart from the backend object so an IO thread that outlives shutdown
    (hung in the kernel) only ever touches its own run, never a later init's.
    """

    def __init__(self) -> None:
        self.files: list[SlotFile] = []
        self.lanes: list[_Lane] = []
        self.pinned: list[torch.Tensor] = []
        self.sums: list[Optional[int]] = []  # per global slot: checksum, _VALID, or None
        self.errors_lock = threading.Lock()
        self.load_errors: set[int] = set()
        self.failed_store_slots: set[int] = set()
        self.open_jobs: dict[int, _Job] = {}
        self.job_ids = itertools.count()
        self.closing = False
        # Orders loads' device copies against `closing`: a job that shutdown ended
        # as failed must not get device blocks written afterwards. Held only to
        # check and count, never across the copy, so threads copy side by side.
        self.copy_cond = threading.Condition()
        self.copies = 0
        self.fatal: Optional[BaseException] = None
        self.bind_errors: list[BaseException] = []  # IO threads that could not start
        self.bytes_written = 0
        self.bytes_read = 0


class DiskBackend:
    """GPU <-> slot-file copy backend with vLLM's ``init``/``launch_copy``/``shutdown`` contract."""

    def __init__(self) -> None:
        self._run: Optional[_Run] = None
        # The monotonic time source, an attribute so timeout tests can replace it.
        self.clock = time.monotonic

    # -- vLLM's contract -------------------------------------------------------

    def init(
        self,
        gpu_caches: dict[str, torch.Tensor],
        device: torch.device,
        load_stream: Any,
        store_stream: Any,
        disk_path: str,
        num_disk_slots: int,
        total_block_bytes: int,
        num_buffer_slots: int = 2,
        use_page_cache: bool = False,
        *,
        disk_paths: Optional[Sequence[str]] = None,
        checksums: bool = True,
        io_depth: Optional[int] = None,
        io_unit_bytes: int = DEFAULT_IO_UNIT_BYTES,
        named_file: bool = False,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
        os_calls: Optional[OsCalls] = None,
        device_impl: Optional[Device] = None,
    ) -> None:
        """Create the slot file(s), staging buffers and IO threads.

        ``disk_paths`` stripes slots over several files (slot s lives in file
        ``s % n``), each with its own threads, so a failed disk costs only its slots.
        ``io_depth`` is the number of IO threads (and staging buffers) per lane;
        it defaults to ``max(num_buffer_slots, 8)``.
        """
        if self._run is not None:
            raise RuntimeError("DiskBackend.init called twice without shutdown")
        if num_buffer_slots < 1:
            raise ValueError(f"num_buffer_slots must be >= 1, got {num_buffer_slots}")
        depth = io_depth if io_depth is not None else max(num_buffer_slots, DEFAULT_IO_DEPTH)
        if depth < 1:
            raise ValueError(f"io_depth must be >= 1, got {depth}")
        if io_unit_bytes < 1:
            raise ValueError(f"io_unit_bytes must be >= 1, got {io_unit_bytes}")
        layout = BlockLayout.from_caches(gpu_caches)
        if layout.block_bytes != total_block_bytes:
            raise ValueError(
                f"total_block_bytes={total_block_bytes} but the caches hold "
                f"{layout.block_bytes} bytes per block (sum of stride(0) * element_size())"
            )
        paths = list(disk_paths) if disk_paths else [disk_path]
        if num_disk_slots < 1:
            raise ValueError(f"num_disk_slots must be >= 1, got {num_disk_slots}")
        if num_disk_slots < len(paths):
            raise ValueError(f"num_disk_slots={num_disk_slots} is fewer than the {len(paths)} disk paths")
        device = resolve_device(device)
        dev = device_impl if device_impl is not None else make_device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # Lowest priority, as vLLM's own offload streams: copies yield to compute.
            load_stream = load_stream or torch.cuda.Stream(device, priority=0)
            store_stream = store_stream or torch.cuda.Stream(device, priority=0)
        osc = os_calls if os_calls is not None else OsCalls()

        run = _Run()
        self._osc, self._dev, self._layout = osc, dev, layout
        self._checksums = checksums
        self._join_timeout = join_timeout
        self._num_slots = num_disk_slots
        try:
            for i, p in enumerate(paths):
                # Slot s of the whole pool lives in file s % n at index s // n.
                n_local = len(range(i, num_disk_slots, len(paths)))
                run.files.append(SlotFile.create(osc, p, n_local, total_block_bytes, use_page_cache, named_file))
            run.sums = [None] * num_disk_slots
            for f in run.files:
                rows = max(1, io_unit_bytes // f.slot_bytes)
                for is_store, stream in ((True, store_stream), (False, load_stream)):
                    lane = _Lane(f, is_store, stream)
                    lane.rows = rows
                    for _ in range(depth):
                        bufs = []
                        for _ in range(1 if is_store else 2):
                            buf = alloc_host(rows * f.slot_bytes, max(f.alignment, 4096))
                            dev.pin(buf)
                            run.pinned.append(buf)
                            bufs.append(buf.view(rows, f.slot_bytes))
                        lane.staging.append(bufs)
                    run.lanes.append(lane)
            started = []
            for lane in run.lanes:
                for k, buffers in enumerate(lane.staging):
                    ready = threading.Event()
                    t = threading.Thread(
                        target=self._serve,
                        args=(run, lane, buffers, ready),
                        name=f"kvoffload-{'store' if lane.is_store else 'load'}-{k}",
                        daemon=True,
                    )
                    t.start()
                    lane.threads.append(t)
                    started.append((t, ready))
            # A thread that cannot set up its device state would leave its lane short
            # (or empty, and jobs waiting forever): init fails instead.
            deadline = time.monotonic() + START_TIMEOUT_S
            for t, ready in started:
                if not ready.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"IO thread {t.name} did not start within {START_TIMEOUT_S} s")
            if run.bind_errors:
                err = run.bind_errors[0]
                raise RuntimeError(f"an IO thread could not set up the device: {err!r}") from err
        except BaseException:
            self._run = run
            self.shutdown()
            raise
        self._run = run
        self._lanes_by_dir = {
            True: [l for l in run.lanes if l.is_store],
            False: [l for l in run.lanes if not l.is_store],
        }
        logger.info(
            "kvoffload DiskBackend: %d slots of %d B over %d file(s), %d IO threads per lane, "
            "checksums %s, %s",
            num_disk_slots, total_block_bytes, len(paths), depth,
            "on" if checksums else "off", "page cache" if use_page_cache else "O_DIRECT",
        )

    def launch_copy(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        is_store: bool,
        event_idx: int,
        events_list: list,
        wait_event: Any = None,
    ) -> None:
        """Queue one job; never blocks. Appends exactly one ``(event_idx, event)``.

        Stores: src = device block ids, dst = slots. Loads: src = slots, dst = device
        block ids. The event completes once the job is over, also when it failed.
        """
        run = self._require_run()
        if run.fatal is not None:
            raise BackendFatalError(f"kvoffload backend failed earlier: {run.fatal}") from run.fatal
        check_job(src_blocks, dst_blocks, is_store, self._layout.num_blocks, self._num_slots)
        event = JobEvent()
        # Appended now, in call order: the worker polls front-first, so the list
        # order is the per-direction completion order it sees.
        events_list.append((event_idx, event))
        if not src_blocks:
            event.complete(ok=True)
            return
        blocks, slots = (src_blocks, dst_blocks) if is_store else (dst_blocks, src_blocks)
        lanes = self._lanes_by_dir[is_store]
        n = len(lanes)
        per_lane: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for b, s in zip(blocks, slots):
            per_lane[s % n].append((b, s))
        units: list[tuple[_Lane, _Unit]] = []
        job = _Job(event, pending=0)
        for lane, pairs in zip(lanes, per_lane):
            for i in range(0, len(pairs), lane.rows):
                chunk = pairs[i : i + lane.rows]
                units.append((lane, _Unit(
                    job, [b for b, _ in chunk], [s for _, s in chunk], [s // n for _, s in chunk], wait_event,
                )))
        job.pending = len(units)
        job.job_id = next(run.job_ids)
        run.open_jobs[job.job_id] = job
        for lane, unit in units:
            lane.queue.put(unit)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (then cleared)."""
        return self._take("load_errors")

    def get_failed_store_slots(self) -> set[int]:
        """Slots whose store failed since the last call (then cleared); they never load as valid."""
        return self._take("failed_store_slots")

    def shutdown(self) -> None:
        """Finish or fail queued jobs, join the threads, close the files. Idempotent."""
        run, self._run = self._run, None
        if run is None:
            return
        with run.copy_cond:
            run.closing = True
        threads = [t for lane in run.lanes for t in lane.threads]
        for lane in run.lanes:
            for _ in lane.threads:
                lane.queue.put(None)
        deadline = self.clock() + self._join_timeout
        for t in threads:
            t.join(max(0.0, deadline - self.clock()))
        alive = [t for t in threads if t.is_alive()]
        with run.copy_cond:  # copies already under way finish before their jobs end
            run.copy_cond.wait_for(lambda: run.copies == 0, max(0.0, deadline - self.clock()))
        # Jobs still held by a hung thread end as failed now, so no poll waits forever;
        # the thread checks `closing` before any later device copy.
        for job in list(run.open_jobs.values()):
            self._end_job(run, job, failed=True)
        if alive:
            # Closing the fd under a live pwritev would let the number be reused by
            # another file, which the late write would then corrupt. Leaking one fd
            # (and the staging memory the thread may still write) is the cheaper failure.
            fds = [f.fd for f in run.files]
            msg = (
                f"{len(alive)} kvoffload IO thread(s) still running {self._join_timeout} s after "
                f"shutdown; leaking fd(s) {fds} of the (already unlinked) slot file(s)"
            )
            logger.warning(msg)
            warnings.warn(msg, LeakedFdWarning, stacklevel=2)
            _LEAKED_RUNS.append(run)
            return
        for buf in run.pinned:
            self._dev.unpin(buf)
        for f in run.files:
            try:
                self._osc.close(f.fd)
            except OSError as e:  # the fd is released by the kernel even then (close(2))
                logger.warning("closing slot file of %s failed: %s", f.path, e)

    # -- introspection ---------------------------------------------------------

    @property
    def files(self) -> list[SlotFile]:
        """The open slot files (one per disk path)."""
        return list(self._require_run().files)

    def stats(self) -> dict[str, int]:
        """Bytes moved to and from the slot files since init."""
        run = self._require_run()
        with run.errors_lock:
            return {"bytes_written": run.bytes_written, "bytes_read": run.bytes_read}

    # -- IO threads ------------------------------------------------------------

    def _serve(self, run: _Run, lane: _Lane, buffers: list[torch.Tensor], ready: threading.Event) -> None:
        try:
            stream = self._dev.bind_thread(lane.stream, self._layout, lane.rows)
            # Per staging buffer: its bytes, and the one event its copies record (a copy
            # on a buffer always waits for the one before, so the event is free again).
            views = [(b, memoryview(b.numpy()).cast("B"), self._dev.new_event()) for b in buffers]
        except BaseException as e:
            run.bind_errors.append(e)
            return
        finally:
            ready.set()
        turn = 0
        pending: Optional[tuple[_Unit, set[int], Any]] = None  # a load whose device copy runs
        while True:
            if pending is None:
                unit = lane.queue.get()
            else:
                try:
                    unit = lane.queue.get_nowait()
                except queue.Empty:  # nothing to overlap with: finish the pending load now
                    pending = self._settle(run, lane, pending)
                    continue
            if unit is None:
                self._settle(run, lane, pending)
                return
            if run.closing or run.fatal is not None:
                self._finish(run, lane, unit, failed=set(range(len(unit.slots))))
                continue
            buf = views[turn]
            turn = (turn + 1) % len(views)
            try:
                if lane.is_store:
                    self._finish(run, lane, unit, self._store_unit(run, lane, stream, unit, *buf))
                    continue
                failed, ev = self._load_unit(run, lane, stream, unit, *buf)
            except BaseException as e:  # device failure: fatal for the whole backend
                self._fail_fatal(run, e, lane, unit)
                pending = self._settle(run, lane, pending)
                continue
            # The previous unit's copy had all of this unit's file IO to finish in;
            # its buffer is the one the next unit reads into, so wait for it now.
            self._settle(run, lane, pending)
            pending = (unit, failed, ev)

    def _settle(self, run: _Run, lane: _Lane, pending: Optional[tuple[_Unit, set[int], Any]]) -> None:
        """Wait for a load's copy to the device, then finish its unit."""
        if pending is None:
            return None
        unit, failed, ev = pending
        if ev is not None:
            try:
                ev.synchronize()
            except BaseException as e:
                self._fail_fatal(run, e, lane, unit)
                return None
            finally:
                _end_copy(run)
        self._finish(run, lane, unit, failed)
        return None

    def _store_unit(self, run, lane, stream, unit, staging, rows_mv, event) -> set[int]:
        n = len(unit.block_ids)
        ev = self._dev.copy_to_host(stream, self._layout, unit.block_ids, staging, range(n), unit.wait_event, event)
        # pwritev reads staging from the CPU side: the device copy must be done first.
        ev.synchronize()
        failed: set[int] = set()
        for j0, j1 in _runs(unit.local):
            for j in range(j0, j1):
                run.sums[unit.slots[j]] = None  # invalid until this write is known good
            sums = [self._checksum(rows_mv, lane.file, j) for j in range(j0, j1)]
            try:
                self._io(lane, rows_mv, unit.local[j0], j0, j1)
            except OSError as e:
                logger.warning("store to slots %s of %s failed: %s", unit.slots[j0:j1], lane.file.path, e)
                failed.update(range(j0, j1))
                continue
            for j, s in zip(range(j0, j1), sums):
                run.sums[unit.slots[j]] = s
            with run.errors_lock:
                run.bytes_written += (j1 - j0) * lane.file.slot_bytes
        return failed

    def _load_unit(self, run, lane, stream, unit, staging, rows_mv, event) -> tuple[set[int], Any]:
        """Read and verify a unit, then start its copy to the device; returns (failed, copy event)."""
        # Slots never stored, or whose store failed, are errors without any IO.
        failed = {j for j, s in enumerate(unit.slots) if run.sums[s] is None}
        for j0, j1 in _runs(unit.local, skip=failed):
            try:
                self._io(lane, rows_mv, unit.local[j0], j0, j1)
            except OSError as e:
                logger.warning("load from slots %s of %s failed: %s", unit.slots[j0:j1], lane.file.path, e)
                failed.update(range(j0, j1))
                continue
            with run.errors_lock:
                run.bytes_read += (j1 - j0) * lane.file.slot_bytes
            for j in range(j0, j1):
                expect = run.sums[unit.slots[j]]
                if expect != _VALID and self._checksum(rows_mv, lane.file, j) != expect:
                    logger.warning("checksum mismatch in slot %d of %s", unit.slots[j], lane.file.path)
                    failed.add(j)
        good = [j for j in range(len(unit.slots)) if j not in failed]
        if not good:
            return failed, None
        with run.copy_cond:
            if run.closing:  # released from a hang after shutdown: the blocks are not ours
                return set(range(len(unit.slots))), None
            run.copies += 1
        try:
            # Not waited for here: _serve settles it before these staging rows are
            # read into again (vLLM's trailing-drain fix, one unit later).
            ev = self._dev.copy_to_device(stream, self._layout, staging, good, [unit.block_ids[j] for j in good], event)
        except BaseException:
            _end_copy(run)
            raise
        return failed, ev

    def _io(self, lane: _Lane, rows_mv: memoryview, local_slot: int, j0: int, j1: int) -> None:
        f = lane.file
        span = rows_mv[j0 * f.slot_bytes : j1 * f.slot_bytes]
        offset = local_slot * f.slot_bytes
        call = self._osc.pwritev if lane.is_store else self._osc.preadv
        done = call(f.fd, [span], offset)
        if done != len(span):
            # A short transfer leaves the slot unknown (old, new or mixed): fail it,
            # never retry-then-trust.
            raise _ShortIO(f"short {'write' if lane.is_store else 'read'}: {done} of {len(span)} bytes at offset {offset}")

    def _checksum(self, rows_mv: memoryview, f: SlotFile, j: int) -> int:
        if not self._checksums:
            return _VALID
        start = j * f.slot_bytes
        return xxhash.xxh3_64_intdigest(rows_mv[start : start + self._layout.block_bytes])

    def _finish(self, run: _Run, lane: _Lane, unit: _Unit, failed: set[int]) -> None:
        if failed:
            with run.errors_lock:
                if lane.is_store:
                    run.failed_store_slots.update(unit.slots[j] for j in failed)
                else:
                    run.load_errors.update(unit.block_ids[j] for j in failed)
        job = unit.job
        with job.lock:
            job.pending -= 1
            job.failed |= bool(failed)
            last = job.pending == 0
        if last:
            self._end_job(run, job, failed=job.failed)

    def _end_job(self, run: _Run, job: _Job, failed: bool, fatal: Optional[BaseException] = None) -> None:
        # Errors are recorded before the event completes: when the worker sees the
        # event, get_block_ids_with_load_errors() already holds the failed blocks.
        if job.event.complete(ok=not failed, fatal=fatal):
            run.open_jobs.pop(job.job_id, None)

    def _fail_fatal(self, run: _Run, exc: BaseException, lane: _Lane, unit: _Unit) -> None:
        direction = "store" if lane.is_store else "load"
        err = BackendFatalError(f"{direction} to {lane.file.path} failed on the device: {exc!r}")
        err.__cause__ = exc
        if run.fatal is None:
            run.fatal = err
            logger.error("%s", err)
        with run.errors_lock:
            if lane.is_store:
                run.failed_store_slots.update(unit.slots)
            else:
                run.load_errors.update(unit.block_ids)
        # Every open job ends now, carrying the failure: a poll of any of them raises.
        for job in list(run.open_jobs.values()):
            self._end_job(run, job, failed=True, fatal=run.fatal)

    # -- helpers ---------------------------------------------------------------

    def _require_run(self) -> _Run:
        if self._run is None:
            raise RuntimeError("DiskBackend is not initialised (call init, or it was shut down)")
        return self._run

    def _take(self, name: str) -> set[int]:
        run = self._run
        if run is None:
            return set()
        with run.errors_lock:
            out = getattr(run, name)
            setattr(run, name, set())
        return out


def _end_copy(run: _Run) -> None:
    """A load's device copy is over (done or failed): shutdown may be waiting for it."""
    with run.copy_cond:
        run.copies -= 1
        run.copy_cond.notify_all()


def _runs(local: Sequence[int], skip: frozenset[int] | set[int] = frozenset()):
    """Maximal index ranges [j0, j1) of consecutive file slots, leaving out ``skip``.

    One range is one pwritev/preadv: its staging rows are contiguous too.
    """
    j = 0
    n = len(local)
    while j < n:
        if j in skip:
            j += 1
            continue
        j1 = j + 1
        while j1 < n and j1 not in skip and local[j1] == local[j1 - 1] + 1:
            j1 += 1
        yield j, j1
        j = j1
