"""`python -m kvoffload.bench --quick --json` on CPU: every figure present, every byte verified.

No timing is asserted: the CI machine's rates mean nothing. What is checked is that
each case ran, moved bytes, compared every loaded byte, was compared with the
ceilings of its own run and left no file behind.
"""

from __future__ import annotations

import json
import os
import pstats
import time

import numpy as np
import pytest
import torch

from kvoffload.bench import report
from kvoffload.bench import suite as bench

DISK_OPS = ("store", "rewrite", "cold-load", "warm-load")
STRIPE_OPS = ("store", "rewrite", "cold-load")


def run_quick(capsys, tmp_path, *extra: str) -> dict:
    a, c = tmp_path / "a", tmp_path / "c"
    a.mkdir(), c.mkdir()
    rc = bench.main(["--quick", "--json", "--device", "cpu", "--dir", str(a), "--dir", str(c), *extra])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert os.listdir(a) == [] and os.listdir(c) == []
    return out


def test_quick_json_has_every_figure_and_verifies_every_byte(capsys, tmp_path):
    out = run_quick(capsys, tmp_path)
    assert out["ok"] and out["all_verified"] and out["leftover_files"] == []
    rows = {r["case"]: r for r in out["cases"]}
    want = []
    for name in bench.LAYOUTS:
        want += [f"{name} raw {k}" for k in ("direct-write", "direct-read", "buffered-read")]
        want += [f"{name} pinned h2d", f"{name} pinned d2h", f"{name} host memcpy", f"{name} host-memory bound"]
        want += [f"{name} dram store", f"{name} dram load", f"{name} seam d2h", f"{name} seam h2d"]
        for mode in ("direct", "pagecache"):
            for seal in bench.SEALS:
                want += [f"{name} {mode} {seal} {op}" for op in DISK_OPS]
    want += [f"llama stripe 2 paths 1 disk {op}" for op in STRIPE_OPS]
    want += [f"llama stripe 2 dirs {seal} {op}" for seal in bench.SEALS for op in STRIPE_OPS]
    want += [f"llama raw direct-{k} 2 dirs" for k in ("write", "read", "read cycling")]
    want += [f"seal {s} 1 thread" for s in ("aes-gcm", "xxh3")]
    assert sorted(set(want) - set(rows)) == []
    for r in out["cases"]:
        assert r["bytes"] > 0 and r["gib_s_best"] > 0 and r["gib_s_worst"] > 0, r
        assert r["cpu_s_per_gib"] is not None and r["cpu_s_per_gib"] >= 0, r
        if r["ceiling"] is not None:
            assert r["ceiling"] in rows and r["ratio"] > 0, r
            # The ceiling's figure beside the case is that case's own figure in this run.
            assert r["ceiling_gib_s"] == rows[r["ceiling"]]["gib_s_best"], r
            # Both figures are rounded to 4 decimals: on a loaded machine's tiny rates that alone is more than 0.1%.
            rounding = 5e-5 / r["ceiling_gib_s"] + 5e-5 / r["gib_s_best"]
            assert r["ratio"] == pytest.approx(r["gib_s_best"] / r["ceiling_gib_s"], rel=1e-3 + rounding, abs=1e-4)
        if r["case"].endswith(("load", "h2d")) and r["group"] not in ("raw", "copy"):
            assert r["verified"] is True, r  # every loaded byte was compared
        if r["group"] == "raw":
            assert r["detail"]["qd"] in (1, 2, 4, 8, 16) and set(r["detail"]["by_qd"]) == {"1", "2", "4", "8", "16"}
            assert r["detail"]["io_bytes"] > 0
        if r["group"] in ("disk", "stripe"):  # the job geometry kvsim calibrates against
            d = r["detail"]
            for k in ("op", "mode", "seal", "blocks", "block_bytes", "slot_bytes", "jobs", "job_bytes", "io_threads",
                      "io_unit_bytes", "paths", "drives", "passes"):
                assert k in d, (k, r)
            assert d["blocks"] * d["block_bytes"] == r["bytes"] // d["passes"]
    # A striped load is compared with all drives' raw reads cycling through the staging's
    # worth of memory (its main ceiling), then into one reused buffer, then one drive's.
    s = rows["llama stripe 2 dirs aes-gcm cold-load"]
    assert list(s["ratios"]) == ["llama raw direct-read cycling 2 dirs", "llama raw direct-read 2 dirs",
                                 "llama raw direct-read"]
    cycling = rows["llama raw direct-read cycling 2 dirs"]["detail"]
    striped = s["detail"]  # the backend's threads and units over two paths: two units a load thread
    assert cycling["footprint"] == 2 * striped["io_threads"] * 2 * striped["io_unit_bytes"]
    assert rows["llama stripe 2 dirs xxh3 store"]["detail"]["drives"] == 2
    # A first store is also compared with the rewrite after it; a page-cache warm load
    # with the host-memory bound, 2/3 of the same run's memcpy.
    assert "llama direct aes-gcm rewrite" in rows["llama direct aes-gcm store"]["ratios"]
    assert rows["llama pagecache xxh3 warm-load"]["ceiling"] == "llama host-memory bound"
    bound, memcpy = rows["llama host-memory bound"], rows["llama host memcpy"]
    assert bound["gib_s_best"] == pytest.approx(memcpy["gib_s_best"] * 2 / 3, rel=1e-3)
    assert "2/3" in out["config"]["host_bound"]["formula"]
    # Encryption cost against checksums alone, for O_DIRECT and page cache.
    costs = {(c["layout"], c["mode"], c["op"], c["drives"]) for c in out["seal_cost"]}
    assert {("llama", "direct", "store", 1), ("llama", "direct", "cold-load", 1),
            ("llama", "pagecache", "warm-load", 1), ("llama", "direct", "store", 2)} <= costs
    # Page-cache cold loads start with the file out of the cache, and the output says how.
    drops = out["cache_drop"]["cases"]
    assert drops and all(d["fadvise"] == "ok" for d in drops)
    assert all(d["resident_after"] is None or d["resident_after"] <= 0.01 for d in drops)


