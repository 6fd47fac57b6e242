"""Several replicas behind llm-d's router, the llm-d tiered-prefix-cache scenario, and a
trace offering more than the deployment serves."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvsim.cli import main
from kvsim.generate import SharedPrefixStages
from kvsim.gpu import load_gpu
from kvsim.hardware import Hardware
from kvsim.models import get_model
from kvsim.replay import ReplayConfig, Workload, build, replay
from kvsim.router import MAX_PREFIX_TOKENS, Router, RouterSpec
from kvsim.scenarios import LLMD_ROWS, get_scenario
from kvsim.tiers import parse_tier
from kvsim.trace import TraceRequest

MODEL = get_model("llama3-8b")


def test_the_benchmark_stages_replay_inference_perfs_order():
    st = SharedPrefixStages(rates=(5, 10), groups=4, prompts_per_group=2, system_len=512, question_len=128)
    stages = st.stages()
    assert [len(s) for s in stages] == [300, 600]
    assert [{r.phase for r in s} for s in stages] == [{"5 QPS"}, {"10 QPS"}]
    for s in stages:
        assert all(a.arrival_ns <= b.arrival_ns for a, b in zip(s, s[1:])) and 55e9 < s[-1].arrival_ns < 70e9
    prompts = [r.hash_ids for r in stages[0]]
    # Eight prompts, shuffled once, sent in order from the first in every stage.
    assert len(set(prompts)) == 8 and prompts[:16] == prompts[:8] * 2
    assert [r.hash_ids for r in stages[1][:8]] == prompts[:8]
    # A group's prompts share its system prompt's blocks, and nothing else.
    by_prefix = {}
    for p in set(prompts):
        by_prefix.setdefault(p[:4], set()).add(p)
    assert len(by_prefix) == 4 and all(len(v) == 2 for v in by_prefix.values())


def _groups_trace(groups: int, per_group: int, gap_ns: int) -> list[TraceRequest]:
    reqs = []
    for i in range(groups * per_group):
        g = i % groups
        prefix = tuple(range(g * 8, g * 8 + 8))
        reqs.append(TraceRequest(i * gap_ns, 9 * 512, 16, prefix + (10_000 + i,), 512))
    return reqs


def test_the_router_keeps_a_prefix_on_one_replica_and_spreads_cold_requests():
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=40 << 30), replicas=4)
    loop, engines, _ = build(_groups_trace(4, 6, 2 * 10**9), parse_tier("none"), cfg)
    loop.run()
    # Each group's first request is cold and goes to the replica that least recently got
    # one; its later requests follow their prefix there.
    homes = [{r.trace.hash_ids[0] for r in e.finished} for e in engines]
    assert sorted(len(h) for h in homes) == [1, 1, 1, 1] and len(set().union(*homes)) == 4
    assert all(len(e.finished) == 6 for e in engines)
    s, _ = replay(_groups_trace(4, 6, 2 * 10**9), parse_tier("none"), cfg)
    assert s["replicas"] == 4 and s["gpu_hit_rate"] > 0.8 * (20 / 24) * (8 / 9)


def test_without_the_prefix_scorers_the_router_only_balances():
    spec = RouterSpec(weights=(("queue", 1.0), ("kv-cache-utilization", 1.0)))
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=40 << 30), replicas=4, router=spec)
    blind, _ = replay(_groups_trace(4, 6, 2 * 10**9), parse_tier("none"), cfg)
    aware, _ = replay(_groups_trace(4, 6, 2 * 10**9), parse_tier("none"),
                      dataclasses.replace(cfg, router=RouterSpec()))
    assert blind["gpu_hit_rate"] < aware["gpu_hit_rate"]


def _idle_replicas(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(waiting=[], num_parked=0, gpu=SimpleNamespace(num_used=0, num_blocks=100))
            for _ in range(n)]


def test_the_router_hashes_a_prompts_first_4096_tokens_only():
    # llm-d's approximate prefix producer hashes 256 blocks of 16 tokens: 8 units of 512.
    assert MAX_PREFIX_TOKENS == 4096
    router = Router(RouterSpec().without("tier-prefix"), _idle_replicas(2), 16, 0, unit_tokens=512)
    a = tuple(range(40))
    b = a[:8] + tuple(range(100, 132))  # a's first 4,096 tokens, then a prompt of its own
    home = router.pick(a)
    belief = router.gpu[home]
    assert belief.matched(a) == 8 and belief.matched(a[8:]) == 0  # nothing past the hashed prefix
    assert belief.matched(b) == 8 and router.pick(b) == home      # alike to the router
    # A 40-unit prompt takes 8 of the belief's 16 entries, so its start is remembered; hashed
    # whole it would overflow them and the router would forget where the prompt began.
    whole = Router(RouterSpec(max_prefix_tokens=None).without("tier-prefix"), _idle_replicas(2), 16, 0, 512)
    assert whole.gpu[whole.pick(a)].matched(a) == 0


def test_router_flags_are_refused_without_a_router_and_mistakes_named(capsys):
    for flag, value in (("--router-prefix-tokens", "0"), ("--router-weights", "queue=2")):
        assert main(["trace", "replay", flag, value]) == 2
        assert f"{flag}: one replica: no router (--replicas N)" in capsys.readouterr().err
    for value, said in (("queue=2,gpu-prefx=3", "unknown 'gpu-prefx' (did you mean 'gpu-prefix'?)"),
                        ("queue", "expected SCORER=WEIGHT pairs"), ("queue=0", "must be a weight in (0, 1e+06]"),
                        ("queue=1,queue=2", "a name given twice")):
        assert main(["trace", "replay", "--scenario", "llm-d-cpu-offload", "--router-weights", value]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_the_baseline_run_is_routed_as_llmds_optimized_baseline():
    router = get_scenario("llm-d-cpu-offload").router
    # The CPU run: the guide's five scorers at 1; the HBM-only run ("Optimized Baseline"):
    # queue 2, KV-cache utilisation 2, prefix 3, no-hit LRU 2.
    assert dict(router.weights) == {s: 1.0 for s in ("queue", "kv-cache-utilization", "gpu-prefix", "tier-prefix",
                                                     "no-hit-lru")}
    assert dict(router.untiered().weights) == {"queue": 2.0, "kv-cache-utilization": 2.0, "gpu-prefix": 3.0,
                                               "no-hit-lru": 2.0}
    # Without a baseline of its own, the replicas without a tier drop the tier scorer only.
    assert RouterSpec().untiered().weights == RouterSpec().without("tier-prefix").weights


def test_a_disk_tier_under_tensor_parallelism_is_refused():
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), tp=2))
    with pytest.raises(ValueError, match=r"disk tier under tensor parallelism \(tp=2\) is not modelled"):
        replay(_groups_trace(1, 1, 1), parse_tier("disk:1TB"), cfg)


@pytest.mark.parametrize("flags, said", [
    (["--tp", "2"], "tier vllm-disk:1TiB: a disk tier under tensor parallelism (tp=2) is not modelled"),
    (["--tier", "none", "--tier", "cpu:1KB"], "tier cpu:1KB: smaller than one unit of 32 2097152-byte slots"),
])
def test_a_tier_that_cannot_be_set_up_is_one_line_before_anything_replays(capsys, flags, said):
    # The tiers before the one refused would replay first, and say what they model.
    trace = str(Path(__file__).parent / "kvsim_fixtures" / "mini_mooncake.jsonl")
    assert main(["trace", "replay", trace, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvsim: error: {said}") and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def llmd_run():
    """The scenario's JSON and what it said on stderr."""
    return _run_json(["trace", "replay", "--scenario", "llm-d-cpu-offload", "--json"])


