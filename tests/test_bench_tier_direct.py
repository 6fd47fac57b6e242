"""`python -m kvoffload.bench.tier --tiers kvoffload-direct`: kvoffload's tier without vLLM
(the GPU host has none): every chunk stored and loaded back, every byte checked."""

from __future__ import annotations

import json
import os

from kvoffload.bench import tier


def test_direct_tier_round_trip_verifies_every_byte(capsys, tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    rc = tier.main(["--dir", str(d), "--gib", "0.03", "--primary-gib", "0.01", "--job-chunks", "2",
                    "--tiers", "kvoffload-direct", "--no-raw", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    [row] = out["tiers"]
    assert row["tier"] == "kvoffload-direct" and row["verified"] and row["failed_jobs"] == 0
    assert row["store_gib_s"] > 0 and row["load_gib_s"] > 0 and row["files"] == 0
    assert os.listdir(d) == []
