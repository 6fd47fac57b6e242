"""The discrete-event loop: a heap keyed ``(time_ns, kind_rank, seq)``.

Handlers return the events they cause instead of touching the heap (Vidur's split),
so only the loop owns time and the queue. ``Kind`` fixes same-time order, and unlike
Vidur that order is part of the heap key; ``seq`` (creation order) breaks the
remaining ties, so a replay is deterministic without any randomness in the loop.
The heap holds plain tuples: their comparison runs in C.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional

from kvsim.clock import Clock


class Kind(IntEnum):
    # An IO completion only wakes an idle engine; it comes first so a step boundary at
    # the same instant already sees it (the event's timestamp is what polling reads).
    IO_DONE = 0
    # Arrivals before step boundaries: a request arriving exactly when a step ends
    # joins the next batch, as it would in a busy-polling engine.
    ARRIVAL = 1
    STEP = 2


@dataclass(slots=True)
class Event:
    time_ns: int
    kind: Kind
    payload: Any = None
    target: Any = None  # the engine (replica) a step or an IO completion belongs to


Handler = Callable[[Event], Iterable[Event]]


class EventLoop:
    def __init__(self, clock: Optional[Clock] = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self._heap: list[tuple[int, int, int, Event]] = []
        self._seq = itertools.count()
        self._handlers: dict[Kind, Handler] = {}
        self._arrivals: list[int] = []  # times of the queued arrivals: the next one is what every engine awaits
        self.num_events = 0

    def on(self, kind: Kind, handler: Handler) -> None:
        self._handlers[kind] = handler

    def push(self, event: Event) -> None:
        if event.time_ns < self.clock.now():
            raise ValueError(f"event {event.kind.name} at {event.time_ns} ns is in the past "
                             f"(now {self.clock.now()} ns)")
        heapq.heappush(self._heap, (event.time_ns, event.kind, next(self._seq), event))
        if event.kind == Kind.ARRIVAL:
            heapq.heappush(self._arrivals, event.time_ns)

    def next_time(self) -> Optional[int]:
        """Time of the earliest pending event, or None when the heap is empty."""
        return self._heap[0][0] if self._heap else None

    def next_arrival(self) -> Optional[int]:
        """Time of the earliest pending arrival, or None."""
        return self._arrivals[0] if self._arrivals else None

    def run(self, until_ns: Optional[int] = None) -> None:
        heap, handlers = self._heap, self._handlers
        while heap:
            if until_ns is not None and heap[0][0] > until_ns:
                break
            ev = heapq.heappop(heap)[3]
            self.clock.advance_to(ev.time_ns)
            self.num_events += 1
            if ev.kind == Kind.ARRIVAL:
                heapq.heappop(self._arrivals)
            for new in handlers[ev.kind](ev):
                self.push(new)
