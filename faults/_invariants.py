"""Invariant checkers: fds, files, threads, file mode, file-system type, and the job ledger."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from kvoffload.device import CpuDevice

TMPFS_MAGIC = 0x01021994
EXT4_SUPER_MAGIC = 0xEF53

# What a broken invariant is counted as in the sweep's report (``python -m faults sweep``).
KINDS = ("hangs", "lost_completions", "wrong_data", "leaked_files", "leaked_fds")


class Violation(AssertionError):
    """A broken invariant, tagged with its kind (one of ``KINDS``) for the sweep's report.

    - hangs: an IO thread or a call that does not end;
    - lost_completions: a launched job that never completes, completes twice, out of
      order, or a launch that appends no event or a wrong one;
    - wrong_data: bytes or outcomes that disagree with the model (wrong bytes served,
      a failure no fault explains, a bare or unclear error);
    - leaked_files: a file left behind, or one others could read;
    - leaked_fds: a file descriptor left open.
    """

    def __init__(self, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown violation kind {kind!r}; one of {KINDS}")
        super().__init__(message)
        self.kind = kind


def expect(ok: Any, kind: str, message: str) -> None:
    """Raise ``Violation(kind, message)`` unless ``ok``."""
    if not ok:
        raise Violation(kind, message)


# -- file descriptors ---------------------------------------------------------------


# The CUDA driver opens its device nodes, eventfds and pipes lazily, on first use in
# the process and in each new thread; the backend itself opens only files and
# directories, so those are what the fd checks compare.
_DRIVER_FDS = ("/dev/", "anon_inode:", "pipe:", "socket:")


def fd_table() -> dict[int, str]:
    """fd -> readlink target for files and directories, from /proc/self/fd.

    The fd listing itself and the CUDA driver's own handles are left out."""
    out = {}
    dfd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(dfd):
            fd = int(name)
            if fd == dfd:
                continue
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed while we looked
                continue
            if not target.startswith(_DRIVER_FDS):
                out[fd] = target
    finally:
        os.close(dfd)
    return out


class FdWatch:
    """No fd leaked: diff /proc/self/fd against a snapshot, allowing only declared leaks
    (RocksDB ``AssertNoOpenFile``). ``close_declared`` closes the deliberate leaks."""

    def __init__(self) -> None:
        self.before = fd_table()
        self.declared: set[int] = set()

    def declare_leak(self, fd: int) -> None:
        self.declared.add(fd)

    def new_fds(self) -> dict[int, str]:
        return {fd: t for fd, t in fd_table().items() if fd not in self.before or self.before[fd] != t}

    def check(self, near: Optional[Path] = None) -> None:
        new = self.new_fds()
        undeclared = {fd: t for fd, t in new.items() if fd not in self.declared}
        expect(not undeclared, "leaked_fds", f"fd(s) leaked: {undeclared}")
        missing = self.declared - set(new)
        expect(not missing, "leaked_fds", f"declared leaked fd(s) {missing} are not open")
        if near is not None:
            prefix = str(near)
            stray = {fd: t for fd, t in fd_table().items() if t.startswith(prefix) and fd not in self.declared}
            expect(not stray, "leaked_fds", f"fd(s) still open on {prefix}: {stray}")

    def close_declared(self) -> None:
        for fd in sorted(self.declared):
            try:
                os.close(fd)
            except OSError:
                pass
        self.declared.clear()


# -- files, threads, modes --------------------------------------------------------


def dir_entries(directory: Path, allow: Iterable[str] = ()) -> list[str]:
    """Names in ``directory`` (symlinks included, dangling or not) other than ``allow``."""
    allow = set(allow)
    return sorted(n for n in os.listdir(directory) if n not in allow)


def assert_dir_clean(directory: Path, allow: Iterable[str] = ()) -> None:
    left = dir_entries(directory, allow)
    expect(not left, "leaked_files", f"file(s) left in {directory}: {left}")


