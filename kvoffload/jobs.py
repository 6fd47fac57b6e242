"""What every backend shares: the job event the vLLM worker polls, and argument checks."""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger("kvoffload")


class BackendFatalError(RuntimeError):
    """A device (CUDA) failure: not recoverable per job, raised on every later call."""


class UnreportedLoadError(RuntimeError):
    """A load failed, and the caller said it does not collect load errors.

    vLLM's own ``SimpleCPUOffloadWorker`` never asks ``get_block_ids_with_load_errors()``:
    under it a failed load that completed quietly would run the request on whatever
    the device blocks held. So the job's event raises this instead, and the engine
    stops loudly. ``KvoffloadConnector`` collects the errors and recomputes.
    """


# Completion order across all jobs of the process: tests check per-direction order with it.
_COMPLETIONS = itertools.count(1)


def _call_back(fn: Callable[[], None]) -> None:
    """Run a done callback in the thread that ends the job (an IO thread): whatever it
    raises, SystemExit and KeyboardInterrupt included, is logged and goes no further, so
    the thread lives on and the job's other callbacks still run."""
    try:
        fn()
    except BaseException:  # noqa: BLE001 - an IO thread must outlive any callback
        logger.exception("kvoffload: a job's done callback %r raised", fn)


class JobEvent:
    """Completion of one ``launch_copy`` job, duck-typed like ``torch.Event``.

    ``query()`` turns True once the job is over: a store's bytes are in the file, a
    load's bytes are in device memory, or the job failed (its blocks or slots are
    then already reported). ``ok`` says which. A job ended by a device failure, or a
    failed load whose caller collects no load errors, raises from ``query`` and
    ``synchronize``, so the engine stops loudly instead of computing on stale KV.
    """

    __slots__ = ("_done", "_lock", "ok", "_raise", "completion", "_callbacks")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.ok: Optional[bool] = None
        self._raise: Optional[BaseException] = None
        self.completion = 0  # position in the process-wide completion order; 0 while pending
        self._callbacks: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        """Whether the job is over (never raises, unlike ``query``)."""
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the job is over; whether it is (never raises)."""
        return self._done.wait(timeout)

    def query(self) -> bool:
        done = self._done.is_set()
        if done and self._raise is not None:
            raise self._raise
        return done

    def synchronize(self, timeout: Optional[float] = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job not complete after {timeout} s")
        self.query()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the job is over: now if it is, else in the thread that ends it.

        So a poller can collect finished jobs without looking at every open one
        (``SlotTier.poll``). ``fn`` must be short: it may run in an IO thread. What it
        raises is logged, never raised into that thread (as ``concurrent.futures`` does).
        """
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        try:  # the caller's own thread: an Exception is logged, as in an IO thread
            fn()
        except Exception:
            logger.exception("kvoffload: a job's done callback %r raised", fn)

    def complete(self, ok: bool, error: Optional[BaseException] = None) -> bool:
        """End the job once; later calls are ignored. Returns whether this call ended it.

        ``error``: raised by every later ``query``/``synchronize``.
        """
        with self._lock:
            if self._done.is_set():
                return False
            self.ok = ok
            self._raise = error
            self.completion = next(_COMPLETIONS)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call_back(fn)
        return True

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("ok" if self.ok else "failed")
        return f"JobEvent({state})"


_INTEGER_DTYPES = frozenset(f"{u}int{n}" for u in ("", "u") for n in (8, 16, 32, 64))


def block_ids(what: str, ids: Any) -> list[int]:
    """``ids`` as a list of Python ints: an ordered sequence (list, tuple, range, numpy or
    torch 1-D array) of integers. Floats and bools are refused: ``1.5`` must not copy
    block 1. So are sets and dicts: sources pair with destinations by position."""
    if isinstance(ids, (str, bytes)) or not (isinstance(ids, Sequence) or hasattr(ids, "tolist")):
        raise TypeError(f"{what} must be an ordered sequence of block ids, got {type(ids).__name__}")
    if getattr(ids, "ndim", 1) != 1:
        raise TypeError(f"{what} must be one-dimensional, got shape {tuple(ids.shape)}")
    if type(ids) in (np.ndarray, torch.Tensor) and str(ids.dtype).removeprefix("torch.") in _INTEGER_DTYPES:
        return ids.tolist()  # an integer array: every element is an int, no need to look at each
    if type(ids) is list and all(type(i) is int for i in ids):
        return list(ids)  # the scheduler's usual form, checked in one C-level pass
    if hasattr(ids, "tolist"):  # numpy and torch: elements become Python numbers
        ids = ids.tolist()
    out = []
    for i in ids:
        # A 0-d bool tensor is no bool, and operator.index turns it into 1: its dtype says.
        if isinstance(i, bool) or str(getattr(i, "dtype", "")) in ("torch.bool", "bool"):
            raise TypeError(f"{what} holds {i!r}: block ids are integers, not bools")
        if getattr(i, "ndim", 0) != 0:  # [tensor([2])] is nested, not the id 2
            raise TypeError(f"{what} holds {i!r}: each block id must be a single integer")
        try:
            out.append(operator.index(i))
        except TypeError:
            raise TypeError(f"{what} holds {i!r} ({type(i).__name__}): block ids are integers") from None
    return out


def check_job(
    src_blocks: Any,
    dst_blocks: Any,
    is_store: Any,
    num_device_blocks: int,
    num_slots: int,
) -> tuple[list[int], list[int]]:
    """Reject a malformed job before it is accepted (out-of-range ids corrupt memory,
    vLLM #52921); returns (device block ids, slots) as lists of ints."""
    if not isinstance(is_store, bool):
        raise TypeError(f"is_store must be a bool, got {is_store!r}")
    src = block_ids("src_blocks", src_blocks)
    dst = block_ids("dst_blocks", dst_blocks)
    if len(src) != len(dst):
        raise ValueError(f"src_blocks has {len(src)} ids, dst_blocks has {len(dst)}")
    dev, slots = (src, dst) if is_store else (dst, src)
    for what, ids, limit in (("device block", dev, num_device_blocks), ("slot", slots, num_slots)):
        if ids and (min(ids) < 0 or max(ids) >= limit):  # one C-level pass per side for a good job
            bad = next(i for i in ids if not 0 <= i < limit)
            raise ValueError(f"{what} id {bad} out of range [0, {limit})")
    if len(set(dst)) != len(dst):
        raise ValueError(f"a {'slot' if is_store else 'device block'} appears twice among the destinations of one job")
    return dev, slots


def check_event_idx(event_idx: Any, events_list: Any) -> None:
    """The two arguments vLLM's worker polls by: refuse them before anything is queued."""
    try:
        if isinstance(event_idx, bool):
            raise TypeError
        operator.index(event_idx)
    except TypeError:
        raise TypeError(f"event_idx must be an int, got {event_idx!r}") from None
    if not callable(getattr(events_list, "append", None)):
        raise TypeError(f"events_list must be a list, got {type(events_list).__name__}")