@pytest.fixture(scope="module")
def llmd(llmd_run):
    return json.loads(llmd_run[0])


def _run_json(argv):
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0
    return out.getvalue(), err.getvalue()


def test_the_llmd_scenario_says_the_hardware_it_runs(llmd_run):
    # Issue 45: it ran 8 replicas of 2 H100s and said "hardware h200-ramdrive" (its IO
    # profile) on stderr.
    doc, err = json.loads(llmd_run[0]), llmd_run[1]
    assert ("kvsim: hardware 8 replicas of 2 H100s (TP=2) running qwen3-32b; IO profile h200-ramdrive (fitted to "
            "tests/data/bench_h200_array.json); load policy always\n") in err
    assert "hardware h200" not in err
    assert "qwen3-32b on 8 replicas of 2 H100s (TP=2), GPU KV 72.8 GiB each, IO profile h200-ramdrive" in doc["title"]


def test_the_llmd_scenario_is_the_guides_deployment(llmd):
    sc = get_scenario("llm-d-cpu-offload")
    assert (sc.replicas, sc.tp, sc.gpu, sc.model) == (8, 2, "h100", "qwen3-32b")
    assert llmd["replicas"] == 8 and llmd["gpu"] == "h100" and llmd["hardware"]["tp"] == 2
    # The guide's 2,384,000 GPU tokens over 8 replicas, at Qwen3-32B's 256 KiB per token.
    assert llmd["hardware"]["gpu_kv_bytes"] == 298_000 * 262_144
    # The JSON says how the router was set: hashing 4,096 tokens a prompt, believing each
    # replica's CPU holds 31,250 blocks of 16 tokens.
    assert llmd["router"]["max_prefix_tokens"] == 4096 and llmd["router"]["tier_belief_tokens"] == 500_000
    assert llmd["router"]["untiered_weights"] == {"queue": 2.0, "kv-cache-utilization": 2.0, "gpu-prefix": 3.0,
                                                  "no-hit-lru": 2.0}
    tiers = {t["tier"]: t for t in llmd["tiers"]}
    assert set(tiers) == {"none", "cpu:200GiB"}
    for t in tiers.values():
        assert [t["phases"][f"{r} QPS"]["requests"] for r in LLMD_ROWS] == [r * 60 for r in LLMD_ROWS]
    assert tiers["none"]["offload_hit_rate"] == 0 < tiers["cpu:200GiB"]["offload_hit_rate"]


