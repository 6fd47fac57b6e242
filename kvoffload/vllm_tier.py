"""kvoffload as the disk tier under vLLM's ``OffloadingConnector`` (CPU primary + disk).

vLLM 0.33's ``TieringOffloadingSpec`` keeps hot blocks in a CPU primary tier and cascades
every stored chunk to its secondary tiers; a chunk missing from the CPU tier is promoted
back from a secondary one. This module is such a secondary tier, loaded out of tree::

    "secondary_tiers": [{"type": "KvoffloadTier", "module_path": "kvoffload.vllm_tier",
                         "disk_path": "/mnt/nvme/kv-tier.bin", "disk_capacity_bytes": "1TiB"}]

Every tier method runs in the scheduler process: ``submit_*`` only queue IO,
``get_finished_jobs`` only polls completed ``JobEvent``s. ``SlotTier``
(``vllm_slot_tier``, re-exported here with ``TierConfig``) is all of it without vLLM
(tests run it in CI); ``KvoffloadTier``, the vLLM class (``vllm_tier_manager``), is
imported on first lookup (module ``__getattr__``), after the release check, so
importing this module never imports vLLM.
"""

from __future__ import annotations

from typing import Any

from kvoffload.vllm_slot_tier import LOCALITIES as LOCALITIES
from kvoffload.vllm_slot_tier import TIER_TYPE as TIER_TYPE
from kvoffload.vllm_slot_tier import FinishedJob as FinishedJob
from kvoffload.vllm_slot_tier import SlotTier as SlotTier
from kvoffload.vllm_slot_tier import TierConfig as TierConfig
from kvoffload.vllm_slot_tier import tier_fingerprint as tier_fingerprint
from kvoffload.vllm_version import check_vllm

_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == TIER_TYPE:
        if not _CLASSES:
            # The release first, at every first lookup, before anything of vLLM's is
            # imported; vllm_tier_manager checks it again, and the interface.
            check_vllm("kvoffload.vllm_tier")
            from kvoffload.vllm_tier_manager import KvoffloadTier

            _CLASSES[TIER_TYPE] = KvoffloadTier
        return _CLASSES[TIER_TYPE]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
