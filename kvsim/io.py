"""IO resources: FIFO server stations, the OS page cache and dirty write-back.

Stations are N identical servers (IO threads), each serving one job (or one unit
of a job) at a time in submission order, as BLIS models disks: N servers, not
fair-shared bandwidth. A job's completion time is fixed when it is submitted, which
is exact for FIFO servers and keeps the event loop free of per-block events. The
device a station's servers share is accounted when a job is submitted: its service
time is computed for the number of servers busy when it starts (``busy_at_start``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class IoStation:
    def __init__(self, servers: int) -> None:
        assert servers >= 1
        self._free_at = [0] * servers

    def _server(self) -> int:
        free_at = self._free_at
        return free_at.index(min(free_at))  # lowest index on ties: deterministic

    def busy_at_start(self, now: int) -> int:
        """How many servers are busy when a job submitted now starts, it included."""
        i = self._server()
        start = max(now, self._free_at[i])
        return 1 + sum(1 for j, f in enumerate(self._free_at) if j != i and f > start)

    def copy(self) -> "IoStation":
        """The same servers, to plan a job on without submitting it."""
        other = IoStation(len(self._free_at))
        other._free_at = list(self._free_at)
        return other

    def submit(self, now: int, service_ns: int) -> int:
        """Queue a job; return its completion time."""
        i = self._server()
        done = max(now, self._free_at[i]) + service_ns
        self._free_at[i] = done
        return done


class PageCache:
    """Resident slots of the slot file, LRU, ``capacity`` slots of host free memory."""

    def __init__(self, capacity_slots: int) -> None:
        self.capacity = max(0, capacity_slots)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def num_resident(self, slots: Sequence[int]) -> int:
        lru = self._lru
        return sum(1 for s in slots if s in lru)

    def touch(self, slots: Sequence[int]) -> None:
        """Buffered reads and writes both leave the pages resident and most recent."""
        lru = self._lru
        for s in slots:
            if s in lru:
                lru.move_to_end(s)
            else:
                lru[s] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class WriteBack:
    """Kernel write-back of dirty pages at disk speed; writers stall above the dirty limit."""

    def __init__(self, write_gbps: float, dirty_limit_bytes: float) -> None:
        self._gbps = write_gbps
        self._limit_ns = dirty_limit_bytes / write_gbps  # backlog, in ns of disk time
        self._free_at = 0
        self.bytes_written = 0

    def dirty(self, now: int, nbytes: int) -> int:
        """Dirty ``nbytes`` at ``now``; return when the writer may continue."""
        self._free_at = max(self._free_at, now) + round(nbytes / self._gbps)
        self.bytes_written += nbytes
        return max(now, self._free_at - round(self._limit_ns))
