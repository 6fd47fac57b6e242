"""A whole IO unit (file IO, retries, every slot's seal or open) in one GIL-free call.

``unit_io.c`` does what the Python path does per unit, under one release of the GIL
(ctypes releases it for the call). It is compiled on first use with the system C
compiler against OpenSSL's libcrypto, into a private cache directory, and loaded
from there; where that cannot be done the backend keeps the Python path (one log
line says why). The seals it knows are AES-GCM (``AesGcmSeal``'s key, nonces and
records, so either path opens what the other sealed) and ``off``; xxh3 checksums stay
on the Python path.

File calls go through the backend's ``OsCalls``: libc's ``preadv``/``pwritev``
themselves when the seam is the plain one, otherwise C callbacks into the seam's
methods, so ``faults.FaultyOsCalls`` injects every fault class here too.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from kvoffload.os_calls import OsCalls

logger = logging.getLogger("kvoffload")

SOURCE = Path(__file__).with_name("unit_io.c")
STATUS_OK, STATUS_IO_ERROR, STATUS_SHORT, STATUS_INTEGRITY, STATUS_CIPHER = range(5)
SEAL_OFF, SEAL_AES_GCM = 0, 1
TAG_BYTES = 16
COMPILE_TIMEOUT_S = 60

IO_FN = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                         use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Slots(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("file_off", "buf", "payload", "nonce", "aad", "tag", "status", "err", "cut")]


class DeviceCopy(ctypes.Structure):
    """unit_io.c's ``kvo_copy``: a device copy the call launches before its own work.

    ``batch``, ``record`` and ``wait`` are the addresses of C functions with
    ``cuMemcpyBatchAsync`` (12.8 ABI), ``cuEventRecord`` and ``cuEventSynchronize``'s
    signatures (``wait`` 0: not waited for); the rest are their arguments.
    """

    _fields_ = [("batch", ctypes.c_void_p), ("record", ctypes.c_void_p), ("wait", ctypes.c_void_p),
                ("dsts", ctypes.c_void_p), ("srcs", ctypes.c_void_p), ("sizes", ctypes.c_void_p),
                ("count", ctypes.c_size_t), ("attrs", ctypes.c_void_p), ("stream", ctypes.c_void_p),
                ("event", ctypes.c_void_p)]


# -- building and loading -----------------------------------------------------------


def cache_dir() -> Path:
    """Where the built library lives: ``$KVOFFLOAD_NATIVE_DIR``, else the user's cache."""
    given = os.environ.get("KVOFFLOAD_NATIVE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvoffload"


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or check it: ours, a directory, no one else may write it.

    The library is loaded into the process from here, so a directory another user
    can write to would let them put code into it.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"{path} is not a private directory of this user (mode {oct(st.st_mode)})")


def _build(out: Path) -> None:
    cc = os.environ.get("CC", "cc")
    fd, tmp = tempfile.mkstemp(prefix=".unit_io-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lcrypto"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if r.returncode != 0:
            raise OSError(errno.ENOEXEC, f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()[:500]}")
        os.chmod(tmp, 0o500)
        os.replace(tmp, out)  # atomic: another process building the same file sees a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + sys.platform.encode() + (sysconfig.get_platform()).encode()).hexdigest()[:16]
    d = cache_dir()
    _private_dir(d)
    lib_path = d / f"unit_io-{key}.so"
    if not lib_path.exists():
        _build(lib_path)
    lib = ctypes.CDLL(str(lib_path))
    for fn in (lib.kvo_store_unit, lib.kvo_load_unit):
        fn.argtypes = [IO_FN, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Slots), ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(DeviceCopy)]
        fn.restype = ctypes.c_int
    return lib


