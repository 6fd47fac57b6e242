"""Two levels, as vLLM 0.33's ``OffloadingConnector`` with ``TieringOffloadingSpec`` runs them.

``cpu:SIZE+disk:SIZE``: a CPU primary (DRAM, its own LRU) and kvoffload's slot files
as the secondary tier (``kvoffload.vllm_tier``), each level a ``SlotPool`` and the
existing timed paths (offload.py). What vLLM's code does (``tiering/manager.py``):

- Stores go GPU -> CPU primary (the ``cpu`` tier's batched PCIe copy). When the
  worker reports one done (seen at a step boundary), ``complete_store`` cascades its
  chunks to every secondary tier at once: write-through at store completion, not on
  eviction. The chunks stay pinned in the CPU (``prepare_read``) until the disk's
  store ends; the disk skips chunks it already holds (``SlotTier.submit_store``).
- A lookup hits a chunk in the CPU primary; a chunk only on disk is promoted: a CPU
  slot is taken at once (evicting the CPU's LRU; no room ends the hit there), the
  request waits (``HIT_PENDING``), the disk -> CPU job runs on the disk tier's IO
  threads (host memcpys, no PCIe), is seen done at a step boundary, and there the
  request's lookup hits and its CPU -> GPU load starts: two hops, each seen at a
  step boundary.
- Secondary jobs are reported whenever they finish (``SlotTier.poll``); the GPU
  worker's front-first, as for the ``cpu`` tier.

Simplified: a request waiting for a promotion holds its CPU hits from its first
lookup (vLLM looks them up again each step and could lose one to an eviction
meanwhile); a chunk whose write into the CPU is in flight for another request ends
this request's hit (vLLM would wait for that write); a promotion that the ``faster``
policy drops (vLLM has no such policy) has still evicted what its CPU slots held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvsim.events import Event
from kvsim.hardware import Hardware
from kvsim.io import IoStation
from kvsim.offload import Job, LoadPlan, OffloadTier
from kvsim.profile import IoProfile
from kvsim.request import Units
from kvsim.tiers import Pipeline, TierSpec
from kvsim.transfer import TransferModel


@dataclass(slots=True)
class Promotion:
    """A load's units that are only on disk: each has a CPU slot waiting for it."""

    keys: list[int]
    slots: list[int]  # their disk slots, pinned
    weights: list[int]
    req: Any = None
    plan: Optional[LoadPlan] = None  # the whole load, CPU -> GPU once promoted