@contextlib.contextmanager
def private_tempdir(prefix: str = "kvoffload-tests-") -> Iterator[Path]:
    """Inside, ``tempfile`` (and, through ``TMPDIR``, any child process) makes its files in
    a new private directory, which must be empty on leaving: whatever code left there
    would have been left in /tmp. The directory is removed either way. Leaked entries are
    named by the time they are found, not by who made them, so a check per test module
    or session is as fine-grained as it gets; the shared /tmp itself is never compared,
    as other processes use it at the same time."""
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    d = Path(tempfile.mkdtemp(prefix=prefix))
    tempfile.tempdir, os.environ["TMPDIR"] = str(d), str(d)
    try:
        yield d
    finally:
        tempfile.tempdir = before[0]
        if before[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[1]
        left = dir_entries(d)
        shutil.rmtree(d, ignore_errors=True)
    expect(not left, "leaked_files", f"left in the temporary directory: {left}")


def assert_mode_0600(fd: int) -> None:
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    expect(mode == 0o600, "leaked_files", f"slot file mode is {mode:o}, want 600")


def kvoffload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvoffload-") and t.is_alive()]


def wait_threads_gone(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while kvoffload_threads():
        expect(time.monotonic() < deadline, "hangs", f"IO threads still alive: {kvoffload_threads()}")
        time.sleep(0.005)


class PinWatch(CpuDevice):
    """The CPU device, recording which host buffers are pinned now (what a GPU's
    ``cudaHostRegister`` holds): everything a run pins must be unpinned when it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pinned: dict[int, torch.Tensor] = {}
        self.pins = 0

    def pin(self, host: torch.Tensor) -> None:
        with self._lock:
            self.pinned[host.data_ptr()] = host
            self.pins += 1

    def unpin(self, host: torch.Tensor) -> None:
        with self._lock:
            self.pinned.pop(host.data_ptr(), None)

    def assert_unpinned(self) -> None:
        with self._lock:
            left = len(self.pinned)
        assert not left, f"{left} staging buffer(s) still pinned"


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 112)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def fs_type(path: os.PathLike | str) -> int:
    """statfs(2) f_type of the file system holding ``path`` (os.statvfs has no f_type)."""
    buf = _Statfs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return buf.f_type & 0xFFFFFFFF


# -- the job ledger -----------------------------------------------------------------


@dataclass
class Op:
    """One launched job (Jepsen invoke); ``status`` is ok / fail / info once judged."""

    idx: int
    is_store: bool
    src: list[int]
    dst: list[int]
    event: Any
    status: Optional[str] = None

    @property
    def slots(self) -> list[int]:
        return self.dst if self.is_store else self.src

    @property
    def blocks(self) -> list[int]:
        return self.src if self.is_store else self.dst


class Ledger:
    """Every launched job ends exactly once, ok or fail, in launch order per direction;
    ``info`` (indeterminate) only for jobs a hung worker still held at shutdown.

    A ``JobEvent`` ends once by construction; its ``completion`` stamp (the
    process-wide completion order) is what the per-direction order is checked by.
    """

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def launch(self, backend, src, dst, is_store: bool, wait_event=None) -> Op:
        events: list = []
        idx = len(self.ops)
        backend.launch_copy(list(src), list(dst), is_store, idx, events, wait_event)
        expect(len(events) == 1 and events[0][0] == idx, "lost_completions", f"launch_copy appended {events}")
        op = Op(idx, is_store, list(src), list(dst), events[0][1])
        self.ops.append(op)
        return op

    @staticmethod
    def done(op: Op) -> bool:
        return op.event.done

    def wait(self, ops: Iterable[Op], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for op in ops:
            left = deadline - time.monotonic()
            expect(op.event.wait(max(0.0, left)), "lost_completions", f"job {op.idx} lost: not complete after {timeout} s")

    def check(self, indeterminate: Iterable[int] = (), in_order: bool = False) -> dict[str, int]:
        """Judge every op; returns the ok/fail/info counts (which sum to the ops launched)."""
        info = set(indeterminate)
        counts = {"ok": 0, "fail": 0, "info": 0}
        for op in self.ops:
            expect(self.done(op), "lost_completions", f"job {op.idx} never completed")
            expect(op.event.ok in (True, False) and op.event.completion > 0, "lost_completions",
                   f"job {op.idx} ended without an outcome")
            if op.idx in info:
                expect(not op.event.ok, "wrong_data", f"job {op.idx} was in a hung worker yet reported ok")
                op.status = "info"
            else:
                op.status = "ok" if op.event.ok else "fail"
            counts[op.status] += 1
        assert sum(counts.values()) == len(self.ops)
        if in_order:
            for direction in (True, False):
                orders = [op.event.completion for op in self.ops if op.is_store is direction]
                expect(orders == sorted(orders), "lost_completions",
                       f"{'store' if direction else 'load'} jobs completed out of order")
        return counts