def test_the_llmd_scenario_orders_the_tiers_and_collapses_as_published(llmd):
    pub = llmd["published"]
    rows = {(r["phase"], r["tier"]): r for r in pub["rows"]}
    assert len(rows) == 2 * len(LLMD_ROWS)
    for rate in LLMD_ROWS:
        none, cpu = rows[(f"{rate} QPS", "none")], rows[(f"{rate} QPS", "cpu:200GiB")]
        assert cpu["mean TTFT"]["kvsim"] < none["mean TTFT"]["kvsim"]  # offload first at every rate, as published
        assert cpu["mean TTFT"]["published"] < none["mean TTFT"]["published"]
        for r in (none, cpu):  # the output rate: 256 of each request's 16,512 tokens, kvsim's and the published
            out, total = r["output tokens/s"], r["tokens/s"]
            assert out["published"] == pytest.approx(total["published"] * 256 / 16512, rel=1e-3)
            assert out["kvsim"] == pytest.approx(total["kvsim"] * 256 / 16512, rel=1e-3)
    # Both runs collapse at the published rates.
    assert pub["collapses_at"] == {"none": {"kvsim": "10 QPS", "published": "10 QPS"},
                                   "cpu:200GiB": {"kvsim": "25 QPS", "published": "25 QPS"}}


def test_the_table_prints_each_rate_beside_the_published_figure(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["trace", "replay", "--scenario", "llm-d-cpu-offload", "--tier", "cpu:200GiB"]) == 0
    out = capsys.readouterr().out
    for rate, (_, offload) in LLMD_ROWS.items():
        row = next(line for line in out.splitlines() if line.startswith(f"│ {rate} QPS cpu:200GiB "))
        assert re.search(rf"/ {offload[0]:.2f} s\s+x\d+\.\d\d", row), row
    assert "collapses at" in out and "published: llm-d/llm-d guides/tiered-prefix-cache" in out
    assert "output tokens/s" in out and re.search(r"│ 15 QPS cpu:200GiB +│ +[\d,]+ / 3,8\d\d  x\d\.\d\d │", out)


