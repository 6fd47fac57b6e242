"""SlotPool against a plain-dict model (hypothesis stateful) plus LRU-order unit tests."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsim.slot_pool import SlotPool

HASHES = st.lists(st.integers(0, 11), min_size=1, max_size=6)


class SlotPoolMachine(RuleBasedStateMachine):
    """The model: block -> slot per state, pin counts, and the set of blocks whose
    store failed (and have not been stored OK since). Eviction order is not modelled
    here (the unit tests pin it); the model checks who may be evicted and how many."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(5)
        self.cached: dict[int, int] = {}
        self.in_flight: dict[int, int] = {}
        self.dropping: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.failed_stores: set[int] = set()
        self.loads: list[list[int]] = []  # outstanding prepare_load calls
        self.stores: list[list[int]] = []  # outstanding prepare_store results

    def _used_slots(self) -> dict[int, int]:
        return {**self.cached, **self.in_flight, **self.dropping}

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
        new = list(dict.fromkeys(h for h in hashes if h not in self._used_slots()))
        evictable = {h for h in self.cached if h not in self.pins and h not in hashes}
        free = self.pool.num_slots - len(self._used_slots())
        got = self.pool.prepare_store(hashes)
        assert [h for h, _ in got] == new[: len(got)]
        assert len(got) == min(len(new), free + len(evictable))
        # Who vanished was evicted: only unpinned blocks outside this request.
        evicted = {h for h in self.cached if self.pool.lookup([h]) == 0}
        assert evicted <= evictable
        assert len(evicted) == self.pool.num_evictions - before_evictions == max(0, len(got) - free)
        pinned_slots = {self.cached[h] for h in self.pins if h in self.cached} | set(self.dropping.values())
        for h in evicted:
            del self.cached[h]
        used = set(self._used_slots().values())
        for h, slot in got:
            assert slot not in used and slot not in pinned_slots
            assert 0 <= slot < self.pool.num_slots
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
        for h in hashes:
            self.pins[h] = self.pins.get(h, 0) + 1
        self.loads.append(hashes)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_load(self, i: int, ok: bool) -> None:
        batch = self.loads.pop(i % len(self.loads))
        self.pool.complete_load(batch, ok)
        for h in batch:
            if not ok and h in self.cached:
                self.dropping[h] = self.cached.pop(h)
            self.pins[h] -= 1
            if self.pins[h] == 0:
                del self.pins[h]
                self.dropping.pop(h, None)

    @invariant()
    def capacity_never_exceeded(self) -> None:
        used = self._used_slots()
        assert len(set(used.values())) == len(used) <= self.pool.num_slots
        assert self.pool.num_free() == self.pool.num_slots - len(used)
        assert self.pool.num_cached() == len(self.cached)
        assert self.pool.num_in_flight() == len(self.in_flight)

    @invariant()
    def pinned_blocks_keep_their_slots(self) -> None:
        for h in self.pins:
            assert h in self.cached or h in self.dropping

    @invariant()
    def no_hit_on_failed_or_dropped(self) -> None:
        for h in self.failed_stores | set(self.in_flight) | set(self.dropping):
            if h not in self.cached:
                assert self.pool.lookup([h]) == 0


SlotPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlotPool = SlotPoolMachine.TestCase


def _fill(pool: SlotPool, hashes: list) -> None:
    got = pool.prepare_store(hashes)
    pool.complete_store([h for h, _ in got], True)


def test_tail_evicted_before_head() -> None:
    pool = SlotPool(4)
    _fill(pool, ["a0", "a1", "a2", "a3"])
    got = pool.prepare_store(["b0"])
    assert pool.lookup(["a0", "a1", "a2", "a3"]) == 3  # a3, the tail, went first
    assert got and got[0][0] == "b0"


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


def test_store_never_evicts_own_head() -> None:
    pool = SlotPool(2)
    _fill(pool, ["a0", "a1"])
    assert pool.prepare_store(["a0", "a1", "a2"]) == []


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
    assert pool.num_free() == 1  # the other load still reads the slot
    assert pool.prepare_store(["a0"]) == []  # not re-stored while the old slot is pinned
    pool.complete_load(["a0"], ok=True)
    assert pool.num_free() == 2


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
