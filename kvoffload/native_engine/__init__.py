"""The native engine: C worker threads per lane that never take the GIL for a unit.

``_core`` is compiled from the C beside this file when the package is built
(``build_native.py``, cffi API mode); it is never built, cached or written at run time.
How a store reaches the disk: ``store_unit.c`` (after ``engine.c``'s device copy); how a
load comes back: ``load_unit.c`` (then ``engine.c``'s copy to the device); the workers,
queues and completions: ``engine.c``; the one interface with this file: ``unit_io.h``.

Python touches a job twice: ``submit`` fills its arrays (every slot's offset, block,
nonce, associated data; a load's records to check) and queues its units in one call;
the collector thread takes finished jobs in batches, one GIL acquisition per batch, and
settles each in a few array operations (``Run.settle``). Units take the GIL only where
Python must act: a fault seam that is not the plain ``OsCalls`` (``_io``: the seam's own
method on the Python engine's very buffers, so a fault hits the same slots on both
engines) and a device whose copies need Python (``_device``: ``faults.SimDevice``, or
CUDA layouts copied through device staging and a kernel).
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kvoffload.device import alloc_host
from kvoffload.engine import OK, SKIP
from kvoffload.os_calls import OsCalls, moved
from kvoffload.slot_records import NONCE_BYTES, TAG_BYTES, Records

if TYPE_CHECKING:
    from kvoffload.run import Job, Run

logger = logging.getLogger("kvoffload")

# Most slots one file call moves, as the Python engine's lanes.MAX_RUN_SLOTS.
MAX_RUN_SLOTS = 1024
_NS = 1_000_000_000


@dataclass(frozen=True)
class NativeCore:
    """The loaded extension: cffi's ``ffi`` and ``lib``, and what it was built as."""

    ffi: Any
    lib: Any
    build: str  # e.g. "unit_io 4f38..." (a digest of its sources)
    gcm: str  # the AES-GCM code path this CPU takes ("none": no AES-GCM here)


_CORE: Optional[NativeCore] = None
_WHY_NOT: Optional[str] = None
_LOCK = threading.Lock()


def _import() -> NativeCore:
    try:
        mod = importlib.import_module("kvoffload.native_engine._core")  # not built without a compiler
    except ModuleNotFoundError as e:
        raise ImportError("the native IO core was not built with this install: pip builds it where it finds a "
                          "C compiler") from e
    except ImportError as e:  # a broken, foreign or empty file under its name
        raise ImportError(f"the native IO core cannot be loaded: {e}") from e
    ffi, lib = mod.ffi, mod.lib
    for name in ("kvo_engine_new", "kvo_store_unit", "kvo_load_unit", "kvo_build_info", "kvo_gcm_supported"):
        if not hasattr(lib, name):
            raise ImportError(f"{mod.__file__} lacks {name}: not kvoffload's native core")
    build = ffi.string(lib.kvo_build_info()).decode()
    here = Path(__file__).parent
    builder = here.parent.parent / "build_native.py"
    if (here / "engine.c").is_file() and builder.is_file():
        # A source tree (an editable install): its sources must be what was built.
        want = _source_digest(builder, here)
        if want is not None and not build.endswith(want):
            raise ImportError(f"{mod.__file__} was built from other sources ({build}, the tree's are {want}): "
                              "rebuild it with `pip install -e .`")
    for name, fn in (("kvo_py_bind", _bind), ("kvo_py_io", _io), ("kvo_py_device", _device)):
        ffi.def_extern(name=name, error=_ERRORS[name])(fn)
    gcm = ffi.string(lib.kvo_gcm_impl()).decode() if lib.kvo_gcm_supported() else "none"
    return NativeCore(ffi, lib, build, gcm)


def _source_digest(builder: Path, sources: Path) -> Optional[str]:
    spec = importlib.util.spec_from_file_location("_kvoffload_build_native", builder)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        return mod.source_digest(sources)
    except Exception:  # noqa: BLE001 - an unreadable tree cannot prove the build stale
        return None


def core() -> Optional[NativeCore]:
    """The native core, or None (``why_unavailable()`` says why); loaded once per process."""
    global _CORE, _WHY_NOT
    if _CORE is not None or _WHY_NOT is not None:
        return _CORE
    with _LOCK:
        if _CORE is None and _WHY_NOT is None:
            try:
                _CORE = _import()
            except Exception as e:  # noqa: BLE001 - a broken or foreign file: the Python engine, said why
                _WHY_NOT = str(e) or type(e).__name__
        return _CORE


