"""FaultyOsCalls: the kvoffload OS seam with scheduled faults.

One lock counts every call per call site across all threads, and one decision
(`_decide`) says whether the call fails, like SQLite's ``tsIsFail`` over
``aSyscall[]`` in src/test_syscall.c.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvoffload.os_calls import OsCalls

# Every public method of the seam is a call site, so a call added to OsCalls is
# wrapped (and can fail) without touching this file.
CALL_SITES = tuple(name for name, fn in vars(OsCalls).items() if callable(fn) and not name.startswith("_"))
DATA_CALLS = ("pwritev", "preadv")

# What each call fails with when the test names no errno (SQLite's default_errno column).
DEFAULT_ERRNO = {
    "open": _errno.EACCES,
    "fchmod": _errno.EPERM,
    "fallocate": _errno.ENOSPC,
    "punch_hole": _errno.EOPNOTSUPP,
    "ftruncate": _errno.EIO,
    "pwritev": _errno.EIO,
    "preadv": _errno.EIO,
    "fstat": _errno.EIO,
    "fdatasync": _errno.EIO,
    "fsync": _errno.EIO,
    "flock": _errno.EWOULDBLOCK,
    "fstatvfs": _errno.EIO,
    "listdir": _errno.EIO,
    "lstat": _errno.EIO,
    "unlink": _errno.EACCES,
    "close": _errno.EIO,
    "dio_alignment": _errno.EIO,
}

# Granularity of a real short transfer on an O_DIRECT fd: the kernel never returns
# a count that is not a multiple of the logical block size, and a prefix that is
# not aligned would fail with EINVAL instead of being written.
_DIRECT_SHORT_GRANULE = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class InjectedOSError(OSError):
    """An OSError raised by the fault harness, never by the kernel (FDB ``asInjectedFault``)."""

    injected = True


_injected_classes: dict[type, type] = {}


def injected_error(err: int, call: str, n: int) -> InjectedOSError:
    """An InjectedOSError that is also the errno's builtin subclass (ENOENT is a FileNotFoundError).

    The backend catches ``FileNotFoundError`` and friends by class, as it would a
    kernel error, so the injected error must have the same class.
    """
    base = type(OSError(err, ""))  # OSError maps errno -> subclass only when built directly
    cls = _injected_classes.get(base)
    if cls is None:
        cls = InjectedOSError if base is OSError else type(f"Injected{base.__name__}", (InjectedOSError, base), {})
        _injected_classes[base] = cls
    return cls(err, f"injected {_errno.errorcode.get(err, err)} in {call} #{n}")


def is_injected(exc: Optional[BaseException], chain: bool = False) -> bool:
    """Whether ``exc`` was raised by the harness; with ``chain``, also via ``__cause__``/``__context__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if getattr(exc, "injected", False):
            return True
        if not chain:
            return False
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class Fault:
    """What happens to one call. Build with the class methods; the repr replays."""

    kind: str  # error | short | lie | bitflip | hang | delay
    errno: int = 0  # error: 0 means DEFAULT_ERRNO of the call
    after: bool = False  # error on pwritev/preadv: do the real transfer, then fail
    fraction: float = 0.5  # short: share of the bytes really transferred
    byte: int = 0  # bitflip: byte offset inside the transfer
    bit: int = 0
    event: Optional[threading.Event] = field(default=None, compare=False)  # hang
    seconds: float = 0.0  # delay; for hang, the give-up time

    @classmethod
    def error(cls, err: int = 0, after: bool = False) -> "Fault":
        return cls("error", errno=err, after=after)

    @classmethod
    def short(cls, fraction: float = 0.5) -> "Fault":
        return cls("short", fraction=fraction)

    @classmethod
    def lie(cls) -> "Fault":
        """pwritev reports every byte written and writes none (a lying device)."""
        return cls("lie")

    @classmethod
    def bitflip(cls, byte: int = 0, bit: int = 0) -> "Fault":
        return cls("bitflip", byte=byte, bit=bit)

    @classmethod
    def hang(cls, event: threading.Event, timeout: float = 60.0) -> "Fault":
        """Block on ``event`` (at most ``timeout`` s), then do the real call."""
        return cls("hang", event=event, seconds=timeout)

    @classmethod
    def delay(cls, seconds: float) -> "Fault":
        return cls("delay", seconds=seconds)

    def __repr__(self) -> str:
        k = self.kind
        if k == "error":
            name = f"errno.{_errno.errorcode[self.errno]}" if self.errno else ""
            return f"Fault.error({name}{', after=True' if self.after else ''})"
        if k == "short":
            return f"Fault.short({self.fraction})"
        if k == "bitflip":
            return f"Fault.bitflip({self.byte}, {self.bit})"
        if k in ("hang", "delay"):
            return f"Fault.{k}({'event, ' if k == 'hang' else ''}{self.seconds})"
        return f"Fault.{k}()"


