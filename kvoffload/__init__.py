"""kvoffload: a disk KV-cache offload backend for vLLM.

Names load on first use (PEP 562), so ``import kvoffload.config`` pulls in neither
torch nor vLLM; ``kvoffload.vllm`` holds the connector.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DiskBackend": "kvoffload.disk_backend",
    "LeakedFdWarning": "kvoffload.disk_backend",
    "BackendFatalError": "kvoffload.jobs",
    "JobEvent": "kvoffload.jobs",
    "OsCalls": "kvoffload.os_calls",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
