"""Hardware and engine defaults: H200, PCIe Gen5, NVMe Gen4 (simulation notes §4.3, §7).

[est] marks a guess to calibrate; everything else is the notes' measured or
documented figure.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    # GPU (notes §7).
    peak_tflops: float = 989.0
    hbm_tbps: float = 4.8
    mfu_prefill: float = 0.5
    decode_bw_eff: float = 0.7
    step_fixed_ms: float = 4.0
    # KV cache share of HBM [est]: 0.9 x 141 GB minus 8B weights and activations.
    gpu_kv_bytes: int = 100 * GiB
    # vLLM engine (notes §7).
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    # PCIe Gen5 x16, pinned, >= 64 MiB copies; ~7 us fixed per copy (notes §4.3).
    h2d_gbps: float = 55.0
    d2h_gbps: float = 55.0
    per_copy_us: float = 7.0
    # NVMe Gen4 x4 (BLIS nvme_gen4) with vLLM's disk backend: 1 thread, QD1 per lane.
    disk_read_gbps: float = 7.0
    disk_write_gbps: float = 5.0
    disk_base_us: float = 80.0
    # One outstanding O_DIRECT IO reaches far less than the device rating [est 2.5].
    disk_qd1_gbps: float = 2.5
    # IO threads per lane, IOs in flight per thread, and the unit a job is split
    # into over the threads (0: the whole job on one thread, as vLLM 0.33 does).
    # kvoffload's DiskBackend: 8 threads, 1 IO each, 16 MiB units.
    load_threads: int = 1
    store_threads: int = 1
    io_depth: int = 1
    io_unit_bytes: int = 0
    buffer_slots: int = 2
    # Page cache: a hit is a memcpy (~14 GB/s measured, 1 thread); capacity is the
    # host's free memory [est: a quarter of a 1 TiB host]; dirty pages throttle
    # writers above the kernel's dirty limit [est: 20% of it, vm.dirty_ratio].
    page_cache_gbps: float = 14.0
    # All threads' page-cache copies together: host memory bandwidth, shared with the
    # DMA (kvoffload's page-cache warm load reached 16-24 GiB/s on an H200 host with 8-16
    # threads, docs/performance.md).
    page_cache_max_gbps: float = 20.0
    host_free_bytes: int = 256 * GiB
    dirty_ratio: float = 0.2

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.max_num_batched_tokens > 0 and self.max_num_seqs > 0
        assert self.load_threads > 0 and self.store_threads > 0 and self.io_depth > 0
        assert self.io_unit_bytes >= 0 and self.page_cache_max_gbps > 0
        assert self.buffer_slots > 0 and self.mfu_prefill > 0
