"""Which disk slot holds which block: the scheduler-side policy of the offload tier.

A block hash is in at most one of three maps: in flight (store launched, invisible),
cached (store completed, loadable) or dropping (a load failed while other loads still
pin the slot). Unpinned cached blocks sit in one OrderedDict, LRU first, so eviction
and touch are O(1) and pinned blocks are never even looked at by eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence

BlockHash = Hashable


def prefix_length(keys: Sequence[Hashable], present: Container[Hashable]) -> int:
    """How many leading ``keys`` are in ``present`` (a prefix cache hit)."""
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


class SlotPool:
    """LRU pool of ``num_slots`` disk slots keyed by block hash.

    Call pattern (vLLM's scheduler does the same with CPU blocks): ``lookup`` then
    ``touch`` the hit; ``prepare_load``/``complete_load`` around a load;
    ``prepare_store``/``complete_store`` around a store.
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.num_evictions = 0
        # Pop from the end: slot 0 is handed out first, which keeps runs reproducible.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._cached: dict[BlockHash, int] = {}
        self._in_flight: dict[BlockHash, int] = {}
        self._dropping: dict[BlockHash, int] = {}
        self._pins: dict[BlockHash, int] = {}
        # Unpinned cached blocks only; first = least recently used.
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()

    def num_free(self) -> int:
        return len(self._free)

    def num_cached(self) -> int:
        return len(self._cached)

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def num_pinned(self) -> int:
        return len(self._pins)

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` whose stores completed OK."""
        return prefix_length(hashes, self._cached)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Make cached ``hashes`` most recently used, the head most of all.

        Walking in reverse leaves the tail older than the head, so a request's tail
        is evicted first and its prefix (the part other requests share) survives,
        as vLLM's free queue does. Pinned blocks are outside the LRU; they re-enter
        it when their last load completes.
        """
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)

    def prepare_store(self, hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Allocate slots for the blocks of ``hashes`` not yet cached or in flight.

        Evicts least recently used unpinned blocks as needed; stops early, storing
        only a prefix of the new blocks, when no slot is free or evictable. Never
        evicts the request's own blocks: lookups match prefixes, so a tail stored
        in place of its head could never be hit. Allocated slots are in flight
        (invisible to ``lookup``) until ``complete_store``.
        """
        # Touching moves the request's cached blocks behind every other block in the
        # LRU, so the first own block at the LRU front means only own blocks remain.
        self.touch(hashes)
        own = set(hashes)
        out: list[tuple[BlockHash, int]] = []
        for h in hashes:
            if h in self._cached or h in self._in_flight or h in self._dropping:
                continue
            slot = self._allocate(own)
            if slot is None:
                break
            self._in_flight[h] = slot
            out.append((h, slot))
        assert self._accounted()
        return out

    def complete_store(self, hashes: Sequence[BlockHash], ok: bool) -> None:
        """Publish in-flight stores as cached (``ok``) or free their slots.

        ``hashes`` are those ``prepare_store`` returned. A failed store is never
        visible: the slot may hold torn data. Reverse order: the tail is older.
        """
        for h in reversed(hashes):
            slot = self._in_flight.pop(h, None)
            if slot is None:
                raise KeyError(f"complete_store: block {h!r} has no store in flight")
            if ok:
                self._cached[h] = slot
                self._lru[h] = None
            else:
                self._free.append(slot)
        assert self._accounted()

    def prepare_load(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Slots of cached ``hashes``, pinned so no store can evict or reuse them."""
        slots = []
        for h in hashes:
            slot = self._cached.get(h)
            if slot is None:
                raise KeyError(f"prepare_load: block {h!r} is not cached (look it up first)")
            n = self._pins.get(h, 0)
            if n == 0:
                del self._lru[h]
            self._pins[h] = n + 1
            slots.append(slot)
        return slots

    def complete_load(self, hashes: Sequence[BlockHash], ok: bool) -> None:
        """Unpin ``hashes``; on failure drop them so the engine recomputes.

        A dropped block disappears from lookups at once; its slot is freed when its
        last pin goes (another load may still be reading it).
        """
        for h in reversed(hashes):
            n = self._pins.get(h)
            if n is None:
                raise KeyError(f"complete_load: block {h!r} has no load in flight")
            if not ok and h in self._cached:
                self._dropping[h] = self._cached.pop(h)
            if n > 1:
                self._pins[h] = n - 1
                continue
            del self._pins[h]
            if h in self._dropping:
                self._free.append(self._dropping.pop(h))
            else:
                self._lru[h] = None
        assert self._accounted()

    def _allocate(self, keep: set[BlockHash]) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru or next(iter(self._lru)) in keep:
            return None
        h, _ = self._lru.popitem(last=False)
        assert h not in self._pins, "evicting a pinned (loading) block"
        self.num_evictions += 1
        return self._cached.pop(h)

    def _accounted(self) -> bool:
        """Every slot is in exactly one place (checked by count; cheap enough for asserts)."""
        held = len(self._cached) + len(self._in_flight) + len(self._dropping)
        return len(self._free) + held == self.num_slots and len(self._lru) + len(self._pins) == (
            len(self._cached) + len(self._dropping)
        )
