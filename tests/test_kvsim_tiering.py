"""kvsim's two-level tier (``cpu:SIZE+disk:SIZE``): vLLM's CPU primary with kvoffload's
slot files as the secondary tier (kvsim/tiering.py, docs/kvsim.md)."""

from __future__ import annotations

import dataclasses

import pytest

from kvsim.generate import ReloadScenario
from kvsim.hardware import Hardware
from kvsim.models import get_model
from kvsim.profile import load_profile
from kvsim.replay import ReplayConfig, build, replay
from kvsim.tiers import KVOFFLOAD, parse_tier
from kvsim.trace import TraceRequest

MODEL = get_model("llama3-8b")
UNIT_BYTES = 512 * MODEL.kv_bytes_per_token  # one 512-token trace block: 64 MiB


def test_a_two_level_spec_parses_into_its_levels():
    t = parse_tier("cpu:8GiB+disk:100GB:pagecache:threads=4")
    assert (t.kind, t.capacity_bytes, t.pipeline, t.text) == ("cpu", 8 << 30, None,
                                                              "cpu:8GiB+disk:100GB:pagecache:threads=4")
    # The disk level is kvoffload's tier: the disk backend's pipeline, its default IO units too.
    alone = parse_tier("disk:100GB:pagecache:threads=4")
    assert (t.secondary.kind, t.secondary.capacity_bytes, t.secondary.pipeline) == (
        alone.kind, alone.capacity_bytes, alone.pipeline)
    assert t.page_cache  # --host-free applies to its disk level
    assert parse_tier("cpu:8GiB+disk:1TB").secondary.pipeline == KVOFFLOAD


@pytest.mark.parametrize("spec, match", [
    ("disk:1TB+cpu:8GiB", r"the first level must be the CPU primary, cpu:SIZE \(got 'disk:1TB'\)"),
    ("pagecache+disk:1TB", r"the first level must be the CPU primary, cpu:SIZE \(got 'pagecache'\)"),
    ("cpu:8GiB+cpu:1GiB", r"the second level must be kvoffload's disk tier, disk:SIZE\[:OPTION...\] \(got 'cpu:1GiB'\)"),
    ("cpu:8GiB+pagecache", r"the second level must be kvoffload's disk tier.*\(got 'pagecache'\)"),
    ("cpu:8GiB+vllm-disk:1TB", r"vllm-disk is vLLM's simple-offload disk backend, not a secondary tier"),
    ("cpu:8GiB+disk:1TB+disk:2TB", r"a two-level tier has two levels"),
    ("cpu:8GiB+", r"the second level must be kvoffload's disk tier"),
    ("cpu:8GiB:pagecache+disk:1TB", r"cpu takes no options"),
    ("cpu:8GiB+disk:0GB", r"^bad tier 'cpu:8GiB\+disk:0GB': size='0GB': must be > 0"),
])
def test_bad_two_level_specs_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_tier(spec)


def _revisit(tier: str) -> tuple[dict, object]:
    """Context X (16 units, 1 GiB), then Y, then X again. The GPU (18 units) and a
    1 GiB CPU level hold one context: Y evicts X from both; a 1 TB disk keeps it.

    Each decodes 32 tokens, at least 4 ms a step (the host's), so it still runs when
    its GPU -> CPU store (1 GiB, ~20 ms) is seen done, and the write-through to disk
    starts then. A request that ended first (2 tokens, once the compiled engine's
    steps got shorter) leaves the engine idle and its store unseen until the next
    arrival, as an idle vLLM engine polls no connector: Y's write-through would then
    start at X's revisit and pin every slot of the CPU level, leaving X no room to be
    promoted into, and X's GPU blocks, released when their store is seen done, would
    join the LRU in block order, so Y would evict X's first unit from the GPU."""
    x, y = tuple(range(100, 116)), tuple(range(200, 216))
    reqs = [TraceRequest(0, 8192 + 256, 32, x + (1,), 512), TraceRequest(2 * 10**9, 8192 + 256, 32, y + (2,), 512),
            TraceRequest(4 * 10**9, 8192 + 256, 32, x + (3,), 512)]
    hw = dataclasses.replace(Hardware(), gpu_kv_bytes=18 * UNIT_BYTES)
    # The fast-drive array: 1 GiB from disk takes less than recomputing 8K tokens.
    cfg = ReplayConfig(MODEL, hw, "always", load_profile("h200-array"))
    loop, (engine,), _ = build(reqs, parse_tier(tier), cfg)
    loop.run()
    return {r.rid: r for r in engine.finished}[2], engine.tier


