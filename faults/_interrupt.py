"""Interrupts at every line: a KeyboardInterrupt at the N-th line one call runs.

``sys.settrace`` sees every line the calling thread runs inside the call: the
backend's and everything it calls in that thread (threading, weakref, logging).
Raising from the trace function is what a Ctrl-C between two lines looks like;
CPython then turns tracing off, so each run gets exactly one interrupt.
``sweep_lines`` runs a point for N = 1, 2, ... until the call completes untouched
(SQLite's fail-the-Nth loop, over lines instead of syscalls).

Not modelled: an interrupt between two bytecodes of one line (after a C call
returns, before its result is stored) or inside C code; lines that other threads
run (their timing is what the concurrent tests vary).

Two kinds of line event raise nothing, because no real signal can land there:
- where a ``with`` block ends, just before the context manager's ``__exit__``
  is called: a signal is acted on after calls, not before them, so Ctrl-C cannot
  skip a C-level ``__exit__`` (a ``threading.Lock`` is always released);
- a line that starts with a NOP (``try:``): nothing runs there, and CPython's
  exception table does not cover it, so an exception raised there would escape
  the enclosing ``with`` and ``try``. The next line's event covers the same state.
A Python-level ``__exit__`` runs its own lines, and those are interrupted.
"""

from __future__ import annotations

import contextlib
import dis
import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Where:
    """A line where an interrupt fired."""

    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.func})"


class LineInterrupt:
    """Runs a call and, at its ``n``-th line event, raises KeyboardInterrupt (or calls ``action``).

    ``at=(file, line)`` counts only that line's events (the ``n``-th time it runs).
    ``fired`` says where it happened (None: the call ran fewer than ``n`` lines);
    ``seen`` lists every line run up to then, for coverage checks;
    ``swallowed_by_python``: it hit a weakref callback or ``__del__``, where CPython
    reports and drops exceptions, so the call went on.
    """

    def __init__(self, n: int, action: Optional[Callable[[], None]] = None,
                 at: Optional[tuple[str, int]] = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.action = action
        self.at = at
        self.count = 0
        self.fired: Optional[Where] = None
        self.seen: list[Where] = []
        self.swallowed_by_python = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # The cyclic garbage collector is off during the call: it runs weakref
        # callbacks and finalizers at arbitrary lines, which would shift the line
        # count from run to run, and CPython 3.11 mishandles an exception raised by a
        # trace function inside one (it comes out as "'traceback' object is not callable").
        previous, hook, collecting = sys.gettrace(), sys.unraisablehook, gc.isenabled()
        sys.unraisablehook = self._on_unraisable
        gc.disable()
        sys.settrace(self._on_call)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(previous)
            if collecting:
                gc.enable()
            sys.unraisablehook = hook

    def _on_unraisable(self, info) -> None:
        # An interrupt inside a weakref callback or __del__ (the garbage collector
        # runs them at any line) is printed and dropped by CPython, as a real Ctrl-C
        # there would be; recorded, so a test can tell it from one the backend ate.
        if self.caused(info.exc_value):
            self.swallowed_by_python = True
        else:
            sys.__unraisablehook__(info)

    @property
    def label(self) -> str:
        return f"#{self.n}" if self.at is None else f"#{self.n} of {self.at[0]}:{self.at[1]}"

    def caused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this interrupt, or was raised while handling it: the
        standard library does not survive every interrupt (one inside
        ``Condition.wait`` comes out as "release unlocked lock")."""
        seen = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, KeyboardInterrupt) and self.fired is not None and self.label in str(exc):
                return True
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return False

    @contextlib.contextmanager
    def blame(self) -> Iterator[None]:
        """Checks inside name this point when they fail."""
        try:
            yield
        except AssertionError as e:
            raise AssertionError(f"after interrupt {self.label} at {self.fired}: {e}") from e

    def _on_call(self, frame, event, arg):
        return self._on_line if self.fired is None else None

    def _on_line(self, frame, event, arg):
        if event != "line" or self.fired is not None:
            return self._on_line if self.fired is None else None
        if frame.f_lasti in _no_signal_here(frame.f_code):
            return self._on_line
        where = Where(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        self.seen.append(where)
        if self.at is None or self.at == (where.file, where.line):
            self.count += 1
        if self.count == self.n:
            self.fired = where
            if self.action is None:
                raise KeyboardInterrupt(f"line interrupt {self.label} at {where}")
            self.action()
            return None
        return self._on_line


_NO_SIGNAL: dict = {}


def _no_signal_here(code) -> frozenset[int]:
    """Offsets of line starts no signal can interrupt: NOPs, and the normal exit of a
    ``with`` block (three ``LOAD_CONST None`` then the call of ``__exit__``;
    CPython 3.11 and 3.12)."""
    found = _NO_SIGNAL.get(code)
    if found is None:
        ins = list(dis.get_instructions(code))
        exits = {
            a.offset for a, b, c, d in zip(ins, ins[1:], ins[2:], ins[3:])
            if all(x.opname == "LOAD_CONST" and x.argval is None for x in (a, b, c))
            and d.opname in ("PRECALL", "CALL") and d.arg == 2
        }
        found = frozenset(exits | {i.offset for i in ins if i.opname == "NOP"})
        _NO_SIGNAL[code] = found
    return found


def sweep_lines(point: Callable[[LineInterrupt], None], must_hit: Callable[[Where], bool] = lambda w: False,
                limit: int = 20000) -> list[Where]:
    """Run ``point(LineInterrupt(n))`` for n = 1, 2, ... until the call runs untouched;
    returns where each interrupt fired.

    Thread timing shifts the line count a little from run to run, so a line can slip
    between two N. Every line matching ``must_hit`` that the untouched run executed
    and no interrupt hit is then interrupted once on purpose (``at=``).
    """
    fired = []
    for n in range(1, limit + 1):
        it = LineInterrupt(n)
        point(it)
        if it.fired is None:
            break
        fired.append(it.fired)
    else:
        raise AssertionError(f"the call still ran {limit} lines: raise the limit or shrink the workload")
    hit = {(w.file, w.line) for w in fired}
    for w in dict.fromkeys(w for w in it.seen if must_hit(w) and (w.file, w.line) not in hit):
        for _ in range(_AIM_ATTEMPTS):  # a line that runs only with some thread timings
            again = LineInterrupt(1, at=(w.file, w.line))
            point(again)
            if again.fired is not None:
                fired.append(again.fired)
                break
        else:
            raise AssertionError(f"{w} ran in the untouched run but in none of {_AIM_ATTEMPTS} runs aimed at it")
    return fired


_AIM_ATTEMPTS = 20