def why_unavailable() -> Optional[str]:
    core()
    return _WHY_NOT


def gcm_key(c: NativeCore, key: bytes) -> Any:
    """The core's expanded AES-GCM key (``wipe`` it when done)."""
    k = c.ffi.new("kvo_gcm_key *")
    c.lib.kvo_gcm_init(k, key)
    return k


def wipe(c: NativeCore, obj: Any) -> None:
    """Overwrite a cffi object's bytes (an expanded key) with zeros."""
    c.ffi.memmove(obj, b"\0" * c.ffi.sizeof(obj[0]), c.ffi.sizeof(obj[0]))


class Cipher:
    """The native engine's AES-GCM on one key, for measuring it (``kvoffload.bench``): what a
    worker's seal costs without the rest of a unit."""

    def __init__(self, key: bytes) -> None:
        c = core()
        if c is None:
            raise RuntimeError(f"the native IO core is unavailable: {why_unavailable()}")
        self.core, self.key = c, gcm_key(c, key)

    def seal(self, nonce: bytes, aad: bytes, buf: memoryview, n: int) -> bytes:
        """Seal ``buf[:n]`` in place (GIL released for the call); the tag."""
        ffi = self.core.ffi
        p, tag = ffi.from_buffer(buf), ffi.new("uint8_t[16]")
        self.core.lib.kvo_gcm_seal(self.key, nonce, aad, len(aad), p, p, n, tag)
        return bytes(tag)


def cipher_available() -> bool:
    """Whether ``Cipher`` runs here: the core was built and this CPU runs its AES-GCM."""
    c = core()
    return c is not None and c.gcm != "none"


def plain_call(osc: OsCalls, name: str) -> bool:
    """Whether ``osc.<name>`` is ``OsCalls``' own, so C may make the call itself: not
    overridden by a subclass, nor set on the instance (as ``mock.patch.object`` does)."""
    return getattr(type(osc), name, None) is getattr(OsCalls, name) and name not in getattr(osc, "__dict__", {})


# -- the callbacks (C worker threads, holding the GIL for them) -------------------------------------

def _bind(handle: Any, worker: int) -> int:
    return _CORE.ffi.from_handle(handle).bind(worker)


def _io(handle: Any, worker: int, job: int, first: int, buf: int, j0: int, j1: int, offset: int) -> int:
    return _CORE.ffi.from_handle(handle).file_call(worker, job, first, buf, j0, j1, offset)


def _device(handle: Any, worker: int, job: int, first: int, n: int, buf: int, phase: int) -> int:
    return _CORE.ffi.from_handle(handle).copy(worker, job, first, n, buf, phase)


def _free(c: NativeCore, engine: Any) -> None:
    """Free a C engine whose Python side is gone, unless a worker of it still runs (then
    it stays: a worker hung in the kernel may come back to it)."""
    if c.lib.kvo_engine_join(engine, 0) == 0:
        c.lib.kvo_engine_free(engine)


# What a callback returns where it raised before catching (it catches everything itself).
_ERRORS = {"kvo_py_bind": 1, "kvo_py_io": -errno.EIO, "kvo_py_device": 1}


class DeviceCopyError(RuntimeError):
    """A device copy a native worker made failed (a device failure: fatal for the run)."""


@dataclass
class _Lane:
    index: int
    is_store: bool
    path: int  # the disk path's index
    rows: int  # slots per unit
    direct: bool  # no staging: IO straight between the file and the host blocks

    @property
    def direction(self) -> str:
        return "store" if self.is_store else "load"


class _Worker:
    """Python's side of one C worker: its staging, and what binding its thread made."""

    def __init__(self, lane: _Lane) -> None:
        self.lane = lane
        self.staging: list[Any] = []  # [rows, slot_bytes] tensors
        self.views: list[memoryview] = []  # their bytes
        self.stream: Any = None
        self.events: list[Any] = []
        self.plan: Any = None  # the kvo_plan, and what it points into
        self.kept: Any = None
        self.copies: dict[int, Any] = {}  # staging buffer -> a Python-made load copy's event


