"""kvoffload: a disk KV-cache offload backend for vLLM.

Importing this package never imports vLLM; ``kvoffload.vllm`` holds the connector.
"""

from kvoffload.cpu_backend import CpuBackend
from kvoffload.disk_backend import DiskBackend, LeakedFdWarning
from kvoffload.jobs import BackendFatalError, JobEvent
from kvoffload.os_calls import OsCalls

__all__ = ["CpuBackend", "DiskBackend", "LeakedFdWarning", "BackendFatalError", "JobEvent", "OsCalls"]
