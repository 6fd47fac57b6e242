"""kvsim's engine: step timing around loads, and the load-or-recompute estimate."""

from __future__ import annotations

from kvsim.hardware import Hardware
from kvsim.models import get_model
from kvsim.replay import ReplayConfig, build
from kvsim.tiers import parse_tier
from kvsim.trace import TraceRequest

MODEL = get_model("llama3-8b")


def test_a_load_started_in_a_decode_only_step_resumes_at_the_next_boundary():
    # Goal: the decode fast-forward must stop for a load that starts in the same
    # step. Request 0 decodes 2,000 tokens alone; request 1 arrives at 100 ms with
    # 64 blocks in the CPU tier and is parked. Its load takes a few ms, so it must
    # resume within a few decode steps (~5 ms each), not when the run of decode
    # steps ends. Before the fix it resumed 17.6 s after arriving.
    long_decode = TraceRequest(0, 600, 2000, (1000, 1001), 512)
    loader = TraceRequest(100_000_000, 1100, 4, (1, 2, 3), 512)
    loop, engine = build([long_decode, loader], parse_tier("cpu:8GiB"), ReplayConfig(MODEL, Hardware(), "always"))
    engine.tier.store(0, list(range(32, 3 * 32)))  # trace blocks 1 and 2
    engine.tier.poll(10**18)
    loop.run()
    r = next(r for r in engine.finished if r.rid == 1)
    assert r.load_blocks == 64
    assert r.resumed_ns - r.arrival_ns < 50_000_000
