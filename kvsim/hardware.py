"""The replica, the vLLM engine settings and the host (simulation notes §7).

The GPU's step time and memory live in its profile (gpu.py), IO rates (drive, page
cache, PCIe, sealing) in the calibrated IO profile (profile.py). [est] marks a
guess; everything else is the notes' measured or documented figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsim.gpu import DEFAULT_GPU, GpuProfile
from kvsim.models import ModelShape
from kvsim.units import size

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    # One replica: ``tp`` GPUs of this kind (gpu.py) running one engine.
    gpu: str = DEFAULT_GPU
    tp: int = 1
    # The replica's KV cache: None = what vLLM allots at gpu_memory_utilization 0.9 on
    # each GPU, less its share of the weights and an activation reserve [est 3.5 GB]
    # (Llama-3-8B on one H200: 99.9 GiB).
    gpu_kv_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 3.5e9
    # vLLM engine (notes §7).
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    # vLLM's async scheduling (on by default from v0.14 with the multiproc executor):
    # EngineCore keeps two batches in flight, so a step's batch is formed one step ahead
    # and what changes during a step reaches a batch two steps on (engine.py, LAG_*).
    async_scheduling: bool = True
    # Host: free memory is the page cache's capacity [est: a quarter of a 1 TiB
    # host]; dirty pages throttle writers above the kernel's dirty limit [est: 20%
    # of it, vm.dirty_ratio].
    host_free_bytes: int = 256 * GiB
    dirty_ratio: float = 0.2

    def kv_bytes(self, model: ModelShape, gpu: GpuProfile) -> int:
        """The replica's KV cache in bytes (of the whole model's KV, all ``tp`` GPUs)."""
        if self.gpu_kv_bytes is not None:
            return self.gpu_kv_bytes
        per_gpu = gpu.hbm_bytes * self.gpu_memory_utilization - model.weight_bytes / self.tp - self.activation_reserve_bytes
        if per_gpu <= 0:
            share = f" over {self.tp} GPUs" if self.tp > 1 else ""
            raise ValueError(f"{model.name}'s weights ({size(model.weight_bytes)}{share}) leave no KV cache on "
                             f"one {gpu.name.upper()} of {size(gpu.hbm_bytes)}; give the replica's KV cache with "
                             f"--gpu-kv")
        return int(per_gpu * self.tp)
