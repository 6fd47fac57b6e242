"""The offload tier: the scheduler-side ``SlotPool`` plus the timed store and load paths.

The pool holds units (request.py): one slot per unit. One job per request per
direction and step, as vLLM's offloading worker launches them. The worker polls each
direction front-first once per engine step and stops at the first unfinished job (a
high-water mark), so a finished job waits behind an earlier unfinished one before
its blocks become visible or its request resumes.

Paths: ``cpu`` = one batched PCIe copy per job on one copy stream. Disk kinds = IO
threads moving a job in units (``Pipeline``; transfer.py has the times).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvoffload.config import num_slots
from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, slot_bytes_for
from kvsim.events import Event, Kind
from kvsim.hardware import Hardware
from kvsim.io import IoStation, PageCache, WriteBack
from kvsim.profile import IoProfile, bytes_per_ns
from kvsim.request import Units
from kvoffload.slot_pool import SlotPool
from kvsim.tiers import TierSpec
from kvsim.transfer import TransferModel


@dataclass(slots=True)
class Job:
    done_ns: int
    keys: list[int]
    num_blocks: int
    payload: Any = None  # loads: the parked request
    pins: list[Any] = field(default_factory=list)  # stores from the GPU: the GPU copies they read


@dataclass(slots=True)
class LoadPlan:
    """Units a request will load, pinned in the tier until the load ends or is dropped."""

    keys: list[int]
    weights: list[int]  # vLLM blocks per unit
    slots: list[int]
    promote: Any = None  # a two-level tier's disk part (tiering.py)


class OffloadTier:
    def __init__(self, spec: TierSpec, hw: Hardware, profile: IoProfile, block_bytes: int, unit_blocks: int,
                 max_units: Optional[int] = None, host_device: bool = False, null_block: bool = True) -> None:
        """``unit_blocks`` vLLM blocks per pool slot; ``max_units``: distinct units the
        replay can ever offer (a pool with more slots never evicts, so it gets no more:
        memory follows the trace, not the capacity). ``host_device``: a secondary tier
        moving blocks between host memory (the CPU primary) and disk. ``null_block``: the
        pool is a vLLM ``BlockPool`` (vLLM's simple offload connector, and so
        ``KvoffloadConnector``), whose block 0 is its null block and holds nothing."""
        assert spec.kind in ("cpu", "disk", "vllm-disk") and spec.secondary is None
        self.block_bytes = block_bytes
        self.pipe = spec.pipeline
        disk = self.pipe is not None
        # kvoffload's sizing rule: an O_DIRECT slot is the block padded to 4096 bytes.
        slot_bytes = slot_bytes_for(block_bytes, MIN_DIRECT_ALIGNMENT, spec.page_cache) if disk else block_bytes
        if spec.capacity_bytes < slot_bytes * (unit_blocks + null_block):
            raise ValueError(f"tier {spec.text}: smaller than one unit of {unit_blocks} {slot_bytes}-byte slots"
                             + (" and vLLM's null block" if null_block else ""))
        self.capacity_units = (num_slots(spec.capacity_bytes, slot_bytes) - null_block) // unit_blocks
        self.pool = SlotPool(min(self.capacity_units, max_units or self.capacity_units))
        # Tensor parallelism: each of the replica's GPUs moves its share of every block over
        # its own PCIe link, at once (vLLM's CPU tier; a disk tier's ranks would share the
        # host's drives, which kvsim does not model).
        if disk and hw.tp > 1:
            raise ValueError(f"tier {spec.text}: a disk tier under tensor parallelism (tp={hw.tp}) is not modelled")
        self.ranks = hw.tp
        self.xfer = TransferModel(profile, self.pipe, block_bytes // hw.tp, slot_bytes, host_device)
        threads = self.xfer.threads if disk else 1
        self.stations = {False: IoStation(threads), True: IoStation(threads)}  # by is_store
        self._jobs: dict[bool, deque[Job]] = {False: deque(), True: deque()}
        self.page_cache: Optional[PageCache] = None
        self._writeback: Optional[WriteBack] = None
        if spec.page_cache:
            self.page_cache = PageCache(hw.host_free_bytes // (slot_bytes * unit_blocks))
            # The kernel writes back at the drives' best rate, whatever the backend's threads.
            drives = self.xfer.drives * bytes_per_ns(profile.disk_write.max_gib_s)
            self._writeback = WriteBack(min(drives, bytes_per_ns(profile.host_io_gib_s)),
                                        hw.dirty_ratio * hw.host_free_bytes)
        # Pool slots written since the slot file was created: a slot's first write costs
        # more (profile.first_write). One byte per pool slot, and the pool is no larger
        # than the units the replay can offer.
        self._written = bytearray(self.pool.num_slots if disk else 0)
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.disk_bytes_read = 0

    # -- timing ---------------------------------------------------------------

    def _submit(self, station: IoStation, now: int, num_blocks: int, hits: int, is_store: bool) -> int:
        """Queue a job on ``station`` unit by unit; return when its last unit is done.
        ``hits``: a load's blocks in the page cache; a store's first writes into their slots.

        Units go to whichever thread frees first, as kvoffload's lanes hand them out,
        so one job spreads over the threads and a later short job can finish first.
        """
        if self.pipe is None:  # the DRAM tier: one batched copy
            t = round(self.xfer.copy_ns(num_blocks, not is_store))
            return station.submit(now, t) + t
        rows = self.xfer.rows or num_blocks
        full, rest = divmod(num_blocks, rows)
        k = min(station.servers, station.busy_count(now) + full + (rest > 0))
        done = now
        for n, count in ((rows, full), (rest, 1 if rest else 0)):
            if not count:
                continue
            h = hits * n // num_blocks  # spread evenly over the units
            busy, span = self.xfer.store_unit(n, k, h) if is_store else self.xfer.load_unit(n, h, k)
            done = max(done, station.submit(now, busy, count) + span)
        return done

    def submit_job(self, now: int, num_blocks: int, is_store: bool, resident: int = 0, fresh: int = 0) -> int:
        """Queue a store or load of ``num_blocks`` (a load: ``resident`` of them in the page
        cache; a store: ``fresh`` of them first writes into their slots); return when it is
        done. The replay's jobs and calibration's bench jobs both come here."""
        return self._submit(self.stations[is_store], now, num_blocks, fresh if is_store else resident, is_store)

    def transfer_ns(self, now: int, slots: Sequence[int], weights: Sequence[int]) -> int:
        """Duration from now until a load of ``slots`` submitted now would finish."""
        station = self.stations[False].copy()
        return self._submit(station, now, sum(weights), self._resident(slots, weights), False) - now

    def _resident(self, slots: Sequence[int], weights: Sequence[int]) -> int:
        return self.page_cache.resident_blocks(slots, weights) if self.page_cache is not None else 0

    @property
    def num_evictions(self) -> int:
        """Units the tier dropped to make room."""
        return self.pool.num_evictions

    # -- the engine's calls ---------------------------------------------------

    def lookup(self, keys: Sequence[int]) -> int:
        return self.pool.lookup(keys)

    def touch(self, keys: Sequence[int]) -> None:
        """A hit: the units become most recently used."""
        self.pool.touch(keys)

    def prepare_load(self, keys: list[int], weights: list[int]) -> LoadPlan:
        """Pin ``keys`` (a hit ``lookup`` found) for a load; ``load`` or ``cancel_load`` it."""
        return LoadPlan(keys, weights, self.pool.prepare_load(keys))

    def cancel_load(self, plan: LoadPlan) -> None:
        """The engine recomputes instead: unpin."""
        self.pool.complete_load(plan.keys, ok=True)

    def load_eta_ns(self, now: int, plan: LoadPlan) -> tuple[int, ...]:
        """Each hop of the load submitted now, in ns: here one, straight to the GPU."""
        return (self.transfer_ns(now, plan.slots, plan.weights),)

    def load(self, now: int, plan: LoadPlan, req: Any) -> Event:
        """Start the load of ``plan`` for ``req``."""
        return self.load_slots(now, plan.keys, plan.slots, plan.weights, req)

    def load_slots(self, now: int, keys: list[int], slots: list[int], weights: Sequence[int], payload: Any) -> Event:
        """Start loading units ``keys`` (pinned in ``slots``); ``payload`` comes back from ``poll``."""
        n = sum(weights)
        hits = self._resident(slots, weights)
        done = self.submit_job(now, n, False, hits)
        if self.pipe is not None:
            self.disk_bytes_read += (n - hits) * self.block_bytes
        if self.page_cache is not None:
            self.page_cache.touch(slots)
        self._jobs[False].append(Job(done, keys, n, payload))
        self.bytes_loaded += n * self.block_bytes
        return Event(done, Kind.IO_DONE)

    def store(self, now: int, units: Units, start: int, stop: int, copies: Sequence[Any] = ()) -> list[Any]:
        """Offer freshly computed units ``start:stop`` (their GPU ``copies``, in order);
        store those the pool gives slots to, and return their copies: vLLM holds a GPU
        block until its store is done (``poll`` hands the copies back).

        No wake-up event: a store's completion matters only to a later lookup, and
        every lookup happens at a step boundary, which polls first.
        """
        keys = units.keys[start:stop]
        granted = self.pool.prepare_store(keys)
        if not granted:
            return []
        n = len(granted) * units.per_unit
        # The request's last unit may hold fewer full blocks: the job carries its weight.
        last = units.last if stop == len(units.keys) and granted[-1][0] == units.keys[-1] else units.per_unit
        n -= units.per_unit - last
        copy_of = dict(zip(keys, copies))
        pins = [copy_of[k] for k, _ in granted if k in copy_of]
        self.store_slots(now, granted, n, (units.per_unit, last), pins)
        return pins

    def store_slots(self, now: int, granted: list[tuple[int, int]], num_blocks: int, payload: Any = None,
                    pins: Optional[list[Any]] = None) -> None:
        """Store units ``granted`` (``(key, slot)``s from ``pool.prepare_store``) of ``num_blocks``."""
        fresh = 0
        if self.pipe is not None:
            written = self._written
            for _, s in granted:
                if not written[s]:
                    written[s] = 1
                    fresh += 1
            fresh = num_blocks * fresh // len(granted)  # first writes spread evenly over the job's blocks
        done = self.submit_job(now, num_blocks, True, fresh=fresh)
        if self.page_cache is not None:
            self.page_cache.touch([s for _, s in granted])
            # Buffered writes return once copied unless the dirty backlog is over the limit.
            done = max(done, self._writeback.dirty(now, num_blocks * self.block_bytes))
        self._jobs[True].append(Job(done, [h for h, _ in granted], num_blocks, payload, pins or []))
        self.bytes_stored += num_blocks * self.block_bytes

    def poll(self, now: int, out: list[Event], released: list[Any]) -> list[Any]:
        """Complete finished jobs; return the resumed requests. ``out`` takes the events of
        transfers a poll starts (a two-level tier's second hop; none here), ``released``
        the GPU copies of the finished stores."""
        for job in self.poll_stores(now):
            released += job.pins
        return [job.payload for job in self.poll_loads(now)]

    def poll_stores(self, now: int, in_order: bool = True) -> list[Job]:
        """Finished store jobs, published in the pool (``in_order``: front-first, as the
        worker polls; else every finished one, as a secondary tier reports them)."""
        return self._finished(self._jobs[True], now, in_order, self.pool.complete_store)

    def poll_loads(self, now: int, in_order: bool = True) -> list[Job]:
        """Finished load jobs, unpinned in the pool."""
        return self._finished(self._jobs[False], now, in_order, self.pool.complete_load)

    @staticmethod
    def _finished(jobs: deque[Job], now: int, in_order: bool,
                  complete: Callable[[list[int], bool], None]) -> list[Job]:
        done = []
        while jobs and jobs[0].done_ns <= now:
            done.append(jobs.popleft())
        if not in_order and jobs:
            late = [j for j in jobs if j.done_ns <= now]
            if late:
                done += late
                jobs_left = [j for j in jobs if j.done_ns > now]
                jobs.clear()
                jobs.extend(jobs_left)
        for job in done:
            complete(job.keys, ok=True)
        return done

    def disk_bytes_written(self) -> int:
        if self.pipe is None:
            return 0
        return self._writeback.bytes_written if self._writeback is not None else self.bytes_stored

    def first_store_done(self) -> Optional[int]:
        """When the first store still queued is done: the next poll that releases GPU blocks."""
        jobs = self._jobs[True]
        return jobs[0].done_ns if jobs else None

    def pending_stores(self, now: int) -> tuple[int, int, int]:
        """Store jobs not done at ``now``: (jobs, bytes, ns until the last is done)."""
        late = [j for j in self._jobs[True] if j.done_ns > now]
        return len(late), sum(j.num_blocks for j in late) * self.block_bytes, max(
            (j.done_ns - now for j in late), default=0)
