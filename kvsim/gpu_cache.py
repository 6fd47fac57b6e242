"""The GPU prefix cache: vLLM's BlockPool reduced to counts and an LRU of units.

Capacity and use are counted in vLLM blocks; what is cached is units (request.py),
each weighing its number of blocks. A request holds references on its cached units
and owns anonymous blocks (not yet computed, loading, output, or duplicates of a
unit another request published first). Units whose last reference goes join an LRU
of evictable units; a request frees its units tail first, so its tail is evicted
before the prefix others share. Eviction takes whole units, so it may free up to
one unit's blocks more than needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.slot_pool import prefix_length


class GpuPrefixCache:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the GPU holds no KV block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.num_used = 0  # referenced blocks, cached or anonymous
        self.num_evictions = 0  # units
        self._refs: dict[int, int] = {}  # cached unit -> references (0: in _lru)
        self._weight: dict[int, int] = {}  # cached unit -> blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = evicted first
        self._lru_blocks = 0

    def lookup(self, keys: Sequence[int]) -> int:
        """Number of leading ``keys`` cached (in use or evictable)."""
        return prefix_length(keys, self._refs)

    def _revived(self, hit_keys: Sequence[int]) -> int:
        refs, weight = self._refs, self._weight
        return sum(weight[k] for k in hit_keys if refs[k] == 0)

    def can_allocate(self, hit_keys: Sequence[int], num_new: int) -> bool:
        return num_new + self._revived(hit_keys) <= self.num_blocks - self.num_used

    def allocate(self, hit_keys: Sequence[int], num_new: int) -> None:
        """Reference ``hit_keys`` and take ``num_new`` anonymous blocks, evicting LRU units."""
        refs, lru, weight = self._refs, self._lru, self._weight
        for k in hit_keys:
            r = refs[k]
            if r == 0:
                del lru[k]
                self._lru_blocks -= weight[k]
                self.num_used += weight[k]
            refs[k] = r + 1
        self.num_used += num_new
        while self.num_used + self._lru_blocks > self.num_blocks:
            k, _ = lru.popitem(last=False)
            del refs[k]
            self._lru_blocks -= weight.pop(k)
            self.num_evictions += 1
        assert self.num_used <= self.num_blocks

    def publish(self, key: int, blocks: int) -> bool:
        """Turn ``blocks`` of the caller's anonymous blocks into cached unit ``key``.

        False when ``key`` is already cached: the caller's copy stays anonymous, as
        vLLM keeps a duplicate block out of its hash table.
        """
        if key in self._refs:
            return False
        self._refs[key] = 1
        self._weight[key] = blocks
        return True

    def free(self, owned_keys: Sequence[int], num_anon: int) -> None:
        refs, lru, weight = self._refs, self._lru, self._weight
        self.num_used -= num_anon
        for k in reversed(owned_keys):
            r = refs[k] - 1
            refs[k] = r
            if r == 0:
                lru[k] = None
                self.num_used -= weight[k]
                self._lru_blocks += weight[k]
        assert 0 <= self.num_used and self.num_used + self._lru_blocks <= self.num_blocks
