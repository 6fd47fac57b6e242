"""vLLM drop-in: ``SimpleCPUOffloadConnector`` with kvoffload's ``DiskBackend`` under it.

Load with ``"kv_connector": "KvoffloadConnector", "kv_connector_module_path":
"kvoffload.vllm"``. vLLM is imported only when ``KvoffloadConnector`` is first
looked up (module ``__getattr__``), so this module imports without vLLM, and an
installed vLLM outside 0.32.x-0.33.x (``vllm_version``), or one whose interface
differs, fails there with one clear message rather than with an AttributeError
deep in a worker.

What changes against vLLM's own connector (same keys, same behaviour otherwise):
- disk mode runs kvoffload's ``DiskBackend``: the worker's disk-mode registration
  (``register_kv_caches``) is kvoffload's, with vLLM's block layout rule
  (``offload_regions``), and it never calls CUDA stream or event APIs for caches
  on the CPU (vLLM's CPU engine replaces them with placeholders);
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
- vLLM's ``vllm:simple_kv_offload_*`` metrics are joined by kvoffload's own
  (``vllm:kvoffload_*``, ``kvoffload.metrics``): what each rank's disk did, summed
  over ranks in vLLM's stats payload, and the hits that really served (a hit whose
  load failed counts as recomputed, not as a hit);
- scheduler and ranks size the pool with one rule (``config.num_slots`` on the
  padded slot size), and every rank checks the scheduler's count against its own.
  vLLM 0.32 has no ``num_cpu_blocks`` key, so the scheduler is handed the byte
  budget whose floor is that count (``_scheduler_capacity``), the same on 0.33.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, Optional

import torch

from kvoffload import metrics, persist
from kvoffload.config import OffloadConfig, rank_disk_path
from kvoffload.os_calls import OsCalls
from kvoffload.vllm_version import SUPPORTED_TEXT, check_vllm

logger = logging.getLogger(__name__)

_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name in ("KvoffloadConnector", "KvoffloadWorker", "KvoffloadWorkerMetadata", "KvoffloadStats"):
        if not _CLASSES:
            _build_connector_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _check_interface(version: str, base: Any, worker_cls: Any, scheduler_cls: Any) -> None:
    """Feature-detect what this adapter relies on; raise ImportError naming what differs."""
    problems = []
    for name in ("register_kv_caches", "start_load_kv", "wait_for_save", "bind_connector_metadata",
                 "build_connector_worker_meta", "get_finished"):
        if not callable(getattr(worker_cls, name, None)):
            problems.append(f"SimpleCPUOffloadWorker.{name} is missing")
    init = set(_params(worker_cls.__init__))
    for p in ("kv_offload_backend", "disk_path", "disk_capacity_bytes", "disk_buffer_slots", "use_page_cache"):
        if p not in init:
            problems.append(f"SimpleCPUOffloadWorker.__init__ has no {p!r} parameter")
    if "disk_capacity_bytes" not in _params(scheduler_cls.__init__):
        problems.append("SimpleCPUOffloadScheduler.__init__ has no 'disk_capacity_bytes' parameter")
    if not hasattr(base, "get_block_ids_with_load_errors"):
        problems.append("KVConnectorBase_V1.get_block_ids_with_load_errors is missing")
    if problems:
        raise ImportError(
            f"kvoffload.vllm supports vLLM {SUPPORTED_TEXT}; the installed vLLM {version} has a different "
            f"simple_kv_offload interface: {'; '.join(problems)}. Install a supported release or use "
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


def _gpu_total_bytes(kv_cache_config: Any) -> int:
    # vLLM's rule (0.33's sizing.gpu_total_bytes): every KVCacheTensor is placed in
    # one backing allocation, so the first one's size is the whole cache.
    return kv_cache_config.kv_cache_tensors[0].size


def scheduler_num_slots(cfg: OffloadConfig, kv_cache_config: Any) -> int:
    """The scheduler's pool size: the ranks' rule applied to the scheduler's KV layout.

    Bytes per block come from the allocation as vLLM's ``_derive_cpu_config`` sees
    them (rounded up), and the result never exceeds vLLM's own unpadded bound.
    """
    total = _gpu_total_bytes(kv_cache_config)
    nb = kv_cache_config.num_blocks
    unpadded = nb * cfg.disk_capacity_bytes // total
    return min(cfg.num_disk_slots(-(-total // nb)), unpadded)


def _scheduler_capacity(num_slots: int, kv_cache_config: Any) -> int:
    """The byte budget for which vLLM's scheduler pool is exactly ``num_slots``.

    vLLM (0.32 and 0.33 alike) sizes it ``num_blocks * capacity // total``; with
    ``capacity = ceil(num_slots * total / num_blocks)`` the floor is ``num_slots``
    because ``total >= num_blocks`` (a block is at least one byte).
    """
    total = _gpu_total_bytes(kv_cache_config)
    nb = kv_cache_config.num_blocks
    return -(-num_slots * total // nb)


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


def offload_regions(kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``[num_blocks, block_bytes]`` int8 regions vLLM's worker offloads, by name.

    vLLM's ``SimpleCPUOffloadWorker.register_kv_caches`` rule (the same in 0.32 and
    0.33; ``tests/test_vllm_connector.py`` holds the two equal): each
    ``KVCacheTensor`` is re-viewed from its storage; a layer-outermost placement
    gives one region per layer (or per KV head group), a block-outermost one a
    single region for all its layers; storage seen twice is taken once.
    """
    num_blocks = kv_cache_config.num_blocks
    regions: dict[str, torch.Tensor] = {}
    seen: set[tuple[torch.device, int]] = set()
    for placed in kv_cache_config.kv_cache_tensors:
        name = next((n for n in placed.layers if n in kv_caches), None)
        if name is None:
            continue
        blocks_span = num_blocks * placed.block_stride
        if placed.layer_stride >= blocks_span:  # layer outermost
            start, span, names = placed.offset, len(placed.layers) * placed.layer_stride, placed.layers
        else:
            start, span, names = 0, blocks_span, placed.layers[:1]
        cache = kv_caches[name]
        raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(cache.untyped_storage())
        if raw.numel() < start + span:
            raise ValueError(f"KV cache {name!r} storage has {raw.numel()} bytes, smaller than the "
                             f"{span} bytes it places at offset {start}")
        views = raw[start:start + span].view(-1, num_blocks, placed.block_stride)
        per_layer, rest = divmod(len(views), len(names))
        if rest:
            raise ValueError(f"KV cache {name!r} places {len(names)} layers in {len(views)} block-strided regions")
        for i, view in enumerate(views):
            key = (view.device, view.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            layer = names[i // per_layer]
            regions[layer if per_layer == 1 else f"{layer}.{i % per_layer}"] = view
    return regions


# vLLM's prefix-caching hashes whose first block is seeded at random in every process
# unless PYTHONHASHSEED is set (vllm/v1/core/kv_cache_utils.py, init_none_hash; 0.32 and 0.33).
_RANDOM_SEEDED_HASHES = ("xxhash", "xxhash_cbor")
# num_tokens of a block key that has none (vLLM's primary hash of a full block may carry None).
_NO_TOKENS = 2**32 - 1


def check_stable_hashes(vllm_config: Any) -> None:
    """Refuse persistence where vLLM's block hashes change on every start: nothing stored
    could ever be found again (and the tier would fill with unreachable blocks)."""
    algo = getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", "sha256")
    if algo in _RANDOM_SEEDED_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise ValueError(
            f"kvoffload: \"persist\": true needs block hashes that survive a restart, but prefix_caching_hash_algo="
            f"{algo!r} seeds them at random in every process unless PYTHONHASHSEED is set; use "
            "--prefix-caching-hash-algo sha256 (vLLM's default) or sha256_cbor, or set PYTHONHASHSEED to one fixed "
            "value for every vLLM process")


def fingerprint(vllm_config: Any, regions: dict[str, torch.Tensor], dp: int, rank: int) -> dict[str, Any]:
    """What a rank's stored KV depends on besides the tokens: a file written under another
    fingerprint is refused at start-up (and its blocks would fail their tags)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    shapes = ";".join(f"{n}:{tuple(t.shape)}:{t.stride(0)}:{t.dtype}" for n, t in regions.items())
    return {"model": str(mc.model), "revision": mc.revision, "dtype": str(mc.dtype),
            "quantization": mc.quantization, "kv_cache_dtype": str(cc.cache_dtype), "block_size": cc.block_size,
            "regions": len(regions), "region_shapes": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "dp_rank": dp, "rank": rank, "world_size": pc.world_size,
            "tensor_parallel_size": pc.tensor_parallel_size, "pipeline_parallel_size": pc.pipeline_parallel_size}


def block_key(block: Any) -> bytes:
    """What a persistent tier stores a block under: vLLM's block hash with its group id, and
    the tokens it covers (what ``BlockPool._insert_block_hash`` takes back at restart)."""
    n = block.block_hash_num_tokens
    return block.block_hash + (_NO_TOKENS if n is None else n).to_bytes(4, "big")


def seed_pool(pool: Any, entries: Sequence[tuple[int, bytes]]) -> None:
    """Put restored blocks into vLLM's offload ``BlockPool``: each slot cached under its hash,
    and the free queue as vLLM's own would be, empty slots first, then the cached ones least
    recently stored first (the next store evicts the oldest)."""
    blocks = []
    for slot, key in entries:
        n = int.from_bytes(key[-4:], "big")
        block = pool.blocks[slot]
        pool._insert_block_hash(key[:-4], block, None if n == _NO_TOKENS else n)
        blocks.append(block)
    for block in blocks:
        pool.free_block_queue.remove(block)
    pool.free_block_queue.append_n(blocks)


def _build_connector_class() -> type:
    check_vllm("kvoffload.vllm")
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import simple_cpu_offload_connector as scc
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
        from vllm.v1.simple_kv_offload.metrics import SimpleCPUOffloadPromMetrics, SimpleCPUOffloadStats
        from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker
    except ImportError as e:
        raise ImportError(f"kvoffload.vllm: the installed vLLM lacks simple_kv_offload ({e}); "
                          f"it supports vLLM {SUPPORTED_TEXT}") from e
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

    class KvoffloadStats(SimpleCPUOffloadStats):
        """vLLM's simple-offload stats payload with kvoffload's metrics in it (one format,
        ``kvoffload.metrics``): histograms are lists of samples, and kvoffload's gauges
        merge over ranks by the larger value."""

        def aggregate(self, other):
            if not other.is_empty():
                metrics.merge(self.data, other.data)
            return self

        def reduce(self) -> dict[str, int | float]:
            return metrics.reduce(self.data)

    class KvoffloadPromMetrics(KVConnectorPromMetrics):
        """vLLM's simple-offload Prometheus metrics, and kvoffload's beside them."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._simple = SimpleCPUOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._ours = metrics.PromExporter(
                {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls},
                labelnames, per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            types, data = transfer_stats_data.get("types", {}), transfer_stats_data.get("data", {})
            ours = {k: v for k, v in data.items() if k in metrics.METRICS}
            # vLLM's observer refuses names it does not know: it gets only its own.
            self._simple.observe({"types": types, "data": {k: v for k, v in data.items() if k not in ours}},
                                 engine_idx)
            self._ours.observe({"types": types, "data": ours}, engine_idx)

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

    class KvoffloadConnector(scc.SimpleCPUOffloadConnector):
        """``SimpleCPUOffloadConnector`` with kvoffload's disk backend (vLLM 0.32.x, 0.33.x)."""

        def __init__(self, vllm_config, role, kv_cache_config) -> None:
            ktc = vllm_config.kv_transfer_config
            extra = dict((ktc.kv_connector_extra_config if ktc is not None else None) or {})
            cfg = OffloadConfig.from_extra_config(extra)
            self.offload = cfg
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
            if self.offload.persist.enabled and meta.store_gpu_blocks:
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

    # Module-level names, so pickle (vLLM ships worker metadata between processes)
    # finds the classes through this module's __getattr__.
    for cls in (KvoffloadConnector, KvoffloadWorker, KvoffloadWorkerMetadata, KvoffloadStats):
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
    worker share one config object, and the scheduler's budget must not reach the
    worker.
    """
    import copy
    import dataclasses

    out = copy.copy(vllm_config)
    out.kv_transfer_config = dataclasses.replace(vllm_config.kv_transfer_config,
                                                 kv_connector_extra_config=extra)
    return out
