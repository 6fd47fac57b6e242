"""Hypothesis stateful test of the secondary tier (``SlotTier``) against a model, through the OS seam.

A program rewrites primary rows, stores and loads keys, polls, looks up, touches, drains,
arms and heals data faults (EIO, short, lie, bit flip on pwritev/preadv) and closes and
reopens the tier. The model keeps, per cached key, the bytes its row held when its store
was submitted, the slot it went to and where the fault log stood then. It checks:

- every job is reported exactly once, with ``success`` and ``transfer_bytes`` matching
  the keys that made it; after ``drain`` + ``poll`` nothing is pending;
- a loaded key's row holds exactly the model's bytes; a failed one's row holds zeros or
  its old bytes; a key that was not a hit leaves its row alone; no other row changes;
- a key fails only if a fault fired on its own slot's bytes since its store was submitted
  (or the tier was closed under the job): with faults off, nothing fails;
- the pool caches exactly the keys whose stores succeeded, minus evictions (only by a
  store, at most one per slot it placed, never a key a load holds) and failed loads;
  ``lookup`` agrees; capacity is never exceeded;
- after close no IO thread and no fd is left.

Each program starts with a data fault armed, keys stored and loaded back, with the tier's
``direct_io`` on (reads straight into the rows) or off (staging), drawn.
Default: 300 programs of up to 30 steps (derandomized under ``CI``, like the ci profile);
``HYPOTHESIS_PROFILE=soak`` runs the soak profile.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from faults import Fault, FaultyOsCalls, FdWatch, wait_threads_gone
from kvoffload.vllm_tier import FinishedJob, SlotTier
from tests.test_vllm_tier import ROW, Primary, tier_config
from tests.test_vllm_tier_faults import FAULTS as SWEEP_FAULTS

pytestmark = pytest.mark.faults

CHUNKS = 12  # primary rows
KEYS = [f"k{i}" for i in range(8)]  # more keys than slots: stores evict
ROW_ORDER = st.permutations(range(CHUNKS))
FAULTS = [
    *SWEEP_FAULTS,
    ("pwritev", Fault.error(errno.EIO, after=True)),  # the bytes went out, the call failed anyway
    ("preadv", Fault.error(errno.EIO, after=True)),
    ("preadv", Fault.bitflip(ROW + 5, 0)),  # the second slot of a multi-slot read
    ("pwritev", Fault.delay(0.003)),  # keeps jobs in flight across steps; damages nothing
    ("preadv", Fault.delay(0.003)),
]


@dataclass(frozen=True)
class Copy:
    """One successful store of a key: what a load of it must return."""

    data: np.ndarray
    slot: int
    log_pos: int  # the fault log's length when the store was submitted


@dataclass
class StoreJob:
    placed: list[tuple[str, int]]  # (key, slot) the tier stores; other keys it skips
    data: dict[str, np.ndarray]
    rows: set[int]
    log_pos: int
    closed: bool = False  # the tier was closed while the job was in flight


@dataclass
class LoadJob:
    hits: list[tuple[str, int, Copy]]  # (key, row, the copy it must load)
    missing: list[tuple[str, int]]  # (key, row) not cached at submit
    before: dict[int, np.ndarray]  # each target row's bytes at submit
    rows: set[int]
    closed: bool = False

    @property
    def pinned(self) -> set[int]:
        return {c.slot for _, _, c in self.hits}


@dataclass
class _Tier:
    tier: SlotTier
    fd: int
    slot_bytes: int
    cached: dict[str, Copy] = field(default_factory=dict)


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-tier-"))
        self.dir.chmod(0o700)
        self.fds = FdWatch()
        self.osc = FaultyOsCalls()
        self.primary: Optional[Primary] = None
        self.t: Optional[_Tier] = None
        self.jobs: dict[int, StoreJob | LoadJob] = {}  # submitted, not yet reported
        self.reported: set[int] = set()
        self.next_id = 0

    # -- lifecycle ----------------------------------------------------------------

    @initialize(slots=st.integers(3, 5), io_threads=st.integers(1, 2), encrypt=st.booleans(),
                unit_rows=st.sampled_from([1, 2, 512]), seed=st.integers(0, 2**16),
                first=st.tuples(st.sampled_from(FAULTS), st.integers(1, 3), st.booleans()),
                direct_io=st.booleans())
    def start(self, slots, io_threads, encrypt, unit_rows, seed, first, direct_io):
        self.primary = Primary(CHUNKS, ROW, seed)
        self.shadow = self.primary.rows.copy()  # what every row not being loaded into holds
        self.cfg = tier_config(self.dir, slots=slots, io_threads=io_threads, encrypt=encrypt,
                               io_unit_bytes=unit_rows * ROW, direct_io=direct_io)
        self._open()
        # Every program starts with a fault armed, keys stored and loaded back, so even a
        # short program moves data through faults.
        self.arm_fault(*first)
        self._store(KEYS[:slots], list(range(slots)))
        self.drain()
        self._load(KEYS[:slots], list(range(slots, 2 * slots)))
        self.drain()

    def _open(self) -> None:
        tier = SlotTier(self.primary.view, self.cfg, os_calls=self.osc)
        (f,) = tier.backend.files
        self.t = _Tier(tier, f.fd, f.slot_bytes)
        assert tier.num_slots == self.cfg.disk_capacity_bytes // f.slot_bytes

    def _close(self) -> None:
        for job in self.jobs.values():
            job.closed = True
        self.t.tier.close()
        # Every job ended at close: one poll reports all of them.
        self._settle(self.t.tier.poll())
        assert not self.jobs and not self.t.tier.pending
        wait_threads_gone()
        self.fds.check(near=self.dir)

    def teardown(self):
        try:
            if self.t is not None:
                self.osc.clear()
                self._close()
                self.primary.close()  # nothing of the tier still holds the primary
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules ----------------------------------------------------------------------

    def _free_rows(self, order: list[int]) -> list[int]:
        """The rows no job uses, in ``order``."""
        busy = set().union(*(j.rows for j in self.jobs.values()))
        return [r for r in order if r not in busy]

    def _job(self, picks: list[int], order: list[int]) -> tuple[list[str], list[int]]:
        """Keys and free rows for a job. What is free, and cached, depends on when the IO
        threads finished, so the draws never depend on them (Hypothesis must be able to
        replay the same choices): ``picks`` name keys (from 8 on: cached keys, so loads
        do IO), ``order`` ranks the rows."""
        cached = sorted(self.t.cached) or KEYS
        keys = list(dict.fromkeys(KEYS[p] if p < len(KEYS) else cached[p % len(cached)] for p in picks))
        rows = self._free_rows(order)[: len(keys)]
        return keys[: len(rows)], rows

    @rule(order=ROW_ORDER, seed=st.integers(0, 2**16))
    def write_row(self, order, seed):
        """vLLM reuses a primary row for other KV (never one a job is using)."""
        for r in self._free_rows(order)[:1]:
            self.primary.rows[r] = np.random.default_rng(seed).integers(-128, 128, ROW, dtype=np.int8)
            self.shadow[r] = self.primary.rows[r]

    @rule(picks=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=4), order=ROW_ORDER)
    def store(self, picks, order):
        keys, rows = self._job(picks, order)
        if keys:
            self._store(keys, rows)

    def _store(self, keys: list[str], rows: list[int]) -> None:
        pool, cached = self.t.tier.pool, self.t.cached
        in_flight = {k for j in self.jobs.values() if isinstance(j, StoreJob) for k, _ in j.placed}
        queue = pool.free_queue()
        assert len(queue) == self.room()
        # What the tier stores: keys neither cached nor in flight, as many as the free
        # queue holds, into its head's slots (SlotPool.prepare_store).
        new = [k for k in keys if k not in cached and k not in in_flight][: len(queue)]
        row_of = dict(zip(keys, rows))
        job = StoreJob(list(zip(new, queue)), {k: self.primary.rows[row_of[k]].copy() for k in new},
                       set(rows), len(self.osc.log))
        self._submit(job, self.t.tier.submit_store, keys, rows)
        evicted = set(cached) - set(pool.cached_slots())
        held = set().union(*(j.pinned for j in self.jobs.values() if isinstance(j, LoadJob)))
        assert all(cached[k].slot in queue[: len(new)] and cached[k].slot not in held for k in evicted), evicted
        for k in evicted:
            del cached[k]
        event(f"store: {len(new)} placed, {len(evicted)} evicted")

    @rule(picks=st.lists(st.integers(0, 3 * len(KEYS) - 1), min_size=1, max_size=4), order=ROW_ORDER)
    def load(self, picks, order):
        keys, rows = self._job(picks, order)
        if keys:
            self._load(keys, rows)

    def _load(self, keys: list[str], rows: list[int]) -> None:
        cached = self.t.cached
        job = LoadJob([(k, r, cached[k]) for k, r in zip(keys, rows) if k in cached],
                      [(k, r) for k, r in zip(keys, rows) if k not in cached],
                      {r: self.primary.rows[r].copy() for r in rows}, set(rows))
        self._submit(job, self.t.tier.submit_load, keys, rows)

    def _submit(self, job, submit, keys, rows) -> None:
        job_id, self.next_id = self.next_id, self.next_id + 1
        self.jobs[job_id] = job
        submit(job_id, keys, np.array(rows))

    @rule()
    def poll(self):
        self._settle(self.t.tier.poll())

    @rule()
    def drain(self):
        assert self.t.tier.drain(timeout=30)
        self._settle(self.t.tier.poll())
        assert not self.jobs and not self.t.tier.pending

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        assert self.t.tier.lookup(key) == (key in self.t.cached)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def touch(self, keys):
        self.t.tier.touch(keys)

    @rule(which=st.sampled_from(FAULTS), nth=st.integers(1, 3), persistent=st.booleans())
    def arm_fault(self, which, nth, persistent):
        call, fault = which
        (self.osc.fail_from if persistent else self.osc.fail_nth)(call, self.osc.calls[call] + nth, fault)

    @rule()
    def heal(self):
        self.osc.clear()

    @rule()
    def close_and_reopen(self):
        self._close()
        self._open()

    # -- checking what the tier reported ------------------------------------------------

    def room(self) -> int:
        """Slots no job holds: the most a store may place."""
        held = set()
        for j in self.jobs.values():
            held |= {s for _, s in j.placed} if isinstance(j, StoreJob) else j.pinned
        return self.t.tier.num_slots - len(held)

    def _faulted(self, slot: int, since: int) -> bool:
        """Whether a fault that can damage data fired on ``slot``'s bytes since log position ``since``."""
        start = slot * self.t.slot_bytes
        fired, _ = self.osc.log_since(since)
        return any(f.fault.kind != "delay" and f.covers(self.t.fd, start, start + self.t.slot_bytes)
                   for f in fired)

    def _settle(self, finished: list[FinishedJob]) -> None:
        pool_after = self.t.tier.pool.cached_slots()
        for f in finished:
            assert f.job_id not in self.reported, f"job {f.job_id} reported twice"
            assert f.job_id in self.jobs, f"job {f.job_id} was never submitted"
            self.reported.add(f.job_id)
            job = self.jobs.pop(f.job_id)
            if isinstance(job, StoreJob):
                self._settle_store(f, job, pool_after)
            else:
                self._settle_load(f, job)
        want = {k: c.slot for k, c in self.t.cached.items()}
        assert pool_after == want, f"the pool caches {pool_after}, the model {want}"

    def _settle_store(self, f: FinishedJob, job: StoreJob, pool_after: dict[str, int]) -> None:
        good = [k for k, s in job.placed if pool_after.get(k) == s]
        assert f.successful_keys is None
        assert (f.success, f.transfer_bytes) == (len(good) == len(job.placed), len(good) * ROW), f
        for k, s in job.placed:
            if k in good:
                self.t.cached[k] = Copy(job.data[k], s, job.log_pos)
            else:
                assert job.closed or self._faulted(s, job.log_pos), f"store of {k} to slot {s} failed, no fault"
                event(f"store of a key failed ({'closed' if job.closed else 'fault'})")

    def _settle_load(self, f: FinishedJob, job: LoadJob) -> None:
        rows = self.primary.rows
        good = {k for k, _, _ in job.hits} if f.success else set(f.successful_keys or ())
        assert good <= {k for k, _, _ in job.hits}, f
        assert f.success == (not job.missing and len(good) == len(job.hits)), f
        assert f.successful_keys is None or not f.success and f.successful_keys, f  # None: all share success
        assert f.transfer_bytes == len(good) * ROW, f
        for k, r in job.missing:
            assert np.array_equal(rows[r], job.before[r]), f"{k} was not a hit, yet row {r} changed"
        for k, r, copy in job.hits:
            if k in good:
                assert np.array_equal(rows[r], copy.data), f"row {r}: {k} loaded wrong bytes"
            else:
                allowed = [job.before[r], np.zeros(ROW, np.int8)] + ([copy.data] if job.closed else [])
                assert any(np.array_equal(rows[r], a) for a in allowed), f"row {r}: failed {k} left other bytes"
                assert job.closed or self._faulted(copy.slot, copy.log_pos), f"load of {k} failed, no fault"
                event(f"load of a key failed ({'closed' if job.closed else 'fault'})")
                if self.t.cached.get(k) is copy:  # not stored again since: dropped, recomputed next time
                    del self.t.cached[k]
        for r in job.rows:
            self.shadow[r] = rows[r]

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def capacity_and_rows(self):
        if self.t is None:
            return
        pool = self.t.tier.pool
        assert pool.check() and set(pool.cached_slots()) == set(self.t.cached)
        assert pool.num_cached() + pool.num_in_flight() <= pool.num_slots
        assert os.fstat(self.t.fd).st_size <= self.cfg.disk_capacity_bytes
        assert 0 <= self.room() == len(pool.free_queue())
        loading = set().union(*(j.rows for j in self.jobs.values() if isinstance(j, LoadJob)))
        for r in range(CHUNKS):
            if r not in loading:
                assert np.array_equal(self.primary.rows[r], self.shadow[r]), f"row {r} changed under no load"


_profile = getattr(settings, "_current_profile", None)
if _profile == "soak":
    TierMachine.TestCase.settings = settings(settings.get_profile("soak"))
else:
    # The ci profile's 2,000 programs would take minutes here: every program makes a tier.
    TierMachine.TestCase.settings = settings(
        max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    )
TestTierMachine = TierMachine.TestCase
