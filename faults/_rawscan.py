"""Raw-device scan: can any KV byte be read back from the block device under the slot file?

``LoopExt4`` makes a small ext4 file system on a loop device over an image file
(root only); ``run_child`` runs a backend in a child process that stores blocks
full of a marker, then shuts down or waits for ``kill -9``; ``count_marker``
counts the marker in the raw image once the file system is unmounted (every
write has reached the image then). A deleted file's blocks keep their bytes until
reused, so a plaintext slot file is found this way after shutdown and after a kill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

_REPO = Path(__file__).resolve().parent.parent
_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")

# The child: a backend on the mounted file system storing every slot full of the marker.
_CHILD = r"""
import json, os, sys, time
import torch
from kvoffload import DiskBackend

cfg = json.loads(sys.argv[1])
n, half = cfg["slots"], cfg["block_bytes"] // 2
fill = bytes.fromhex(cfg["marker"]) * (n * half // 16)
caches = {name: torch.frombuffer(bytearray(fill), dtype=torch.int8).view(n, half) for name in ("k", "v")}
b = DiskBackend()
b.init(caches, "cpu", None, None, os.path.join(cfg["dir"], "kv"), n, 2 * half, use_page_cache=cfg["page_cache"],
       named_file=cfg["named"], encrypt=cfg["encrypt"], report_load_errors=True, io_threads=2)
ev = []
b.launch_copy(list(range(n)), list(range(n)), True, 0, ev)
ev[0][1].synchronize()
assert ev[0][1].ok
if cfg["page_cache"]:
    os.fsync(b.files[0].fd)  # what writeback does within dirty_expire (30 s) anyway
print("stored", flush=True)
if cfg["end"] == "kill":
    time.sleep(600)
b.shutdown()
"""


class LoopSetupError(RuntimeError):
    """The loop device or file system could not be set up here (no free loop device,
    mount not allowed in this container, ...): a reason to skip, not a backend failure."""


class LoopExt4:
    """An ext4 file system of ``size_mib`` on a loop device over an image file, mounted at
    ``mnt`` (mode 0700). Unmounted, detached and deleted on exit, whatever happened."""

    def __init__(self, size_mib: int = 64) -> None:
        self.size_mib = size_mib
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.work = Path(tempfile.mkdtemp(prefix="kvoffload-rawscan-", dir=base))
        self.image = self.work / "ext4.img"
        self.mnt = self.work / "mnt"
        self.dev: Optional[str] = None
        self.mounted = False

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why this machine cannot build one (None if it can)."""
        if os.geteuid() != 0:
            return "not root: loop devices and mount need root"
        missing = [t for t in _TOOLS if shutil.which(t) is None]
        if missing:
            return f"missing {', '.join(missing)}"
        return None

    def __enter__(self) -> "LoopExt4":
        try:
            with open(self.image, "wb") as f:
                f.truncate(self.size_mib << 20)
            self.dev = _run("losetup", "-f", "--show", str(self.image)).strip()
            _run("mkfs.ext4", "-q", "-F", self.dev)
            self.mnt.mkdir()
            self.mount()
        except BaseException as e:
            self.__exit__(None, None, None)
            if isinstance(e, RuntimeError):
                raise LoopSetupError(str(e)) from e
            raise
        return self

    def mount(self) -> None:
        _run("mount", self.dev, str(self.mnt))
        self.mounted = True
        os.chmod(self.mnt, 0o700)

    def unmount(self) -> None:
        """Unmount: every write the file system made is in the image after this."""
        if self.mounted:
            _run("umount", str(self.mnt))
            self.mounted = False

    def __exit__(self, *exc) -> None:
        try:
            if self.mounted and subprocess.run(["umount", str(self.mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
            self.mounted = False
        finally:
            if self.dev:
                subprocess.run(["losetup", "-d", self.dev], capture_output=True)
                self.dev = None
            shutil.rmtree(self.work, ignore_errors=True)


def _run(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def run_child(directory: Path, marker: bytes, end: str, named: bool, page_cache: bool, encrypt: bool,
              slots: int = 64, block_bytes: int = 64 << 10, timeout: float = 120.0) -> None:
    """A backend in a child process stores ``slots`` blocks full of ``marker`` under
    ``directory``, then ends by ``end``: "shutdown" (and exit) or "kill" (``kill -9``)."""
    if end not in ("shutdown", "kill") or len(marker) != 16:
        raise ValueError(f"end must be shutdown or kill and the marker 16 bytes, got {end!r}, {marker!r}")
    cfg = {"dir": str(directory), "marker": marker.hex(), "end": end, "named": named, "page_cache": page_cache,
           "encrypt": encrypt, "slots": slots, "block_bytes": block_bytes}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cfg)], cwd=_REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        if line != "stored":
            p.kill()
            raise RuntimeError(f"child did not store: {line!r} {p.communicate(timeout=timeout)[1][-2000:]}")
        if end == "kill":
            os.kill(p.pid, signal.SIGKILL)
        err = p.communicate(timeout=timeout)[1]
        want = -signal.SIGKILL if end == "kill" else 0
        if p.returncode != want:
            raise RuntimeError(f"child ended with {p.returncode}, not {want}: {err[-2000:]}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def count_marker(image: Path, marker: bytes, chunk: int = 8 << 20) -> int:
    """How many times ``marker`` occurs in the raw image."""
    found, tail = 0, b""
    with open(image, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data:
                return found
            buf = tail + data
            found += buf.count(marker)
            # Keep the last len-1 bytes: a marker split across two chunks is found once.
            tail = buf[-(len(marker) - 1):]
