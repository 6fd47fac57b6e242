"""vLLM drop-in: ``SimpleCPUOffloadConnector`` with kvoffload's ``DiskBackend`` under it.

Load with ``"kv_connector": "KvoffloadConnector", "kv_connector_module_path":
"kvoffload.vllm"``. vLLM is imported only when ``KvoffloadConnector`` is first
looked up (module ``__getattr__``), so this module imports without vLLM, and an
installed vLLM whose interface differs from 0.33.x fails there with one clear
message rather than with an AttributeError deep in a worker.

What changes against vLLM 0.33's own connector (same keys, same behaviour otherwise):
- disk mode runs kvoffload's ``DiskBackend`` (the worker's hard-coded
  ``if self.disk_mode`` branch, ``_init_disk_mode``, is overridden);
- a failed load is recomputed exactly once: its device blocks go to vLLM through
  ``get_block_ids_with_load_errors()`` (``kv_load_failure_policy="recompute"``),
  and its slots leave the scheduler's offload index, so no lookup offers them
  again (vLLM 0.33 would: the same hit, the same failed load, forever);
- a failed store never becomes a hit: its slots leave the index as soon as every
  rank has reported the store (vLLM 0.33 has no failed-store channel);
- both travel from the workers to the scheduler in vLLM's own worker metadata
  (``KvoffloadWorkerMetadata``, aggregated over ranks), never through shared
  Python objects: in vLLM the scheduler and the workers are separate processes;
- per-rank files are named by DP rank and global rank, not ``device.index``;
- scheduler and ranks size the pool with one rule (``config.num_slots`` on the
  padded slot size), and every rank checks the scheduler's count against its own.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections import Counter
from typing import Any, Optional

from kvoffload.config import OffloadConfig, rank_disk_path
from kvoffload.os_calls import OsCalls

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.33.x"
_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name in ("KvoffloadConnector", "KvoffloadWorker", "KvoffloadWorkerMetadata"):
        if not _CLASSES:
            _build_connector_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _check_interface(version: str, base: Any, worker_cls: Any, scheduler_cls: Any) -> None:
    """Feature-detect what this adapter overrides; raise ImportError naming what differs."""
    problems = []
    expect = {
        "SimpleCPUOffloadWorker._init_disk_mode": (
            getattr(worker_cls, "_init_disk_mode", None), ["self", "unique_gpu_caches", "total_bytes_per_block", "device"]),
        "SimpleCPUOffloadWorker._resolve_num_cpu_blocks": (
            getattr(worker_cls, "_resolve_num_cpu_blocks", None), ["self", "capacity_bytes", "bytes_per_block"]),
    }
    for what, (fn, params) in expect.items():
        if fn is None:
            problems.append(f"{what} is missing")
        elif _params(fn) != params:
            problems.append(f"{what}{tuple(_params(fn))} differs from {tuple(params)}")
    init = set(_params(worker_cls.__init__))
    for p in ("kv_offload_backend", "disk_path", "disk_capacity_bytes", "disk_buffer_slots",
              "use_page_cache", "num_cpu_blocks"):
        if p not in init:
            problems.append(f"SimpleCPUOffloadWorker.__init__ has no {p!r} parameter")
    if "num_cpu_blocks" not in _params(scheduler_cls.__init__):
        problems.append("SimpleCPUOffloadScheduler.__init__ has no 'num_cpu_blocks' parameter")
    if not hasattr(base, "get_block_ids_with_load_errors"):
        problems.append("KVConnectorBase_V1.get_block_ids_with_load_errors is missing")
    if problems:
        raise ImportError(
            f"kvoffload.vllm supports vLLM {SUPPORTED_VLLM}; the installed vLLM {version} has a different "
            f"simple_kv_offload interface: {'; '.join(problems)}. Pin vllm==0.33.* or use "
            'kv_connector "SimpleCPUOffloadConnector" (vLLM\'s own disk backend).'
        )


def _ranks(vllm_config: Any) -> tuple[int, int]:
    """(DP rank, global rank of this worker in its world group)."""
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    try:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank
    except AssertionError:  # world group not initialized: one process, rank 0
        rank = 0
    return dp, rank


def scheduler_num_slots(cfg: OffloadConfig, kv_cache_config: Any) -> int:
    """The scheduler's pool size: the ranks' rule applied to the scheduler's KV layout.

    Bytes per block come from the allocation as vLLM's ``_derive_cpu_config`` sees
    them (rounded up), and the result never exceeds vLLM's own unpadded bound.
    """
    from vllm.v1.simple_kv_offload.sizing import gpu_total_bytes

    total = gpu_total_bytes(kv_cache_config)
    nb = kv_cache_config.num_blocks
    unpadded = nb * cfg.disk_capacity_bytes // total
    return min(cfg.num_disk_slots(-(-total // nb)), unpadded)


def _build_connector_class() -> type:
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import simple_cpu_offload_connector as scc
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
        from vllm.v1.simple_kv_offload.sizing import sync_num_offload_blocks_across_workers
        from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker
    except ImportError as e:
        raise ImportError(
            f"kvoffload.vllm needs vLLM {SUPPORTED_VLLM} (pip install 'vllm==0.33.*'): {e}"
        ) from e
    _check_interface(getattr(vllm, "__version__", "unknown"), KVConnectorBase_V1,
                     SimpleCPUOffloadWorker, SimpleCPUOffloadScheduler)
    _log_through_vllm()
    from kvoffload.disk_backend import DiskBackend

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

        def _resolve_num_cpu_blocks(self, capacity_bytes: int, bytes_per_block: int) -> int:
            if not self.disk_mode:
                return super()._resolve_num_cpu_blocks(capacity_bytes, bytes_per_block)
            local = self.offload.num_disk_slots(bytes_per_block)
            requested = self._num_cpu_blocks_override
            if requested is not None:
                if requested > local:
                    raise ValueError(
                        f"num_cpu_blocks={requested} exceeds this rank's {local} disk slots "
                        f"(disk_capacity_bytes={self.offload.disk_capacity_bytes} // "
                        f"{self.offload.slot_bytes(bytes_per_block)} B per slot)"
                    )
                return requested
            # All-reduce MIN: PP stages differ in bytes per block; every rank must
            # hold every slot id the scheduler hands out (#52921).
            return sync_num_offload_blocks_across_workers(local)

        def _init_disk_mode(self, unique_gpu_caches, total_bytes_per_block, device) -> None:
            assert self.disk_path is not None
            self.rank_path = rank_disk_path(self.disk_path, *_ranks(self.vllm_config))
            backend = DiskBackend()
            backend.init(
                unique_gpu_caches, device, self.load_stream, self.store_stream, self.rank_path,
                self.num_cpu_blocks, total_bytes_per_block, self.disk_buffer_slots,
                self.use_page_cache, report_load_errors=True, os_calls=self.os_calls,
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
            if self.disk_mode and md is not None and md.store_cpu_blocks:
                self._store_event_of.update(dict.fromkeys(md.store_cpu_blocks, md.store_event))
            super().wait_for_save()

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

    class KvoffloadConnector(scc.SimpleCPUOffloadConnector):
        """``SimpleCPUOffloadConnector`` with kvoffload's disk backend (vLLM 0.33.x)."""

        def __init__(self, vllm_config, role, kv_cache_config) -> None:
            ktc = vllm_config.kv_transfer_config
            extra = dict((ktc.kv_connector_extra_config if ktc is not None else None) or {})
            cfg = OffloadConfig.from_extra_config(extra)
            self.offload = cfg
            self._kvoffload_num_slots: int | None = None
            vllm_extra = cfg.normalized_extra(extra)
            if cfg.disk_mode and role == KVConnectorRole.SCHEDULER and cfg.num_cpu_blocks is None:
                # Without this, vLLM sizes the scheduler pool from unpadded block bytes
                # (the engine only aligns it for the connector named
                # "SimpleCPUOffloadConnector"): more slots than any rank's file holds.
                self._kvoffload_num_slots = scheduler_num_slots(cfg, kv_cache_config)
                vllm_extra["num_cpu_blocks"] = self._kvoffload_num_slots
            elif cfg.disk_mode and role == KVConnectorRole.SCHEDULER:
                self._kvoffload_num_slots = cfg.num_cpu_blocks
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
            if cfg.disk_mode and self.worker_handler is not None:
                self.worker_handler = KvoffloadWorker(
                    vllm_config, kv_cache_config,
                    cfg.cpu_bytes_per_rank(vllm_config.parallel_config.world_size),
                    kv_offload_backend="disk", disk_path=cfg.disk_path,
                    disk_capacity_bytes=cfg.disk_capacity_bytes,
                    disk_buffer_slots=cfg.disk_buffer_slots, use_page_cache=cfg.use_page_cache,
                    num_cpu_blocks=cfg.num_cpu_blocks, offload=cfg,
                )

        def build_connector_meta(self, scheduler_output):
            meta = super().build_connector_meta(scheduler_output)
            if self._kvoffload_num_slots is not None:
                meta.kvoffload_num_slots = self._kvoffload_num_slots
            return meta

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

        def shutdown(self) -> None:
            backend = self._disk_backend()
            if backend is not None:
                backend.shutdown()
            super().shutdown()

    # Module-level names, so pickle (vLLM ships worker metadata between processes)
    # finds the classes through this module's __getattr__.
    for cls in (KvoffloadConnector, KvoffloadWorker, KvoffloadWorkerMetadata):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        _CLASSES[cls.__name__] = cls
    return KvoffloadConnector


