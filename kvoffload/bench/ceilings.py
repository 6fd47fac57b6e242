"""Ceilings for ``python -m kvoffload.bench``: what the file system and the copy engine do alone.

Raw file IO is measured the way the backend's IO threads use the disk: each of
``qd`` threads owns one aligned buffer and does ``pwritev``/``preadv`` of one slot
at a time over its own share of a preallocated file, at random slot offsets. Also
here: the page-cache tools (drop, residency) and the pinned copy rate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from kvoffload.device import alloc_host
from kvoffload.slot_file import O_DIRECT, round_up

QUEUE_DEPTHS = (1, 2, 4, 8, 16)
DIRECT_ALIGNMENT = 4096
FILL_IO_BYTES = 4 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_PROT_READ, _MAP_SHARED = 0x1, 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class Timed:
    """Bytes moved, wall seconds and process CPU seconds (all threads) of one measurement."""

    nbytes: int
    seconds: float
    cpu_seconds: float
    detail: dict = field(default_factory=dict)

    @property
    def gib_s(self) -> float:
        return self.nbytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


class Stopwatch:
    """Wall and process CPU time between ``start`` and ``stop``; CUDA work is synchronized."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "Stopwatch":
        self._sync()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.c0


# --- raw file IO -----------------------------------------------------------------


class RawFile:
    """A preallocated, unnamed scratch file in ``directory``, filled with random bytes.

    Unwritten (fallocated) extents read back as zeros without touching the disk,
    so the file is written once in full before any read is timed.
    """

    def __init__(self, directory: str, nbytes: int) -> None:
        self.size = round_up(nbytes, FILL_IO_BYTES)  # so that fill() covers every byte
        self.directory = directory
        flags = os.O_RDWR | os.O_CLOEXEC
        # Named, then unlinked at once: nothing is left behind whatever happens.
        path = os.path.join(directory, f".kvoffload-raw-{os.getpid()}-{id(self)}")
        try:
            self.direct_fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise OSError(e.errno, f"{directory!r} does not support O_DIRECT; give --dir on ext4/xfs") from e
            raise
        try:
            self.buffered_fd = os.open(path, flags)
        finally:
            os.unlink(path)
        try:
            os.posix_fallocate(self.direct_fd, 0, self.size)
        except OSError as e:  # glibc's emulation cannot work under O_DIRECT
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.direct_fd, self.size)

    def fill(self, qd: int = 8) -> None:
        """Write every byte once (random data), O_DIRECT."""
        run_io([self], [self.direct_fd], FILL_IO_BYTES, qd, is_write=True, seconds=None, order="sequential")

    def close(self) -> None:
        for fd in (self.direct_fd, self.buffered_fd):
            os.close(fd)


def run_io(
    files: list[RawFile],
    fds: list[int],
    io_bytes: int,
    qd: int,
    is_write: bool,
    seconds: Optional[float],
    order: str = "random",
    seed: int = 0,
    footprint: int = 0,
) -> Timed:
    """``qd`` threads per file, each moving ``io_bytes`` per call into its own aligned buffer.

    Thread t of a file takes every qd-th slot of a (random) permutation of the
    file's slots. With ``seconds`` the threads stop at that deadline (wrapping
    around their share if they finish early); without, each share is done once.
    ``footprint``: the threads cycle through that many bytes of buffers between them
    instead of reusing one each. On a RAM drive a read is a CPU copy, and one buffer
    stays in the CPU caches: the pipeline's staging does not, so the honest ceiling
    for it cycles through as much memory as the staging holds.
    """
    rng = np.random.default_rng(seed)
    jobs = []
    for f, fd in zip(files, fds):
        n = f.size // io_bytes
        assert n >= 1, f"raw file of {f.size} B holds no {io_bytes} B IO"
        slots = rng.permutation(n) if order == "random" else np.arange(n)
        for t in range(min(qd, n)):
            jobs.append((fd, slots[t::qd] * io_bytes))
    done = [0] * len(jobs)
    ends = [0.0] * len(jobs)
    per_thread = max(1, footprint // (len(jobs) * io_bytes)) if footprint else 1
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs) + 1)

    def worker(k: int, fd: int, offsets: np.ndarray) -> None:
        buf = alloc_host(io_bytes * per_thread, DIRECT_ALIGNMENT)
        if is_write:
            buf.copy_(torch.randint(0, 256, (io_bytes * per_thread,), dtype=torch.uint8))
        whole = memoryview(buf.numpy()).cast("B")
        views = [[whole[b * io_bytes : (b + 1) * io_bytes]] for b in range(per_thread)]
        call = os.pwritev if is_write else os.preadv
        offs = offsets.tolist()
        try:
            start.wait()
            i, moved = 0, 0
            while not halt.is_set():
                if i == len(offs):
                    if deadline is None:
                        break
                    i = 0
                got = call(fd, views[i % per_thread], offs[i])
                if got != io_bytes:
                    raise OSError(errno.EIO, f"short raw {'write' if is_write else 'read'}: {got} of {io_bytes}")
                moved += got
                i += 1
                if deadline is not None and time.perf_counter() >= deadline:
                    break
            done[k] = moved
        except threading.BrokenBarrierError:
            return  # the caller was interrupted before the start
        except BaseException as e:
            errors.append(e)
        ends[k] = time.perf_counter()

    halt = threading.Event()
    threads = [threading.Thread(target=worker, args=(k, fd, o), daemon=True) for k, (fd, o) in enumerate(jobs)]
    c0 = t0 = 0.0
    deadline: Optional[float] = None

    def go() -> None:  # all started: the clock starts as the barrier releases them
        nonlocal c0, t0, deadline
        c0, t0 = time.process_time(), time.perf_counter()
        deadline = None if seconds is None else t0 + seconds

    run_all_threads(threads, start, halt, go)
    cpu = time.process_time() - c0
    if errors:
        raise errors[0]
    return Timed(sum(done), max(ends) - t0, cpu, {"qd": qd, "io_bytes": io_bytes, "footprint": footprint})


