"""The connector's worker side: ``KvoffloadWorker`` on every rank, and its report, ``KvoffloadWorkerMetadata``.

In disk mode the worker registers vLLM's KV regions (``vllm_rules.offload_regions``)
with kvoffload's ``DiskBackend``, one slot file per rank, named by DP rank and global
rank. What failed (stores by event, loads by slot) reaches the scheduler only in the
worker metadata, which vLLM ships between processes and aggregates over ranks.
vLLM's classes come from ``vllm_bases``, which checks them first.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from kvoffload import persist
from kvoffload.config import OffloadConfig, rank_disk_path
from kvoffload.disk_backend import DiskBackend
from kvoffload.os_calls import OsCalls
from kvoffload.vllm_bases import SimpleCPUOffloadWorker, SimpleCPUOffloadWorkerMetadata
from kvoffload.vllm_rules import fingerprint, offload_regions

logger = logging.getLogger(__name__)


def _ranks(vllm_config: Any) -> tuple[int, int]:
    """(DP rank, global rank of this worker in its world group)."""
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    try:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank
    except AssertionError:  # world group not initialized: one process, rank 0
        rank = 0
    return dp, rank


def _min_over_ranks(n: int) -> int:
    """All-reduce MIN over vLLM's world group (0.33's
    ``sync_num_offload_blocks_across_workers``; 0.32 has none): PP stages differ in
    bytes per block, and every rank must hold every slot id the scheduler hands out
    (#52921)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return n
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size <= 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, group=group.cpu_group, op=dist.ReduceOp.MIN)
    return int(t.item())


@dataclasses.dataclass
class KvoffloadWorkerMetadata(SimpleCPUOffloadWorkerMetadata):
    """One worker's report to the scheduler: vLLM's completed stores plus what failed.

    ``failed_store_events``: store event -> slots whose write failed on this rank.
    ``failed_load_slots``: slots whose load failed (IO error, short read, integrity
    check, or a slot whose store had failed). Plain lists, as vLLM ships the
    metadata between processes.
    """

    failed_store_events: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    failed_load_slots: list[int] = dataclasses.field(default_factory=list)

    def aggregate(self, other):
        """Sums completions (vLLM's rule) and unions failures: a slot that failed on any
        rank holds no usable block."""
        merged = super().aggregate(other)
        failed = {e: set(s) for e, s in self.failed_store_events.items()}
        for e, slots in getattr(other, "failed_store_events", {}).items():
            failed.setdefault(e, set()).update(slots)
        return KvoffloadWorkerMetadata(
            completed_store_events=merged.completed_store_events,
            failed_store_events={e: sorted(s) for e, s in failed.items()},
            failed_load_slots=sorted(set(self.failed_load_slots)
                                     | set(getattr(other, "failed_load_slots", ()))),
        )


