"""The GPU prefix cache: vLLM's BlockPool reduced to counts and an LRU of hashes.

A request holds references on its cached blocks and owns some anonymous blocks (not
yet computed, loading, or duplicates of a block another request published first).
Blocks whose last reference goes join an LRU of evictable blocks; a request frees
its blocks tail first, so its tail is evicted before the prefix others share.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvsim.slot_pool import prefix_length


class GpuPrefixCache:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the GPU holds no KV block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.num_used = 0  # referenced blocks, cached or anonymous
        self.num_evictions = 0
        self._refs: dict[int, int] = {}  # cached key -> references (0: in _lru)
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = evicted first

    def lookup(self, keys: Sequence[int]) -> int:
        """Number of leading ``keys`` cached (in use or evictable)."""
        return prefix_length(keys, self._refs)

    def can_allocate(self, hit_keys: Sequence[int], num_new: int) -> bool:
        refs = self._refs
        revived = sum(1 for k in hit_keys if refs[k] == 0)
        return num_new + revived <= self.num_blocks - self.num_used

    def allocate(self, hit_keys: Sequence[int], num_new: int) -> None:
        """Reference ``hit_keys`` and take ``num_new`` anonymous blocks, evicting LRU."""
        refs, lru = self._refs, self._lru
        for k in hit_keys:
            r = refs[k]
            if r == 0:
                del lru[k]
                self.num_used += 1
            refs[k] = r + 1
        self.num_used += num_new
        while self.num_used + len(lru) > self.num_blocks:
            k, _ = lru.popitem(last=False)
            del refs[k]
            self.num_evictions += 1
        assert self.num_used <= self.num_blocks

    def publish(self, key: int) -> bool:
        """Turn one of the caller's anonymous blocks into cached ``key``.

        False when ``key`` is already cached: the caller's copy stays anonymous, as
        vLLM keeps a duplicate block out of its hash table.
        """
        if key in self._refs:
            return False
        self._refs[key] = 1
        return True

    def free(self, owned_keys: Sequence[int], num_anon: int) -> None:
        refs, lru = self._refs, self._lru
        self.num_used -= num_anon
        for k in reversed(owned_keys):
            r = refs[k] - 1
            refs[k] = r
            if r == 0:
                lru[k] = None
                self.num_used -= 1
        assert 0 <= self.num_used and self.num_used + len(lru) <= self.num_blocks
