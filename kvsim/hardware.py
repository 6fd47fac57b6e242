"""The GPU, the vLLM engine settings and the host (simulation notes §4.4, §7).

IO rates (drive, page cache, PCIe, sealing) live in the calibrated IO profile
(profile.py). [est] marks a guess; everything else is the notes' measured or
documented figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsim.models import ModelShape

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    # H200 (notes §7).
    peak_tflops: float = 989.0
    hbm_tbps: float = 4.8
    hbm_bytes: float = 141e9
    mfu_prefill: float = 0.5
    decode_bw_eff: float = 0.7
    step_fixed_ms: float = 4.0
    # KV cache: None = what vLLM allots at gpu_memory_utilization 0.9, less the
    # weights and an activation reserve [est 3.5 GB] (Llama-3-8B: 107 GB).
    gpu_kv_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 3.5e9
    # vLLM engine (notes §7).
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    # Host: free memory is the page cache's capacity [est: a quarter of a 1 TiB
    # host]; dirty pages throttle writers above the kernel's dirty limit [est: 20%
    # of it, vm.dirty_ratio].
    host_free_bytes: int = 256 * GiB
    dirty_ratio: float = 0.2

    def kv_bytes(self, model: ModelShape) -> int:
        if self.gpu_kv_bytes is not None:
            return self.gpu_kv_bytes
        kv = self.hbm_bytes * self.gpu_memory_utilization - model.weight_bytes - self.activation_reserve_bytes
        if kv <= 0:
            raise ValueError(f"{model.name}'s weights ({model.weight_bytes / 1e9:.0f} GB) leave no KV cache on one "
                             f"{self.hbm_bytes / 1e9:.0f} GB GPU; give the KV cache of one rank with --gpu-kv")
        return int(kv)