def sweep(files: list[RawFile], io_bytes: int, kind: str, seconds: float, hold_seconds: float = 0.0,
          depths=QUEUE_DEPTHS, footprint: int = 0) -> Timed:
    """Best rate over the queue depths; ``kind`` is direct-write, direct-read or buffered-read.

    Each depth runs ``seconds``; the best one then runs again for ``hold_seconds``
    (when longer), and that longer window is the figure reported.
    """
    is_write = kind == "direct-write"
    fds = [f.buffered_fd if kind == "buffered-read" else f.direct_fd for f in files]
    results = {qd: run_io(files, fds, io_bytes, qd, is_write, seconds, seed=qd, footprint=footprint)
               for qd in depths}
    best_qd = max(results, key=lambda q: results[q].gib_s)
    best = results[best_qd]
    if hold_seconds > seconds:
        best = run_io(files, fds, io_bytes, best_qd, is_write, hold_seconds, seed=best_qd, footprint=footprint)
    best.detail = {
        "qd": best_qd,
        "io_bytes": io_bytes,
        "files": len(files),
        "by_qd": {str(q): round(r.gib_s, 3) for q, r in results.items()},
        "sweep_seconds": seconds,
        "footprint": footprint,
    }
    return best


def warm(files: list[RawFile]) -> None:
    """Read every byte through the page cache so buffered reads are warm."""
    for f in files:
        run_io([f], [f.buffered_fd], FILL_IO_BYTES, 4, False, None, order="sequential")


def run_threads(n: int, body, seconds: float) -> tuple[float, list]:
    """Run ``body(k, deadline)`` on ``n`` threads started together; (wall seconds, their results).

    The deadline is ``seconds`` after the common start. The probes in scripts/ time
    their cases with it; an exception in any thread is raised here.
    """
    out = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)

    def wrap(k):
        try:
            barrier.wait()
            out[k] = body(k, deadline)
        except threading.BrokenBarrierError:
            pass  # the caller was interrupted before the start
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(k,)) for k in range(n)]
    deadline = t0 = 0.0

    def go() -> None:
        nonlocal deadline, t0
        t0 = time.perf_counter()
        deadline = t0 + seconds

    run_all_threads(ts, barrier, None, go)
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, out


def run_all_threads(threads: list[threading.Thread], start: Optional[threading.Barrier] = None,
                    halt: Optional[threading.Event] = None, go: Optional[Callable[[], None]] = None) -> None:
    """Start ``threads``, call ``go``, release them through the ``start`` barrier (if any), join them.

    If the caller is interrupted at any point of this (Ctrl-C, or SIGTERM turned into
    an interrupt), the threads are told to stop (``halt``; the barrier is broken) and
    those started are still joined before the interrupt goes on: a thread left in
    torch code when the interpreter exits aborts the process ("terminate called
    without an active exception").
    """
    launched = []
    try:
        for t in threads:
            launched.append(t)  # before start(): an interrupt inside start() may follow the launch
            t.start()
        if go is not None:
            go()
        if start is not None:
            start.wait()
        for t in threads:
            t.join()
    except BaseException:
        if halt is not None:
            halt.set()
        if start is not None:
            start.abort()
        give_up = time.monotonic() + 5.0
        for t in launched:
            while True:
                try:
                    t.join()
                    break
                except RuntimeError:  # start() was cut off: the thread may yet start, or never
                    if time.monotonic() > give_up:
                        break
                    time.sleep(0.001)
        raise


