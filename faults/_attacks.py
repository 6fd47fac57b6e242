"""Attacks on the slot file: symlinks planted, raced or put above its path, and
tampering with the live file itself.

Each helper sets the trap; ``Victim`` is the file an attacker wants written or
truncated, and proves afterwards that it is byte-identical. ``Tamper`` changes a
live slot file from outside the backend, through ``/proc/self/fd`` (as any
process of the same user could through ``/proc/<pid>/fd``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from faults._seam import CallInfo, FaultyOsCalls
from kvoffload.os_calls import OsCalls


@dataclass
class Victim:
    """A file outside the cache directory whose bytes, size and mode must never change."""

    path: Path
    digest: str
    size: int
    mode: int
    ino: int

    @classmethod
    def create(cls, path: Path, nbytes: int = 12345) -> "Victim":
        data = hashlib.sha256(str(path).encode()).digest() * (nbytes // 32 + 1)
        path.write_bytes(data[:nbytes])
        os.chmod(path, 0o644)
        return cls.snapshot(path)

    @classmethod
    def snapshot(cls, path: Path) -> "Victim":
        st = os.stat(path)
        return cls(path, hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mode, st.st_ino)

    def assert_untouched(self) -> None:
        now = Victim.snapshot(self.path)
        assert (now.size, now.digest) == (self.size, self.digest), f"victim {self.path} was written or truncated"
        assert (now.mode, now.ino) == (self.mode, self.ino), f"victim {self.path} was replaced or chmod-ed"


def plant_symlink(link: Path, target: Path) -> Path:
    """A symlink at ``link`` to ``target``: live if ``target`` exists, dangling otherwise."""
    os.symlink(target, link)
    return link


def symlinked_parent(base: Path) -> tuple[Path, Path]:
    """``base/real`` and ``base/link -> real``: a cache path under ``link`` has a symlinked parent."""
    real, link = base / "real", base / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    return real, link


def world_writable_dir(path: Path, sticky: bool = False) -> Path:
    """A directory anyone may write to (0777), with or without the sticky bit."""
    path.mkdir(exist_ok=True)
    os.chmod(path, 0o1777 if sticky else 0o777)
    return path


class SymlinkRace:
    """Plants ``link -> target`` right after the backend unlinks ``link``'s name,
    that is, between its unlink and its ``O_CREAT|O_EXCL`` open (RocksDB
    ``SyncPoint::LoadDependency``, made deterministic by the seam's hook)."""

    def __init__(self, osc: FaultyOsCalls, link: Path, target: Path, times: Optional[int] = 1) -> None:
        self.link, self.target = link, target
        self.times = times  # None: every time
        self.planted = 0
        osc.after("unlink", self._after_unlink)

    def _after_unlink(self, info: CallInfo) -> None:
        name = info.args[0]
        if os.path.basename(name) != self.link.name:
            return
        if self.times is not None and self.planted >= self.times:
            return
        os.symlink(self.target, self.link)
        self.planted += 1


class Tamper:
    """Changes a live slot file through its ``/proc/self/fd`` link, with a descriptor of
    its own (buffered, not O_DIRECT): the backend's fd, offsets and records are not touched."""

    def __init__(self, fd: int) -> None:
        self.link = f"/proc/self/fd/{fd}"

    def _open(self) -> int:
        return os.open(self.link, os.O_RDWR)

    def truncate(self, size: int) -> None:
        fd = self._open()
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def scribble(self, offset: int, length: int, seed: int = 0) -> None:
        """Overwrite [offset, offset + length) with seeded random bytes."""
        data = hashlib.shake_256(f"{seed}:{offset}".encode()).digest(length)
        self.write(offset, data)

    def write(self, offset: int, data: bytes) -> None:
        fd = self._open()
        try:
            assert os.pwrite(fd, data, offset) == len(data)
        finally:
            os.close(fd)

    def read(self, offset: int, length: int) -> bytes:
        fd = self._open()
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def punch(self, offset: int, length: int) -> None:
        """Free [offset, offset + length): it reads back as zeros."""
        fd = self._open()
        try:
            OsCalls().punch_hole(fd, offset, length)
        finally:
            os.close(fd)
