"""``KvoffloadConnector``, the class vLLM builds in both roles; its own work is the scheduler side.

In the scheduler it sizes the pool with the ranks' rule and hands vLLM's scheduler
that size, restores a persistent pool, drops the slots whose store or load failed
from the offload index and counts the hits that really served. In a worker it hands
disk mode to ``KvoffloadWorker`` (``vllm_worker``). vLLM's classes come from
``vllm_bases``, which checks them first.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter
from typing import Any

from kvoffload import metrics, persist
from kvoffload.config import OffloadConfig, rank_disk_path
from kvoffload.disk_backend import DiskBackend
from kvoffload.vllm_bases import KVConnectorRole, scc
from kvoffload.vllm_metrics import KvoffloadPromMetrics, KvoffloadStats
from kvoffload.vllm_rules import (_drop_slots, _scheduler_capacity, block_key, check_stable_hashes,
                                  scheduler_num_slots, seed_pool)
from kvoffload.vllm_worker import KvoffloadWorker, KvoffloadWorkerMetadata

logger = logging.getLogger(__name__)


class KvoffloadConnector(scc.SimpleCPUOffloadConnector):
    """``SimpleCPUOffloadConnector`` with kvoffload's disk backend (vLLM 0.32.x, 0.33.x)."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        ktc = vllm_config.kv_transfer_config
        extra = dict((ktc.kv_connector_extra_config if ktc is not None else None) or {})
        cfg = OffloadConfig.from_extra_config(extra)
        self.offload = cfg
        # The stored blocks' keys go to the ranks only where a persistent pool keeps them.
        self._send_store_keys = cfg.disk_mode and cfg.persist.enabled
        if cfg.disk_mode and cfg.persist.enabled:
            check_stable_hashes(vllm_config)
        self._kvoffload_num_slots: int | None = None
        vllm_extra = cfg.normalized_extra(extra)
        # The pool size is kvoffload's (the rule every rank applies), and vLLM's
        # scheduler gets it as the byte budget whose floor it is: vLLM sizes its
        # pool from unpadded block bytes (the engine aligns it only for the
        # connector named "SimpleCPUOffloadConnector", and 0.32 has no
        # num_cpu_blocks key), which would hand out more slots than a file holds.
        if cfg.disk_mode:
            vllm_extra.pop("num_cpu_blocks", None)
        if cfg.disk_mode and role == KVConnectorRole.SCHEDULER:
            own = scheduler_num_slots(cfg, kv_cache_config)
            if cfg.num_cpu_blocks is not None and cfg.num_cpu_blocks > own:
                raise ValueError(
                    f"num_cpu_blocks={cfg.num_cpu_blocks} exceeds the {own} disk slots that "
                    f"disk_capacity_bytes={cfg.disk_capacity_bytes} holds for this model's blocks")
            self._kvoffload_num_slots = cfg.num_cpu_blocks or own
            vllm_extra["disk_capacity_bytes"] = _scheduler_capacity(self._kvoffload_num_slots,
                                                                    kv_cache_config)
        if vllm_extra != extra:
            vllm_config = _with_extra(vllm_config, vllm_extra)
        super().__init__(vllm_config, role, kv_cache_config)
        if cfg.disk_mode and ktc.kv_load_failure_policy != "recompute":
            logger.warning(
                'kvoffload: kv_load_failure_policy is %r; a failed disk read will fail its '
                'request. Set "kv_load_failure_policy": "recompute" to recompute instead.',
                ktc.kv_load_failure_policy,
            )
        # Store event -> workers that reported it, and the slots that failed in it:
        # a failed slot is dropped once the event is complete on every rank.
        self._store_reports: Counter[int] = Counter()
        self._failed_stores: dict[int, set[int]] = {}
        self._world_size = vllm_config.parallel_config.world_size
        # Hits counted when their load ends, and the slots reported failed (by any
        # rank) while a load holding them is still in flight.
        self._hits = metrics.HitMetrics()
        self._failed_loading: set[int] = set()
        if cfg.disk_mode and cfg.persist.enabled and self.scheduler_manager is not None:
            self._restore(vllm_config)
        if cfg.disk_mode and self.worker_handler is not None:
            self.worker_handler = KvoffloadWorker(
                vllm_config, kv_cache_config,
                cfg.cpu_bytes_per_rank(vllm_config.parallel_config.world_size),
                kv_offload_backend="disk", disk_path=cfg.disk_path,
                disk_capacity_bytes=cfg.disk_capacity_bytes,
                disk_buffer_slots=cfg.disk_buffer_slots, use_page_cache=cfg.use_page_cache,
                offload=cfg,
            )

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        if self._kvoffload_num_slots is not None:
            meta.kvoffload_num_slots = self._kvoffload_num_slots
        if self._send_store_keys and meta.store_gpu_blocks:
            # Each stored block's hash, as vLLM will publish it when the store completes
            # (the GPU blocks are held until then): the ranks write it to their index.
            gpu = self.scheduler_manager._gpu_block_pool
            meta.kvoffload_store_keys = [block_key(gpu.blocks[b]) for b in meta.store_gpu_blocks]
        return meta

    def _restore(self, vllm_config) -> None:
        """Seed vLLM's offload pool from the ranks' indexes (the workers opened and checked
        them before the scheduler exists): a slot is restored where every rank holds the
        same block; what is not, is counted by cause."""
        cfg, pool = self.offload, self.scheduler_manager.cpu_block_pool
        dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        paths = [rank_disk_path(cfg.disk_path, dp, r) for r in range(self._world_size)]
        try:
            key = cfg.persist.operator_key()
            found = persist.agree([persist.read_pool([p], key) for p in paths], reserved=(0,))
        except persist.PersistError as e:
            logger.warning("kvoffload: the persistent disk tier starts empty: %s", e)
            return
        entries = [(s, k) for s, k in found.entries() if s < len(pool.blocks)]
        refused = found.refused + Counter({"capacity": len(found.slots) - len(entries)})
        seed_pool(pool, entries)
        self._hits.restored(len(entries), +refused)
        logger.info("kvoffload restored %d block(s) from %s (refused: %s)", len(entries), ", ".join(paths),
                    ", ".join(f"{c} {n}" for c, n in sorted(refused.items()) if n) or "none")

    def _disk_backend(self):
        backend = getattr(self.worker_handler, "_backend", None)
        return backend if isinstance(backend, DiskBackend) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.worker_handler
        return worker.take_load_errors() if isinstance(worker, KvoffloadWorker) else set()

    def update_connector_output(self, connector_output) -> None:
        """vLLM's bookkeeping, plus: failed slots leave the offload index.

        A slot of a failed load is still held by that load here (vLLM releases
        it below), so it still holds the block that failed; dropping its hash
        means the recompute vLLM schedules is the only one. A failed store's
        slot is published by vLLM once every rank reported the event; it is
        dropped right after, before any lookup can see it.
        """
        mgr = self.scheduler_manager
        meta = connector_output.kv_connector_worker_meta
        if mgr is not None and self.offload.disk_mode:
            self._count_hits(mgr, connector_output.finished_recving, getattr(meta, "failed_load_slots", ()))
        if mgr is None or not isinstance(meta, KvoffloadWorkerMetadata):
            super().update_connector_output(connector_output)
            return
        if meta.failed_load_slots:
            _drop_slots(mgr.cpu_block_pool, meta.failed_load_slots)
        for event, slots in meta.failed_store_events.items():
            self._failed_stores.setdefault(event, set()).update(slots)
        super().update_connector_output(connector_output)
        for event, count in meta.completed_store_events.items():
            self._store_reports[event] += count
            if self._store_reports[event] >= self._world_size:
                del self._store_reports[event]
                failed = self._failed_stores.pop(event, None)
                if failed:
                    _drop_slots(mgr.cpu_block_pool, failed)

    def _count_hits(self, mgr, finished_recving, failed_load_slots) -> None:
        """Each finished load's tokens: served up to its first failed block, recomputed from
        there (vLLM's rule). Read before vLLM's bookkeeping forgets the loads."""
        self._failed_loading.update(failed_load_slots)
        loads, done = mgr._reqs_to_load, set(finished_recving or ())
        for req_id in done:
            state = loads.get(req_id)
            if state is not None and state.load_event is not None:
                self._hits.load_ended(*metrics.split_load(state.transfer_meta.cpu_block_ids,
                                                          self._failed_loading, mgr.block_size))
        if self._failed_loading:
            # Kept only while a load in flight holds the slot (another rank may report later).
            held = {s for req_id, st in loads.items() if req_id not in done for s in st.transfer_meta.cpu_block_ids}
            self._failed_loading &= held

    def get_kv_connector_stats(self):
        """vLLM's simple-offload stats (scheduler side) and kvoffload's: hits and slots on
        the scheduler, the disk's counters on each worker (vLLM sums them over ranks)."""
        base = super().get_kv_connector_stats()
        parts = [None if base is None else base.data]
        mgr = getattr(self, "scheduler_manager", None)
        if mgr is not None and self.offload.disk_mode:
            pool = mgr.cpu_block_pool
            # Block 0 of vLLM's pool is its null block: it never holds KV.
            parts.append(self._hits.take(len(pool.cached_block_hash_to_block), mgr.num_cpu_blocks - 1))
        backend = self._disk_backend()
        if backend is not None:
            parts.append(backend.take_metrics())
        data = metrics.combine(parts)
        return None if data is None else KvoffloadStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvoffloadStats(data=data) if data is not None else KvoffloadStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvoffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        backend = self._disk_backend()
        if backend is not None:
            backend.shutdown()
        super().shutdown()


def _with_extra(vllm_config: Any, extra: dict[str, Any]) -> Any:
    """A shallow copy of ``vllm_config`` whose transfer config carries ``extra``.

    A copy, not an in-place edit: with the in-process executor the scheduler and the
    worker share one config object, and the scheduler's budget must not reach the
    worker.
    """
    out = copy.copy(vllm_config)
    out.kv_transfer_config = dataclasses.replace(vllm_config.kv_transfer_config,
                                                 kv_connector_extra_config=extra)
    return out