def test_profile_covers_the_io_threads(capsys, tmp_path):
    run_quick(capsys, tmp_path, "--profile", str(tmp_path / "kv.prof"), "--layouts", "small", "--modes", "direct",
              "--seals", "off", "--only", "disk")
    st = pstats.Stats(str(tmp_path / "kv.prof"))
    # Each engine settles its jobs on its own threads (IO threads, or the native collector).
    assert any(f.endswith("run.py") and fn == "settle" for f, _, fn in st.stats)


def test_runs_give_each_ratio_per_run_with_its_median(capsys, tmp_path):
    # Issue 33: one run cannot settle a ratio; --runs N measures each case and its ceiling
    # back to back N times, and the row carries each run's ratio and their median.
    out = run_quick(capsys, tmp_path, "--layouts", "small", "--modes", "direct", "--seals", "off", "--only", "disk",
                    "--runs", "3")
    r = {x["case"]: x for x in out["cases"]}["small direct off cold-load"]
    assert len(r["ratio_per_run"]) == 3 and all(x > 0 for x in r["ratio_per_run"])
    assert r["ratio_median"] == sorted(r["ratio_per_run"])[1]


@pytest.mark.parametrize("only", ["seal", "seam", "dram"])
def test_profile_works_with_any_selection(capsys, tmp_path, only):
    # Issue 33: --profile --only seal measured, then ended in a pstats traceback (nothing profiled).
    run_quick(capsys, tmp_path, "--profile", str(tmp_path / "kv.prof"), "--layouts", "small", "--seals", "aes-gcm",
              "--only", only)
    pstats.Stats(str(tmp_path / "kv.prof"))  # a readable profile, whatever it holds


def test_the_native_seal_and_each_io_path_are_measured_side_by_side(capsys, tmp_path, native_core):
    out = run_quick(capsys, tmp_path, "--layouts", "small", "--modes", "direct", "--seals", "aes-gcm",
                    "--only", "disk,seal", "--io-paths", "native,python")
    rows = {r["case"]: r for r in out["cases"]}
    assert rows["seal aes-gcm native 1 thread"]["detail"]["impl"] == "native"
    assert rows["seal aes-gcm 1 thread"]["detail"]["impl"] == "python"
    for path in ("native", "python"):
        r = rows[f"small direct aes-gcm [{path}] cold-load"]
        assert r["detail"]["io_path"] == path and r["verified"] is True and r["cpu_s_per_gib"] > 0
    assert out["machine"]["io_path"].startswith("native (")


def test_every_case_is_timed_over_case_seconds(capsys, tmp_path):
    secs = 0.05
    out = run_quick(capsys, tmp_path, "--case-seconds", str(secs), "--layouts", "mla", "--modes", "pagecache",
                    "--seals", "xxh3", "--only", "disk,stripe,dram,seam,seal")
    assert out["config"]["case_seconds"] == secs
    for r in out["cases"]:
        # Derived rows (the bound) carry the memcpy's time.
        assert r["seconds"] >= secs, r
        assert r["verified"] is not False, r
    # A first store is a first store every pass: it repeats on a fresh backend.
    store = next(r for r in out["cases"] if r["case"] == "mla pagecache xxh3 store")
    assert store["bytes"] == store["detail"]["passes"] * store["detail"]["blocks"] * store["detail"]["block_bytes"]


