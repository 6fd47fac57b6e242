"""`python -m kvoffload.bench.tier --tiers kvoffload-direct`: kvoffload's tier without vLLM
(the GPU host has none): every chunk stored and loaded back, every byte checked."""

from __future__ import annotations

import json
import os

import pytest

from kvoffload.bench import tier


@pytest.mark.parametrize("seal", ["aes-gcm", "xxh3", "off"])
def test_direct_tier_round_trip_verifies_every_byte(capsys, tmp_path, seal):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    rc = tier.main(["--dir", str(d), "--gib", "0.03", "--primary-gib", "0.01", "--job-chunks", "2",
                    "--tiers", "kvoffload-direct", "--no-raw", "--json", "--seal", seal])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["seal"] == seal
    [row] = out["tiers"]
    assert row["tier"] == "kvoffload-direct" and row["verified"] and row["failed_jobs"] == 0
    assert row["seal"] == seal
    assert row["store_gib_s"] > 0 and row["store_again_gib_s"] > 0 and row["load_gib_s"] > 0 and row["files"] == 0
    assert row["direct_io"] == {"store": False, "load": False}  # the tier's default: staging
    assert os.listdir(d) == []


@pytest.mark.parametrize("seal", ["aes-gcm", "xxh3"])
def test_direct_io_both_gives_a_row_per_pass_order(capsys, tmp_path, seal):
    rc = tier.main(["--dir", str(tmp_path), "--gib", "0.02", "--primary-gib", "0.01", "--tiers", "kvoffload-direct",
                    "--no-raw", "--json", "--direct-io", "both", "--seal", seal])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    # Page-aligned 2 MiB rows: with direct_io, loads read straight into them; only checksums are stored from them.
    assert [t["direct_io"] for t in out["tiers"]] == [{"store": False, "load": False},
                                                      {"store": seal == "xxh3", "load": True}]
    assert [tier.label(t) for t in out["tiers"]] == ["kvoffload-direct (staged)", "kvoffload-direct (into rows)"]


def test_missing_dir_is_one_clear_line(tmp_path, capsys):
    assert tier.main(["--dir", str(tmp_path / "nope"), "--tiers", "kvoffload-direct"]) == 2
    assert capsys.readouterr().err == (f"python -m kvoffload.bench.tier: error: argument --dir: {tmp_path / 'nope'}: "
                                       "no such directory\n")


@pytest.mark.parametrize("argv, words", [
    (["--gib", "nan"], "argument --gib: must be a number of GiB"),
    (["--chunk-mib", "inf"], "argument --chunk-mib: must be a number of MiB"),
    (["--io-unit-mib", "1e-9"], "argument --io-unit-mib: must be a number of MiB, at least 1 byte"),
    (["--io-threads", "0"], "argument --io-threads: must be an integer in [1, 1024], got '0'"),
    (["--io-threads", "-1"], "argument --io-threads: must be an integer in [1, 1024], got '-1'"),
    (["--tiers", "kvofload"], "unknown 'kvofload' (did you mean 'kvoffload'?)"),
    (["--gib", "100000"], "--gib 100000: the run needs 107374182400000 bytes at once on"),
])
def test_mistakes_are_one_line_before_anything_runs(capsys, tmp_path, argv, words):
    """Issue 23: each of these was a traceback, a silent default (--io-threads 0), an empty
    table with "ok": true (--tiers kvofload), or a SlotFileError traceback after the raw
    ceilings had run (a run larger than its disk)."""
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    rc = tier.main(["--dir", str(d), "--tiers", "kvoffload-direct", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("python -m kvoffload.bench.tier: error: ") and words in err, err
    assert os.listdir(d) == []
