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


def test_repeat_runs_every_case_each_round_in_alternating_order(capsys, tmp_path):
    rc = tier.main(["--dir", str(tmp_path), "--gib", "0.02", "--primary-gib", "0.01", "--tiers", "kvoffload-direct",
                    "--no-raw", "--json", "--direct-io", "both", "--repeat", "3"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    got = [(t["round"], tier.label(t)) for t in out["tiers"]]
    staged, rows = "kvoffload-direct (staged)", "kvoffload-direct (into rows)"
    assert got == [(1, staged), (1, rows), (2, rows), (2, staged), (3, staged), (3, rows)]
    assert out["ratios"] == [] and out["ratio_spread"] == []  # no fs row to divide by


def test_ratios_pair_rows_of_one_round_and_spread_gives_median_and_range():
    def row(name, rnd, load, **kw):
        return {"tier": name, "dirs": 1, "round": rnd, "store_gib_s": 1.0, "store_again_gib_s": 2.0,
                "load_gib_s": load, "direct_io": {"store": False, "load": False}, **kw}

    tiers = [row("kvoffload-direct", 1, 3.0), row("fs-core", 1, 2.0, fs_io="C"),
             row("fs-core", 2, 4.0, fs_io="C"), row("kvoffload-direct", 2, 2.0),
             row("kvoffload-direct", 3, 6.0), row("fs-core", 3, 4.0, fs_io="C")]
    rs = tier.ratios(tiers)
    assert [(r["round"], r["load"]) for r in rs] == [(1, 1.5), (2, 0.5), (3, 1.5)]  # never across rounds
    [spread] = tier.ratio_spread(rs)
    assert spread["rounds"] == 3 and spread["load"] == {"median": 1.5, "min": 0.5, "max": 1.5}
    assert spread["store"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    text = tier.table({"chunks": 1, "chunk_bytes": 4096, "job_chunks": 1, "primary_chunks": 1, "seal": "aes-gcm",
                       "dirs": ["d"], "tiers": [dict(t, store_cpu_s_per_gib=0.1, load_cpu_s_per_gib=0.1,
                                                     load_of_raw_read=None, files=0, verified=True) for t in tiers],
                       "ratios": rs, "ratio_spread": [spread]})
    assert "median (range) of 3 rounds: store 1.00x (1.00-1.00), again 1.00x (1.00-1.00), load 1.50x (0.50-1.50)" in text
    assert "kvoffload-direct (staged) #2" in text and ", round 2: " in text