def test_only_runs_the_named_cases_and_their_ceilings(capsys, tmp_path):
    out = run_quick(capsys, tmp_path, "--layouts", "many", "--only", "seam")
    assert {r["group"] for r in out["cases"]} == {"copy", "seam"}
    assert {r["case"] for r in out["cases"] if r["group"] == "seam"} == {"many seam d2h", "many seam h2d"}


def test_metrics_group_times_loads_with_collection_on_and_off(capsys, tmp_path):
    # Goal: --only metrics times loads with kvoffload's metric collection on and off,
    # interleaved, and reports both rates, on/off per pair and its spread.
    out = run_quick(capsys, tmp_path, "--layouts", "small", "--modes", "pagecache", "--only", "metrics",
                    "--metrics-pairs", "3")
    rows = {r["case"]: r for r in out["cases"] if r["group"] == "metrics"}
    on, off = rows["small pagecache metrics on load"], rows["small pagecache metrics off load"]
    assert on["verified"] is True and off["verified"] is True
    assert on["ceiling"] == off["case"] and on["ratio"] > 0
    d = on["detail"]
    assert d["collect"] is True and off["detail"]["collect"] is False and d["pairs"] == 3
    pairs = zip(d["gib_s_per_pair"], off["detail"]["gib_s_per_pair"])
    assert d["on_off"]["per_pair"] == pytest.approx([a / b for a, b in pairs], abs=1e-3)
    for q in (d["on_off"], d["cpu_s_per_gib_on_off"]):
        assert len(q["per_pair"]) == 3 and q["min"] <= q["median"] <= q["max"]
    (line,) = report.metrics_lines(out)
    assert line.startswith("metric collection, small pagecache load: on ") and "3 pairs" in line


def test_seal_rates_scale_figure(capsys, tmp_path):
    out = run_quick(capsys, tmp_path, "--layouts", "small", "--only", "seal", "--io-threads", "2")
    rows = {r["case"]: r for r in out["cases"]}
    one = rows["seal aes-gcm 1 thread"]
    assert one["detail"]["buffer_bytes"] == 2 << 20 and one["detail"]["threads"] == 1
    if (os.cpu_count() or 1) > 1:
        many = rows["seal aes-gcm 2 threads"]
        assert many["ceiling"] == one["case"]
        assert many["detail"]["scaling"] == pytest.approx(many["gib_s_best"] / one["gib_s_best"], rel=1e-2)


def test_runs_report_best_and_worst(capsys, tmp_path):
    out = run_quick(capsys, tmp_path, "--runs", "2", "--layouts", "mla", "--modes", "direct", "--seals", "aes-gcm")
    assert out["config"]["runs"] == 2
    for r in out["cases"]:
        assert r["gib_s_best"] >= r["gib_s_worst"] > 0
        assert r["verified"] is not False


def test_table_is_printed_last(capsys, tmp_path):
    rc = bench.main(["--quick", "--device", "cpu", "--dir", str(tmp_path), "--layouts", "small",
                     "--modes", "pagecache", "--seals", "off", "--only", "disk,dram", "--dram-streams", "1,2"])
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert rc == 0
    assert any(line.startswith("small dram load") and line.endswith("ok") for line in lines)
    assert lines[-1].startswith("small dram 2 streams load") and lines[-1].endswith("ok")
    assert any(line.startswith("page cache before cold loads") for line in lines)
    assert any(line.startswith("host-memory bound = 2/3 x host memcpy") for line in lines)


def one_line_error(capsys, argv: list[str]) -> str:
    rc = bench.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("python -m kvoffload.bench: error: "), err
    return err


def test_too_large_a_case_is_one_clear_line(capsys, tmp_path):
    err = one_line_error(capsys, ["--device", "cpu", "--dir", str(tmp_path), "--layouts", "llama", "--gib", "1000000",
                                  "--max-blocks", str(10**9)])
    assert "--gib 1000000: the files of a run need" in err and "at most --gib" in err
    assert os.listdir(tmp_path) == []  # its private directory is gone


