"""``KvoffloadTier``: ``SlotTier`` behind vLLM's ``SecondaryTierManager``, the class vLLM's tiering builds.

vLLM is imported here after the release check (``vllm_version``), and the tiering
interface is feature-detected (``_check_interface``) before the class exists, so it
cannot be imported past them however it is reached; each fails in one line.
``kvoffload.vllm_tier``, the module vLLM loads, looks the class up here.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from kvoffload import metrics
from kvoffload.os_calls import OsCalls
from kvoffload.vllm_rules import check_stable_hashes
from kvoffload.vllm_slot_tier import SlotTier, TierConfig, tier_fingerprint
from kvoffload.vllm_version import SUPPORTED_TEXT, check_vllm

logger = logging.getLogger(__name__)


def _check_interface(version: str, base: Any, job_result: Any) -> None:
    """Feature-detect what the tier implements; raise ImportError naming what differs."""
    problems = [f"SecondaryTierManager.{m} is missing" for m in
                ("lookup", "submit_store", "submit_load", "get_finished_jobs", "drain_jobs", "on_new_request",
                 "has_pending_work", "touch", "shutdown") if not hasattr(base, m)]
    fields = getattr(job_result, "__dataclass_fields__", {})
    problems += [f"JobResult has no {f!r} field" for f in ("job_id", "success", "successful_keys", "transfer_bytes")
                 if f not in fields]
    if problems:
        raise ImportError(f"kvoffload.vllm_tier supports vLLM {SUPPORTED_TEXT}; the installed vLLM {version} "
                          f"has a different tiering interface: {'; '.join(problems)}.")


check_vllm("kvoffload.vllm_tier")
try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import (
        Locality, LookupResult, Medium, OffloadingCounterMetadata, OffloadingGaugeMetadata,
        OffloadingHistogramMetadata, RequestOffloadingContext, get_offload_group_idx,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
except ImportError as e:
    raise ImportError(f"kvoffload.vllm_tier: the installed vLLM lacks the tiering interface ({e}); "
                      f"it supports vLLM {SUPPORTED_TEXT}") from e
_check_interface(getattr(vllm, "__version__", "unknown"), SecondaryTierManager, JobResult)


class KvoffloadTier(SecondaryTierManager):
    """kvoffload's slot files as a vLLM secondary tier (``SlotTier`` behind vLLM's interface)."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, os_calls: Optional[OsCalls] = None,
                 **tier_config: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        cfg = TierConfig.from_tier_config(tier_config)
        self.locality = Locality(cfg.locality) if cfg.locality else None
        # A chunk is blocks_per_chunk blocks of its KV cache group (the key's last 4 bytes).
        per_group = [n * offloading_spec.blocks_per_chunk for n in offloading_spec.tokens_per_block]
        fp = None
        if cfg.persist.enabled:
            from vllm.config import get_current_vllm_config_or_none

            # Where vLLM's config is reachable here; vLLM builds its tiers outside that
            # context in some releases, so docs/vllm.md states the rule for this path.
            current = get_current_vllm_config_or_none()
            if current is not None:
                check_stable_hashes(current)
            fp = tier_fingerprint(offloading_spec.config)
        self.slot_tier = SlotTier(primary_kv_view, cfg, os_calls=os_calls,
                                  tokens_of=lambda key: per_group[get_offload_group_idx(key)], fingerprint=fp)
        logger.info("kvoffload tier %r: %d slots of %d B over %s", tier_type, self.slot_tier.num_slots,
                    self.block_size_bytes, ", ".join(cfg.disk_paths))

    def lookup(self, key: Any, req_context: Any) -> Any:
        return LookupResult.HIT if self.slot_tier.lookup(key) else LookupResult.MISS

    def touch(self, keys: Any, req_context: Any) -> None:
        self.slot_tier.touch(list(keys))

    def submit_store(self, job_metadata: Any) -> None:
        self.slot_tier.submit_store(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

    def submit_load(self, job_metadata: Any) -> None:
        self.slot_tier.submit_load(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

    def get_finished_jobs(self) -> list:
        return [JobResult(job_id=f.job_id, success=f.success, successful_keys=f.successful_keys,
                          transfer_bytes=f.transfer_bytes) for f in self.slot_tier.poll()]

    def has_pending_work(self) -> bool:
        return self.slot_tier.pending

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        self.slot_tier.drain()

    def shutdown(self) -> None:
        self.slot_tier.close()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvoffload's metrics (``kvoffload.metrics``) for vLLM's offloading Prometheus metrics."""
        return metrics.definitions(OffloadingCounterMetadata, OffloadingGaugeMetadata,
                                   OffloadingHistogramMetadata)

    def get_stats(self) -> Any:
        """What the disk tier did since the last call (vLLM polls it every scheduler step)."""
        payload = self.slot_tier.take_metrics()
        return OffloadingConnectorStats(data=payload) if payload else None
