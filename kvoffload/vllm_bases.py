"""The vLLM classes kvoffload's connector builds on, imported here, after the checks, and only here.

``vllm_connector``, ``vllm_worker`` and ``vllm_metrics`` take vLLM's classes from this
module, never from vLLM, so none of them is imported past these checks, however it is
reached (vLLM's lookup through ``kvoffload.vllm``, a test, pickle loading worker
metadata). In order, each failing in one line rather than with an AttributeError deep
in a worker: the release (``vllm_version``), the modules, the interface
(``vllm_rules._check_interface``). A vLLM that moves a name changes this file.
"""

from __future__ import annotations

import logging

from kvoffload.vllm_rules import _check_interface
from kvoffload.vllm_version import SUPPORTED_TEXT, check_vllm

# What the connector's modules take from here.
__all__ = ["KVConnectorPromMetrics", "KVConnectorRole", "SimpleCPUOffloadPromMetrics", "SimpleCPUOffloadStats",
           "SimpleCPUOffloadWorker", "SimpleCPUOffloadWorkerMetadata", "scc"]

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


# kvoffload's records (the start-up line, the warnings) go out as vLLM's own.
_log_through_vllm()