_LIB: Optional[ctypes.CDLL] = None
_WHY_NOT: Optional[str] = None
_LOCK = threading.Lock()


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None (``why_unavailable()`` says why); built once per process."""
    global _LIB, _WHY_NOT
    if _LIB is not None or _WHY_NOT is not None:  # settled: no lock on every init
        return _LIB
    with _LOCK:
        if _LIB is None and _WHY_NOT is None:
            try:
                _LIB = _load()
            except (OSError, subprocess.SubprocessError) as e:
                _WHY_NOT = str(e)
        return _LIB


def why_unavailable() -> Optional[str]:
    library()
    return _WHY_NOT


def crypto_version() -> Optional[str]:
    """The OpenSSL the library's AES-GCM runs on (its libcrypto), or None without the
    library. Said at start-up: an older libcrypto than cryptography's can seal several
    times slower per core (docs/vllm_tiering.md)."""
    lib = library()
    if lib is None:
        return None
    fn = lib.OpenSSL_version  # libcrypto's, found through the library's own dependencies
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_char_p
    return fn(0).decode(errors="replace")


# -- the OS seam as C function pointers ---------------------------------------------


_libc = ctypes.CDLL(None, use_errno=True)
_LIBC_FNS = (ctypes.cast(_libc.preadv, IO_FN), ctypes.cast(_libc.pwritev, IO_FN))
_callback_error = threading.local()


def io_functions(osc: OsCalls) -> tuple[Any, Any]:
    """(preadv, pwritev) for ``osc`` as C function pointers.

    libc's own when ``osc`` does what ``OsCalls`` does (no GIL anywhere in the unit),
    else callbacks into ``osc``'s methods: an ``OSError`` becomes -1 and its errno;
    anything else ends the call the same way and is raised by ``take_callback_error``.
    """
    if type(osc).preadv is OsCalls.preadv and type(osc).pwritev is OsCalls.pwritev:
        return _LIBC_FNS
    fns = getattr(osc, "_unit_io_fns", None)
    if fns is None:
        fns = (IO_FN(_callback(osc.preadv)), IO_FN(_callback(osc.pwritev)))
        osc._unit_io_fns = fns  # the callbacks must live as long as the seam
    return fns


def _callback(method: Any) -> Any:
    def call(fd: int, iov_ptr: int, iovcnt: int, offset: int) -> int:
        if getattr(_callback_error, "exc", None) is not None:
            ctypes.set_errno(errno.EIO)
            return -1
        try:
            iov = (_Iovec * iovcnt).from_address(iov_ptr)
            bufs = [memoryview((ctypes.c_char * v.iov_len).from_address(v.iov_base)).cast("B") for v in iov]
            return method(fd, bufs, offset)
        except OSError as e:
            ctypes.set_errno(e.errno or errno.EIO)
            return -1
        except BaseException as e:  # noqa: BLE001 - carried out of C, raised by the caller
            _callback_error.exc = e
            ctypes.set_errno(errno.EIO)
            return -1

    return call


def take_callback_error() -> None:
    """Raise what a callback of this thread's last unit raised (other than OSError)."""
    exc = getattr(_callback_error, "exc", None)
    if exc is not None:
        _callback_error.exc = None
        raise exc


# -- one unit -------------------------------------------------------------------------


@dataclass
class UnitArrays:
    """One IO thread's per-slot arrays (capacity ``rows``), reused for every unit."""

    file_off: np.ndarray
    buf: np.ndarray
    payload: np.ndarray
    nonce: np.ndarray
    aad: np.ndarray
    tag: np.ndarray
    status: np.ndarray
    err: np.ndarray
    cut: np.ndarray  # 1 where a slot's IO must not join the run before it (a batch's next unit)
    slots: _Slots

    @classmethod
    def make(cls, rows: int) -> "UnitArrays":
        arrays = dict(file_off=np.zeros(rows, np.int64), buf=np.zeros(rows, np.uint64),
                      payload=np.zeros(rows, np.uint64), nonce=np.zeros(rows, np.uint64),
                      aad=np.zeros(rows, np.uint64), tag=np.zeros((rows, TAG_BYTES), np.uint8),
                      status=np.zeros(rows, np.int32), err=np.zeros(rows, np.int32), cut=np.zeros(rows, np.uint8))
        slots = _Slots(**{k: v.ctypes.data for k, v in arrays.items()})
        return cls(slots=slots, **arrays)


class DeviceCopyError(RuntimeError):
    """A device copy launched by ``run_unit`` failed (a device failure: fatal)."""


def run_unit(lib: ctypes.CDLL, is_store: bool, fns: tuple[Any, Any], fd: int, n: int, a: UnitArrays,
             slot_bytes: int, payload_bytes: int, seal: int, key: Optional[bytes],
             copy: Optional[DeviceCopy] = None) -> None:
    """Store or load the first ``n`` slots described in ``a``; outcomes land in
    ``a.status``/``a.err`` (and, for stores, ``a.tag``). Releases the GIL throughout.

    ``copy`` is launched first (a store's: its blocks into staging, waited for; a
    load's: the previous unit's out of staging). Where it fails, ``DeviceCopyError``
    is raised and nothing else was done.
    """
    a.status[:n] = STATUS_OK
    a.err[:n] = 0
    fn = lib.kvo_store_unit if is_store else lib.kvo_load_unit
    rc = fn(fns[1] if is_store else fns[0], fd, n, ctypes.byref(a.slots), slot_bytes, payload_bytes, seal, key,
            None if copy is None else ctypes.byref(copy))
    take_callback_error()
    if rc == -1:
        raise MemoryError("kvoffload unit_io: no memory for a cipher context")
    if rc != 0:
        raise DeviceCopyError(f"kvoffload unit_io: the unit's device copy failed: CUresult {rc}")