# --- page cache -------------------------------------------------------------------


def resident_fraction(fd: int, size: int) -> Optional[float]:
    """Share of the file's pages in the page cache (mmap + mincore), or None if unknown."""
    if size <= 0:
        return 0.0
    page = os.sysconf("SC_PAGE_SIZE")
    addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        npages = -(-size // page)
        vec = (ctypes.c_ubyte * npages)()
        if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return None
        arr = np.frombuffer(vec, dtype=np.uint8)
        return float((arr & 1).sum()) / npages
    finally:
        _libc.munmap(ctypes.c_void_p(addr), size)


@dataclass
class DropReport:
    """What dropping the page cache of some files did."""

    fadvise: str = "not tried"
    drop_caches: str = "not tried"
    resident_after: Optional[float] = None

    def as_dict(self) -> dict:
        return {"fadvise": self.fadvise, "drop_caches": self.drop_caches, "resident_after": self.resident_after}


def drop_page_cache(fds_sizes: list[tuple[int, int]], allow_global: bool) -> DropReport:
    """Evict the files' pages: fsync + POSIX_FADV_DONTNEED, then drop_caches if pages remain.

    fsync first because DONTNEED only drops clean pages. The global
    ``/proc/sys/vm/drop_caches`` is written only when fadvise left pages behind
    (it empties the cache of the whole machine) and ``allow_global``.
    """
    rep = DropReport()
    try:
        for fd, _ in fds_sizes:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rep.fadvise = "ok"
    except OSError as e:
        rep.fadvise = f"failed: {e.strerror}"
    rep.resident_after = resident_of(fds_sizes)
    if rep.resident_after is not None and rep.resident_after <= 0.01:
        rep.drop_caches = "not needed"
        return rep
    if not allow_global:
        rep.drop_caches = "not allowed (--no-drop-caches)"
        return rep
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        rep.drop_caches = "ok"
    except OSError as e:
        rep.drop_caches = f"failed: {e.strerror}"
    rep.resident_after = resident_of(fds_sizes)
    return rep


def resident_of(fds_sizes: list[tuple[int, int]]) -> Optional[float]:
    """Share of the pages of several files in the page cache, weighted by size."""
    total = sum(s for _, s in fds_sizes)
    got = 0.0
    for fd, size in fds_sizes:
        r = resident_fraction(fd, size)
        if r is None:
            return None
        got += r * size
    return got / total if total else 0.0


# --- device copies ----------------------------------------------------------------


def copy_rate(device: torch.device, host: torch.Tensor, dev: torch.Tensor, block_bytes: int, to_device: bool,
              seconds: float) -> Timed:
    """Block-sized copies between a pinned host buffer and device memory (memcpy on CPU).

    One copy per block, queued back to back on one stream; passes repeat until
    ``seconds`` have gone by.
    """
    n = host.numel() // block_bytes
    assert n >= 1
    h = host[: n * block_bytes].view(n, block_bytes)
    d = dev[: n * block_bytes].view(n, block_bytes)
    src, dst = (h, d) if to_device else (d, h)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def one_pass() -> None:
        if stream is not None:
            with torch.cuda.stream(stream):
                for i in range(n):
                    dst[i].copy_(src[i], non_blocking=True)
            stream.synchronize()
        else:
            for i in range(n):
                dst[i].copy_(src[i])

    one_pass()  # untimed: first-touch page faults and lazy CUDA setup are not the copy rate
    moved = 0
    sw = Stopwatch(device)
    with sw:
        while True:
            one_pass()
            moved += n * block_bytes
            if time.perf_counter() - sw.t0 >= seconds:
                break
    return Timed(moved, sw.seconds, sw.cpu_seconds, {"block_bytes": block_bytes})


def memcpy_rate(nbytes: int, threads: int, seconds: float) -> Timed:
    """Host-memory copy between two CPU tensors with ``threads`` threads.

    A page-cache load moves each byte through host memory three times (the kernel
    reads the page cache and writes staging, the DMA reads staging) where this copy
    moves it twice, so about 2/3 of this rate bounds it whatever the PCIe link does.
    ``nbytes`` should exceed the last-level cache.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch is not the copy rate
        moved = 0
        sw = Stopwatch(torch.device("cpu"))
        with sw:
            while True:
                dst.copy_(src)
                moved += nbytes
                if time.perf_counter() - sw.t0 >= seconds:
                    break
    finally:
        torch.set_num_threads(prev)
    return Timed(moved, sw.seconds, sw.cpu_seconds, {"threads": threads, "bytes": nbytes})
