"""Which disk slot holds which block: the scheduler-side policy of the offload tier.

The policy vLLM 0.33 runs for ``KvoffloadConnector`` (``SimpleCPUOffloadScheduler``'s
CPU ``BlockPool``, plus the connector's dropping of failed slots), rebuilt without
vLLM: kvoffload's secondary tier (``vllm_tier``) runs it in production, and kvsim
drives the same code. ``tests/test_vllm_slot_pool.py`` runs it and vLLM's pool on the
same random call sequences and compares every hit, store, slot and eviction.

One free queue holds every slot nobody holds (head = reused next): slots holding
no block first, then cached blocks, least recently released first. Loads and
stores in flight hold their slots outside the queue. What vLLM does, and so this:

- released blocks join the tail in the order given, a request's head first, so
  under pressure the head of a prefix is evicted before its tail;
- a slot released without a block (failed store or load) goes to the front;
- a store takes slots from the head, evicting whatever cached block is there,
  the request's own included, and stores only as many blocks as the queue holds.
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

    Call pattern (vLLM's scheduler does the same with its CPU blocks): ``lookup``,
    then ``prepare_load`` the part it loads and ``touch`` the hit; ``complete_load``
    when the load ends; ``prepare_store``/``complete_store`` around a store.
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.num_evictions = 0
        # Slots nobody holds, head first: slot 0 is handed out first.
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self._slot_of: dict[BlockHash, int] = {}  # cached: loadable
        self._hash_of: dict[int, BlockHash] = {}
        self._in_flight: dict[BlockHash, int] = {}  # stores launched, invisible to lookup
        self._refs: dict[int, int] = {}  # slots held by loads or stores
        self._pins: dict[BlockHash, list[int]] = {}  # slots each hash's loads hold, oldest first

    def num_free(self) -> int:
        """Slots holding no block that nobody holds."""
        return sum(1 for s in self._queue if s not in self._hash_of)

    def num_cached(self) -> int:
        return len(self._slot_of)

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def num_pinned(self) -> int:
        """Hashes with a load in flight."""
        return len(self._pins)

    def cached_slots(self) -> dict[BlockHash, int]:
        """Block -> slot of every loadable block."""
        return dict(self._slot_of)

    def free_queue(self) -> list[int]:
        """Slots nobody holds, the next one handed out first."""
        return list(self._queue)

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` whose stores completed OK."""
        return prefix_length(hashes, self._slot_of)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """A hit: move cached ``hashes`` nobody holds to the tail, head first.

        vLLM holds a hit while the scheduler allocates, then releases it in
        request order. Held blocks (loading) rejoin the queue when released.
        """
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is not None and slot in self._queue:
                self._queue.move_to_end(slot)

    def prepare_store(self, hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Allocate slots for the blocks of ``hashes`` neither cached nor in flight.

        At most as many as the queue holds (counted first, as vLLM does), from its
        head; a cached block found there is evicted. Allocated slots are in flight
        (invisible to ``lookup``) until ``complete_store``.
        """
        room = len(self._queue)
        chosen: list[BlockHash] = []
        for h in dict.fromkeys(hashes):
            if h in self._slot_of or h in self._in_flight:
                continue
            if len(chosen) >= room:
                break
            chosen.append(h)
        out = []
        for h in chosen:
            slot, _ = self._queue.popitem(last=False)
            old = self._hash_of.pop(slot, None)
            if old is not None:
                del self._slot_of[old]
                self.num_evictions += 1
            self._refs[slot] = 1
            self._in_flight[h] = slot
            out.append((h, slot))
        assert len(self._queue) + len(self._refs) == self.num_slots
        return out

    def complete_store(self, hashes: Sequence[BlockHash], ok: bool) -> None:
        """Publish in-flight stores as cached (``ok``) or free their slots.

        ``hashes`` are those ``prepare_store`` returned. A failed store is never
        visible: the slot may hold torn data; it goes to the front of the queue.
        """
        slots = []
        for h in hashes:
            slot = self._in_flight.pop(h, None)
            if slot is None:
                raise KeyError(f"complete_store: block {h!r} has no store in flight")
            if ok:
                self._slot_of[h] = slot
                self._hash_of[slot] = h
            slots.append(slot)
        self._release(slots if ok else sorted(slots))
        assert len(self._queue) + len(self._refs) == self.num_slots

    def prepare_load(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Slots of cached ``hashes``, held so no store can evict or reuse them."""
        slots = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                raise KeyError(f"prepare_load: block {h!r} is not cached (look it up first)")
            self._hold(slot)
            self._pins.setdefault(h, []).append(slot)
            slots.append(slot)
        return slots

    def complete_load(self, hashes: Sequence[BlockHash], ok: bool) -> None:
        """Release ``hashes``' oldest loads; on failure drop them so the engine recomputes.

        A dropped block disappears from lookups at once (and may be stored again);
        its slot joins the queue's front when its last holder lets go.
        """
        slots = []
        for h in hashes:
            held = self._pins.get(h)
            if not held:
                raise KeyError(f"complete_load: block {h!r} has no load in flight")
            slot = held.pop(0)
            if not held:
                del self._pins[h]
            if not ok and self._hash_of.get(slot) == h:
                del self._slot_of[h], self._hash_of[slot]
            slots.append(slot)
        self._release(slots)
        assert len(self._queue) + len(self._refs) == self.num_slots

    def _hold(self, slot: int) -> None:
        n = self._refs.get(slot, 0)
        if n == 0:
            del self._queue[slot]
        self._refs[slot] = n + 1

    def _release(self, slots: Sequence[int]) -> None:
        """vLLM's ``free_blocks``: slots let go by their last holder join the queue, those
        holding no block at the front (reused first), cached ones at the tail, in order."""
        empty, cached = [], []
        for slot in slots:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                del self._refs[slot]
                (cached if slot in self._hash_of else empty).append(slot)
        for slot in reversed(empty):
            self._queue[slot] = None
            self._queue.move_to_end(slot, last=False)
        for slot in cached:
            self._queue[slot] = None

    def restore(self, entries: Sequence[tuple[int, BlockHash]]) -> None:
        """A fresh pool takes the blocks a persistent tier found at start-up, least recently
        stored first: each cached in its slot, queued behind the empty slots in that order
        (the next stores evict the oldest), as if they had just been stored in it."""
        if self._slot_of or self._refs:
            raise RuntimeError("SlotPool.restore: only a fresh pool can be restored")
        for slot, h in entries:
            if not 0 <= slot < self.num_slots or slot in self._hash_of or h in self._slot_of:
                raise ValueError(f"SlotPool.restore: slot {slot} for {h!r} is out of range or given twice")
            self._slot_of[h] = slot
            self._hash_of[slot] = h
            self._queue.move_to_end(slot)

    def check(self) -> bool:
        """Every slot is queued or held, never both; cached blocks sit in one of the two.

        A full scan, for tests; the calls themselves only check the counts (the scan
        made kvsim's replays 25 times slower).
        """
        return (len(self._queue) + len(self._refs) == self.num_slots
                and not self._queue.keys() & self._refs.keys()
                and all(s in self._queue or s in self._refs for s in self._hash_of))
