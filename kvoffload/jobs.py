"""What every backend shares: the job event the vLLM worker polls, and argument checks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Optional


class BackendFatalError(RuntimeError):
    """A device (CUDA) failure: not recoverable per job, raised on every later call."""


class JobEvent:
    """Completion of one ``launch_copy`` job, duck-typed like ``torch.Event``.

    ``query()`` turns True once the job is over: a store's bytes are in the file, a
    load's bytes are in device memory, or the job failed (its blocks or slots are
    then already reported). ``ok`` says which. A job ended by a device failure
    raises that failure from ``query``/``synchronize``, so the engine stops loudly.
    """

    __slots__ = ("_done", "_lock", "ok", "_fatal")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.ok: Optional[bool] = None
        self._fatal: Optional[BaseException] = None

    def query(self) -> bool:
        done = self._done.is_set()
        if done and self._fatal is not None:
            raise BackendFatalError(str(self._fatal)) from self._fatal
        return done

    def synchronize(self, timeout: Optional[float] = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job not complete after {timeout} s")
        self.query()

    def complete(self, ok: bool, fatal: Optional[BaseException] = None) -> bool:
        """End the job once; later calls are ignored. Returns whether this call ended it."""
        with self._lock:
            if self._done.is_set():
                return False
            self.ok = ok
            self._fatal = fatal
            self._done.set()
            return True

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("ok" if self.ok else "failed")
        return f"JobEvent({state})"


def check_job(
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    is_store: bool,
    num_device_blocks: int,
    num_slots: int,
) -> None:
    """Reject a malformed job before it is accepted (out-of-range ids corrupt memory, vLLM #52921)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"src_blocks has {len(src_blocks)} ids, dst_blocks has {len(dst_blocks)}")
    dev, slots = (src_blocks, dst_blocks) if is_store else (dst_blocks, src_blocks)
    for what, ids, limit in (("device block", dev, num_device_blocks), ("slot", slots, num_slots)):
        for i in ids:
            if not 0 <= i < limit:
                raise ValueError(f"{what} id {i} out of range [0, {limit})")
    dst_what = "slot" if is_store else "device block"
    if len(set(dst_blocks)) != len(dst_blocks):
        raise ValueError(f"a {dst_what} appears twice among the destinations of one job")