def test_reload_flags_are_refused_with_the_llmd_scenario(capsys):
    assert main(["trace", "replay", "--scenario", "llm-d-cpu-offload", "--contexts", "4"]) == 2
    assert "--contexts: reload-scenario flags; scenario llm-d-cpu-offload is not a reload scenario" in \
        capsys.readouterr().err


# -- a trace offering more than the deployment serves ----------------------------------------


def _heavy_trace(path: Path) -> None:
    """Mooncake records: 8K-token prompts of their own at 8 per second for 60 s, about
    65,000 prompt tokens a second, well over what one H200 prefills of Llama-3-8B."""
    with path.open("w") as f:
        for i in range(480):
            ids = list(range(i * 16, i * 16 + 16))
            f.write(json.dumps({"timestamp": i * 125, "input_length": 8192, "output_length": 32,
                                "hash_ids": ids}) + "\n")


def _serves(argv: list[str], capsys) -> None:
    """A rerun with a setting the overload line gave: no overload line, no tier warning."""
    assert main(argv) == 0
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "kvsim: overloaded" not in text and "warning" not in text, text


def test_an_overloaded_trace_says_so_with_settings_that_serve_it(tmp_path, capsys):
    trace = tmp_path / "heavy.jsonl"
    _heavy_trace(trace)
    assert main(["trace", "replay", str(trace), "--tier", "none"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    m = re.search(r"kvsim: overloaded: the trace offers ([\d,]+) prompt tokens/s over 60 s \(480 requests\); one "
                  r"H200 serving llama3-8b served none ([\d,]+) tokens/s, so its TTFTs are mostly queueing\. Replayed "
                  r"to find what serves it \(every tier keeping up, queueing at most half its TTFT\): --replicas (\d+) "
                  r"does; --time-scale ([\d.]+) does", out)
    assert m, out
    offered, served = (int(g.replace(",", "")) for g in m.groups()[:2])
    assert abs(offered - 8192 * 480 / 59.875) < 1 and offered > served
    assert out.index("kvsim: overloaded") < out.index("GPU token hit rate")  # before the table
    assert "queueing for the GPU" not in out  # the line says why; no warning repeats it
    for fix in (["--replicas", m.group(3)], ["--time-scale", m.group(4)]):
        _serves(["trace", "replay", str(trace), "--tier", "none", *fix], capsys)


def _bursty_trace(path: Path) -> None:
    """Mooncake records as the conversation trace sends them, in bursts: every 3 s, 60
    distinct 4K-token prompts at one instant, for a minute (about 86,000 prompt tokens a
    second, twice what one H200 prefills of Llama-3-8B)."""
    with path.open("w") as f:
        for i in range(1200):
            f.write(json.dumps({"timestamp": i // 60 * 3000, "input_length": 4096, "output_length": 32,
                                "hash_ids": list(range(i * 8, i * 8 + 8))}) + "\n")


def test_the_overload_line_gives_no_time_scale_that_would_leave_bursts_queueing(tmp_path, capsys):
    # Issue 45: the Mooncake trace's line suggested --time-scale 2.5, the served rate with
    # headroom; replayed with it every tier still warned that queueing was 70-84% of its
    # TTFT, since its requests come in bursts that queue at any rate. Every value the line
    # gives now has been replayed on every tier and served it.
    trace = tmp_path / "bursty.jsonl"
    _bursty_trace(trace)
    argv = ["trace", "replay", str(trace), "--tier", "none", "--tier", "disk:1TiB"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    m = re.search(r"--replicas (\d+) does; --time-scale ([\d.]+) and 1,000,000 do not \(at 1,000,000 (none|disk:1TiB) "
                  r"still queues for (\d+)% of its TTFT; up to 60 requests arrive at one instant\)", captured.err)
    assert m and doc["overload"] in captured.err, captured.err
    assert doc["served_by"] == {"replicas": int(m.group(1)), "time_scale": None} and int(m.group(4)) > 50
    _serves([*argv, "--replicas", m.group(1)], capsys)
    # The rate rule's value (the first tried) keeps up with the arrivals, and still warns.
    assert main([*argv, "--time-scale", m.group(2), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["overload"] is None and all("queueing for the GPU" in t["warnings"][0] for t in doc["tiers"])


def test_a_trace_the_deployment_keeps_up_with_gets_no_overload_line(tmp_path, capsys):
    trace = tmp_path / "heavy.jsonl"
    _heavy_trace(trace)
    assert main(["trace", "replay", str(trace), "--tier", "none", "--time-scale", "20", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["overload"] is None and "kvsim: overloaded" not in captured.err


def test_the_page_cache_serves_reloads_only_from_memory_the_gpu_does_not_duplicate():
    # The default scenario's 32 GiB of free memory holds the contexts written last, which the
    # GPU holds too: no reload reads the page cache, so the drive reads what O_DIRECT reads.
    # With 256 GiB it holds every context: the drive reads nothing.
    sc = get_scenario("dram-limited-nvme")
    reqs = sc.workload.requests()
    for free, same in ((sc.host_free_bytes, True), (256 << 30, False)):
        hw = dataclasses.replace(Hardware(), host_free_bytes=free)
        cfg = ReplayConfig(get_model(sc.model), hw, sc.load_policy, gpu=load_gpu("h200"))
        direct, _ = replay(reqs, parse_tier("disk:200GB"), cfg)
        buffered, _ = replay(reqs, parse_tier("disk:200GB:pagecache"), cfg)
        assert direct["bytes_loaded"] == buffered["bytes_loaded"] > 0
        if same:
            assert buffered["disk_bytes_read"] == direct["disk_bytes_read"] == direct["bytes_loaded"]
        else:
            assert buffered["disk_bytes_read"] == 0 < direct["disk_bytes_read"]


def test_stages_start_once_the_one_before_has_drained():
    st = SharedPrefixStages(rates=(2, 4), stage_s=5, groups=2, prompts_per_group=2, system_len=512, question_len=128)
    work = Workload(tuple(st.stages()), 7 * 10**9)
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=8 << 30))
    s, _ = replay(work, parse_tier("none"), cfg)
    assert s["requests"] == 30 and list(s["phases"]) == ["2 QPS", "4 QPS"]
    first, second = s["phases"]["2 QPS"], s["phases"]["4 QPS"]
    assert second["first_arrival_s"] >= first["last_finish_s"] + 7
    assert second["tokens_per_s"] > first["tokens_per_s"]


def _burst(path: Path) -> None:
    with path.open("w") as f:
        for i in range(300):
            f.write(json.dumps({"timestamp": 0, "input_length": 8192, "output_length": 64,
                                "hash_ids": list(range(i * 16, i * 16 + 16))}) + "\n")


def test_a_burst_whose_stores_hold_the_gpu_drains_and_says_how_to_split_it(tmp_path, capsys):
    # 300 distinct 8K-token prompts at once: the GPU fills with blocks the disk tier's stores
    # still hold; the idle engine used to wait for a store completion that sends no event,
    # and the replay ended with requests waiting. It wakes at the first store's end now.
    trace = tmp_path / "burst.jsonl"
    _burst(trace)
    assert main(["trace", "replay", str(trace), "--tier", "disk:1TB", "--json"]) == 0
    captured = capsys.readouterr()
    t = json.loads(captured.out)["tiers"][0]
    assert t["requests"] == 300 and t["offload_hit_rate"] == 0
    m = re.search(r"kvsim: overloaded: the trace's 300 requests \(2,457,600 prompt tokens\) arrive at once; .* "
                  r"--replicas (\d+) does$", captured.err.strip())
    assert m and "--time-scale" not in captured.err, captured.err
    _serves(["trace", "replay", str(trace), "--tier", "disk:1TB", "--replicas", m.group(1)], capsys)