class KvoffloadWorker(SimpleCPUOffloadWorker):
    """vLLM's worker with kvoffload's backend, sizing rule and rank naming in disk mode."""

    # The backend's OS seam; tests set a faults.FaultyOsCalls here (on the class).
    os_calls: Optional[OsCalls] = None

    def __init__(self, *args: Any, offload: OffloadConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.rank_path: str | None = None
        # Which slot each device block of a launched load reads, and which store
        # event each slot was last written by: the backend reports device block ids
        # and slots; the scheduler needs slots and events.
        self._load_slot_of: dict[int, int] = {}
        self._store_event_of: dict[int, int] = {}
        self._failed_load_slots: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Disk mode: vLLM's regions and pool rule, kvoffload's backend and slot sizing.

        vLLM's own method makes CUDA streams first thing (``priority_range``),
        which vLLM's CPU engine has only as a placeholder; here streams exist only
        for CUDA caches, at the lowest priority (vLLM's rule: KV IO yields to
        compute), and the backend needs only that priority from them.
        """
        if not self.disk_mode:
            super().register_kv_caches(kv_caches)
            return
        if not kv_caches:
            logger.warning("kvoffload: no KV caches to offload")
            return
        self.device = next(iter(kv_caches.values())).device
        regions = offload_regions(self.kv_cache_config, kv_caches)
        total_bytes_per_block = sum(t.stride(0) * t.element_size() for t in regions.values())
        self.num_cpu_blocks = self._disk_slots(total_bytes_per_block)
        if self.device.type == "cuda":
            low, _ = torch.cuda.Stream.priority_range()
            self.load_stream = torch.cuda.Stream(self.device, priority=low)
            self.store_stream = torch.cuda.Stream(self.device, priority=low)
        self.gpu_kv_caches = regions
        self._init_disk_mode(regions, total_bytes_per_block, self.device)

    def _disk_slots(self, bytes_per_block: int) -> int:
        local = self.offload.num_disk_slots(bytes_per_block)
        requested = self.offload.num_cpu_blocks
        if requested is not None:
            if requested > local:
                raise ValueError(
                    f"num_cpu_blocks={requested} exceeds this rank's {local} disk slots "
                    f"(disk_capacity_bytes={self.offload.disk_capacity_bytes} // "
                    f"{self.offload.slot_bytes(bytes_per_block)} B per slot)"
                )
            return requested
        return _min_over_ranks(local)

    def _init_disk_mode(self, unique_gpu_caches, total_bytes_per_block, device) -> None:
        assert self.disk_path is not None
        ranks = _ranks(self.vllm_config)
        self.rank_path = rank_disk_path(self.disk_path, *ranks)
        kept = None
        if self.offload.persist.enabled:
            kept = persist.Persist(self.offload.persist.operator_key(),
                                   fingerprint(self.vllm_config, unique_gpu_caches, *ranks))
        backend = DiskBackend()
        backend.init(
            unique_gpu_caches, device, self.load_stream, self.store_stream, self.rank_path,
            self.num_cpu_blocks, total_bytes_per_block, self.disk_buffer_slots,
            self.use_page_cache, report_load_errors=True, os_calls=self.os_calls, persist=kept,
            **self.offload.backend_kwargs(),
        )
        self._backend = backend
        logger.info("kvoffload is serving the disk offload tier: %d tensors, %d slots of %d B in %s",
                    len(unique_gpu_caches), self.num_cpu_blocks,
                    self.offload.slot_bytes(total_bytes_per_block), self.rank_path)

    def start_load_kv(self) -> None:
        md = self._connector_metadata
        if self.disk_mode and md is not None and md.load_cpu_blocks:
            self._load_slot_of.update(zip(md.load_gpu_blocks, md.load_cpu_blocks))
        super().start_load_kv()

    def wait_for_save(self) -> None:
        md = self._connector_metadata
        if not (self.disk_mode and md is not None and md.store_cpu_blocks):
            super().wait_for_save()
            return
        self._store_event_of.update(dict.fromkeys(md.store_cpu_blocks, md.store_event))
        keys = getattr(md, "kvoffload_store_keys", None)
        wait = None
        if self.device is not None and self.device.type == "cuda":
            if keys is None:
                super().wait_for_save()  # orders the store after a compute-done CUDA event
                return
            # vLLM's own ordering (#45704), with the blocks' keys for the persistent tier.
            if self._store_compute_done is None:
                self._store_compute_done = torch.Event()
            self._store_compute_done.record(torch.cuda.current_stream())
            wait = self._store_compute_done
        # Host caches: the forward wrote them synchronously before this runs, so
        # there is nothing to wait for (and vLLM's event is a CUDA event).
        self._backend.launch_copy(md.store_gpu_blocks, md.store_cpu_blocks, is_store=True,
                                  event_idx=md.store_event, events_list=self._store_events, wait_event=wait,
                                  keys=keys)

    def take_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call; their slots are kept
        for the next worker metadata.

        The backend records a failed load before its event completes, so the
        blocks come out no later than the pass whose ``get_finished`` returns
        the request, and before any later load can reuse the device block.
        """
        backend = self._backend
        if not isinstance(backend, DiskBackend):
            return set()
        bad = backend.get_block_ids_with_load_errors()
        if bad:
            self._failed_load_slots.update(self._load_slot_of[b] for b in bad)
            logger.warning("kvoffload: %d block(s) failed to load from disk; reported to vLLM "
                           "(kv_load_failure_policy decides: recompute or fail) and dropped from "
                           "the offload index", len(bad))
        return bad

    def build_connector_worker_meta(self):
        base = super().build_connector_worker_meta()
        failed_stores: dict[int, list[int]] = {}
        backend = self._backend
        if isinstance(backend, DiskBackend):
            # Recorded before the store's event completes: reported no later than
            # the completion, so the scheduler knows before it publishes the slot.
            for slot in sorted(backend.get_failed_store_slots()):
                failed_stores.setdefault(self._store_event_of[slot], []).append(slot)
            if failed_stores:
                logger.warning("kvoffload: %d block(s) failed to store to disk; never offered "
                               "as a hit", sum(map(len, failed_stores.values())))
        if base is None and not failed_stores and not self._failed_load_slots:
            return None
        meta = KvoffloadWorkerMetadata(
            completed_store_events=base.completed_store_events if base is not None else {},
            failed_store_events=failed_stores,
            failed_load_slots=sorted(self._failed_load_slots),
        )
        self._failed_load_slots = set()
        return meta

    def bind_connector_metadata(self, metadata) -> None:
        # The scheduler may see another rank's layout (PP); refuse before any
        # copy could touch a slot past the end of this rank's file.
        sched = getattr(metadata, "kvoffload_num_slots", None)
        if self.disk_mode and sched is not None and self.num_cpu_blocks and sched > self.num_cpu_blocks:
            raise RuntimeError(
                f"kvoffload: the scheduler uses {sched} disk slots but this rank's file "
                f"{self.rank_path} has {self.num_cpu_blocks}; set kv_connector_extra_config "
                f'"num_cpu_blocks": {self.num_cpu_blocks} (or less) for every rank'
            )
        super().bind_connector_metadata(metadata)
