"""The connector's stats and Prometheus metrics: vLLM's simple-offload ones, kvoffload's beside them.

``KvoffloadStats`` is the payload the scheduler and every rank report and vLLM merges
over ranks, in ``kvoffload.metrics``'s format; ``KvoffloadPromMetrics`` turns it into
vLLM's ``vllm:simple_kv_offload_*`` series and kvoffload's ``vllm:kvoffload_*``.
vLLM's classes come from ``vllm_bases``, which checks them first.
"""

from __future__ import annotations

from typing import Any

from kvoffload import metrics
from kvoffload.vllm_bases import KVConnectorPromMetrics, SimpleCPUOffloadPromMetrics, SimpleCPUOffloadStats


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