class _Job:
    """A submitted job's arrays (the C side reads and writes them until it is collected)."""

    __slots__ = ("job", "slots", "blocks", "files", "status", "err", "nonce", "tag", "aad", "ident", "records",
                 "file_off", "host", "unit_ns", "c", "units", "wait_event", "exc")

    def __init__(self, job: "Job", slots: np.ndarray, blocks: np.ndarray, files: np.ndarray) -> None:
        self.job, self.slots, self.blocks, self.files = job, slots, blocks, files
        self.exc: Optional[BaseException] = None  # what a callback raised for it


class NativeEngine:
    """``engine.Engine`` on the native core's C workers (``io_threads`` per lane)."""

    name = "native"

    def __init__(self, run: "Run", c: NativeCore) -> None:

        self.run, self.core = run, c
        ffi, lib = c.ffi, c.lib
        seal = run.seal
        self.key = gcm_key(c, seal.key) if seal.name == "aes-gcm" else ffi.NULL
        self.seal_code = lib.KVO_SEAL_AES_GCM if seal.name == "aes-gcm" else lib.KVO_SEAL_OFF
        self.gate = ffi.new("int *")
        self.lanes: list[_Lane] = []
        for is_store in (True, False):
            for i, f in enumerate(run.files):
                rows = run.rows_per_unit(f)
                self.lanes.append(_Lane(len(self.lanes), is_store, i, rows, run.direct_lane(f, is_store)))
        self.workers = [_Worker(lane) for lane in self.lanes for _ in range(run.threads_per_lane)]
        self._handle = ffi.new_handle(self)
        self.c = lib.kvo_engine_new(len(self.lanes), len(self.workers), self.seal_code, self.key, self.gate,
                                    self._handle, lib.kvo_py_bind, lib.kvo_py_io, lib.kvo_py_device)
        if self.c == ffi.NULL:
            raise MemoryError("kvoffload: the native engine could not be made")
        # Freed with this object, never before: whatever calls in late (a launch_copy racing
        # a shutdown, a finalizer) finds it whole; not at all while a worker still runs.
        weakref.finalize(self, _free, c, self.c)
        for lane in self.lanes:
            f = run.files[lane.path]
            lib.kvo_engine_lane(self.c, lane.index, int(lane.is_store), f.fd, f.slot_bytes, run.layout.block_bytes,
                                int(lane.direct), MAX_RUN_SLOTS)
        self.slot_bytes = np.array([f.slot_bytes for f in run.files], np.int64)
        self.jobs: dict[int, _Job] = {}
        self.bind_errors: list[BaseException] = []
        self.cuda_waits = {True: False, False: False}  # per direction: the workers' copies wait on CUDA events
        self.lock = threading.Lock()
        self.seconds = {"store": {"seal": 0, "device": 0, "io": 0}, "load": {"seal": 0, "device": 0, "io": 0}}
        self.collector: Optional[threading.Thread] = None
        self.collected = False  # the collector has ended: every worker is gone
        self.on_last: Optional[Callable[[], None]] = None  # abandoned: what the collector's end runs

    # -- start --------------------------------------------------------------------------

    def start(self, start_timeout: float) -> None:
        run, lib = self.run, self.core.lib
        for k, w in enumerate(self.workers):
            f = run.files[w.lane.path]
            slot = f.slot_bytes
            for _ in range(0 if w.lane.direct else (1 if w.lane.is_store else 2)):
                # TAG_BYTES spare: sealing the last row borrows the 16 bytes after it.
                buf = alloc_host(w.lane.rows * slot + TAG_BYTES, max(f.alignment, 4096))
                run.pinned.append(buf)
                run.dev.pin(buf)
                w.staging.append(buf[: w.lane.rows * slot].view(w.lane.rows, slot))
                w.views.append(memoryview(buf.numpy()).cast("B"))
            addrs = [b.data_ptr() for b in w.staging] + [0, 0]
            if lib.kvo_engine_worker(self.c, k, w.lane.index, addrs[0], addrs[1], w.lane.rows) != 0:
                raise MemoryError("kvoffload: no memory for a native worker")
        rc = lib.kvo_engine_start(self.c)
        # The collector first: whatever start() met, workers that run end through it.
        self.collector = threading.Thread(target=self._collect, name="kvoffload-collect", daemon=True)
        self.collector.start()
        if rc != 0:
            raise RuntimeError(f"kvoffload: a native worker could not be started: {errno.errorcode.get(rc, rc)}")
        ready = lib.kvo_engine_ready(self.c, int(start_timeout * _NS))
        if ready < 0:
            raise RuntimeError(f"a native IO worker did not start within {start_timeout} s")
        if ready == 0:
            err = self.bind_errors[0] if self.bind_errors else RuntimeError("no copy plan")
            raise RuntimeError(f"an IO thread could not set up the device: {err!r}") from err

    def bind(self, worker: int) -> int:
        """On worker ``worker``'s own thread: bind the device, make its events and its plan."""
        w, run, ffi = self.workers[worker], self.run, self.core.ffi
        try:
            w.stream = run.dev.bind_thread(run.streams[w.lane.is_store], run.layout, w.lane.rows,
                                           to_host=w.lane.is_store)
            w.events = [run.dev.new_event() for _ in range(2)]
            plan = run.dev.copy_plan(w.stream, run.layout, w.lane.is_store, w.events)
            p = ffi.new("kvo_plan *")
            if plan is None:
                p.kind = self.core.lib.KVO_COPY_PY
            else:
                p.kind = self.core.lib.KVO_COPY_CUDA if plan.kind == "cuda" else self.core.lib.KVO_COPY_MEMCPY
                arrays = [np.ascontiguousarray(a, np.uint64) for a in (plan.base, plan.bpb, plan.offset)]
                p.tensors = len(arrays[0])
                p.base, p.bpb, p.offset = (ffi.cast("uint64_t *", a.ctypes.data) for a in arrays)
                if plan.kind == "cuda":
                    fn = plan.functions
                    p.batch = ffi.cast("kvo_batch_fn", fn["batch"])
                    p.record = ffi.cast("kvo_record_fn", fn["record"])
                    p.sync = ffi.cast("kvo_wait_fn", fn["sync"])
                    p.stream_wait = ffi.cast("kvo_stream_wait_fn", fn["stream_wait"])
                    p.attrs, p.stream = ffi.cast("void *", plan.attrs), ffi.cast("void *", plan.stream)
                    p.event[0], p.event[1] = (ffi.cast("void *", h) for h in plan.events)
                    self.cuda_waits[w.lane.is_store] = True
                w.kept = (arrays, plan)
            w.plan = p
            self.core.lib.kvo_engine_plan(self.c, worker, p)
            return 0
        except BaseException as e:  # noqa: BLE001 - init reports it
            self.bind_errors.append(e)
            return 1

    # -- jobs -----------------------------------------------------------------------------

    def submit(self, job: "Job", blocks: np.ndarray, slots: np.ndarray, wait_event: Any,
               records: Optional[Records]) -> None:
        run, ffi, lib = self.run, self.core.ffi, self.core.lib
        n, nfiles = len(slots), len(run.files)
        files = slots % nfiles
        order = np.argsort(files, kind="stable")  # lane by lane
        slots, blocks, files = slots[order], blocks[order], files[order]
        j = _Job(job, slots, blocks, files)
        j.file_off = (slots // nfiles) * self.slot_bytes[files]
        j.status = np.zeros(n, np.int32)
        j.err = np.zeros(n, np.int32)
        seal = run.seal
        if records is not None:
            records = records.take(order)
        j.ident = records.ident if records is not None else np.zeros((n, 0), np.uint8)
        j.aad = seal.aad_array(slots, j.ident if j.ident.shape[1] else None)
        if job.is_store:
            j.tag = np.zeros((n, TAG_BYTES), np.uint8)
            j.nonce = seal.nonce_rows(n) if self.seal_code == lib.KVO_SEAL_AES_GCM else np.zeros((n, NONCE_BYTES),
                                                                                                   np.uint8)
        else:
            j.records = records
            j.status[~records.valid] = SKIP
            j.nonce = np.ascontiguousarray(records.nonce) if records.nonce.shape[1] else np.zeros((n, NONCE_BYTES),
                                                                                                   np.uint8)
            j.tag = np.ascontiguousarray(records.tag) if records.tag.shape[1] else np.zeros((n, TAG_BYTES), np.uint8)
        c = ffi.new("kvo_job *")
        c.id, c.n = job.job_id, n
        c.block = ffi.cast("int64_t *", blocks.ctypes.data)
        c.file_off = ffi.cast("int64_t *", j.file_off.ctypes.data)
        if run.host_blocks is not None:
            base = np.uint64(run.layout.caches[0].data_ptr())
            j.host = base + blocks.astype(np.uint64) * np.uint64(run.layout.block_bytes)
            c.host = ffi.cast("uint64_t *", j.host.ctypes.data)
        c.nonce = ffi.cast("uint8_t *", j.nonce.ctypes.data)
        c.aad = ffi.cast("uint8_t *", j.aad.ctypes.data)
        c.aad_bytes = j.aad.shape[1]
        c.tag = ffi.cast("uint8_t *", j.tag.ctypes.data)
        c.status = ffi.cast("int32_t *", j.status.ctypes.data)
        c.err = ffi.cast("int32_t *", j.err.ctypes.data)
        c.py_io = int(not plain_call(run.osc, "pwritev" if job.is_store else "preadv"))
        j.wait_event = wait_event
        if wait_event is not None:
            handle = run.dev.event_handle(wait_event) if self.cuda_waits[job.is_store] else None
            if handle is None:
                c.wait_py = 1
            elif handle:  # 0: an event never recorded, which a stream's wait skips too
                c.wait_event = ffi.cast("void *", handle)
        # The units: each lane's rows in chunks of its unit.
        starts = np.searchsorted(files, np.arange(nfiles + 1))
        spans = []
        for i in range(nfiles):
            lane = self.lanes[(0 if job.is_store else nfiles) + i]
            spans += [(lane.index, a, min(a + lane.rows, starts[i + 1])) for a in range(starts[i], starts[i + 1],
                                                                                       lane.rows)]
        j.unit_ns = np.zeros(len(spans), np.int64)
        c.unit_io_ns = ffi.cast("int64_t *", j.unit_ns.ctypes.data)
        units = ffi.new("kvo_qunit[]", len(spans))
        for k, (lane, a, b) in enumerate(spans):
            u = units[k]
            u.job, u.lane, u.first, u.n, u.index = c, lane, a, b - a, k
        c.pending = len(spans)
        j.c, j.units = c, units
        job.pending = 1  # the collector settles the job in one go
        added = np.bincount([s[0] for s in spans], minlength=len(self.lanes))
        self.jobs[job.job_id] = j
        self.run.metrics.queued(job.is_store, {self.lanes[k].path: int(lib.kvo_engine_queued(self.c, k) + added[k])
                                               for k in np.flatnonzero(added).tolist()})
        lib.kvo_engine_submit(self.c, units, len(spans))

    def _collect(self) -> None:
        """The collector: takes finished jobs in batches (the GIL once per batch) until the
        engine stopped and every worker is gone."""
        ffi, lib = self.core.ffi, self.core.lib
        ids = np.zeros(256, np.int64)
        out = ffi.cast("int64_t *", ids.ctypes.data)
        while True:
            n = lib.kvo_engine_collect(self.c, out, len(ids), -1)
            if n < 0:
                break
            for jid in ids[:n].tolist():
                j = self.jobs.pop(jid)
                try:
                    self._settle(j)
                except BaseException:  # noqa: BLE001 - a job must end whatever went wrong here
                    logger.exception("kvoffload: settling job %d failed", jid)
                    self.run.end_job(j.job, failed=True)
        with self.lock:
            self.collected = True
            last = self.on_last
        if last is not None:
            last()

    def _settle(self, j: _Job) -> None:
        run, c = self.run, j.c
        is_store = j.job.is_store
        if c.failure:
            exc = j.exc if j.exc is not None else DeviceCopyError(f"kvoffload: a device copy failed: CUresult "
                                                                  f"{c.failure}")
            run.fail_fatal(exc, f"{'store' if is_store else 'load'} (native engine)")
        direction = "store" if is_store else "load"
        with self.lock:
            acc = self.seconds[direction]
            acc["seal"] += c.seal_ns / _NS
            acc["device"] += c.copy_ns / _NS
            acc["io"] += float(j.unit_ns.sum()) / _NS
        if is_store:
            made = Records(np.ones(len(j.slots), bool), j.nonce if self.seal_code == self.core.lib.KVO_SEAL_AES_GCM
                           else np.zeros((len(j.slots), 0), np.uint8),
                           j.tag if self.seal_code == self.core.lib.KVO_SEAL_AES_GCM
                           else np.zeros((len(j.slots), 0), np.uint8),
                           np.zeros((len(j.slots), 0), np.uint8), j.ident)
        else:
            made = j.records
        run.settle(j.job, j.slots, j.blocks, j.status, j.err, made, j.unit_ns / _NS)

    # -- the callbacks ------------------------------------------------------------------------

    def file_call(self, worker: int, job: int, first: int, buf: int, j0: int, j1: int, offset: int) -> int:
        """The seam's file call for rows [j0, j1) of a unit, on the buffers the Python
        engine would pass: a slice of the worker's staging, or the unit's host blocks."""
        w, run = self.workers[worker], self.run
        j = self.jobs[job]
        method = run.osc.pwritev if w.lane.is_store else run.osc.preadv
        try:
            if w.lane.direct:
                host, size = run.host_blocks, run.layout.block_bytes
                bufs = [host[x * size:(x + 1) * size] for x in j.blocks[first + j0:first + j1].tolist()]
            else:
                size = run.files[w.lane.path].slot_bytes
                bufs = [w.views[buf][j0 * size:j1 * size]]
            return moved(method(run.files[w.lane.path].fd, bufs, offset), method)
        except OSError as e:
            return -(e.errno or errno.EIO)
        except BaseException as e:  # noqa: BLE001 - fatal for the run, raised by the collector
            j.exc = e
            return self.core.lib.KVO_RAISED

    def copy(self, worker: int, job: int, first: int, n: int, buf: int, phase: int) -> int:
        """A device copy Python makes (the device offered no plan), or a store's wait event."""
        w, run = self.workers[worker], self.run
        j = self.jobs[job]
        try:
            ids = j.blocks[first:first + n]
            if phase == 3:
                j.wait_event.synchronize()
            elif phase == 0:
                run.dev.copy_to_host(w.stream, run.layout, ids.tolist(), w.staging[0], range(n), j.wait_event,
                                     w.events[0]).synchronize()
            elif phase == 1:
                good = np.flatnonzero(j.status[first:first + n] == OK)
                w.copies[buf] = run.dev.copy_to_device(w.stream, run.layout, w.staging[buf], good.tolist(),
                                                       ids[good].tolist(), w.events[buf])
            else:
                ev = w.copies.pop(buf)
                if not ev.query():
                    ev.synchronize()
            return 0
        except BaseException as e:  # noqa: BLE001 - fatal for the run, raised by the collector
            j.exc = e
            return 1

    # -- stop ---------------------------------------------------------------------------------

    def begin_close(self) -> None:
        self.core.lib.kvo_gate_close(self.gate)
        self.core.lib.kvo_engine_stop(self.c)

    def fail(self) -> None:
        self.core.lib.kvo_engine_fail(self.c)

    def join(self, deadline: float, clock: Callable[[], float]) -> list[str]:
        alive = self.core.lib.kvo_engine_join(self.c, max(0, int((deadline - clock()) * _NS)))
        if not alive and self._collector_started():
            self.collector.join(max(0.0, deadline - clock()))  # it ends once it took the last jobs
        return [f"native IO worker {k}" for k in range(alive)]

    def wait_copies(self, deadline: float, clock: Callable[[], float]) -> None:
        self.core.lib.kvo_engine_wait_copies(self.c, max(0, int((deadline - clock()) * _NS)))

    def end_writes(self) -> None:
        self.core.lib.kvo_gate_end(self.gate)

    def _collector_started(self) -> bool:
        """Whether the collector runs or ran (an interrupt may have come before its start)."""
        return self.collector is not None and self.collector.ident is not None

    def abandon(self, close: Callable[[], None]) -> None:
        with self.lock:
            self.on_last = close
            last = self.collected or not self._collector_started()
        if last:
            close()

    def close(self) -> None:
        """Wipe the key, once no worker and no collector can use it (the C engine itself is
        freed with this object)."""
        if self._collector_started() and self.collector is not threading.current_thread():
            self.collector.join()
        if self.key and self.core.lib.kvo_engine_join(self.c, 0) == 0:
            wipe(self.core, self.key)

    # -- reports ------------------------------------------------------------------------------

    def queued(self) -> dict[tuple[str, int], int]:
        lib = self.core.lib
        return {(lane.direction, lane.path): int(lib.kvo_engine_queued(self.c, lane.index)) for lane in self.lanes}

    def stage_seconds(self) -> dict[str, dict[str, float]]:
        with self.lock:
            return {d: dict(v) for d, v in self.seconds.items()}

