"""``python -m kvsim``: JSON, table, plot, errors, and the real Mooncake trace if present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsim.cli import main

MINI = str(Path(__file__).parent / "kvsim_fixtures" / "mini_mooncake.jsonl")
REAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
ARGS = ["trace", "replay", MINI, "--gpu-kv", "8GiB", "--time-scale", "4", "--tier", "none", "--tier", "disk:32GiB"]


def test_json_is_byte_identical_across_runs(capsys):
    assert main(ARGS + ["--json"]) == 0
    first = capsys.readouterr().out
    assert main(ARGS + ["--json"]) == 0
    assert capsys.readouterr().out == first
    doc = json.loads(first)
    assert [t["tier"] for t in doc["tiers"]] == ["none", "disk:32GiB"]
    assert doc["tiers"][1]["offload_hit_rate"] > 0 and doc["tiers"][0]["bytes_stored"] == 0


def test_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert main(ARGS + ["--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "TTFT P99" in out and "disk:32GiB" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_then_replay_the_file(capsys, tmp_path):
    trace = tmp_path / "reload.jsonl"
    assert main(["trace", "generate", "reload", "--contexts", "6", "-o", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 12
    assert main(["trace", "replay", str(trace), "--tier", "cpu:8GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"][0]["requests"] == 12


def test_bad_inputs_are_clear_errors(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{oops\n')
    assert main(["trace", "replay", str(bad)]) == 2
    assert f"kvsim: error: {bad}:2: not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "replay", MINI, "--tier", "tape:1TB"])
    assert "use none, cpu:<size>" in capsys.readouterr().err


def test_hitrate_oracle(capsys):
    assert main(["trace", "hitrate", MINI, "--capacity", "8GiB", "--capacity", "1TB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rates = [float(l.rsplit(" ", 1)[1]) for l in lines]
    assert 0 < rates[0] < rates[1] < 1


@pytest.mark.skipif(not REAL.exists(), reason="the shared Mooncake trace is not present")
def test_real_mooncake_trace_sampled(capsys):
    assert main(["trace", "replay", str(REAL), "--sample", "0.05", "--time-scale", "2",
                 "--tier", "none", "--tier", "disk:1TB", "--json"]) == 0
    none, disk = json.loads(capsys.readouterr().out)["tiers"]
    assert none["requests"] > 300
    assert disk["offload_hit_rate"] > 0
    assert disk["recomputed_tokens"] < none["recomputed_tokens"]
