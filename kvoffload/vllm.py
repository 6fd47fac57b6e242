"""vLLM drop-in: ``SimpleCPUOffloadConnector`` with kvoffload's ``DiskBackend`` under it.

Load with ``"kv_connector": "KvoffloadConnector", "kv_connector_module_path":
"kvoffload.vllm"``. vLLM is imported only when ``KvoffloadConnector`` is first
looked up (module ``__getattr__``), so this module imports without vLLM, and an
installed vLLM outside 0.32.x-0.33.x (``vllm_version``), or one whose interface
differs, fails there with one clear message rather than with an AttributeError
deep in a worker.

This module is where vLLM looks the classes up; they live in ``vllm_connector``
(``KvoffloadConnector``, whose own work is the scheduler side), ``vllm_worker``
(``KvoffloadWorker`` and its report, ``KvoffloadWorkerMetadata``) and ``vllm_metrics``
(``KvoffloadStats``, the Prometheus side), which take vLLM's classes from
``vllm_bases``, where they are checked first. What needs no vLLM is in
``vllm_rules``, its names re-exported here.

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

from typing import Any

from kvoffload.vllm_rules import _check_interface as _check_interface
from kvoffload.vllm_rules import _drop_slots as _drop_slots
from kvoffload.vllm_rules import _scheduler_capacity as _scheduler_capacity
from kvoffload.vllm_rules import block_key as block_key
from kvoffload.vllm_rules import check_stable_hashes as check_stable_hashes
from kvoffload.vllm_rules import fingerprint as fingerprint
from kvoffload.vllm_rules import offload_regions as offload_regions
from kvoffload.vllm_rules import scheduler_num_slots as scheduler_num_slots
from kvoffload.vllm_rules import seed_pool as seed_pool
from kvoffload.vllm_version import check_vllm

_NAMES = ("KvoffloadConnector", "KvoffloadWorker", "KvoffloadWorkerMetadata", "KvoffloadStats")
_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        if not _CLASSES:
            _CLASSES.update(_import_classes())
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _import_classes() -> dict[str, type]:
    # The release first, at every first lookup, before anything of vLLM's is imported;
    # then the class modules, which take vLLM's classes only from vllm_bases: it checks
    # the release again (for whatever reaches them another way), then the interface.
    check_vllm("kvoffload.vllm")
    from kvoffload.vllm_connector import KvoffloadConnector
    from kvoffload.vllm_metrics import KvoffloadStats
    from kvoffload.vllm_worker import KvoffloadWorker, KvoffloadWorkerMetadata

    return {cls.__name__: cls for cls in (KvoffloadConnector, KvoffloadWorker, KvoffloadWorkerMetadata, KvoffloadStats)}
