"""``kvsim calibrate``: the shipped profiles are what the recorded bench runs give, and
kvsim then predicts the bench's own store and load times (docs/kvsim.md)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from kvsim.calibrate import TOLERANCE, BenchError, calibrate, load_bench
from kvsim.cli import main
from kvsim.profile import PROFILE_DIR, IoProfile, load_profile
from kvsim.tiers import (KVOFFLOAD_BUFFER_SLOTS, KVOFFLOAD_IO_THREADS,
                         kvoffload_threads, kvoffload_unit_bytes, parse_tier)

DATA = Path(__file__).parent / "data"
RECORDED = {"h200-disk": "bench_h200_disk.json", "h200-array": "bench_h200_array.json",
            "h200-ramdrive": "bench_h200_array.json"}
# The array's bench ran O_DIRECT cases only: page-cache writes come from the same host's disk profile.
BASE = {"h200-disk": None, "h200-array": "h200-disk", "h200-ramdrive": "h200-disk"}
# One of the array's drives: its single-file cases each ran on one (seal_cost: paths 1, drives 1).
DRIVES = {"h200-ramdrive": 1}


def _recorded(name: str) -> Path:
    path = DATA / RECORDED[name]
    if not path.exists():
        pytest.skip(f"{path} is not recorded (python -m kvoffload.bench --json on the H200)")
    return path


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_shipped_profiles_are_what_calibration_gives(name):
    path = _recorded(name)
    base = load_profile(BASE[name]) if BASE[name] else None
    fitted = calibrate(load_bench(str(path)), name, f"tests/data/{RECORDED[name]}", base, DRIVES.get(name))
    assert fitted.to_json() == load_profile(name).to_json()


def test_the_one_drive_profile_is_one_of_the_arrays_drives():
    # Goal: h200-ramdrive is h200-array with one drive: the same rates per drive, the
    # same predictions of the bench's cases (each case runs on the drives it ran on).
    one, four = load_profile("h200-ramdrive"), load_profile("h200-array")
    assert (one.drives, four.drives) == (1, 4)
    assert dataclasses.replace(one, name=four.name, drives=4, notes=four.notes) == four


# The rows kvsim still misses by more than TOLERANCE, with the looser bound each is held
# to; docs/kvsim.md ("Fidelity") gives the measured cause of each.
KNOWN_MISSES = {
    "h200-disk": {
        # 64 KiB, O_DIRECT, aes-gcm: 17-27 us per slot slower than xxh3 on the same drive,
        # where the page cache shows 4-6 us between the two seals.
        "small direct aes-gcm store": 0.30,
        "small direct aes-gcm rewrite": 0.35,
        "small direct aes-gcm cold-load": 0.30,
        "small direct aes-gcm warm-load": 0.30,
        # 64 KiB, O_DIRECT, xxh3: the copy and the per-slot CPU overlap the drive more than
        # kvsim's per-thread sum of them allows.
        "small direct xxh3 store": 0.15,
        "small direct xxh3 rewrite": 0.15,
        # 64 KiB, page cache, aes-gcm: 6 us per slot above xxh3; one per-slot CPU bounds both.
        "small pagecache aes-gcm rewrite": 0.20,
    },
    "h200-array": {},
    "h200-ramdrive": {},
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_kvsim_predicts_the_bench_jobs_within_ten_percent(name):
    # Goal: the fidelity claim. Every kvoffload case of both block layouts, first stores
    # into a fresh file included: kvsim's time for the bench's own jobs, all launched at
    # once, within 10% of what the bench measured on the H200, the predicted cases
    # (64 KiB blocks, striping, page-cache cold loads) too; the known misses within
    # their own bound, and still misses (fixed ones leave the list).
    bench = load_bench(str(_recorded(name)))
    profile = load_profile(name)
    rows = {r["case"]: r for r in profile.fidelity}
    kvoffload_cases = {c["case"] for c in bench["cases"] if c["group"] in ("disk", "stripe")}
    assert set(rows) == kvoffload_cases and {c.split()[0] for c in rows} == set(bench["config"]["layouts"])
    misses = KNOWN_MISSES[name]
    assert set(misses) <= set(rows)
    for case, r in rows.items():
        if case in misses:
            assert TOLERANCE < abs(r["error"]) <= misses[case], r
        else:
            assert abs(r["error"]) <= TOLERANCE, r
    assert [r for r in rows.values() if r["role"] == "predicted" and r["case"] not in misses]
    assert len([r for r in rows.values() if r["case"].endswith(" store") and r["case"] not in misses]) >= 4


def test_first_writes_and_small_blocks_are_fitted_from_the_bench_not_assumed():
    # Goal: the mechanisms behind the store and 64 KiB rows come from what the bench
    # measured: first writes from store against rewrite (a fixed and a per-byte part
    # from the two block sizes), the drive's cost per IO from its raw ceilings at both
    # sizes, the seam's cost per row, the per-slot CPU; a bench of one layout gets
    # what it cannot measure from the base profile of the same host.
    disk, array = load_profile("h200-disk"), load_profile("h200-array")
    assert disk.first_write.us > 0 and disk.first_write.us_per_mib > 0
    assert disk.first_write_page_cache.us_per_mib > 0
    assert disk.disk_read.io_us > 0 and disk.disk_write.io_us > 0
    assert disk.seam_h2d_row_us > 0 and disk.seam_d2h_row_us > 0 and disk.slot_cpu_us > 0
    assert array.first_write.us_per_mib > disk.first_write.us_per_mib  # the RAM drives' first writes cost more
    assert array.slot_cpu_us == disk.slot_cpu_us and array.first_write_page_cache == disk.first_write_page_cache
    fitted = {r["case"]: r["role"] for r in disk.fidelity}
    assert fitted["llama direct xxh3 store"] == "first write" and fitted["small direct xxh3 store"] == "predicted"
    assert fitted["small pagecache xxh3 warm-load"] == "slot cpu"


@pytest.mark.parametrize("cpus", [2, 16, 64])
@pytest.mark.parametrize("paths", [1, 4])
def test_kvsim_pipeline_defaults_are_kvoffloads(cpus, paths):
    import inspect

    from kvoffload import disk_backend

    assert KVOFFLOAD_IO_THREADS == disk_backend.DEFAULT_IO_THREADS
    assert inspect.signature(disk_backend.DiskBackend.init).parameters["num_buffer_slots"].default == \
        KVOFFLOAD_BUFFER_SLOTS
    assert kvoffload_threads(cpus, paths) == disk_backend.default_io_threads(paths, KVOFFLOAD_BUFFER_SLOTS, cpus)
    for threads in (1, 2, 4, 8, 16, 64):
        assert kvoffload_unit_bytes(paths, threads) == disk_backend.default_io_unit_bytes(paths, threads)


def test_kvsim_tier_unit_is_kvoffload_tiers():
    from kvoffload import vllm_tier

    # The tier takes the backend's default unit, as kvsim's disk levels do unless told otherwise.
    assert vllm_tier.TierConfig.io_unit_bytes is None
    assert parse_tier("cpu:8GiB+disk:1TB").secondary.pipeline.unit_bytes is None
    assert parse_tier("cpu:8GiB+disk:1TB:unit=16MiB").secondary.pipeline.unit_bytes == 16 << 20
    assert parse_tier("disk:1TB").pipeline.unit_bytes is None


def test_the_calibrate_command_writes_a_profile_replay_can_use(tmp_path, capsys):
    bench = _recorded("h200-array")
    out = tmp_path / "hw.json"
    assert main(["calibrate", str(bench), "-o", str(out)]) == 0
    table = capsys.readouterr().out
    assert "llama stripe 4 dirs aes-gcm cold-load" in table and "predicted" in table
    profile = load_profile(str(out))
    assert profile.name == "hw" and profile.drives == 4
    assert main(["trace", "replay", "--hardware", str(out), "--contexts", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["io_profile"] == "hw"


def test_a_bench_without_what_calibration_needs_is_a_clear_error(tmp_path):
    bench = load_bench(str(_recorded("h200-disk")))
    broken = copy.deepcopy(bench)
    broken["cases"] = [c for c in broken["cases"] if c["case"] != "llama host memcpy"]
    with pytest.raises(BenchError, match="the bench has no case 'llama host memcpy'"):
        calibrate(broken, "x", "x")
    with pytest.raises(BenchError, match="no 'cases' list"):
        calibrate({"machine": {}}, "x", "x")
    p = tmp_path / "b.json"
    p.write_text("{")
    with pytest.raises(BenchError, match=r"b.json:1: not JSON"):
        load_bench(str(p))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(disk_read={**d["disk_read"], "max_gib_s": 0}), r"disk_read.max_gib_s must be a number > 0"),
    (lambda d: d.update(host_io_gib_s="fast"), r"host_io_gib_s must be a number > 0, got 'fast'"),
    (lambda d: d.update(drives=0), r"drives must be an integer >= 1, got 0"),
    (lambda d: d.update(cpus=2.5), r"cpus must be an integer >= 1, got 2.5"),
    (lambda d: d.update(seal_gib_s={"aes-gcm": 9.0}), r"seal_gib_s lacks xxh3"),
    (lambda d: d.update(turbo=True), r"unknown profile key\(s\) turbo"),
    (lambda d: d.pop("pcie_h2d_gib_s"), r"profile lacks pcie_h2d_gib_s"),
    (lambda d: d.update(disk_write={**d["disk_write"], "io_us": -1}), r"disk_write.io_us must be a number >= 0"),
    (lambda d: d.update(first_write={"us": 1, "us_per_mb": 2}), r"first_write: unknown key\(s\) us_per_mb"),
    (lambda d: d.update(first_write_page_cache=3), r"first_write_page_cache must be an object with us, us_per_mib"),
    (lambda d: d.update(slot_cpu_us=-0.5), r"slot_cpu_us must be a number >= 0, got -0.5"),
    # Each figure in its range (kvsim/limits.py): a rate of 1e-300 GiB/s overflowed a float
    # (an OverflowError traceback), a cost of 1e300 us too, 2**62 drives never finished.
    (lambda d: d.update(disk_read={**d["disk_read"], "max_gib_s": 1e-300}),
     r"disk_read.max_gib_s must be a rate in \[1e-06, 1e\+06\] GiB/s, got 1e-300"),
    (lambda d: d.update(seal_gib_s={**d["seal_gib_s"], "xxh3": 1e300}),
     r"seal_gib_s.xxh3 must be a rate in \[1e-06, 1e\+06\] GiB/s, got 1e\+300"),
    (lambda d: d.update(first_write={"us": 1, "us_per_mib": 1e300}),
     r"first_write.us_per_mib must be at most 1e\+09 us"),
    (lambda d: d.update(drives=2**62), r"drives must be an integer in \[1, 1024\], got 4611686018427387904"),
    (lambda d: d.update(cpus=10**30), r"cpus must be an integer in \[1, 65536\], got 1000000000000000000000000000000"),
])
def test_a_bad_profile_names_the_field(tmp_path, edit, match):
    doc = json.loads((PROFILE_DIR / "h200_disk.json").read_text())
    edit(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        load_profile(str(p))
    assert isinstance(load_profile("h200-disk"), IoProfile)


def test_an_absurd_profile_on_the_command_line_is_one_line_naming_its_line(tmp_path, capsys):
    doc = json.loads((PROFILE_DIR / "h200_disk.json").read_text())
    doc["drives"] = 2**62  # simulated one by one: the replay never finished
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(doc, indent=1))
    assert main(["trace", "replay", "--hardware", str(p), "--contexts", "2", "--tier", "disk:1TB"]) == 2
    out, err = capsys.readouterr()
    line = next(i for i, text in enumerate(p.read_text().splitlines(), 1) if '"drives"' in text)
    assert out == "" and err == (f"kvsim: error: {p}:{line}: profile 'h200-disk': drives must be an integer in "
                                 f"[1, 1024], got 4611686018427387904\n")


def _case(bench: dict, name: str) -> dict:
    return next(c for c in bench["cases"] if c["case"] == name)


@pytest.mark.parametrize("edit, message", [
    # A ZeroDivisionError (1e300 GiB/s), an OverflowError (1e-300 GiB/s) traceback; a case
    # of 2**62 bytes, paths or IO threads ran out of memory.
    (lambda b: _case(b, "llama raw direct-read").update(gib_s_best=1e300),
     "case 'llama raw direct-read': gib_s_best must be a rate in [1e-06, 1e+06] GiB/s, got 1e+300"),
    (lambda b: _case(b, "llama raw direct-write")["detail"]["by_qd"].update({"1": 1e-300}),
     "case 'llama raw direct-write': detail.by_qd.1 must be a rate in [1e-06, 1e+06] GiB/s, got 1e-300"),
    (lambda b: _case(b, "llama direct xxh3 rewrite").update(bytes=2**45),
     "case 'llama direct xxh3 rewrite': bytes must be at most 1048576 blocks of 2097152 bytes, got 35184372088832"),
    (lambda b: _case(b, "llama direct xxh3 rewrite").update(bytes=2**62),
     "case 'llama direct xxh3 rewrite': bytes must be an integer in [1, 1125899906842624], got 4611686018427387904"),
    (lambda b: _case(b, "llama direct xxh3 rewrite")["detail"].update(paths=2**62),
     "case 'llama direct xxh3 rewrite': detail.paths must be an integer in [1, 1024], got 4611686018427387904"),
    (lambda b: _case(b, "llama direct xxh3 rewrite")["detail"].update(io_threads=10**30),
     "case 'llama direct xxh3 rewrite': detail.io_threads must be an integer in [1, 1024], got " + str(10**30)),
    (lambda b: _case(b, "llama seam h2d")["detail"].update(rows_per_call=10**30),
     "case 'llama seam h2d': detail.rows_per_call must be an integer in [1, 1048576], got " + str(10**30)),
    (lambda b: b["config"].update(job_bytes=10**30),
     "config.job_bytes must be an integer in [1, 1125899906842624], got " + str(10**30)),
    (lambda b: b["machine"].update(cpus=10**30), "machine.cpus must be an integer in [1, 65536], got " + str(10**30)),
])
def test_absurd_figures_in_a_bench_name_the_file_and_line(tmp_path, capsys, edit, message):
    bench = json.loads(_recorded("h200-disk").read_text())
    edit(bench)
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(bench, indent=1))
    assert main(["calibrate", str(p), "-o", str(tmp_path / "hw.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kvsim: error: {p}:") and err.endswith(f": {message}\n")
    assert err.count("\n") == 1 and not (tmp_path / "hw.json").exists()
    assert int(err[len(f"kvsim: error: {p}:"):].split(":")[0]) > 1  # the line of the figure, not the file's first


def test_a_profile_from_before_the_per_io_costs_still_loads_without_them(tmp_path):
    doc = json.loads((PROFILE_DIR / "h200_disk.json").read_text())
    for key in ("seam_h2d_row_us", "seam_d2h_row_us", "slot_cpu_us", "first_write", "first_write_page_cache"):
        doc.pop(key)
    for d in ("disk_read", "disk_write"):
        doc[d].pop("io_us")
    p = tmp_path / "old.json"
    p.write_text(json.dumps(doc))
    old = load_profile(str(p))
    assert old.slot_cpu_us == 0 and old.first_write.ns(1 << 21) == 0 and old.disk_read.io_us == 0
