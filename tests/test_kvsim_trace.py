"""Trace readers, tier specs and prompt units."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvsim.request import prompt_units
from kvsim.tiers import KVOFFLOAD, VLLM_033, parse_bytes, parse_tier
from kvsim.trace import TraceError, TraceRequest, parse_lines, read_trace

MINI = Path(__file__).parent / "kvsim_fixtures" / "mini_mooncake.jsonl"


def _rec(**kw) -> str:
    base = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
    base.update(kw)
    return json.dumps(base)


def test_mooncake_records_parse():
    reqs = list(parse_lines([_rec(), _rec(timestamp=3000)]))
    assert reqs[1] == TraceRequest(3_000_000_000, 1000, 5, (0, 1), 512)


def test_kvsim_records_parse_with_their_block_size_and_phase():
    line = json.dumps({"arrival_us": 7, "input_length": 40, "output_length": 1, "hash_ids": [3, 4, 5],
                       "block_tokens": 16, "phase": "reload"})
    assert list(parse_lines([line])) == [TraceRequest(7000, 40, 1, (3, 4, 5), 16, "reload")]


@pytest.mark.parametrize("line, match", [
    ("{not json", r"^t:2: not JSON"),
    (_rec(hash_ids=[0]), r"^t:2: 1 hash_ids for input_length 1000: expected ceil\(1000/512\) = 2"),
    (_rec(input_length=0), r"^t:2: 'input_length' must be an integer in \[1, 1000000000\], got 0"),
    (_rec(output_length="5"), r"^t:2: 'output_length' must be an integer"),
    (_rec(hash_ids=[0, -1]), r"^t:2: 'hash_ids' must be a list of integers in \[0, 2\*\*64\)"),
    ('{"timestamp": 0}', r"^t:2: mooncake record lacks hash_ids, input_length, output_length"),
    ("[1]", r"^t:2: expected a JSON object"),
])
def test_bad_records_name_their_line(line, match):
    with pytest.raises(TraceError, match=match):
        list(parse_lines([_rec(timestamp=5), line], "t"))


@pytest.mark.parametrize("line, match", [
    # Each figure in its range (kvsim/limits.py), refused where the record is read.
    (_rec(output_length=10**30), r"^t:2: 'output_length' must be an integer in \[0, 1000000000\], got 1000000000000000000000000000000$"),
    (_rec(input_length=2**62), r"^t:2: 'input_length' must be an integer in \[1, 1000000000\], got 4611686018427387904$"),
    (_rec(timestamp=10**30), r"^t:2: 'timestamp' must be an integer in \[0, 9223372036854\] \(ms\), got 1000000000000000000000000000000$"),
    (_rec(timestamp=10**300), r"^t:2: 'timestamp' must be an integer in \[0, 9223372036854\] \(ms\), got 1000000000000000000000000000000000000000\.\.\. \(301 characters\)$"),
    (_rec(output_length=float("nan")), r"^t:2: 'output_length' must be an integer in \[0, 1000000000\], got nan$"),
    (_rec(output_length=float("inf")), r"^t:2: 'output_length' must be an integer in \[0, 1000000000\], got inf$"),
    ('{"timestamp": 1' + "0" * 5000 + ', "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}',
     r"^t:2: not a trace record: an integer of more than 4300 digits$"),
])
def test_absurd_figures_in_a_record_name_their_line(line, match):
    with pytest.raises(TraceError, match=match):
        list(parse_lines([_rec(timestamp=5), line], "t"))


@pytest.mark.parametrize("record, match", [
    ({"arrival_us": 2**63, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
     r"^t:2: 'arrival_us' must be an integer in \[0, 9223372036854775\] \(us\)"),
    ({"arrival_us": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0], "block_tokens": 10**30},
     r"^t:2: 'block_tokens' must be an integer in \[1, 1000000000\]"),
])
def test_absurd_figures_in_a_kvsim_record_name_their_line(record, match):
    first = json.dumps({"arrival_us": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]})
    with pytest.raises(TraceError, match=match):
        list(parse_lines([first, json.dumps(record)], "t"))


def test_the_largest_figures_a_record_may_hold_still_replay(tmp_path, capsys):
    # The bounds are far beyond a deployment, and what they allow runs: the latest arrival
    # (int64 ns) stretched a million-fold, an output of a billion tokens (more than the
    # model's context: refused at arrival, as vLLM refuses it).
    from kvsim.cli import main
    t = tmp_path / "t.jsonl"
    t.write_text(_rec(timestamp=0) + "\n" + _rec(timestamp=(2**63 - 1) // 10**6) + "\n"
                 + _rec(timestamp=(2**63 - 1) // 10**6, output_length=10**9) + "\n")
    assert main(["trace", "replay", str(t), "--tier", "none", "--time-scale", "1000000", "--json"]) == 0
    tier = json.loads(capsys.readouterr().out)["tiers"][0]
    assert (tier["requests"], tier["rejected"]) == (2, 1)
    assert tier["makespan_s"] >= (2**63 - 1) * 10**6 / 1e9 * 0.99


@pytest.mark.parametrize("field, value", [("output_length", 10**30), ("timestamp", 10**30), ("input_length", 2**62)])
def test_an_absurd_trace_on_the_command_line_is_one_line(tmp_path, capsys, field, value):
    from kvsim.cli import main
    t = tmp_path / "t.jsonl"
    t.write_text(_rec() + "\n" + _rec(**{field: value}) + "\n")
    for argv in (["trace", "replay", str(t)], ["trace", "hitrate", str(t), "--capacity", "8GiB"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"kvsim: error: {t}:2: '{field}' must be an integer in [")
        assert err.count("\n") == 1


def test_a_bad_phase_names_its_line():
    line = '{"arrival_us": 0, "input_length": 1, "output_length": 1, "hash_ids": [0], "phase": 3}'
    with pytest.raises(TraceError, match=r"^t:1: 'phase' must be a non-empty string, got 3"):
        list(parse_lines([line], "t"))


def test_unknown_first_record_format():
    with pytest.raises(TraceError, match=r"^t:1: neither a Mooncake record \(timestamp\) nor a kvsim"):
        list(parse_lines(['{"foo": 1}'], "t"))


def test_arrivals_going_backwards_are_an_error():
    with pytest.raises(TraceError, match=r"^t:3: arrival goes backwards"):
        list(parse_lines([_rec(timestamp=5), "", _rec(timestamp=4)], "t"))


def test_time_scale_sample_and_limit():
    full = read_trace(str(MINI))
    slow = read_trace(str(MINI), time_scale=2.5)
    assert [r.arrival_ns * 2.5 for r in full] == [r.arrival_ns for r in slow]
    half = read_trace(str(MINI), sample=0.5, seed=1)
    assert 0.2 * len(full) < len(half) < 0.8 * len(full)
    assert half == read_trace(str(MINI), sample=0.5, seed=1)
    # Whole conversations: a kept request's conversation root is kept every time.
    roots = {r.hash_ids[1] for r in half if len(r.hash_ids) > 1}
    assert all(r in half for r in full if len(r.hash_ids) > 1 and r.hash_ids[1] in roots)
    assert len(read_trace(str(MINI), limit=7)) == 7


def test_empty_trace_is_an_error(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(str(p))


def test_prompt_units_weigh_full_vllm_blocks_only():
    # 1000 tokens = one full 512 block (32 vLLM blocks) + 488 tokens (30 full 16-token blocks).
    u = prompt_units(TraceRequest(0, 1000, 1, (7, 9), 512), 16)
    assert (u.keys, u.per_unit, u.last) == ([7, 9], 32, 30)
    assert [u.blocks(n) for n in range(3)] == [0, 32, 62]
    assert [u.within(b) for b in (0, 31, 32, 61, 62, 99)] == [0, 0, 1, 1, 2, 2]
    # A last trace block shorter than one vLLM block holds nothing cacheable.
    u = prompt_units(TraceRequest(0, 520, 1, (7, 9), 512), 16)
    assert (u.keys, u.last, u.blocks(1)) == ([7], 32, 32)
    with pytest.raises(ValueError, match="not a multiple"):
        prompt_units(TraceRequest(0, 1000, 1, (7, 9), 512), 24)


def test_sizes_follow_kvoffloads_parser():
    assert parse_bytes("x", "8GiB") == 8 << 30
    assert parse_bytes("x", "100GB") == 100 * 10**9
    assert parse_bytes("x", "1.5TB") == 1_500_000_000_000
    assert parse_bytes("x", "4096") == 4096


def test_tier_specs_name_their_pipeline():
    assert parse_tier("none").kind == "none"
    t = parse_tier("disk:100GB:pagecache")
    assert (t.kind, t.capacity_bytes, t.page_cache, t.text) == ("disk", 10**11, True, "disk:100GB:pagecache")
    assert t.pipeline == dataclasses.replace(KVOFFLOAD, page_cache=True)
    assert parse_tier("vllm-disk:1TB").pipeline == VLLM_033
    assert parse_tier("cpu:8GiB").pipeline is None and not parse_tier("cpu:8GiB").page_cache
    t = parse_tier("disk:1TB:threads=16:ios-per-thread=2:unit=4MiB:seal=xxh3:paths=4")
    assert (t.pipeline.threads, t.pipeline.ios_per_thread, t.pipeline.unit_bytes, t.pipeline.seal,
            t.pipeline.paths) == (16, 2, 4 << 20, "xxh3", 4)
    assert parse_tier("vllm-disk:1TB:threads=4").pipeline.threads == 4


@pytest.mark.parametrize("spec, match", [
    ("gpu:8GiB", "use none, cpu:SIZE, disk:SIZE"),
    ("cpu", "cpu needs a size"),
    ("disk:", "disk needs a size"),
    ("cpu:8GiB:pagecache", "cpu takes no options"),
    ("disk:8GiB:odirect", "unknown option 'odirect'; disk takes pagecache, threads"),
    ("vllm-disk:8GiB:seal=xxh3", "unknown option 'seal=xxh3'; vllm-disk takes pagecache, threads, ios-per-thread"),
    ("disk:8GiB:threads=0", r"threads='0' must be an integer >= 1"),
    ("disk:8GiB:ios-per-thread=two", r"ios-per-thread='two' must be an integer >= 1"),
    ("disk:8GiB:threads", "threads needs a value"),
    ("disk:8GiB:pagecache=1", "pagecache takes no value"),
    ("disk:8GiB:pagecache:pagecache", "option pagecache given twice"),
    ("disk:8GiB:seal=rot13", "seal='rot13': use one of aes-gcm, xxh3, off"),
    ("disk:8GiB:unit=0MiB", "unit='0MiB': must be > 0"),
    ("disk:8 parsecs", r"^bad tier 'disk:8 parsecs': size='8 parsecs': expected an integer number of bytes"),
    ("disk:0GB", r"^bad tier 'disk:0GB': size='0GB': must be > 0"),
])
def test_bad_tier_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_tier(spec)
