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


def test_missing_dir_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        tier.main(["--dir", str(tmp_path / "nope"), "--tiers", "kvoffload-direct"])
    assert str(e.value.code) == f"--dir {tmp_path / 'nope'}: no such directory (the tiers' files go there; create it first)"
