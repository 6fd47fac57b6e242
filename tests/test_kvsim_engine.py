"""kvsim's engine and reports: step timing around loads, the load-or-recompute
estimate, and the honest parts of the summary (overload, threads, queued work)."""

from __future__ import annotations

import dataclasses

from kvsim.hardware import GiB, Hardware
from kvsim.models import get_model
from kvsim.replay import ReplayConfig, build, replay
from kvsim.tiers import parse_tier
from kvsim.trace import TraceRequest

MODEL = get_model("llama3-8b")


def _run_with_tier_holding(requests, tier: str, units: list[int], policy: str = "always"):
    loop, (engine,), _ = build(requests, parse_tier(tier), ReplayConfig(MODEL, Hardware(), policy))
    granted = engine.tier.pool.prepare_store(units)
    engine.tier.pool.complete_store([h for h, _ in granted], ok=True)
    loop.run()
    return {r.rid: r for r in engine.finished}


def test_a_load_started_in_a_decode_only_step_resumes_at_the_next_boundary():
    # Goal: the decode fast-forward must stop for a load that starts in the same
    # step. Request 0 decodes 2,000 tokens alone; request 1 arrives at 100 ms with
    # 64 blocks in the CPU tier and is parked. Its load takes a few ms, so it must
    # resume within a few decode steps (~5 ms each), not when the run of decode
    # steps ends. Before the fix it resumed 17.6 s after arriving.
    long_decode = TraceRequest(0, 600, 2000, (1000, 1001), 512)
    loader = TraceRequest(100_000_000, 1100, 4, (1, 2, 3), 512)
    r = _run_with_tier_holding([long_decode, loader], "cpu:8GiB", [1, 2])[1]
    assert r.load_blocks == 64
    assert r.resumed_ns - r.arrival_ns < 50_000_000


def test_the_engine_expects_a_load_at_the_step_boundary_that_sees_it():
    # Goal: the `faster` policy compares when a load is seen complete with when a
    # recompute would be done, so that expectation must hold. A load is seen at a
    # step boundary: here 20 prompts of 6,000 tokens keep every step a full
    # 8,192-token prefill (~0.25 s); request 10 (between them in the queue) loads 2
    # units from DRAM in a few ms. It must be expected at the next boundary, within
    # a tenth of a step. The old estimate priced the polling at 4 ms: ~0.24 s early.
    prefills = [TraceRequest(0, 6000, 4, tuple(range(100 * i + 1000, 100 * i + 1012)), 512) for i in range(20)]
    loader = TraceRequest(0, 1100, 4, (1, 2, 3), 512)
    r = _run_with_tier_holding(prefills[:10] + [loader] + prefills[10:], "cpu:8GiB", [1, 2])[10]
    assert r.load_blocks == 64
    step = r.resumed_ns - r.admitted_ns
    assert step > 200_000_000  # it did wait for a long step
    assert abs(r.resumed_ns - r.load_eta_ns) < step / 10


def test_an_overloaded_gpu_is_reported():
    # Goal: a TTFT made of queueing is flagged, not printed as a normal result.
    # 40 requests of 16K new tokens each arrive at once: ~0.5 s of prefill each.
    burst = [TraceRequest(0, 16_384, 1, tuple(range(i * 100, i * 100 + 32)), 512) for i in range(40)]
    s, _ = replay(burst, parse_tier("none"), ReplayConfig(MODEL))
    assert s["queue_share_of_ttft"] > 0.5
    assert "queueing for the GPU is" in s["warnings"][0] and "overloaded" in s["warnings"][0]
    calm = [dataclasses.replace(r, arrival_ns=i * 2_000_000_000) for i, r in enumerate(burst)]
    s, _ = replay(calm, parse_tier("none"), ReplayConfig(MODEL))
    assert s["queue_share_of_ttft"] < 0.1 and s["warnings"] == []


def test_thread_utilisation_and_the_stores_still_queued_at_the_end():
    # Goal: vLLM's single store thread is reported busy when it is (the drive's
    # share can be far lower), and stores still queued when the last request
    # finishes are reported with their drain time instead of vanishing.
    reqs = [TraceRequest(i * 200_000_000, 16_384, 1, tuple(range(i * 100, i * 100 + 32)), 512) for i in range(20)]
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=100 * GiB))
    vllm, _ = replay(reqs, parse_tier("vllm-disk:1TB"), cfg)
    kvo, _ = replay(reqs, parse_tier("disk:1TB"), cfg)
    assert vllm["io_threads_busy"]["store"]["mean"] > 0.9
    assert vllm["disk_write_util"] < vllm["io_threads_busy"]["store"]["mean"]
    pending = vllm["stores_pending_at_end"]
    assert pending["jobs"] > 0 and pending["bytes"] > 0 and pending["drain_s"] > 1
    assert kvo["stores_pending_at_end"]["drain_s"] < pending["drain_s"]
    assert kvo["io_threads_busy"]["store"]["mean"] < vllm["io_threads_busy"]["store"]["mean"]


