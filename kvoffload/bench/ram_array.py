"""RAM-backed drives for ``python -m kvoffload.bench --make-array N``: a stand-in for an NVMe array.

Each drive is a loop device over a sparse file in ``/dev/shm`` (tmpfs), with a file
system made on it and mounted under a private directory; the loop driver accepts
O_DIRECT, so the backend's direct path runs as on a real drive, at RAM-copy speed.
Building needs root. Whatever happens after the first step (an error, Ctrl-C,
SIGTERM), everything made is undone: unmounted, detached, deleted.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Optional

from kvoffload.bench.sizing import mem_available
from kvoffload.cli_args import UsageError, held

GiB = 2**30
SHM_DIR = "/dev/shm"
IMAGE_PREFIX = "kvoffload-array-"
# ext4: no root reserve (the backend sizes by f_bavail, so reserved blocks would be
# lost space), and inode tables and journal zeroed now rather than by a background
# thread that would write during the timed cases.
MKFS = {
    "ext4": ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0"],
    "xfs": ["mkfs.xfs", "-q", "-f"],
}
# mkfs.xfs refuses smaller file systems.
MIN_GIB = {"ext4": 0.0625, "xfs": 0.3}


class ArrayError(UsageError):
    """The array cannot be built here; the message says why (one line, exit code 2)."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP while the array exists: unwinds like Ctrl-C so it is torn down."""


@dataclass
class Drive:
    image: str
    mountpoint: str
    loop: Optional[str] = None
    mounted: bool = False


@dataclass
class RamArray:
    """``count`` drives of ``gib_each`` GiB; ``with RamArray(...) as a: a.mountpoints``."""

    count: int
    gib_each: float
    fs: str = "ext4"
    shm_dir: str = SHM_DIR
    drives: list[Drive] = field(default_factory=list)
    root: Optional[str] = None  # private directory holding the mount points
    teardown_errors: list[str] = field(default_factory=list)
    made: list[dict] = field(default_factory=list)  # each drive as built, kept after teardown for the record

    @property
    def bytes_each(self) -> int:
        return int(self.gib_each * GiB) // 4096 * 4096

    @property
    def mountpoints(self) -> list[str]:
        return [d.mountpoint for d in self.drives if d.mounted]

    def unfilled_bytes(self) -> int:
        """RAM the images may still take as the cases write (tmpfs allocates on write)."""
        used = 0
        for d in self.drives:
            try:
                used += os.stat(d.image).st_blocks * 512
            except OSError:
                pass
        return max(0, self.count * self.bytes_each - used)

    def describe(self) -> dict:
        return {"drives": self.count, "bytes_each": self.bytes_each, "fs": self.fs, "shm_dir": self.shm_dir,
                "made": self.made, "teardown": "ok" if not self.teardown_errors else self.teardown_errors}

    # -- build and tear down -------------------------------------------------------

    def __enter__(self) -> "RamArray":
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def build(self) -> None:
        with held():  # made and recorded for teardown in one step
            self.root = tempfile.mkdtemp(prefix="kvoffload-array-")
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"  # the pid first: stale_images() reads it
        for i in range(self.count):
            image = os.path.join(self.shm_dir, f"{IMAGE_PREFIX}{tag}-d{i}.img")
            d = Drive(image, os.path.join(self.root, f"d{i}"))
            # Recorded before each step: an interrupt between a step and its record
            # must not hide what the step made (teardown looks on the system too).
            self.drives.append(d)
            fd = os.open(d.image, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, self.bytes_each)
            finally:
                os.close(fd)
            d.loop = _run(["losetup", "-f", "--show", d.image]).strip()
            _run([*MKFS[self.fs], d.loop])
            os.mkdir(d.mountpoint, 0o700)
            _run(["mount", d.loop, d.mountpoint])
            d.mounted = True
            self.made.append({"image": d.image, "loop": d.loop, "mountpoint": d.mountpoint})

    def teardown(self) -> None:
        """Undo every step that was done, last first; signals are held off meanwhile.

        A step that fails is reported in ``teardown_errors`` with the command that
        finishes it by hand; the other steps still run.
        """
        got: list[int] = []
        held = {}
        if _in_main_thread():
            held = {s: signal.signal(s, lambda n, f: got.append(n)) for s in _SIGNALS}
        try:
            for d in reversed(self.drives):
                self._undo(d)
            self.drives.clear()
            if self.root is not None:
                self._step(f"rmdir {self.root}", lambda: os.rmdir(self.root))
                self.root = None
        finally:
            for s, h in held.items():
                signal.signal(s, h)
        for msg in self.teardown_errors:
            print(f"kvoffload bench: array teardown: {msg}", file=sys.stderr)
        if got:
            raise Interrupted(f"signal {got[0]} during teardown")

    def _undo(self, d: Drive) -> None:
        # What the system says, not only the records: a mount or losetup that an
        # interrupt cut off after it took effect left no record.
        if os.path.ismount(d.mountpoint):
            if not self._step(f"umount {d.mountpoint}", lambda: _umount(d.mountpoint)):
                return  # still mounted: its loop device and image stay, named above
        d.mounted = False
        self._step(f"rmdir {d.mountpoint}", lambda: os.rmdir(d.mountpoint), missing_ok=True)
        loops = _loops_of(d.image)
        for loop in loops if loops is not None else [d.loop] if d.loop else []:
            self._step(f"losetup -d {loop}", lambda: _run(["losetup", "-d", loop]))
        self._step(f"rm {d.image}", lambda: os.unlink(d.image), missing_ok=True)

    def _step(self, what: str, fn, missing_ok: bool = False) -> bool:
        try:
            fn()
            return True
        except FileNotFoundError:
            if missing_ok:
                return True
            self.teardown_errors.append(f"{what}: not found")
        except (OSError, subprocess.SubprocessError) as e:
            self.teardown_errors.append(f"{what} failed ({_reason(e)}); finish it by hand")
        return False


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def termination_as_interrupt():
    """While inside, SIGTERM and SIGHUP raise ``Interrupted`` (a KeyboardInterrupt), so the
    ``finally`` blocks that remove files and drives run as they do on Ctrl-C."""
    if not _in_main_thread():
        yield
        return

    def raise_interrupted(signum, frame):
        raise Interrupted(f"signal {signum}")

    old = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _run(cmd: list[str]) -> str:
    # A session of its own: a Ctrl-C at the terminal reaches this process (which
    # then tears down) but not a umount or losetup -d half done.
    p = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True, timeout=300)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd, p.stdout, p.stderr)
    return p.stdout


