"""A simulated device for kvoffload's ``Device`` seam: copies finish when the test says.

Each copy is queued at launch and its bytes move only when it completes, so code
that reads a staging row before its device->host copy completed sees stale bytes,
and code that overwrites a row whose host->device copy is still in flight corrupts
the device block, exactly the bugs a real GPU shows only under load. Events report
False until then. Copies on one stream complete in launch order and never before
their ``wait_event``. The test completes copies with ``complete_next`` /
``complete_all``, or gives each a virtual delay (``delay_ns``) and drives virtual
time with ``advance_to``.
Strict checks: copies need a pinned host buffer and a thread that called
``bind_thread``, as async CUDA copies do.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvoffload.device import BlockLayout, DeviceEvent, copy_rows


@dataclass(frozen=True, eq=False)
class SimStream:
    """A per-thread stream; compared by identity, as CUDA streams are."""

    thread: str
    lane_stream: Any


class SimEvent:
    """A copy's completion, duck-typed like ``torch.cuda.Event``."""

    def __init__(self, device: "SimDevice", copy_id: int) -> None:
        self._device = device
        self.copy_id = copy_id
        self.done = False
        self.done_at_ns: Optional[int] = None

    def query(self) -> bool:
        return self.done

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block until the test completes this copy (``timeout`` s, default the device's)."""
        self._device._wait(self, timeout)

    def __repr__(self) -> str:
        return f"SimEvent(copy {self.copy_id}, {'done' if self.done else 'pending'})"


@dataclass
class _Copy:
    copy_id: int
    to_host: bool
    stream: Any
    layout: BlockLayout
    block_ids: list[int]
    host: torch.Tensor
    rows: list[int]
    wait_event: Optional[DeviceEvent]
    due_ns: Optional[int]
    event: SimEvent

    def ready(self) -> bool:
        return self.wait_event is None or self.wait_event.query()

    def host_ranges(self) -> list[tuple[int, int]]:
        row_bytes = self.host.stride(0) * self.host.element_size()
        base = self.host.data_ptr()
        return [(base + r * row_bytes, row_bytes) for r in self.rows]

    def move_bytes(self) -> None:
        copy_rows(self.layout, self.block_ids, self.host, self.rows, self.to_host)


class SimDevice:
    def __init__(self, delay_ns: Optional[int] = None, sync_timeout: float = 10.0) -> None:
        """``delay_ns``: a copy is due ``delay_ns`` of virtual time after its launch."""
        if delay_ns is not None and delay_ns < 0:
            raise ValueError(f"delay_ns must be >= 0, got {delay_ns}")
        self.delay_ns, self.sync_timeout = delay_ns, sync_timeout
        self.now_ns = 0  # virtual time; only advance_to moves it
        self._cv = threading.Condition()
        self._pending: list[_Copy] = []  # launch order
        self._ids = itertools.count()
        self._pinned: dict[int, int] = {}  # data_ptr -> nbytes
        self._bound: set[int] = set()  # thread idents
        self.log: list[tuple[str, int, str]] = []  # ("launch"|"complete", copy_id, "to_host"|"to_device")

    # -- the Device seam --------------------------------------------------------

    def bind_thread(self, stream: Any = None, layout: Any = None, rows: int = 0, to_host: Any = None) -> Any:
        """Register this thread; return its own stream, as ``CudaDevice`` gives each IO
        thread one (copies of different threads are not ordered with each other)."""
        with self._cv:
            self._bound.add(threading.get_ident())
        return SimStream(threading.current_thread().name, stream)

    def new_event(self) -> None:
        return None  # every copy gets its own SimEvent: the test completes copies one by one

    def pin(self, host: torch.Tensor) -> None:
        with self._cv:
            if host.data_ptr() in self._pinned:
                raise RuntimeError("host buffer pinned twice (cudaHostRegister fails on that)")
            self._pinned[host.data_ptr()] = host.numel() * host.element_size()

    def unpin(self, host: torch.Tensor) -> None:
        with self._cv:
            if self._pinned.pop(host.data_ptr(), None) is None:
                raise RuntimeError("unpin of a host buffer that is not pinned")
            if any(c.host.data_ptr() == host.data_ptr() for c in self._pending):
                raise RuntimeError("unpin while a copy from or to the buffer is in flight")

    def copy_to_host(self, stream, layout, block_ids, host, rows, wait_event=None, event=None) -> SimEvent:
        return self._launch(True, stream, layout, block_ids, host, rows, wait_event)

    def copy_to_device(self, stream, layout, host, rows, block_ids, event=None) -> SimEvent:
        return self._launch(False, stream, layout, block_ids, host, rows, None)

    def host_view(self, layout: Any) -> None:
        return None  # copies are the test's to complete: they go through staging

    def copy_plan(self, *args: Any, **kwargs: Any) -> None:
        return None  # the test completes copies: an engine makes each through copy_to_*

    def event_handle(self, event: Any) -> None:
        return None  # a SimEvent is waited on in Python

    # -- the test's controls ----------------------------------------------------

    def num_pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def wait_pending(self, n: int = 1, timeout: float = 5.0) -> bool:
        """Wait until at least ``n`` copies are in flight (IO threads launch them)."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self._pending) >= n, timeout)

    def complete_next(self) -> Optional[SimEvent]:
        """Complete the oldest copy that may complete now; None when none is in flight."""
        with self._cv:
            if not self._pending:
                return None
            c = self._eligible()
            if c is None:
                raise RuntimeError(f"{len(self._pending)} copies in flight, none may complete "
                                   "(each waits on its stream or its wait_event)")
            self._complete(c)
            return c.event

    def complete_all(self) -> int:
        n = 0
        while self.complete_next() is not None:
            n += 1
        return n

    def advance_to(self, t_ns: int) -> int:
        """Move virtual time to ``t_ns``, completing in order the copies due by then."""
        if self.delay_ns is None:
            raise RuntimeError("advance_to needs a SimDevice built with delay_ns")
        if t_ns < self.now_ns:
            raise ValueError(f"virtual time cannot go backwards: now {self.now_ns} ns, asked {t_ns} ns")
        n = 0
        with self._cv:
            while True:
                c = self._eligible()
                if c is None or c.due_ns > t_ns:
                    break
                self.now_ns = max(self.now_ns, c.due_ns)
                self._complete(c)
                n += 1
            self.now_ns = t_ns
        return n

    def busy(self, addr: int, nbytes: int) -> list[str]:
        """Directions of in-flight copies touching host bytes [addr, addr + nbytes)."""
        with self._cv:
            return [("to_host" if c.to_host else "to_device")
                    for c in self._pending
                    for a, n in c.host_ranges()
                    if a < addr + nbytes and addr < a + n]

    # -- internals ----------------------------------------------------------------

    def _launch(self, to_host, stream, layout, block_ids, host, rows, wait_event) -> SimEvent:
        block_ids, rows = list(block_ids), list(rows)
        if len(block_ids) != len(rows):
            raise ValueError(f"{len(block_ids)} block ids but {len(rows)} rows")
        with self._cv:
            if threading.get_ident() not in self._bound:
                raise RuntimeError("copy launched from a thread that never called bind_thread()")
            ptr = host.data_ptr()
            if not any(p <= ptr < p + n for p, n in self._pinned.items()):
                raise RuntimeError("async copy with an unpinned host buffer (it would run synchronously)")
            cid = next(self._ids)
            due = None if self.delay_ns is None else self.now_ns + self.delay_ns
            c = _Copy(cid, to_host, stream, layout, block_ids, host, rows, wait_event, due, SimEvent(self, cid))
            self._pending.append(c)
            self.log.append(("launch", cid, "to_host" if to_host else "to_device"))
            self._cv.notify_all()
            return c.event

    def _eligible(self) -> Optional[_Copy]:
        seen_streams: list[Any] = []
        for c in self._pending:
            if any(c.stream is s for s in seen_streams):
                continue  # an earlier copy on its stream is still in flight
            if c.ready():
                return c
            seen_streams.append(c.stream)
        return None

    def _complete(self, c: _Copy) -> None:
        c.move_bytes()
        self._pending.remove(c)
        c.event.done_at_ns = None if self.delay_ns is None else self.now_ns
        c.event.done = True
        self.log.append(("complete", c.copy_id, "to_host" if c.to_host else "to_device"))
        self._cv.notify_all()

    def _wait(self, ev: SimEvent, timeout: Optional[float]) -> None:
        t = self.sync_timeout if timeout is None else timeout
        with self._cv:
            if not self._cv.wait_for(lambda: ev.done, t):
                raise TimeoutError(f"{ev!r} not completed after {t} s: the test never completed it")
