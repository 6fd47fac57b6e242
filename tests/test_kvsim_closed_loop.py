"""A closed loop (``--concurrency N``): N requests in flight, the next sent as one finishes."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from kvsim.cli import main
from kvsim.hardware import GiB, Hardware
from kvsim.models import get_model
from kvsim.replay import ReplayConfig, Workload, build, replay
from kvsim.tiers import parse_tier
from kvsim.trace import TraceRequest

MODEL = get_model("llama3-8b")


def _trace(n: int, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests of 1-8 blocks, some sharing a prefix, arrivals 10 s apart (unused by a closed loop)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        blocks = rng.randint(1, 8)
        prefix = rng.randrange(3)
        ids = tuple(range(prefix * 100, prefix * 100 + blocks // 2)) + tuple(range(10_000 + i * 10, 10_000 + i * 10
                                                                                    + blocks - blocks // 2))
        out.append(TraceRequest(i * 10**10, blocks * 512, rng.randint(1, 40), ids, 512))
    return out


def _run(reqs: list[TraceRequest], n: int, replicas: int = 1, tier: str = "none"):
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=4 * GiB), replicas=replicas)
    loop, engines, _ = build(reqs, parse_tier(tier), cfg, work=Workload((reqs,), concurrency=n))
    loop.run()
    return sorted((r for e in engines for r in e.finished), key=lambda r: r.rid), engines


@pytest.mark.parametrize("n, replicas, tier", [(1, 1, "none"), (3, 1, "cpu:8GiB"), (5, 3, "none"), (4, 2, "disk:64GB")])
def test_at_most_n_requests_are_in_flight_and_each_next_is_sent_as_one_finishes(n, replicas, tier):
    reqs = _trace(40)
    done, _ = _run(reqs, n, replicas, tier)
    assert [r.rid for r in done] == list(range(40))  # every request, in the trace's order
    assert all(r.trace is reqs[r.rid] for r in done)
    assert [r.arrival_ns for r in done[:n]] == [0] * n
    finishes = sorted(r.finish_ns for r in done)
    # The k-th request after the first n arrives when the k-th request finishes.
    assert [r.arrival_ns for r in done[n:]] == finishes[:40 - n]
    events = sorted([(r.arrival_ns, 1) for r in done] + [(r.finish_ns, -1) for r in done])
    in_flight, most = 0, 0
    for _, d in events:  # a finish before an arrival at the same instant
        in_flight += d
        most = max(most, in_flight)
    assert most == n


def test_a_closed_loop_as_wide_as_the_trace_is_the_trace_arriving_at_once():
    reqs = _trace(30)
    at_once = [dataclasses.replace(r, arrival_ns=0) for r in reqs]
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=4 * GiB))
    closed, t1 = replay(Workload((reqs,), concurrency=30), parse_tier("cpu:8GiB"), cfg)
    open_, t2 = replay(at_once, parse_tier("cpu:8GiB"), cfg)
    assert t1 == t2 and closed == open_


def test_a_request_refused_at_arrival_gives_its_place_to_the_next():
    reqs = _trace(10)
    reqs[1] = dataclasses.replace(reqs[1], input_length=200 * 512, hash_ids=tuple(range(50_000, 50_200)))
    cfg = ReplayConfig(MODEL, dataclasses.replace(Hardware(), gpu_kv_bytes=1 * GiB))
    s, _ = replay(Workload((reqs,), concurrency=2), parse_tier("none"), cfg)
    assert (s["requests"], s["rejected"]) == (9, 1)


def test_concurrency_on_the_command_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i * 10**6}, "input_length": 1024, "output_length": 8, '
                             f'"hash_ids": [{i}, {i + 1000}]}}\n' for i in range(12)))
    assert main(["trace", "replay", str(trace), "--tier", "none", "--concurrency", "3", "--json"]) == 0
    out = capsys.readouterr()
    assert "in a closed loop of 3" in out.out and "overloaded" not in out.err
    assert json.loads(out.out)["concurrency"] == 3
    for argv, message in [(["--concurrency", "3", "--time-scale", "2"],
                           "--time-scale: arrival times; --concurrency sends each request as one finishes"),
                          (["--concurrency", "0"], "argument --concurrency: must be an integer in [1, 1000000000]")]:
        assert main(["trace", "replay", str(trace), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert main(["trace", "replay", "--concurrency", "3"]) == 2
    assert "--concurrency: trace flags" in capsys.readouterr().err