@dataclass
class CallInfo:
    """What a hook sees: the call, its 1-based occurrence (None while disabled), arguments, outcome."""

    call: str
    n: Optional[int]
    args: tuple
    kwargs: dict
    result: Any = None
    error: Optional[BaseException] = None
    fault: Optional[Fault] = None


@dataclass(frozen=True)
class Fired:
    """One fault that fired: the ledger of intended damage (FDB AsyncFileChaos)."""

    call: str
    n: int
    fault: Fault
    fd: Optional[int] = None
    offset: Optional[int] = None
    length: Optional[int] = None

    def covers(self, fd: int, start: int, end: int) -> bool:
        """Whether this data-call fault touched bytes [start, end) of fd."""
        if self.fd != fd or self.offset is None:
            return False
        return self.offset < end and start < self.offset + self.length


@dataclass
class _Rule:
    call: str
    first: int
    persistent: bool
    fault: Fault
    last: Optional[int] = None
    every: int = 1  # persistent: only every k-th call from ``first`` on
    where: Optional[Callable[[tuple], bool]] = None  # only calls whose arguments match

    def match(self, call: str, n: int, args: tuple) -> bool:
        if call != self.call or n < self.first:
            return False
        if self.where is not None and not self.where(args):
            return False
        if self.persistent:
            return (self.last is None or n <= self.last) and (n - self.first) % self.every == 0
        return n == self.first


@dataclass
class _RandomRule:
    """Seeded random faults: the decision is a pure function of (seed, call, n),
    so it does not depend on which thread asked first."""

    seed: int
    calls: tuple[str, ...]
    rate: float
    faults: dict[str, tuple[Fault, ...]]

    def pick(self, call: str, n: int) -> Optional[Fault]:
        if call not in self.calls:
            return None
        rng = random.Random(f"{self.seed}:{call}:{n}")
        if rng.random() >= self.rate:
            return None
        return rng.choice(self.faults.get(call) or (Fault.error(),))