@pytest.mark.parametrize("argv, words", [
    (["--make-array", "2", "--dir", "."], "give it or --dir, not both"),
    (["--case-seconds", "-1"], "argument --case-seconds: must be a number >= 0, got '-1'"),
    (["--only", "disk,bogus"], "unknown 'bogus'"),
    (["--gib", "0"], "argument --gib: must be a number of GiB, at least 1 byte, got '0'"),
    (["--dram-streams", "1,0"], "'1,0': expected a comma list of distinct integers >= 1"),
    # issue 23: each of these ran (or crashed) instead of being refused where it was parsed
    (["--gib", "inf"], "argument --gib: must be a number of GiB, at least 1 byte, got 'inf'"),
    (["--gib", "nan"], "argument --gib: must be a number of GiB"),
    (["--io-unit-mib", "1e-9"], "argument --io-unit-mib: must be a number of MiB, at least 1 byte, got '1e-9'"),
    (["--job-mib", "inf"], "argument --job-mib: must be a number of MiB"),
    (["--raw-seconds", "nan"], "argument --raw-seconds: must be a number > 0, got 'nan'"),
    (["--io-threads", "0"], "argument --io-threads: must be an integer in [1, 1024], got '0'"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["--seals", "aes-gcm,rot13"], "unknown 'rot13'"),
    (["--layout", "big:0x4096"], "argument --layout: 'big:0x4096': a name, and tensors and bytes >= 1"),
])
def test_bad_flags_are_refused(capsys, argv, words):
    assert words in one_line_error(capsys, ["--device", "cpu", *argv])


def test_bad_paths_are_refused_before_the_run(capsys, tmp_path):
    """Issue 23: a missing --dir or a file as --dir was a traceback, and a --profile into a
    missing directory failed only after the whole run, losing its results."""
    (tmp_path / "f").write_text("x")
    for argv, words in ((["--dir", str(tmp_path / "nope")], "argument --dir: "),
                        (["--dir", str(tmp_path / "f")], "not a directory"),
                        (["--dir", str(tmp_path), "--profile", str(tmp_path / "nope" / "kv.prof")], "--profile")):
        assert words in one_line_error(capsys, ["--device", "cpu", "--quick", *argv])
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_compact_report_of_several_runs(capsys, tmp_path):
    out = run_quick(capsys, tmp_path, "--layouts", "llama", "--modes", "direct", "--seals", "aes-gcm,xxh3")
    path = tmp_path / "disk.json"
    path.write_text(json.dumps(out))
    assert report.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "== disk: " in text and "llama ceilings: write" in text and "bound" in text
    assert "llama  direct aes-gcm" in text and "store/rewrite" in text
    assert "encryption cost vs checksums (1 - aes-gcm/xxh3), llama direct:" in text
    # A step that left no JSON is named, and the summary fails.
    assert report.main([str(path), str(tmp_path / "array.json")]) == 1
    assert "== array: no result" in capsys.readouterr().out


@pytest.mark.parametrize("streams", [1, 3])
def test_dram_backend_round_trip(device, streams):
    from kvoffload.bench.dram_backend import CpuBackend
    from tests.conftest import block_bytes, make_caches, snapshot

    caches = make_caches(device, 8, [576 * 2, 4096])
    b = CpuBackend()
    b.init(caches, device, None, None, 16, block_bytes(caches), streams=streams)
    try:
        want, ev = snapshot(caches), []
        for j in range(4):  # jobs of two blocks, round-robin over the streams
            b.launch_copy([2 * j, 2 * j + 1], [8 + 2 * j, 9 + 2 * j], True, j, ev)
        for _, e in ev:
            e.synchronize()
        for t in caches.values():
            t.zero_()
        ev.clear()
        for j in range(4):
            b.launch_copy([9 + 2 * j, 8 + 2 * j], [2 * j + 1, 2 * j], False, 4 + j, ev)
        assert [i for i, _ in ev] == [4, 5, 6, 7]
        for _, e in ev:
            e.synchronize()
        for k in caches:
            assert torch.equal(caches[k].cpu(), want[k])
        assert b.get_block_ids_with_load_errors() == set()
    finally:
        b.shutdown()
        b.shutdown()


def test_an_interrupt_leaves_no_measurement_thread_running():
    """Ctrl-C or SIGTERM while threads are released: they are stopped and joined before the
    interrupt goes on (a thread still in torch code at interpreter exit aborts the process)."""
    import threading

    from kvoffload.bench.ceilings import run_all_threads

    start, halt = threading.Barrier(5), threading.Event()
    moved = []

    def worker():
        try:
            start.wait()
        except threading.BrokenBarrierError:
            return
        while not halt.is_set():
            moved.append(torch.ones(1024).sum())

    def interrupted():
        raise KeyboardInterrupt

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    with pytest.raises(KeyboardInterrupt):
        run_all_threads(threads, start, halt, interrupted)
    assert not any(t.is_alive() for t in threads) and halt.is_set() and start.broken


