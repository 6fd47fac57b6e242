"""The operating-system seam: every file call the backend makes goes through here.

Production passes `OsCalls()`; tests pass a wrapper (``faults.FaultyOsCalls``) that
fails, shortens, delays or hangs chosen calls. One object, syscall-named methods,
so a fault plan can say "fail the 3rd pwritev" across all IO threads
(SQLite's test_syscall.c, RocksDB's FaultInjectionTestFS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
from collections.abc import Sequence
from typing import Optional

# statx(2) constants (linux/stat.h). Python 3.11 has no os.statx.
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000


class _StatxTimestamp(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32), ("_pad", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [
        ("stx_mask", ctypes.c_uint32),
        ("stx_blksize", ctypes.c_uint32),
        ("stx_attributes", ctypes.c_uint64),
        ("stx_nlink", ctypes.c_uint32),
        ("stx_uid", ctypes.c_uint32),
        ("stx_gid", ctypes.c_uint32),
        ("stx_mode", ctypes.c_uint16),
        ("_pad1", ctypes.c_uint16),
        ("stx_ino", ctypes.c_uint64),
        ("stx_size", ctypes.c_uint64),
        ("stx_blocks", ctypes.c_uint64),
        ("stx_attributes_mask", ctypes.c_uint64),
        ("stx_atime", _StatxTimestamp),
        ("stx_btime", _StatxTimestamp),
        ("stx_ctime", _StatxTimestamp),
        ("stx_mtime", _StatxTimestamp),
        ("stx_rdev_major", ctypes.c_uint32),
        ("stx_rdev_minor", ctypes.c_uint32),
        ("stx_dev_major", ctypes.c_uint32),
        ("stx_dev_minor", ctypes.c_uint32),
        ("stx_mnt_id", ctypes.c_uint64),
        ("stx_dio_mem_align", ctypes.c_uint32),
        ("stx_dio_offset_align", ctypes.c_uint32),
        ("_spare", ctypes.c_uint64 * 12),
    ]


# fallocate(2) modes (linux/falloc.h).
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_statx = getattr(_libc, "statx", None)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def moved(result: object, call: object) -> int:
    """What a ``preadv``/``pwritev`` of the seam returned, checked: a byte count, never
    negative (an error is an ``OSError``). Anything else is a broken seam, refused the same
    way on both IO paths (a ``TypeError`` out of the unit: fatal for the run)."""
    if isinstance(result, bool) or not isinstance(result, int) or result < 0:
        raise TypeError(f"{call!r} returned {result!r}, not a count of bytes moved")
    return result


class OsCalls:
    """Plain pass-through to the kernel. Subclass or wrap to inject faults."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: Optional[int] = None) -> int:
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def fchmod(self, fd: int, mode: int) -> None:
        os.fchmod(fd, mode)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def punch_hole(self, fd: int, offset: int, length: int) -> None:
        """Free the blocks of [offset, offset + length) and keep the size (discard)."""
        if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        """Make the file's data (and the metadata needed to read it) durable."""
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        """Make a file, or a directory's entries (a directory fd), durable."""
        os.fsync(fd)

    def flock(self, fd: int, operation: int) -> None:
        """flock(2): ``fcntl.LOCK_EX | fcntl.LOCK_NB`` raises ``BlockingIOError`` when held."""
        fcntl.flock(fd, operation)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def fstatvfs(self, fd: int) -> os.statvfs_result:
        return os.fstatvfs(fd)

    def lstat(self, path: str, *, dir_fd: Optional[int] = None) -> os.stat_result:
        """stat(2) of the name itself (a symlink is not followed)."""
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def listdir(self, dir_fd: int) -> list[str]:
        return os.listdir(dir_fd)

    def unlink(self, path: str, *, dir_fd: Optional[int] = None) -> None:
        os.unlink(path, dir_fd=dir_fd)

    # os.close itself, not a method that calls it: `osc.close(fds.pop())` then drops
    # an fd from its owner and closes it with no Python line in between, so an
    # interrupt can neither leak it nor leave it listed to be closed twice.
    close = staticmethod(os.close)

    def dio_alignment(self, fd: int) -> Optional[tuple[int, int]]:
        """(memory, offset) alignment for O_DIRECT from statx(STATX_DIOALIGN).

        None where the kernel or file system does not report it (kernel < 6.1,
        tmpfs); (0, 0) means the file system reports no direct IO support.
        """
        if _statx is None:
            return None
        buf = _Statx()
        rc = _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, ctypes.byref(buf))
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if not buf.stx_mask & _STATX_DIOALIGN:
            return None
        return buf.stx_dio_mem_align, buf.stx_dio_offset_align
