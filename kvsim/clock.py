"""Virtual time in integer nanoseconds, owned by the event loop.

Integers, not floats: a replay must be exact and repeatable byte for byte, and float
sums drift with the order of additions. Only the loop calls ``advance_to``.
"""

from __future__ import annotations


class Clock:
    def __init__(self, start_ns: int = 0) -> None:
        self._now = start_ns

    def now(self) -> int:
        return self._now

    def advance_to(self, t_ns: int) -> None:
        if t_ns < self._now:
            raise ValueError(f"clock cannot go backwards: now {self._now} ns, asked {t_ns} ns")
        self._now = t_ns