def _finished(requests, hw: Hardware, tier: str = "none", held: tuple = ()) -> dict:
    loop, (engine,), _ = build(requests, parse_tier(tier), ReplayConfig(MODEL, hw))
    if held:
        granted = engine.tier.pool.prepare_store(list(held))
        engine.tier.pool.complete_store([h for h, _ in granted], ok=True)
    loop.run()
    return {r.rid: r for r in engine.finished}


SYNC = dataclasses.replace(Hardware(), async_scheduling=False)


def test_async_scheduling_puts_the_batch_already_formed_before_an_arrival():
    # Goal: vLLM's async scheduling as EngineCore runs it (two batches in flight). Request
    # 0 prefills 8,000 tokens in one long step; request 1 arrives during it. Synchronous,
    # 1 joins the batch right after that step, beside 0's first decode. Async, that batch
    # was formed before 1 arrived (0's decode alone), so 1 runs one short step later. Both
    # admit it at the same boundary, and an idle engine takes a request at once.
    long = TraceRequest(0, 8000, 64, tuple(range(16)), 512)
    late = TraceRequest(20_000_000, 512, 4, (100,), 512)
    sync, asyn = _finished([long, late], SYNC), _finished([long, late], Hardware())
    assert sync[0].first_token_ns == asyn[0].first_token_ns > 100_000_000
    assert sync[1].admitted_ns == asyn[1].admitted_ns == asyn[0].first_token_ns
    decode_step = (sync[0].finish_ns - sync[0].first_token_ns) / 63
    gap = asyn[1].first_token_ns - sync[1].first_token_ns
    assert 0.5 * decode_step < gap < 2 * decode_step


def test_async_scheduling_runs_a_finished_load_three_steps_after_the_worker_sees_it():
    # Goal: a load is seen when the worker launches a step (at the previous one's end); it
    # reaches the scheduler with that step's output and its request runs two steps later:
    # three decode steps of request 0 between the boundary that saw the load and the
    # loader's batch, where a synchronous engine runs it in the next. Alone on the engine
    # (no batch in flight) a loaded request runs at once either way.
    long_decode = TraceRequest(0, 600, 2000, (1000, 1001), 512)
    loader = TraceRequest(100_000_000, 1100, 4, (1, 2, 3), 512)
    runs = {name: _finished([long_decode, loader], hw, "cpu:8GiB", (1, 2)) for name, hw in
            (("sync", SYNC), ("async", Hardware()))}
    waits = {name: r[1].first_token_ns - r[1].resumed_ns for name, r in runs.items()}
    assert all(r[1].load_blocks == 64 for r in runs.values())
    decode_step = (runs["sync"][0].finish_ns - runs["sync"][0].first_token_ns) / 1999
    assert 2.5 * decode_step < waits["async"] - waits["sync"] < 3.5 * decode_step
    alone = {name: _finished([dataclasses.replace(loader, arrival_ns=0)], hw, "cpu:8GiB", (1, 2))[0]
             for name, hw in (("sync", SYNC), ("async", Hardware()))}
    assert alone["sync"].first_token_ns == alone["async"].first_token_ns


def test_async_scheduling_frees_a_finished_requests_blocks_for_the_batch_after_next():
    # Goal: a request's blocks return when the scheduler takes its last output, after the
    # next batch was formed. The GPU holds 110 blocks: requests 0 (38 blocks, 8 tokens
    # out) and 2 (63 blocks, decoding long) run; request 1 (38 blocks) waits for 0's.
    # Synchronous, 1 is admitted at the boundary where 0 finishes; async, one decode step
    # of request 2 later. Request 2 keeps the engine busy (an idle one frees at once).
    block = 16 * MODEL.kv_bytes_per_token
    hw = dataclasses.replace(Hardware(), gpu_kv_bytes=111 * block)
    reqs = [TraceRequest(0, 600, 8, (1, 2), 512), TraceRequest(0, 600, 400, (3, 4), 512),
            TraceRequest(0, 600, 4, (5, 6), 512)]
    sync = _finished(reqs, dataclasses.replace(hw, async_scheduling=False))
    asyn = _finished(reqs, hw)
    assert sync[2].admitted_ns == sync[0].finish_ns > 0
    decode_step = (sync[1].finish_ns - sync[1].first_token_ns) / 399
    assert 0.5 * decode_step < asyn[2].admitted_ns - asyn[0].finish_ns < 2 * decode_step
