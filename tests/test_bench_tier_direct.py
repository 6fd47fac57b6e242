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
    # Page-aligned 2 MiB rows: loads read straight into them; only checksums are stored from them.
    assert row["direct_io"] == {"store": seal != "aes-gcm", "load": True}
    assert os.listdir(d) == []


def test_direct_io_off_stages_every_byte(capsys, tmp_path):
    rc = tier.main(["--dir", str(tmp_path), "--gib", "0.02", "--primary-gib", "0.01", "--tiers", "kvoffload-direct",
                    "--no-raw", "--json", "--direct-io", "off"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["tiers"][0]["direct_io"] == {"store": False, "load": False}
    assert "kvoffload-direct (staged)" in tier.table(out)


def test_missing_dir_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        tier.main(["--dir", str(tmp_path / "nope"), "--tiers", "kvoffload-direct"])
    assert str(e.value.code) == f"--dir {tmp_path / 'nope'}: no such directory (the tiers' files go there; create it first)"
