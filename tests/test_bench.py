"""`python -m kvoffload.bench --quick --json` on CPU: every figure present, every byte verified.

No timing is asserted: the CI machine's rates mean nothing. What is checked is that
each case ran, moved bytes, compared every loaded byte and left no file behind.
"""

from __future__ import annotations

import json
import os
import pstats

import torch

from kvoffload.bench import suite as bench

DISK_OPS = ("store", "rewrite", "cold-load", "warm-load")


def run_quick(capsys, tmp_path, *extra: str) -> dict:
    a, c = tmp_path / "a", tmp_path / "c"
    a.mkdir(), c.mkdir()
    rc = bench.main(["--quick", "--json", "--device", "cpu", "--dir", str(a), "--dir", str(c), *extra])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert os.listdir(a) == [] and os.listdir(c) == []
    return out


def test_quick_json_has_every_figure_and_verifies_every_byte(capsys, tmp_path):
    out = run_quick(capsys, tmp_path, "--profile", str(tmp_path / "kv.prof"))
    assert out["ok"] and out["all_verified"] and out["leftover_files"] == []
    rows = {r["case"]: r for r in out["cases"]}
    want = []
    for name in bench.LAYOUTS:
        want += [f"{name} raw {k}" for k in ("direct-write", "direct-read", "buffered-read")]
        want += [f"{name} pinned h2d", f"{name} pinned d2h", f"{name} host memcpy"]
        want += [f"{name} dram store", f"{name} dram load"]
        for mode in ("direct", "pagecache"):
            for seal in bench.SEALS:
                want += [f"{name} {mode} {seal} {op}" for op in DISK_OPS]
    want += ["llama seam d2h", "llama seam h2d"]
    want += [f"llama stripe 2 paths 1 disk {op}" for op in ("store", "rewrite", "cold-load")]
    want += [f"llama stripe 2 dirs {op}" for op in ("store", "rewrite", "cold-load")]
    want += [f"llama raw direct-{k} 2 dirs" for k in ("write", "read")]
    assert sorted(set(want) - set(rows)) == []
    for r in out["cases"]:
        assert r["bytes"] > 0 and r["gib_s_best"] > 0 and r["gib_s_worst"] > 0, r
        assert r["cpu_s_per_gib"] is not None and r["cpu_s_per_gib"] >= 0, r
        if r["ceiling"] is not None:
            assert r["ceiling"] in rows and r["ratio"] > 0, r
        if r["case"].endswith(("load", "h2d")) and r["group"] not in ("raw", "copy"):
            assert r["verified"] is True, r  # every loaded byte was compared
        if r["group"] == "raw":
            assert r["detail"]["qd"] in (1, 2, 4, 8, 16)
    # Page-cache cold loads start with the file out of the cache, and the output says how.
    drops = out["cache_drop"]["cases"]
    assert drops and all(d["fadvise"] == "ok" for d in drops)
    assert all(d["resident_after"] is None or d["resident_after"] <= 0.01 for d in drops)
    st = pstats.Stats(str(tmp_path / "kv.prof"))
    assert any("store_path.py" in f for f, _, _ in st.stats)  # the IO threads are in the profile


def test_runs_report_best_and_worst(capsys, tmp_path):
    out = run_quick(capsys, tmp_path, "--runs", "2", "--layouts", "mla", "--modes", "direct", "--seals", "aes-gcm")
    assert out["config"]["runs"] == 2
    for r in out["cases"]:
        assert r["gib_s_best"] >= r["gib_s_worst"] > 0
        assert r["verified"] is not False


def test_table_is_printed_last(capsys, tmp_path):
    rc = bench.main(["--quick", "--device", "cpu", "--dir", str(tmp_path), "--layouts", "small",
                     "--modes", "pagecache", "--seals", "off"])
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert rc == 0
    assert lines[-1].startswith("small dram load") and lines[-1].endswith("ok")
    assert any(line.startswith("page cache before cold loads") for line in lines)


def test_dram_backend_round_trip(device):
    from kvoffload.bench.dram_backend import CpuBackend
    from tests.conftest import block_bytes, make_caches, snapshot

    caches = make_caches(device, 8, [576 * 2, 4096])
    b = CpuBackend()
    b.init(caches, device, None, None, 16, block_bytes(caches))
    try:
        want, ev = snapshot(caches), []
        b.launch_copy(list(range(8)), list(range(8, 16)), True, 0, ev)
        ev[0][1].synchronize()
        for t in caches.values():
            t.zero_()
        b.launch_copy(list(range(8, 16)), list(range(8)), False, 1, ev)
        ev[1][1].synchronize()
        for k in caches:
            assert torch.equal(caches[k].cpu(), want[k])
        assert b.get_block_ids_with_load_errors() == set()
    finally:
        b.shutdown()
        b.shutdown()