class FaultyOsCalls(OsCalls):
    """Wraps a real ``OsCalls``; fails, shortens, corrupts, delays or hangs chosen calls.

    Schedules: ``fail_nth`` (one transient fault), ``fail_from`` (every call from
    the Nth on), ``fail_random`` (seeded), ``buggify`` (FoundationDB's 0.25/0.25).
    ``calls`` and ``fired`` count per call site; ``log`` lists every fault fired.
    Hooks run outside the lock, before and after the named call (RocksDB SyncPoint).
    """

    def __init__(self, inner: Optional[OsCalls] = None) -> None:
        self.inner = inner if inner is not None else OsCalls()
        self._lock = threading.Lock()
        self.enabled = True
        self.calls: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()
        self.log: list[Fired] = []
        self._rules: list[Any] = []
        self._before: dict[str, list[Callable[[CallInfo], None]]] = {c: [] for c in CALL_SITES}
        self._after: dict[str, list[Callable[[CallInfo], None]]] = {c: [] for c in CALL_SITES}
        self.hang_entered = threading.Event()  # set when any call starts hanging
        self.hanging = 0  # calls blocked in a hang right now
        self._hang_events: list[threading.Event] = []

    # -- schedules -------------------------------------------------------------

    def fail_nth(self, call: str, n: int, fault: Optional[Fault] = None) -> "FaultyOsCalls":
        """Fail only the ``n``-th call (1-based, counted from the last ``reset``)."""
        return self._add(_Rule(call, n, False, fault or Fault.error()))

    def fail_from(self, call: str, n: int, fault: Optional[Fault] = None, last: Optional[int] = None,
                  where: Optional[Callable[[tuple], bool]] = None) -> "FaultyOsCalls":
        """Fail the ``n``-th call and every later one (up to ``last``): a dead device.

        ``where(args)`` narrows it to some calls, e.g. one file of several:
        ``where=lambda args: args[0] == fd``.
        """
        return self._add(_Rule(call, n, True, fault or Fault.error(), last, where=where))

    def fail_every(self, call: str, k: int, fault: Optional[Fault] = None) -> "FaultyOsCalls":
        """Fail every ``k``-th call (k, 2k, 3k, ...): a flaky device."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return self._add(_Rule(call, k, True, fault or Fault.error(), every=k))

    def fail_random(self, seed: int, rate: float, calls: Sequence[str] = CALL_SITES,
                    faults: Optional[dict[str, Sequence[Fault]]] = None) -> "FaultyOsCalls":
        """Fail each call of ``calls`` with probability ``rate``, decided from ``seed``."""
        faults = {k: tuple(v) for k, v in (faults or {}).items()}
        return self._add(_RandomRule(seed, tuple(calls), rate, faults))

    def buggify(self, seed: int, p_active: float = 0.25, p_fire: float = 0.25,
                faults: Optional[dict[str, Sequence[Fault]]] = None) -> list[str]:
        """FoundationDB BUGGIFY: each call site is active this run with ``p_active``
        (decided now, from ``seed``), and an active site fires with ``p_fire``."""
        rng = random.Random(seed)
        active = [c for c in CALL_SITES if rng.random() < p_active]
        self.fail_random(seed, p_fire, active, faults)
        return active

    def _add(self, rule) -> "FaultyOsCalls":
        fault = getattr(rule, "fault", None)
        call = getattr(rule, "call", None)
        if call is not None and call not in CALL_SITES:
            raise ValueError(f"unknown call site {call!r}; one of {CALL_SITES}")
        if fault is not None:
            _check_fault_fits(call, fault)
            if fault.kind == "hang":
                self._hang_events.append(fault.event)
        with self._lock:
            self._rules.append(rule)
        return self

    def clear(self) -> None:
        """Drop every schedule (counters and log stay)."""
        with self._lock:
            self._rules.clear()

    def reset(self) -> None:
        """Drop schedules, counters and the log."""
        with self._lock:
            self._rules.clear()
            self.calls.clear()
            self.fired.clear()
            self.log.clear()

    def release_hangs(self) -> None:
        """Set every hang Event ever scheduled (teardown calls this, so no thread stays blocked)."""
        for ev in self._hang_events:
            ev.set()

    def before(self, call: str, fn: Callable[[CallInfo], None]) -> None:
        self._before[call].append(fn)

    def after(self, call: str, fn: Callable[[CallInfo], None]) -> None:
        """``fn`` runs after the call, also when it raised (``info.error``)."""
        self._after[call].append(fn)

    def fired_total(self) -> int:
        with self._lock:
            return sum(self.fired.values())

    def log_since(self, pos: int) -> tuple[list[Fired], int]:
        """The faults fired since log position ``pos``, and the position to ask from next."""
        with self._lock:
            return self.log[pos:], len(self.log)

    # -- the decision ----------------------------------------------------------

    def _decide(self, call: str, args: tuple) -> tuple[Optional[int], Optional[Fault]]:
        with self._lock:
            if not self.enabled:
                return None, None
            self.calls[call] += 1
            n = self.calls[call]
            fault = None
            for rule in self._rules:
                if isinstance(rule, _RandomRule):
                    fault = rule.pick(call, n)
                elif rule.match(call, n, args):
                    fault = rule.fault
                if fault is not None:
                    break
            if fault is not None:
                self.fired[call] += 1
                if call in DATA_CALLS:
                    fd, bufs, off = args
                    self.log.append(Fired(call, n, fault, fd, off, sum(len(b) for b in bufs)))
                else:
                    self.log.append(Fired(call, n, fault, args[0] if args and isinstance(args[0], int) else None))
            return n, fault

    def _call(self, call: str, real: Callable, *args, **kwargs):
        n, fault = self._decide(call, args)
        info = CallInfo(call, n, args, kwargs, fault=fault)
        for fn in self._before[call]:
            fn(info)
        try:
            info.result = self._apply(call, n, fault, real, args, kwargs)
        except BaseException as e:
            info.error = e
            raise
        finally:
            for fn in self._after[call]:
                fn(info)
        return info.result

    def _apply(self, call, n, fault, real, args, kwargs):
        if fault is None:
            return real(*args, **kwargs)
        kind = fault.kind
        err = fault.errno or DEFAULT_ERRNO.get(call, _errno.EIO)
        if kind == "delay":
            time.sleep(fault.seconds)
            return real(*args, **kwargs)
        if kind == "hang":
            with self._lock:
                self.hanging += 1
            self.hang_entered.set()
            try:
                fault.event.wait(fault.seconds)
            finally:
                with self._lock:
                    self.hanging -= 1
            return real(*args, **kwargs)
        if kind == "error":
            if call == "close":
                # SQLite ts_close: "Even if simulating an error, close the original
                # file-descriptor." Linux releases the fd even when close reports an
                # error (close(2)); a fake that kept it open would report false leaks.
                real(*args, **kwargs)
            elif fault.after and call in DATA_CALLS:
                real(*args, **kwargs)  # the bytes moved, then the device reported an error
            raise injected_error(err, call, n)
        fd, bufs, offset = args
        total = sum(len(b) for b in bufs)
        if kind == "lie":
            return total
        if kind == "short":
            # A real partial transfer: a prefix really goes to (or comes from) the file
            # and the smaller count comes back (SQLite's ts_write writes half, then fails).
            k = int(total * fault.fraction)
            if _is_direct(fd):
                k -= k % _DIRECT_SHORT_GRANULE
            k = min(k, total - 1) if total else 0
            if k <= 0:
                return 0
            return real(fd, _prefix(bufs, k), offset)
        if kind == "bitflip":
            got = real(fd, bufs, offset)
            if fault.byte < got:
                _flip(bufs, fault.byte, fault.bit)
            return got
        raise AssertionError(f"unhandled fault {fault!r}")



def _wrap(call: str):
    def method(self, *args, **kwargs):
        return self._call(call, getattr(self.inner, call), *args, **kwargs)

    method.__name__ = call
    method.__doc__ = f"``OsCalls.{call}`` through the fault schedule."
    return method


# The seam: one wrapper per call site, made from OsCalls itself.
for _name in CALL_SITES:
    setattr(FaultyOsCalls, _name, _wrap(_name))


def _check_fault_fits(call: Optional[str], fault: Fault) -> None:
    if fault.kind in ("short", "bitflip", "lie") and call not in (None, *DATA_CALLS):
        raise ValueError(f"{fault!r} only applies to pwritev/preadv, not {call}")
    if fault.kind == "bitflip" and call == "pwritev":
        raise ValueError("bitflip models corruption read back: schedule it on preadv")
    if fault.kind == "lie" and call == "preadv":
        raise ValueError("lie models a write that never happened: schedule it on pwritev")
    if fault.kind == "hang" and fault.event is None:
        raise ValueError("Fault.hang needs an Event")


def _is_direct(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)
    except OSError:
        return False


def _prefix(bufs: Sequence, k: int) -> list:
    out = []
    for b in bufs:
        if k <= 0:
            break
        mv = memoryview(b).cast("B")
        out.append(mv[: min(k, len(mv))])
        k -= len(mv)
    return out


def _flip(bufs: Sequence, byte: int, bit: int) -> None:
    for b in bufs:
        mv = memoryview(b).cast("B")
        if byte < len(mv):
            mv[byte] ^= 1 << bit
            return
        byte -= len(mv)
