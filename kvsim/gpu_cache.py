"""The GPU prefix cache: vLLM's BlockPool reduced to counts and an LRU of cached units.

Capacity and use are counted in vLLM blocks; what is cached is units (request.py),
each weighing its number of blocks. A request references the cached units it hit
or computed and owns anonymous blocks (not yet computed, loading, output). As vLLM
does, a unit computed again while another copy is cached (a request that
recomputes the last block of a full hit, or two requests computing the same unit)
is cached too, as a second copy: vLLM never de-duplicates, so block tables stay
append-only; a hit takes the oldest copy. As ``BlockPool.free_blocks`` queues them,
freed blocks holding no cached unit go to the front of the free queue (reused
first) and cached units to its back, the request's tail first, so its tail is
evicted before the prefix others share. Eviction takes whole units, so it may free
up to one unit's blocks more than needed. vLLM takes a request's blocks step by
step (a prefill chunk's, a decode token's); kvsim reserves them all at admission,
so a request never has to be preempted, and takes them when vLLM would (``take``),
which is when they may evict a unit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.slot_pool import prefix_length


class CachedUnit:
    """One cached copy of a unit: its blocks and the requests referencing it."""

    __slots__ = ("key", "blocks", "refs")

    def __init__(self, key: int, blocks: int) -> None:
        self.key, self.blocks, self.refs = key, blocks, 1


class GpuPrefixCache:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the GPU holds no KV block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.num_taken = 0  # referenced blocks, cached or anonymous
        self.num_reserved = 0  # promised to admitted requests, not yet taken
        self.num_evictions = 0  # unit copies
        self._copies: dict[int, list[CachedUnit]] = {}  # unit -> its cached copies, oldest first
        self._lru: OrderedDict[CachedUnit, None] = OrderedDict()  # unreferenced copies, first evicted first
        self._lru_blocks = 0

    @property
    def num_used(self) -> int:
        """Blocks taken or reserved."""
        return self.num_taken + self.num_reserved

    def lookup(self, keys: Sequence[int]) -> int:
        """Number of leading ``keys`` cached (in use or evictable)."""
        return prefix_length(keys, self._copies)

    def _revived(self, hit_keys: Sequence[int]) -> int:
        copies = self._copies
        return sum(c.blocks for c in (copies[k][0] for k in hit_keys) if c.refs == 0)

    def can_allocate(self, hit_keys: Sequence[int], num_new: int) -> bool:
        return num_new + self._revived(hit_keys) <= self.num_blocks - self.num_used

    def allocate(self, hit_keys: Sequence[int], num_new: int) -> list[CachedUnit]:
        """Reference ``hit_keys`` (their oldest copies, returned) and reserve ``num_new``
        blocks (``take`` takes them)."""
        copies, lru = self._copies, self._lru
        hit = [copies[k][0] for k in hit_keys]
        for c in hit:
            if c.refs == 0:
                del lru[c]
                self._lru_blocks -= c.blocks
                self.num_taken += c.blocks
            c.refs += 1
        self.num_reserved += num_new
        assert self.num_used <= self.num_blocks
        return hit

    def take(self, num: int) -> None:
        """Take ``num`` reserved blocks: free uncached ones first, then evicting LRU units."""
        assert num <= self.num_reserved
        self.num_reserved -= num
        self.num_taken += num
        lru, copies = self._lru, self._copies
        while self.num_taken + self._lru_blocks > self.num_blocks:
            c, _ = lru.popitem(last=False)
            self._lru_blocks -= c.blocks
            same = copies[c.key]
            same.remove(c)
            if not same:
                del copies[c.key]
            self.num_evictions += 1

    def publish(self, key: int, blocks: int) -> CachedUnit:
        """Cache ``blocks`` of the caller's anonymous blocks as a copy of unit ``key``."""
        c = CachedUnit(key, blocks)
        self._copies.setdefault(key, []).append(c)
        return c

    def pin(self, copies: Sequence[CachedUnit]) -> None:
        """Reference copies an offload store reads (their request still references them)."""
        for c in copies:
            assert c.refs > 0
            c.refs += 1

    def unpin(self, copies: Sequence[CachedUnit]) -> None:
        """A store is done: release its copies in block order, as vLLM's store completion
        frees them, so a copy its request no longer holds joins the LRU head first."""
        self.free(list(reversed(copies)), 0)

    def free(self, owned: Sequence[CachedUnit], num_anon: int, num_reserved: int = 0) -> None:
        """Release a request's anonymous blocks, its units (last first) and what it never took."""
        lru = self._lru
        self.num_taken -= num_anon
        self.num_reserved -= num_reserved
        for c in reversed(owned):
            c.refs -= 1
            if c.refs == 0:
                lru[c] = None
                self.num_taken -= c.blocks
                self._lru_blocks += c.blocks
        assert 0 <= self.num_taken and self.num_taken + self._lru_blocks <= self.num_blocks >= self.num_used