def test_a_unit_evicted_from_the_cpu_level_is_served_from_disk_in_two_hops():
    # Goal: the two-level model. X left the GPU and the CPU level but is on disk: its
    # revisit loads it disk -> CPU (a promotion), then CPU -> GPU, each hop seen at a
    # step boundary; slower than a CPU hit, faster than recomputing.
    cpu_only, _ = _revisit("cpu:1GiB")
    assert cpu_only.load_blocks == 0  # Y did evict X from a 1 GiB CPU level
    two, tier = _revisit("cpu:1GiB+disk:1TB")
    assert two.load_blocks == cpu_only.load_blocks + 15 * 32  # the GPU still held X's first unit
    x_bytes = two.load_blocks * MODEL.kv_bytes_per_token * 16
    assert tier.bytes_promoted == x_bytes  # disk -> CPU
    assert tier.bytes_loaded == x_bytes  # CPU -> GPU: every byte crossed both hops
    assert tier.disk.stations[False].busy_ns != [0] * tier.disk.stations[False].servers
    dram, _ = _revisit("cpu:8GiB+disk:1TB")  # X stays in the CPU level: one hop
    recompute, _ = _revisit("none")
    ttft = {name: r.first_token_ns - r.arrival_ns for name, r in
            (("dram", dram), ("two", two), ("recompute", recompute))}
    assert dram.load_blocks == two.load_blocks and recompute.load_blocks == 0
    assert ttft["dram"] < ttft["two"] < ttft["recompute"]


def test_the_two_level_tier_on_the_reload_scenario():
    # Goal: the docs' row, as properties rather than figures. Under vLLM's policy
    # (always load), write-through means the disk level holds what a lone disk tier
    # would, and the CPU level what a lone CPU tier would: the two-level tier hits at
    # least as often as either. Its reloads are never faster than DRAM that holds
    # everything and, from the fast array, faster than recomputing. A CPU level
    # larger than the GPU cache holds contexts the GPU lost and beats the disk
    # alone; one that holds the whole working set serves every reload itself.
    reqs = ReloadScenario().requests()
    cfg = ReplayConfig(get_model("qwen3-32b"), Hardware(), "always", load_profile("h200-array"))
    tiers = ("none", "cpu:72GiB", "disk:100GB", "cpu:72GiB+disk:100GB", "cpu:8GiB+disk:100GB",
             "cpu:200GB", "cpu:200GB+disk:100GB")
    s = {t: replay(reqs, parse_tier(t), cfg)[0] for t in tiers}
    hit = {t: v["offload_hit_rate"] for t, v in s.items()}
    reload = {t: v["phases"]["reload"]["ttft_ms"] for t, v in s.items()}
    assert hit["cpu:72GiB+disk:100GB"] >= max(hit["cpu:72GiB"], hit["disk:100GB"]) > hit["cpu:72GiB"] > 0
    for two in ("cpu:72GiB+disk:100GB", "cpu:8GiB+disk:100GB"):
        assert s[two]["bytes_promoted"] > 0
        for p in ("p50", "p90", "p99"):
            assert reload["cpu:200GB"][p] <= reload[two][p] < reload["none"][p]
    assert reload["cpu:72GiB+disk:100GB"]["p50"] < reload["disk:100GB"]["p50"]
    assert s["cpu:200GB+disk:100GB"]["bytes_promoted"] == 0
    assert reload["cpu:200GB+disk:100GB"] == reload["cpu:200GB"]