class TwoLevelTier:
    def __init__(self, spec: TierSpec, hw: Hardware, profile: IoProfile, block_bytes: int, unit_blocks: int,
                 max_units: Optional[int] = None) -> None:
        assert spec.kind == "cpu" and spec.secondary is not None
        primary = dataclasses.replace(spec, secondary=None, text=spec.text.split("+")[0])
        # vLLM's OffloadingConnector pools (its CPU manager, kvoffload's SlotTier) have no null block.
        self.cpu = OffloadTier(primary, hw, profile, block_bytes, unit_blocks, max_units, null_block=False)
        self.disk = OffloadTier(spec.secondary, hw, profile, block_bytes, unit_blocks, max_units, host_device=True,
                                null_block=False)

    # -- what the summary reads: PCIe between GPU and CPU, IO on the disk level --------

    @property
    def bytes_stored(self) -> int:
        return self.cpu.bytes_stored

    @property
    def bytes_loaded(self) -> int:
        return self.cpu.bytes_loaded

    @property
    def bytes_promoted(self) -> int:
        return self.disk.bytes_loaded

    @property
    def num_evictions(self) -> int:
        """Units dropped from the disk level: gone from the tier."""
        return self.disk.num_evictions

    @property
    def capacity_units(self) -> int:
        """What the tier holds: its disk level, which every CPU chunk is written through to."""
        return self.disk.capacity_units

    @property
    def ranks(self) -> int:
        return self.cpu.ranks

    @property
    def pipe(self) -> Optional[Pipeline]:
        return self.disk.pipe

    @property
    def xfer(self) -> TransferModel:
        return self.disk.xfer

    @property
    def stations(self) -> dict[bool, IoStation]:
        return self.disk.stations

    @property
    def disk_bytes_read(self) -> int:
        return self.disk.disk_bytes_read

    def disk_bytes_written(self) -> int:
        return self.disk.disk_bytes_written()

    def first_store_done(self) -> Optional[int]:
        """When the first GPU -> CPU store still queued is done (it holds GPU blocks)."""
        return self.cpu.first_store_done()

    def pending_stores(self, now: int) -> tuple[int, int, int]:
        """Stores into either level not done at ``now``: (jobs, bytes, ns until the last is done)."""
        (j1, b1, t1), (j2, b2, t2) = self.cpu.pending_stores(now), self.disk.pending_stores(now)
        return j1 + j2, b1 + b2, max(t1, t2)

    # -- the engine's calls ---------------------------------------------------------

    def lookup(self, keys: list[int]) -> int:
        """Leading units in the CPU or on disk (vLLM: HIT or, promoted, HIT_PENDING)."""
        cpu, disk = self.cpu.pool, self.disk.pool
        n = 0
        for k in keys:
            if not (cpu.lookup((k,)) or disk.lookup((k,))):
                break
            n += 1
        return n

    def touch(self, keys: list[int]) -> None:
        """vLLM touches the hit in every tier."""
        self.cpu.touch(keys)
        self.disk.touch(keys)

    def prepare_load(self, keys: list[int], weights: list[int]) -> LoadPlan:
        """Pin the CPU hits, take a CPU slot for each unit only on disk; the hit ends at
        the first unit the CPU has no room for."""
        cpu = self.cpu.pool
        in_cpu = [cpu.lookup((k,)) == 1 for k in keys]
        hits = [k for k, h in zip(keys, in_cpu) if h]
        cpu.prepare_load(hits)  # first, so the promotions cannot evict them
        granted = dict(cpu.prepare_store([k for k, h in zip(keys, in_cpu) if not h]))
        cut = next((i for i, (k, h) in enumerate(zip(keys, in_cpu)) if not h and k not in granted), len(keys))
        cpu.complete_load([k for k, h in zip(keys[cut:], in_cpu[cut:]) if h], ok=True)
        cpu.complete_store([k for k in keys[cut:] if k in granted], ok=False)
        keys, weights, in_cpu = keys[:cut], weights[:cut], in_cpu[:cut]
        plan = LoadPlan(keys, weights, [])  # no CPU slot times anything: the CPU has no page cache
        promote = [i for i, h in enumerate(in_cpu) if not h]
        if promote:
            pk = [keys[i] for i in promote]
            plan.promote = Promotion(pk, self.disk.pool.prepare_load(pk), [weights[i] for i in promote])
        return plan

    def cancel_load(self, plan: LoadPlan) -> None:
        p = plan.promote
        promoted = set(p.keys) if p is not None else set()
        self.cpu.pool.complete_load([k for k in plan.keys if k not in promoted], ok=True)
        if p is not None:
            self.cpu.pool.complete_store(p.keys, ok=False)
            self.disk.pool.complete_load(p.keys, ok=True)

    def load_eta_ns(self, now: int, plan: LoadPlan) -> tuple[int, ...]:
        """Disk -> CPU for the units only on disk (if any), then CPU -> GPU for all."""
        to_gpu = self.cpu.transfer_ns(now, plan.slots, plan.weights)
        p = plan.promote
        return (to_gpu,) if p is None else (self.disk.transfer_ns(now, p.slots, p.weights), to_gpu)

    def load(self, now: int, plan: LoadPlan, req: Any) -> Event:
        p = plan.promote
        if p is None:
            return self.cpu.load(now, plan, req)
        p.req, p.plan = req, plan
        return self.disk.load_slots(now, p.keys, p.slots, p.weights, p)

    def store(self, now: int, units: Units, start: int, stop: int, copies: Sequence[Any] = ()) -> list[Any]:
        """GPU -> CPU primary; the disk gets them once the CPU has them (``poll``)."""
        return self.cpu.store(now, units, start, stop, copies)

    def poll(self, now: int, out: list[Event], released: list[Any]) -> list[Any]:
        for job in self.cpu.poll_stores(now):
            released += job.pins
            self._cascade(now, job)
        for job in self.disk.poll_stores(now, in_order=False):
            self.cpu.pool.complete_load(job.payload, ok=True)  # the CPU copies read for it
        for job in self.disk.poll_loads(now, in_order=False):
            p: Promotion = job.payload
            self.cpu.pool.complete_store(p.keys, ok=True)
            self.cpu.pool.prepare_load(p.keys)  # the request's lookup hits them now: pinned for the GPU load
            out.append(self.cpu.load(now, p.plan, p.req))
        return [job.payload for job in self.cpu.poll_loads(now)]

    def _cascade(self, now: int, job: Job) -> None:
        """Write the units a GPU -> CPU store put in the CPU through to the disk."""
        granted = self.disk.pool.prepare_store(job.keys)
        if not granted:
            return
        per_unit, last = job.payload
        n = len(granted) * per_unit - (per_unit - last if granted[-1][0] == job.keys[-1] else 0)
        keys = [k for k, _ in granted]
        self.cpu.pool.prepare_load(keys)  # vLLM's prepare_read: held until the disk has them
        self.disk.store_slots(now, granted, n, keys)


Tier = Union[OffloadTier, TwoLevelTier]


def make_tier(spec: TierSpec, hw: Hardware, profile: IoProfile, block_bytes: int, unit_blocks: int,
              max_units: Optional[int] = None) -> Tier:
    """The tier ``spec`` names (not ``none``)."""
    cls = TwoLevelTier if spec.secondary is not None else OffloadTier
    return cls(spec, hw, profile, block_bytes, unit_blocks, max_units)
