"""Smoke run of ``python -m kvoffload.bench.tier`` (needs vLLM: its fs tier is the baseline)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvoffload.bench import tier as bench  # noqa: E402


def test_tier_bench_moves_and_checks_every_byte(tmp_path, capsys) -> None:
    d = tmp_path / "d"
    d.mkdir()
    rc = bench.main(["--dir", str(d), "--gib", "0.03", "--chunk-mib", "1", "--primary-gib", "0.01",
                     "--job-chunks", "4", "--no-raw", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    by = {t["tier"]: t for t in out["tiers"]}
    assert set(by) == {"kvoffload", "fs"}
    assert out["chunks"] == 30 and out["primary_chunks"] == 10  # three load waves
    assert by["kvoffload"]["files"] == 0  # one anonymous preallocated file
    assert by["fs"]["files"] >= 30  # one file per chunk
    assert all(t["failed_jobs"] == 0 and t["load_gib_s"] > 0 for t in by.values())
    assert list(d.iterdir()) == []  # nothing left behind