class _ToVllmLogger(logging.Handler):
    """Hands kvoffload's records to vLLM's logger, the only one vLLM configures: with
    its handler, format and level. Without it kvoffload's INFO lines (the start-up line
    operators look for) would be dropped and its warnings printed bare."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_through_vllm() -> None:
    ours = logging.getLogger("kvoffload")
    if not any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        ours.addHandler(_ToVllmLogger())
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def _drop_slots(pool: Any, slots: Any) -> None:
    """Take ``slots`` out of vLLM's offload index (a ``BlockPool``).

    A slot still held (by its load) keeps its place until released, when vLLM
    puts it, hashless, at the front of the free queue. A free one (its store was
    just published) is moved there now, as vLLM's ``free_blocks`` would have put it
    without the hash: reused before any cached block is evicted.
    """
    slots = sorted(set(slots))
    pool.evict_blocks(set(slots))
    free = [pool.blocks[s] for s in slots if pool.blocks[s].ref_cnt == 0]
    for block in free:
        pool.free_block_queue.remove(block)
    pool.free_block_queue.prepend_n(free)


def _with_extra(vllm_config: Any, extra: dict[str, Any]) -> Any:
    """A shallow copy of ``vllm_config`` whose transfer config carries ``extra``.

    A copy, not an in-place edit: with the in-process executor the scheduler and the
    worker share one config object, and the scheduler-only ``num_cpu_blocks`` must not
    reach the worker.
    """
    import copy
    import dataclasses

    out = copy.copy(vllm_config)
    out.kv_transfer_config = dataclasses.replace(vllm_config.kv_transfer_config,
                                                 kv_connector_extra_config=extra)
    return out
