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
from kvsim.tiers import (KVOFFLOAD_BUFFER_SLOTS, KVOFFLOAD_IO_THREADS, KVOFFLOAD_IO_UNIT_BYTES,
                         KVOFFLOAD_TIER_IO_UNIT_BYTES, kvoffload_threads, parse_tier)

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

    assert (KVOFFLOAD_IO_THREADS, KVOFFLOAD_IO_UNIT_BYTES) == (disk_backend.DEFAULT_IO_THREADS,
                                                               disk_backend.DEFAULT_IO_UNIT_BYTES)
    assert inspect.signature(disk_backend.DiskBackend.init).parameters["num_buffer_slots"].default == \
        KVOFFLOAD_BUFFER_SLOTS
    assert kvoffload_threads(cpus, paths) == disk_backend.default_io_threads(paths, KVOFFLOAD_BUFFER_SLOTS, cpus)


def test_kvsim_tier_unit_is_kvoffload_tiers():
    from kvoffload import vllm_tier

    assert KVOFFLOAD_TIER_IO_UNIT_BYTES == vllm_tier.TierConfig.io_unit_bytes == vllm_tier.TIER_IO_UNIT_BYTES
    # The disk level of a two-level tier runs the tier's units unless told otherwise.
    assert parse_tier("cpu:8GiB+disk:1TB").secondary.pipeline.unit_bytes == KVOFFLOAD_TIER_IO_UNIT_BYTES
    assert parse_tier("cpu:8GiB+disk:1TB:unit=16MiB").secondary.pipeline.unit_bytes == 16 << 20
    assert parse_tier("disk:1TB").pipeline.unit_bytes == KVOFFLOAD_IO_UNIT_BYTES


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
])
def test_a_bad_profile_names_the_field(tmp_path, edit, match):
    doc = json.loads((PROFILE_DIR / "h200_disk.json").read_text())
    edit(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        load_profile(str(p))
    assert isinstance(load_profile("h200-disk"), IoProfile)


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