def _loops_of(image: str) -> Optional[list[str]]:
    """Loop devices attached to ``image`` (``losetup -j``), or None if it cannot tell."""
    if not os.path.exists(image):
        return []
    try:
        out = _run(["losetup", "-j", image])
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.split(":", 1)[0] for line in out.splitlines() if line.strip()]


def _umount(path: str) -> None:
    try:
        _run(["umount", path])
    except subprocess.CalledProcessError:
        # Busy (an IO thread that outlived its backend still holds a file): detach
        # now; the kernel finishes once the last file is closed.
        _run(["umount", "-l", path])


def _reason(e: BaseException) -> str:
    if isinstance(e, subprocess.CalledProcessError):
        lines = (e.stderr or "").strip().splitlines()
        return lines[-1] if lines else f"exit status {e.returncode}"
    return getattr(e, "strerror", None) or str(e)


# --- checks before anything is made ------------------------------------------------------


def preflight(count: int, gib_each: float, fs: str, reserve_bytes: int, shm_dir: str = SHM_DIR) -> None:
    """Refuse (``ArrayError``, one line) unless ``count`` drives of ``gib_each`` GiB can be made
    here and ``reserve_bytes`` of memory stay free beside them for the cases."""
    if count < 1:
        raise ArrayError(f"--make-array: want at least 1 drive, got {count}")
    if fs not in MKFS:
        raise ArrayError(f"--fs: pick one of {', '.join(MKFS)}, got {fs!r}")
    if not gib_each >= MIN_GIB[fs]:
        raise ArrayError(f"--array-gib {gib_each:g}: mkfs.{fs} needs at least {MIN_GIB[fs]:g} GiB per drive")
    check_tools(fs)
    check_room(count, gib_each, reserve_bytes, shm_dir)


def check_tools(fs: str) -> None:
    if os.geteuid() != 0:
        raise ArrayError("--make-array needs root (losetup, mkfs and mount); run as root, or give --dir")
    for tool in ("losetup", MKFS[fs][0], "mount", "umount"):
        if shutil.which(tool) is None:
            hint = " (install xfsprogs, or use --fs ext4)" if tool == "mkfs.xfs" else ""
            raise ArrayError(f"--make-array: {tool} not found on PATH{hint}")
    if not os.path.exists("/dev/loop-control"):
        raise ArrayError("--make-array: no /dev/loop-control here (no loop device support)")


def check_room(count: int, gib_each: float, reserve_bytes: int, shm_dir: str = SHM_DIR) -> None:
    """The drives fit ``shm_dir``, and memory holds them (tmpfs is RAM) plus ``reserve_bytes``."""
    want = count * int(gib_each * GiB)
    try:
        st = os.statvfs(shm_dir)
    except OSError as e:
        raise ArrayError(f"--make-array: cannot use {shm_dir}: {e.strerror}") from None
    free = st.f_bavail * st.f_frsize
    stale = stale_images(shm_dir)
    note = f"; stale images from earlier runs there: {' '.join(stale)}" if stale else ""
    if want > free:
        raise ArrayError(f"--make-array {count} --array-gib {gib_each:g}: {want / GiB:.1f} GiB of drives but "
                         f"{shm_dir} has {free / GiB:.1f} GiB free{note}")
    avail = mem_available()
    if want + reserve_bytes > avail:
        raise ArrayError(f"--make-array {count} --array-gib {gib_each:g}: {want / GiB:.1f} GiB of drives plus "
                         f"{reserve_bytes / GiB:.1f} GiB for the cases exceed the {avail / GiB:.1f} GiB of memory "
                         f"available{note}")


def stale_images(shm_dir: str = SHM_DIR) -> list[str]:
    """Images left by a bench process that no longer exists (killed with -9)."""
    out = []
    for path in sorted(glob.glob(os.path.join(shm_dir, IMAGE_PREFIX + "*.img"))):
        pid = os.path.basename(path)[len(IMAGE_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            out.append(path)
    return out


