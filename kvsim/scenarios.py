"""Named scenarios: a workload, the tiers compared, and the deployment around them.

``python -m kvsim trace replay [--scenario NAME]`` replays one (default:
``dram-limited-nvme``); a flag given on the command line overrides the scenario's
choice (``--tier``, ``--model``, ``--hardware``, ``--load-policy``, ``--gpu-kv``,
``--host-free``, ``--replicas``, the reload workload's flags). A scenario that
reproduces a published result carries the published table, and kvsim prints its
figures beside it. What each figure rests on is in docs/kvsim.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from kvsim.generate import ReloadScenario, SharedPrefixStages
from kvsim.router import UNTUNED_LRU_TOKENS, RouterSpec

GiB = 1 << 30


@dataclass(frozen=True)
class Published:
    """A published result: per phase (a rate stage) and configuration, mean and P90 TTFT,
    mean and P90 end-to-end latency in seconds, and total token throughput per second."""

    source: str
    configurations: dict[str, str]  # "none" / "offload": the name the source gives it
    rows: dict[tuple[str, str], tuple[float, float, float, float, float]]

    def row(self, phase: str, tier: str) -> Optional[tuple[float, float, float, float, float]]:
        return self.rows.get((phase, "none" if tier == "none" else "offload"))


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str  # one line: the deployment and the workload
    workload: Union[ReloadScenario, SharedPrefixStages]
    tiers: tuple[str, ...]
    model: str
    hardware: str  # an IO profile (profile.py)
    load_policy: str
    host_free_bytes: int  # the page cache's capacity
    gpu_kv_bytes: Optional[int] = None  # None: what vLLM allots (hardware.py), unless gpu_kv_tokens
    gpu_kv_tokens: Optional[int] = None  # the replica's KV cache in tokens, as a source states it
    gpu: str = "h200"
    tp: int = 1
    replicas: int = 1
    max_num_seqs: Optional[int] = None  # None: Hardware's
    router: RouterSpec = field(default_factory=RouterSpec)
    published: Optional[Published] = None


LLMD = "llm-d-cpu-offload"
SCENARIOS = {s.name: s for s in (
    # What the disk tier exists for: host DRAM too small for the contexts, one fast local
    # drive, more contexts than the GPU cache holds, and reloads the GPU cannot all recompute.
    # Sizes in GiB, kvsim's one convention (kvsim/units.py): 147 GiB of contexts, which a
    # 100 GiB disk holds two thirds of and a 200 GiB one all of.
    Scenario(
        "dram-limited-nvme",
        "Qwen3-32B on one H200, one NVMe-class drive (h200-ramdrive), 8 GiB DRAM tier, 32 GiB free host "
        "memory; 96 user contexts of 6,144 tokens after a 12,288-token shared prompt (147 GiB of KV), "
        "visited at 0.5/s, then reloaded in shuffled order at 1/s",
        ReloadScenario(contexts=96),
        ("none", "cpu:8GiB", "disk:100GiB", "disk:200GiB", "vllm-disk:200GiB", "disk:200GiB:pagecache",
         "cpu:8GiB+disk:200GiB"),
        "qwen3-32b", "h200-ramdrive", "always", 32 * GiB),
    # vLLM PR #49644's reload benchmark: vLLM's own disk backend on local NVMe, an 8 GB
    # DRAM tier against a 100 GB disk tier, then 32 GB of each, the page cache and none,
    # on a 128 GB host: its "GB" are GiB (its example's disk_capacity_bytes is
    # 107374182400; 8 GiB is vLLM's CPU default). The PR names no model, GPU or request rate: kvsim's reload
    # workload of 48 contexts (sized before this comparison so that 100 GB holds it and
    # 8 GB does not) on one H200 (docs/kvsim.md says what that implies).
    Scenario(
        "vllm-pr-49644",
        "vLLM PR #49644's reload benchmark: vLLM's disk backend on one NVMe-class drive (h200-ramdrive), "
        "128 GiB host; assumed: Qwen3-32B on one H200, 48 user contexts of 6,144 tokens after a 12,288-token "
        "shared prompt (75 GiB of KV), visited at 0.5/s, then reloaded in shuffled order at 1/s",
        ReloadScenario(),
        ("none", "cpu:8GiB", "vllm-disk:100GiB", "cpu:32GiB", "vllm-disk:32GiB", "vllm-disk:32GiB:pagecache"),
        "qwen3-32b", "h200-ramdrive", "always", 128 * GiB),
)}

# llm-d's tiered prefix cache guide, "CPU Offloading Benchmarking Results", GPU high
# cache scenario (llm-d/llm-d guides/tiered-prefix-cache/cpu/README.md, the version with
# all eight rates; guides/tiered-prefix-cache/README.md gives 5, 10, 20 and 40 QPS with
# the same figures): 16 H100s as 8 servers of TP=2, Qwen3-32B, the workload profile
# llm-d/llm-d-benchmark workload/profiles/inference-perf/guide_tiered-prefix-cache_1.yaml.in.
LLMD_ROWS = {
    5: ((1.62, 2.65, 11.98, 21.60, 74638.5), (1.17, 1.79, 11.49, 20.25, 82880.0)),
    10: ((8.08, 16.61, 26.28, 32.60, 122387.7), (0.41, 1.31, 6.97, 9.23, 167027.5)),
    15: ((23.19, 43.64, 41.79, 60.08, 121248.1), (0.38, 0.48, 7.66, 9.16, 247732.6)),
    20: ((43.67, 78.13, 62.29, 92.14, 114663.2), (0.89, 2.66, 9.03, 11.22, 300749.2)),
    25: ((61.01, 110.00, 79.91, 128.00, 113870.1), (4.80, 10.87, 13.24, 19.42, 318589.9)),
    30: ((78.79, 143.67, 97.77, 160.89, 118508.8), (12.06, 23.01, 20.58, 31.07, 328334.0)),
    35: ((97.24, 174.85, 116.54, 193.17, 116009.0), (19.28, 36.31, 27.81, 44.59, 324511.5)),
    40: ((115.57, 206.39, 134.78, 223.93, 115645.0), (25.38, 48.14, 33.95, 56.29, 331212.6)),
}
LLMD_PUBLISHED = Published(
    "llm-d/llm-d guides/tiered-prefix-cache/cpu/README.md, CPU Offloading Benchmarking Results (GPU, high cache)",
    {"none": "Optimized Baseline (HBM-only)", "offload": "GPU + CPU tier prefix aware routing"},
    {(SharedPrefixStages.phase(r), c): v for r, (base, off) in LLMD_ROWS.items()
     for c, v in (("none", base), ("offload", off))})
# The router's belief of each server's CPU cache: the guide's values file sets the CPU
# producer's lruCapacityPerServer to 82,000 blocks ("~200GB ... based on 160KB/token")
# with autoTune off, but the producer's makeserver then hands the indexer the constant
# 31,250 (kvsim/router.py); with 256 hashed blocks a prompt, both hold more prompts than
# a server is sent (docs/kvsim.md runs both).
# The HBM-only run is the table's "Optimized Baseline": llm-d's optimized-baseline router
# of the approximate-scorer releases weighs queue 2, KV-cache utilisation 2, prefix 3 and
# no-hit LRU 2 (its values file then; llm-d's default-plugins.yaml and the inference
# extension's standard deployment weigh prefix, KV-cache and queue 3:2:2 likewise).
LLMD_BASELINE_WEIGHTS = (("queue", 2.0), ("kv-cache-utilization", 2.0), ("gpu-prefix", 3.0), ("no-hit-lru", 2.0))
SCENARIOS[LLMD] = Scenario(
    LLMD,
    "llm-d's tiered prefix cache guide: Qwen3-32B on 8 replicas of 2 H100s (TP=2) behind llm-d's prefix-aware "
    "router, 298,000 tokens of GPU KV and 200 GiB of vLLM's CPU tier each; 250 groups x 5 prompts "
    "(16,000-token system prompt, 256-token question, 256 tokens out), Poisson stages of 60 s at 5 to 40 QPS",
    SharedPrefixStages(),
    ("none", "cpu:200GiB"),
    "qwen3-32b", "h200-ramdrive", "always", 256 * GiB,
    gpu_kv_tokens=2_384_000 // 8, gpu="h100", tp=2, replicas=8, max_num_seqs=1024,
    router=RouterSpec(tier_capacity_tokens=UNTUNED_LRU_TOKENS, untiered_weights=LLMD_BASELINE_WEIGHTS), published=LLMD_PUBLISHED)
DEFAULT_SCENARIO = "dram-limited-nvme"


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}") from None
