"""Trace readers, tier specs and block keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsim.request import block_keys
from kvsim.tiers import parse_bytes, parse_tier
from kvsim.trace import TraceError, TraceRequest, parse_lines, read_trace

MINI = Path(__file__).parent / "kvsim_fixtures" / "mini_mooncake.jsonl"


def _rec(**kw) -> str:
    base = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
    base.update(kw)
    return json.dumps(base)


def test_mooncake_records_parse():
    reqs = list(parse_lines([_rec(), _rec(timestamp=3000)]))
    assert reqs[1] == TraceRequest(3_000_000_000, 1000, 5, (0, 1), 512)


def test_kvsim_records_parse_with_their_block_size():
    line = json.dumps({"arrival_us": 7, "input_length": 40, "output_length": 1, "hash_ids": [3, 4, 5],
                       "block_tokens": 16})
    assert list(parse_lines([line])) == [TraceRequest(7000, 40, 1, (3, 4, 5), 16)]


@pytest.mark.parametrize("line, match", [
    ("{not json", r"^t:2: not JSON"),
    (_rec(hash_ids=[0]), r"^t:2: 1 hash_ids for input_length 1000: expected ceil\(1000/512\) = 2"),
    (_rec(input_length=0), r"^t:2: 'input_length' must be an integer >= 1"),
    (_rec(output_length="5"), r"^t:2: 'output_length' must be an integer"),
    (_rec(hash_ids=[0, -1]), r"^t:2: 'hash_ids' must be a list of non-negative integers"),
    ('{"timestamp": 0}', r"^t:2: mooncake record lacks hash_ids, input_length, output_length"),
    ("[1]", r"^t:2: expected a JSON object"),
])
def test_bad_records_name_their_line(line, match):
    with pytest.raises(TraceError, match=match):
        list(parse_lines([_rec(timestamp=5), line], "t"))


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


def test_block_keys_skip_partial_tails():
    # 1000 tokens = one full 512 block (32 keys) + 488 tokens (30 full 16-token blocks).
    keys = block_keys(TraceRequest(0, 1000, 1, (7, 9), 512), 16)
    assert keys == list(range(7 * 32, 8 * 32)) + list(range(9 * 32, 9 * 32 + 30))
    with pytest.raises(ValueError, match="not a multiple"):
        block_keys(TraceRequest(0, 1000, 1, (7, 9), 512), 24)


def test_sizes_and_tier_specs():
    assert parse_bytes("x", "8GiB") == 8 << 30
    assert parse_bytes("x", "100GB") == 100 * 10**9
    assert parse_bytes("x", "1.5TB") == 1_500_000_000_000
    assert parse_tier("none").kind == "none"
    t = parse_tier("disk:100GB:pagecache")
    assert (t.kind, t.capacity_bytes, t.page_cache, t.text) == ("disk", 10**11, True, "disk:100GB:pagecache")
    assert parse_tier("cpu:8GiB").page_cache is False


@pytest.mark.parametrize("spec, match", [
    ("gpu:8GiB", "use none, cpu:<size>"),
    ("cpu", "cpu needs a size"),
    ("disk:", "disk needs a size"),
    ("cpu:8GiB:pagecache", "cpu takes no options"),
    ("disk:8GiB:odirect", "the only disk option is 'pagecache'"),
    ("disk:8 parsecs", r"^bad tier 'disk:8 parsecs': size='8 parsecs': expected an integer number of bytes"),
    ("disk:0GB", r"^bad tier 'disk:0GB': size='0GB': must be > 0"),
])
def test_bad_tier_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_tier(spec)
