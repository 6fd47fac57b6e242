"""SlotPool against a plain-dict model (hypothesis stateful) plus LRU-order unit tests."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.slot_pool import SlotPool

HASHES = st.lists(st.integers(0, 11), min_size=1, max_size=6)


class SlotPoolMachine(RuleBasedStateMachine):
    """The model: block -> slot while cached or in flight, which slots loads and stores
    hold, and the blocks whose store failed (and were not stored OK since). Queue
    order is not modelled here (the unit tests and tests/test_vllm_slot_pool.py pin
    it); the model checks how many blocks a store gets, who may be evicted and how
    many, and that a held slot is never handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(5)
        self.cached: dict[int, int] = {}
        self.in_flight: dict[int, int] = {}
        self.pins: dict[int, list[int]] = {}  # hash -> slots its loads hold, oldest first
        self.failed_stores: set[int] = set()
        self.loads: list[list[int]] = []  # outstanding prepare_load calls
        self.stores: list[list[int]] = []  # outstanding prepare_store results

    def _held(self) -> set[int]:
        return set(self.in_flight.values()) | {s for slots in self.pins.values() for s in slots}

    @rule(hashes=HASHES)
    def lookup_and_touch(self, hashes: list[int]) -> None:
        n = self.pool.lookup(hashes)
        expect = 0
        while expect < len(hashes) and hashes[expect] in self.cached:
            expect += 1
        assert n == expect
        self.pool.touch(hashes[:n])

    @rule(hashes=HASHES)
    def store(self, hashes: list[int]) -> None:
        before_evictions = self.pool.num_evictions
        held = self._held()
        new = [h for h in dict.fromkeys(hashes) if h not in self.cached and h not in self.in_flight]
        room = self.pool.num_slots - len(held)  # every slot nobody holds, cached or not
        evictable = {h for h, s in self.cached.items() if s not in held}  # the request's own too
        empty = room - len(evictable)
        got = self.pool.prepare_store(hashes)
        assert [h for h, _ in got] == new[: min(len(new), room)]
        # Who vanished was evicted: only cached blocks nobody holds, and only once
        # no empty slot was left.
        evicted = {h for h in self.cached if self.pool.lookup([h]) == 0}
        assert evicted <= evictable
        assert len(evicted) == self.pool.num_evictions - before_evictions == max(0, len(got) - empty)
        for h in evicted:
            del self.cached[h]
        used = set(self.cached.values()) | held
        for h, slot in got:
            assert 0 <= slot < self.pool.num_slots and slot not in used
            self.in_flight[h] = slot
            used.add(slot)
        if got:
            self.stores.append([h for h, _ in got])

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_store(self, i: int, ok: bool) -> None:
        batch = self.stores.pop(i % len(self.stores))
        self.pool.complete_store(batch, ok)
        for h in batch:
            slot = self.in_flight.pop(h)
            if ok:
                self.cached[h] = slot
                self.failed_stores.discard(h)
            else:
                self.failed_stores.add(h)

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        hashes = data.draw(st.lists(st.sampled_from(sorted(self.cached)), min_size=1, max_size=4))
        slots = self.pool.prepare_load(hashes)
        assert slots == [self.cached[h] for h in hashes]
        for h, slot in zip(hashes, slots):
            self.pins.setdefault(h, []).append(slot)
        self.loads.append(hashes)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_load(self, i: int, ok: bool) -> None:
        batch = self.loads.pop(i % len(self.loads))
        self.pool.complete_load(batch, ok)
        for h in batch:
            slot = self.pins[h].pop(0)  # each hash's oldest load ends first
            if not self.pins[h]:
                del self.pins[h]
            if not ok and self.cached.get(h) == slot:
                del self.cached[h]  # dropped: no hit, may be stored again

    @invariant()
    def capacity_never_exceeded(self) -> None:
        held = self._held()
        cached_free = {s for s in self.cached.values() if s not in held}
        assert len(set(self.cached.values()) | set(self.in_flight.values())) == len(self.cached) + len(self.in_flight)
        assert self.pool.num_free() == self.pool.num_slots - len(held) - len(cached_free)
        assert self.pool.num_cached() == len(self.cached)
        assert self.pool.num_in_flight() == len(self.in_flight)
        assert self.pool.num_pinned() == len(self.pins)
        assert self.pool.check()

    @invariant()
    def no_hit_on_failed_or_dropped(self) -> None:
        for h in self.failed_stores | set(self.in_flight) | set(self.pins):
            if h not in self.cached:
                assert self.pool.lookup([h]) == 0


SlotPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlotPool = SlotPoolMachine.TestCase


def _fill(pool: SlotPool, hashes: list) -> None:
    got = pool.prepare_store(hashes)
    pool.complete_store([h for h, _ in got], True)


def test_head_evicted_before_tail() -> None:
    # vLLM releases a request's blocks head first, so the head is the oldest.
    pool = SlotPool(4)
    _fill(pool, ["a0", "a1", "a2", "a3"])
    got = pool.prepare_store(["b0"])
    assert pool.lookup(["a0", "a1", "a2", "a3"]) == 0
    assert pool.lookup(["a1", "a2", "a3"]) == 3
    assert got == [("b0", 0)]


def test_touch_protects_a_hit_prefix() -> None:
    pool = SlotPool(4)
    _fill(pool, ["a0", "a1"])
    _fill(pool, ["b0", "b1"])
    pool.touch(["a0", "a1"])  # a is now newer than b
    pool.prepare_store(["c0", "c1"])
    assert pool.lookup(["a0", "a1"]) == 2
    assert pool.lookup(["b0"]) == 0
    assert pool.num_evictions == 2


def test_pinned_block_is_never_evicted_and_store_comes_up_short() -> None:
    pool = SlotPool(2)
    _fill(pool, ["a0", "a1"])
    assert pool.prepare_load(["a0", "a1"]) == [0, 1]
    assert pool.prepare_store(["b0"]) == []
    pool.complete_load(["a0", "a1"], ok=True)
    assert [h for h, _ in pool.prepare_store(["b0"])] == ["b0"]


def test_store_may_evict_its_own_head() -> None:
    # As in vLLM: the queue holds 2 slots, so the new block gets one, at the head.
    pool = SlotPool(2)
    _fill(pool, ["a0", "a1"])
    assert pool.prepare_store(["a0", "a1", "a2"]) == [("a2", 0)]
    assert pool.lookup(["a0", "a1"]) == 0 and pool.lookup(["a1"]) == 1


def test_empty_slots_are_reused_before_any_eviction() -> None:
    pool = SlotPool(3)
    _fill(pool, ["a0", "a1"])
    got = pool.prepare_store(["b0"])
    pool.complete_store(["b0"], ok=False)  # slot 2 back, empty, at the front
    assert pool.prepare_store(["c0"]) == [("c0", got[0][1])]
    assert pool.num_evictions == 0


def test_failed_store_is_never_a_hit_and_frees_its_slot() -> None:
    pool = SlotPool(2)
    got = pool.prepare_store(["a0", "a1"])
    assert pool.lookup(["a0"]) == 0  # in flight: invisible
    pool.complete_store([h for h, _ in got], ok=False)
    assert pool.lookup(["a0", "a1"]) == 0
    assert pool.num_free() == 2


def test_failed_load_drops_block_after_last_pin() -> None:
    pool = SlotPool(2)
    _fill(pool, ["a0"])
    pool.prepare_load(["a0"])
    pool.prepare_load(["a0"])
    pool.complete_load(["a0"], ok=False)
    assert pool.lookup(["a0"]) == 0
    assert pool.num_free() == 1  # the other load still reads slot 0
    assert pool.prepare_store(["a0"]) == [("a0", 1)]  # stored again, elsewhere
    pool.complete_load(["a0"], ok=True)
    assert pool.num_free() == 1  # slot 0 is back, empty; slot 1 is in flight


def test_misuse_raises() -> None:
    pool = SlotPool(1)
    with pytest.raises(KeyError, match="not cached"):
        pool.prepare_load(["x"])
    with pytest.raises(KeyError, match="no store in flight"):
        pool.complete_store(["x"], True)
    with pytest.raises(KeyError, match="no load in flight"):
        pool.complete_load(["x"], True)
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(0)