def test_engine_group_reports_both_ratios_per_case(capsys, tmp_path):
    # Goal: --only engine runs the worker-shaped steps on both paths, directions and
    # drive sets, every case with its two ratios, their spread, its repeats and no
    # failed job, and nothing else (no disk cases, no probe); no file is left.
    out = run_quick(capsys, tmp_path, "--only", "engine", "--engine-shares", "0.5")
    assert out["ok"] and out["cases"] == []
    got = {(r["path"], r["direction"], r["drives"]) for r in out["engine"]}
    assert got == {(p, d, n) for p in ("gpu", "tier", "raw") for d in ("load", "store") for n in (1, 2)}
    for r in out["engine"]:
        assert r["share"] == 0.5 and r["repeats"] == 2 and r["failed_jobs"] == 0, r
        # A segment that launches runs until one IO unit has finished: no rate is 0 or nan.
        assert r["gib_s_busy"] > 0 and r["gib_s_ref"] > 0 and r["python_ms_alone"] > 0, r
        lo, hi = r["engine_step_ratio_spread"]
        assert 0 < lo == r["engine_step_ratio"] <= r["engine_step_ratio_median"] <= hi, r
        lo, hi = r["bandwidth_ratio_spread"]
        assert 0 < lo <= r["bandwidth_ratio_median"] <= hi == r["bandwidth_ratio"], r
        assert len(r["detail"]["gib_s_busy"]) == r["repeats"]


@pytest.mark.parametrize("flag, value", [("--engine-shares", "0"), ("--engine-shares", "1.5"),
                                         ("--engine-shares", "x"), ("--engine-paths", "gpu,disk")])
def test_engine_flags_are_checked(capsys, flag, value):
    assert f"argument {flag}: " in one_line_error(capsys, ["--device", "cpu", flag, value])


def test_an_engine_segment_counts_the_bytes_moved_not_whole_jobs(tmp_path):
    # A segment holds a few jobs of a quarter of the footprint each: counting whole ones made
    # every rate a multiple of job_bytes / segment (ratios of 0.67, 0.75 or 1.0). A job that
    # cannot finish in the segment still moved its units' bytes, and the rate says so.
    from kvoffload.bench import engine

    path = engine.GpuPath(torch.device("cpu"), [str(tmp_path / "kv")], (1 << 20,), 64, io_threads=1,
                          io_unit_bytes=1 << 20)
    try:
        driver = engine.Driver(path, is_store=True, job_blocks=48, depth=1, rng=np.random.default_rng(0))
        before = path.moved(True)
        seg = driver.segment(0, 0.03, launch=True)
        after = path.moved(True)
        assert seg.bytes_moved % (1 << 20) == 0 and 0 < seg.bytes_moved <= after - before, seg
        assert seg.gib_s == pytest.approx(seg.bytes_moved / seg.wall_s / 2**30)
        if seg.jobs == 0:  # the usual case: 48 MiB do not finish in 30 ms here
            assert seg.gib_s > 0
    finally:
        path.close()


class _LatePath:
    """An engine path whose IO finishes its first unit only ``after`` seconds in (or never)."""

    num_blocks, failed = 64, 0

    def __init__(self, after: float) -> None:
        self.t0, self.after, self.jobs = time.perf_counter(), after, 0

    def moved(self, is_store: bool) -> int:
        return 1 << 20 if time.perf_counter() - self.t0 >= self.after else 0

    def launch(self, is_store: bool, blocks: list, slots: list) -> None:
        self.jobs += 1

    def poll(self, is_store: bool) -> int:
        return 0

    def in_flight(self, is_store: bool) -> int:
        return 0


def test_an_engine_segment_waits_for_one_io_unit_and_a_stalled_reference_is_an_error():
    # A 0.05 s segment on a loaded machine may see no IO unit finish: a rate over none is
    # no rate (it made bandwidth_ratio nan). The segment runs on until one has.
    from kvoffload.bench.engine import Driver, run_case
    driver = Driver(_LatePath(0.3), False, 4, 3, np.random.default_rng(0))
    seg = driver.segment(0, 0.05, launch=True)
    assert seg.wall_s >= 0.3 and seg.bytes_moved > 0 and seg.gib_s > 0
    assert driver.segment(0, 0.05, launch=False).wall_s < 0.3  # a segment without IO does not wait
    # A backend that moves nothing at all: the case says so instead of reporting nan.
    stalled = Driver(_LatePath(float("inf")), False, 4, 3, np.random.default_rng(0))
    stalled.unit_wait_s = 0.1
    with pytest.raises(RuntimeError, match="the reference segment moved nothing"):
        run_case(stalled, 0.5, 0.05, 1, 1, 0.1, 1e6)
