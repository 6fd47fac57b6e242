"""IO resources: FIFO server stations, the OS page cache and dirty write-back.

Stations are N identical servers (IO threads), each serving one unit of a job at a
time in submission order, as BLIS models disks: N servers, not fair-shared
bandwidth. A unit's times are fixed when it is submitted, which is exact for FIFO
servers and keeps the event loop free of per-block events. The device the servers
share is accounted per job: its units are timed for the threads busy while it runs
(``busy_count`` plus its own units, at most N). Each server's busy time is kept for
the per-thread utilisation report.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence


class IoStation:
    def __init__(self, servers: int) -> None:
        assert servers >= 1
        self.servers = servers
        self._free: list[tuple[int, int]] = [(0, i) for i in range(servers)]  # heap of (free at, server)
        self.busy_ns = [0] * servers

    def busy_count(self, now: int) -> int:
        """Servers still busy at ``now``."""
        return sum(1 for f, _ in self._free if f > now)

    def copy(self) -> "IoStation":
        """The same servers, to plan a job on without submitting it."""
        other = IoStation(self.servers)
        other._free = list(self._free)
        return other

    def submit(self, now: int, busy_ns: int, count: int = 1) -> int:
        """Queue ``count`` units that each hold the first free server for ``busy_ns``;
        return when the last one starts (the latest: starts never go down)."""
        busy_ns = max(1, busy_ns)
        if count <= self.servers:
            free, busy = self._free, self.busy_ns
            start = now
            for _ in range(count):
                f, i = free[0]
                start = max(now, f)
                heapq.heapreplace(free, (start + busy_ns, i))  # ties: lowest server first
                busy[i] += busy_ns
            return start
        return self._submit_many(now, busy_ns, count)

    def _submit_many(self, now: int, busy_ns: int, count: int) -> int:
        """``submit`` of more units than servers, as one unit at a time would do it.

        Server i (free at e_i) starts units at e_i, e_i + busy, ...; one unit at a
        time always takes the earliest of those starts (lowest server on ties), so
        the units get the ``count`` smallest starts. Every start before
        ``lo = min e + (count // servers - 1) * busy`` is among them (fewer than
        ``count`` exist): those are handed out at once, the rest one at a time.
        """
        e = [0] * self.servers  # by server: when it can start
        for f, i in self._free:
            e[i] = f if f > now else now
        lo = min(e) + (count // self.servers - 1) * busy_ns
        n = [(lo - 1 - t) // busy_ns + 1 if t < lo else 0 for t in e]
        nxt = [(t + k * busy_ns, i) for i, (t, k) in enumerate(zip(e, n))]
        heapq.heapify(nxt)
        start = lo
        for _ in range(count - sum(n)):
            start, i = nxt[0]
            heapq.heapreplace(nxt, (start + busy_ns, i))
            n[i] += 1
        busy = self.busy_ns
        free = []
        for f, i in self._free:
            if n[i]:
                f = e[i] + n[i] * busy_ns
                busy[i] += n[i] * busy_ns
            free.append((f, i))
        heapq.heapify(free)
        self._free = free
        return start


class PageCache:
    """Resident slots of the slot file, LRU, ``capacity`` slots of host free memory."""

    def __init__(self, capacity_slots: int) -> None:
        self.capacity = max(0, capacity_slots)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def resident_blocks(self, slots: Sequence[int], weights: Sequence[int]) -> int:
        lru = self._lru
        return sum(w for s, w in zip(slots, weights) if s in lru)

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

    def __init__(self, bytes_per_ns: float, dirty_limit_bytes: float) -> None:
        self._rate = bytes_per_ns
        self._limit_ns = dirty_limit_bytes / bytes_per_ns  # backlog, in ns of disk time
        self._free_at = 0
        self.bytes_written = 0

    def dirty(self, now: int, nbytes: int) -> int:
        """Dirty ``nbytes`` at ``now``; return when the writer may continue."""
        self._free_at = max(self._free_at, now) + round(nbytes / self._rate)
        self.bytes_written += nbytes
        return max(now, self._free_at - round(self._limit_ns))
