"""Named reload scenarios: a workload, the tiers compared, and the deployment around them.

``python -m kvsim trace replay [--scenario NAME]`` replays one (default:
``dram-limited-nvme``); a flag given on the command line overrides the scenario's
choice (``--tier``, ``--model``, ``--hardware``, ``--load-policy``, ``--gpu-kv``,
``--host-free``, the workload flags). What each figure rests on is in docs/kvsim.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsim.generate import ReloadScenario

GiB = 1 << 30


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str  # one line: the deployment and the workload
    workload: ReloadScenario
    tiers: tuple[str, ...]
    model: str
    hardware: str  # an IO profile (profile.py)
    load_policy: str
    host_free_bytes: int  # the page cache's capacity
    gpu_kv_bytes: Optional[int] = None  # None: what vLLM allots on one H200 (hardware.py)


SCENARIOS = {s.name: s for s in (
    # What the disk tier exists for: host DRAM too small for the contexts, one fast local
    # drive, more contexts than the GPU cache holds, and reloads the GPU cannot all recompute.
    Scenario(
        "dram-limited-nvme",
        "Qwen3-32B on one H200, one NVMe-class drive (h200-ramdrive), 8 GiB DRAM tier, 32 GiB free host "
        "memory; 96 user contexts of 6,144 tokens after a 12,288-token shared prompt (160 GB of KV), "
        "visited at 0.5/s, then reloaded in shuffled order at 1/s",
        ReloadScenario(contexts=96),
        ("none", "cpu:8GiB", "disk:100GB", "disk:200GB", "vllm-disk:200GB", "disk:200GB:pagecache",
         "cpu:8GiB+disk:200GB"),
        "qwen3-32b", "h200-ramdrive", "always", 32 * GiB),
    # vLLM PR #49644's reload benchmark: vLLM's own disk backend on local NVMe, an 8 GB
    # DRAM tier against a 100 GB disk tier, then 32 GB of each, the page cache and none,
    # on a 128 GB host. The PR names no model, GPU or request rate: kvsim's reload
    # workload of 48 contexts (sized before this comparison so that 100 GB holds it and
    # 8 GB does not) on one H200 (docs/kvsim.md says what that implies).
    Scenario(
        "vllm-pr-49644",
        "vLLM PR #49644's reload benchmark: vLLM's disk backend on one NVMe-class drive (h200-ramdrive), "
        "128 GB host; assumed: Qwen3-32B on one H200, 48 user contexts of 6,144 tokens after a 12,288-token "
        "shared prompt (80 GB of KV), visited at 0.5/s, then reloaded in shuffled order at 1/s",
        ReloadScenario(),
        ("none", "cpu:8GiB", "vllm-disk:100GiB", "cpu:32GiB", "vllm-disk:32GiB", "vllm-disk:32GiB:pagecache"),
        "qwen3-32b", "h200-ramdrive", "always", 128 * GiB),
)}
DEFAULT_SCENARIO = "dram-limited-nvme"


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}") from None
