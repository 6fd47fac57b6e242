"""``python -m kvsim calibrate BENCH.json -o hw.json``: an IO profile from kvoffload's bench.

Two steps. The ceilings give the shape: the drive's queue-depth-1 time per IO
(latency + size / rate, from the two IO sizes when there are two) and its best rate
over queue depths (``raw direct-*``), one thread's page-cache read (``raw
buffered-read`` at its highest queue depth, per thread), the pinned and batched copy
rates (``pinned *``, ``seam *``) and host memory (``host memcpy``). Then one factor
per path is fitted to kvoffload's own cases on the largest block layout, replayed
through kvsim's tier code with the bench's jobs (all launched at once, as the bench
does): the drive's read rate (O_DIRECT loads), its write rate (rewrites), the
page-cache write rate (page-cache rewrites) and the host-memory bound (page-cache
warm loads). A factor is needed because the raw ceilings are timed over short
windows and a virtual disk swings more than that between windows
(docs/performance.md). Everything else is predicted, not fitted: the other layouts,
page-cache cold loads, striping over several paths. First stores into a fresh file
(``store``: ext4 converts unwritten extents) are listed but kvsim does not model
them (it models slots being reused: ``rewrite``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, Optional

from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, slot_bytes_for
from kvsim.hardware import Hardware
from kvsim.offload import OffloadTier
from kvsim.profile import HOST_PASSES, DiskDirection, GiB, IoProfile
from kvsim.tiers import KVOFFLOAD, TierSpec

# One thread sealing a slot, measured on the 2-core dev VM (shared notes
# measured-2026-12.md: cryptography 50 AES-128-GCM 9.4 GiB/s per thread; README:
# xxh3_64 44 GiB/s). The bench has no case that times sealing alone.
SEAL_GIB_S = {"aes-gcm": 9.4, "xxh3": 44.0}
COPY_CALL_US = 7.0  # notes §4.3, when the bench has one block size only
# kvsim's claim for the bench's own jobs (docs/kvsim.md, tests/test_kvsim_calibrate.py).
TOLERANCE = 0.10


class BenchError(ValueError):
    """The bench JSON lacks what calibration needs; the message says what."""


def _cases(bench: dict) -> dict[str, dict]:
    if not isinstance(bench, dict) or not isinstance(bench.get("cases"), list):
        raise BenchError("not the output of `python -m kvoffload.bench --json` (no 'cases' list)")
    return {c["case"]: c for c in bench["cases"]}


def _need(cases: dict[str, dict], name: str) -> dict:
    if name not in cases:
        raise BenchError(f"the bench has no case {name!r} (run it with --layouts llama and --modes direct)")
    return cases[name]


def _cpus(bench: dict) -> int:
    cpus = bench.get("machine", {}).get("cpus")
    if not isinstance(cpus, int) or cpus < 1:
        raise BenchError("the bench machine lists no cpus")
    return cpus


def _pipeline(bench: dict) -> tuple[Optional[int], Optional[int], str]:
    """The backend's IO threads per lane and unit bytes as the bench ran them, and from where.

    The bench's config has ``io_threads`` only when it was given; its seam cases run
    the backend's unit (``rows_per_call`` blocks) on its default threads. Without
    either, kvsim's own defaults for kvoffload apply.
    """
    cfg = bench.get("config", {})
    seam = next((c for c in bench.get("cases", []) if c.get("group") == "seam"), None)
    threads = cfg.get("io_threads")
    unit = cfg.get("io_unit_bytes")
    if seam is not None:
        slot = slot_bytes_for(_layouts(bench)[seam["layout"]], MIN_DIRECT_ALIGNMENT, False)
        threads = threads or seam["detail"].get("threads")
        unit = unit or seam["detail"]["rows_per_call"] * slot
        return threads, unit, "the seam cases"
    return threads, unit, "the bench config" if threads or unit else "kvsim's defaults for kvoffload"


def _layouts(bench: dict) -> dict[str, int]:
    layouts = bench.get("config", {}).get("layouts")
    if not isinstance(layouts, dict) or not layouts:
        raise BenchError("the bench config lists no layouts")
    return {name: int(v["block_bytes"]) for name, v in layouts.items()}


def _direction(cases: dict[str, dict], layouts: dict[str, int], kind: str) -> DiskDirection:
    """Queue-depth-1 latency and rate from the raw ceilings of up to two IO sizes; best rate of the largest."""
    points = []
    for name in layouts:
        c = cases.get(f"{name} raw direct-{kind}")
        if c is not None:
            io = c["detail"]["io_bytes"]
            points.append((io, io / (c["detail"]["by_qd"]["1"] * GiB)))  # (bytes, seconds per IO at qd 1)
    if not points:
        raise BenchError(f"the bench has no 'raw direct-{kind}' case")
    points.sort()
    (b0, t0), (b1, t1) = points[0], points[-1]
    if b1 > b0 and t1 > t0:
        per_byte = (t1 - t0) / (b1 - b0)
        latency = max(0.0, t0 - b0 * per_byte)
    else:
        latency, per_byte = 0.0, t1 / b1
    largest = max(layouts, key=layouts.get)
    best = _need(cases, f"{largest} raw direct-{kind}")["gib_s_best"]
    return DiskDirection(round(latency * 1e6, 3), round(1 / per_byte / GiB, 4), best)


def ceilings(bench: dict, name: str, source: str, base: Optional[IoProfile] = None) -> IoProfile:
    """The profile from the ceilings alone, before any factor is fitted; ``notes`` say
    where each figure came from. What the bench cannot give comes from ``base`` (a
    profile of the same host), else from a prior."""
    cases = _cases(bench)
    layouts = _layouts(bench)
    big = max(layouts, key=layouts.get)
    sizes = ", ".join(f"{b:,} B" for b in sorted(layouts.values()))
    notes = [f"disk_read, disk_write: queue-depth-1 latency and rate from the raw direct ceilings at {sizes}; "
             f"best rate over queue depths of the {big} layout"]
    h2d, d2h = (_need(cases, f"{big} pinned {d}")["gib_s_best"] for d in ("h2d", "d2h"))
    notes.append(f"pcie_h2d_gib_s, pcie_d2h_gib_s: {big} pinned copy ceilings")
    seam = {d: cases.get(f"{big} seam {d}", {}).get("gib_s_best") for d in ("h2d", "d2h")}
    notes.append("seam_*: the seam cases" if all(seam.values()) else "seam_*: prior: the pinned copy rates")
    memcpy = _need(cases, f"{big} host memcpy")["gib_s_best"]
    host = round(memcpy * 2 / HOST_PASSES, 4)
    notes.append(f"host_io_gib_s: host memcpy {memcpy} x 2/{HOST_PASSES} (DRAM passes of a memcpy / of a file load)")
    pc_read = host
    buffered = cases.get(f"{big} raw buffered-read")
    if buffered is not None:
        qd = max(buffered["detail"]["by_qd"], key=int)
        pc_read = round(buffered["detail"]["by_qd"][qd] / int(qd), 4)
        notes.append(f"page_cache_read_gib_s: raw buffered-read at queue depth {qd}, per thread")
    else:
        notes.append("page_cache_read_gib_s: prior: host_io_gib_s (no buffered-read ceiling)")
    call = COPY_CALL_US
    small = min(layouts, key=layouts.get)
    if small != big and f"{small} pinned h2d" in cases:
        # Per copy: call + bytes / rate, at two block sizes.
        t_small = layouts[small] / (cases[f"{small} pinned h2d"]["gib_s_best"] * GiB)
        t_big = layouts[big] / (h2d * GiB)
        rate = (layouts[big] - layouts[small]) / (t_big - t_small)
        call = round(max(0.0, t_small - layouts[small] / rate) * 1e6, 3)
        notes.append(f"copy_call_us: pinned h2d at {layouts[small]:,} and {layouts[big]:,} B per copy")
    elif base is not None:
        call = base.copy_call_us
        notes.append(f"copy_call_us: from profile {base.name} (this bench has one block size)")
    else:
        notes.append(f"copy_call_us: prior: {COPY_CALL_US} us (simulation notes 4.3)")
    notes.append("seal_gib_s: prior: one thread on the 2-core dev VM (AES-GCM: cryptography 50; xxh3_64)")
    return IoProfile(
        name=name, source=source, drives=len(bench.get("machine", {}).get("dirs", [])) or 1, cpus=_cpus(bench),
        disk_read=_direction(cases, layouts, "read"), disk_write=_direction(cases, layouts, "write"),
        page_cache_read_gib_s=pc_read, page_cache_write_gib_s=pc_read,
        host_io_gib_s=host, pcie_h2d_gib_s=h2d, pcie_d2h_gib_s=d2h, copy_call_us=call,
        seam_h2d_gib_s=seam["h2d"] or h2d, seam_d2h_gib_s=seam["d2h"] or d2h, seal_gib_s=dict(SEAL_GIB_S),
        notes=notes,
    )


# -- replaying the bench's own cases through kvsim -------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    measured_s: float
    block_bytes: int
    num_blocks: int
    job_blocks: int
    is_store: bool
    page_cache: bool
    warm: bool  # page cache: every slot resident
    seal: str
    paths: int
    drives: int
    threads: Optional[int]  # per lane; None: kvoffload's rule from the host's cores
    unit_bytes: int
    role: str  # which factor it fits ("read", "write", ...), "predicted", or "first-store"


def bench_cases(bench: dict) -> list[Case]:
    """kvoffload's store and load cases of a bench run, with what kvsim needs to replay them."""
    layouts = _layouts(bench)
    big = max(layouts, key=layouts.get)
    cfg = bench["config"]
    threads, unit, _ = _pipeline(bench)
    out = []
    for c in bench["cases"]:
        if c["group"] not in ("disk", "stripe"):
            continue
        name, d = c["case"], c["detail"]
        op = name.rsplit(" ", 1)[1]
        layout, mode = c["layout"], d["mode"]
        drives = 1
        if c["group"] == "stripe" and " dirs " in name:
            drives = d["paths"]
        block = layouts[layout]
        fit = c["group"] == "disk" and layout == big
        if op == "store":
            role = "first-store"
        elif not fit or (mode == "pagecache" and op == "cold-load"):
            role = "predicted"
        elif mode == "direct":
            role = "write" if op == "rewrite" else "read"
        else:
            role = "page-cache write" if op == "rewrite" else "host memory"
        out.append(Case(name, c["bytes"] / (c["gib_s_best"] * GiB), block, c["bytes"] // block,
                        max(1, cfg["job_bytes"] // block), op in ("store", "rewrite"), mode == "pagecache",
                        mode == "pagecache" and op == "warm-load", d["seal"], d.get("paths", 1), drives,
                        d.get("io_threads", threads), d.get("io_unit_bytes", unit or KVOFFLOAD.unit_bytes), role))
    if not out:
        raise BenchError("the bench has no kvoffload store or load case (group 'disk')")
    return out


def predict_s(case: Case, profile: IoProfile) -> float:
    """Seconds kvsim takes for the case's jobs, all launched at once as the bench does."""
    slot = slot_bytes_for(case.block_bytes, MIN_DIRECT_ALIGNMENT, case.page_cache)
    pipe = dataclasses.replace(KVOFFLOAD, seal=case.seal, paths=case.paths, page_cache=case.page_cache,
                               threads=case.threads, unit_bytes=case.unit_bytes)
    spec = TierSpec("disk", case.num_blocks * slot, pipe, "bench")
    tier = OffloadTier(spec, Hardware(), dataclasses.replace(profile, drives=case.drives), case.block_bytes, 1)
    done = 0
    for start in range(0, case.num_blocks, case.job_blocks):
        n = min(case.job_blocks, case.num_blocks - start)
        done = max(done, tier.submit_job(0, n, case.is_store, n if case.warm else 0))
    return done / 1e9


def _error(case: Case, profile: IoProfile) -> float:
    return predict_s(case, profile) / case.measured_s - 1


# Each fitted factor: the cases it fits to, and how it changes the profile.
_FACTORS: dict[str, Callable[[IoProfile, float], IoProfile]] = {
    "read": lambda p, f: dataclasses.replace(p, disk_read=_scaled(p.disk_read, f)),
    "write": lambda p, f: dataclasses.replace(p, disk_write=_scaled(p.disk_write, f)),
    "host memory": lambda p, f: dataclasses.replace(p, host_io_gib_s=round(p.host_io_gib_s * f, 4)),
    "page-cache write": lambda p, f: dataclasses.replace(
        p, page_cache_write_gib_s=round(p.page_cache_write_gib_s * f, 4)),
}


def _scaled(d: DiskDirection, f: float) -> DiskDirection:
    return DiskDirection(d.latency_us, round(d.qd1_gib_s * f, 4), round(d.max_gib_s * f, 4))


def _fit_factor(profile: IoProfile, cases: list[Case], apply: Callable[[IoProfile, float], IoProfile]) -> float:
    """The factor that minimises the largest |log(predicted / measured)| (golden-section search)."""
    def worst(log_f: float) -> float:
        p = apply(profile, math.exp(log_f))
        return max(abs(math.log(predict_s(c, p) / c.measured_s)) for c in cases)

    lo, hi = math.log(0.05), math.log(20.0)
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = worst(a), worst(b)
    for _ in range(60):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = worst(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = worst(b)
    return math.exp((lo + hi) / 2)


def calibrate(bench: dict, name: str, source: str, base: Optional[IoProfile] = None) -> IoProfile:
    """Fit a profile to a bench run; its ``fidelity`` lists every kvoffload case.
    ``base``: a profile of the same host, for what this bench does not measure."""
    profile = ceilings(bench, name, source, base)
    cases = bench_cases(bench)
    threads, unit, where = _pipeline(bench)
    notes = list(profile.notes)
    notes.append(f"bench pipeline (from {where}): {threads or 'default'} IO threads per lane, "
                 f"{unit or KVOFFLOAD.unit_bytes:,}-byte units")
    # Host memory first: its bound also caps the drives.
    for role, field_names in (("host memory", "host_io_gib_s"), ("page-cache write", "page_cache_write_gib_s"),
                              ("read", "disk_read"), ("write", "disk_write")):
        fit_on = [c for c in cases if c.role == role]
        if fit_on:
            f = _fit_factor(profile, fit_on, _FACTORS[role])
            profile = _FACTORS[role](profile, f)
            notes.append(f"{field_names}: x{f:.3f}, fitted on " + ", ".join(c.name for c in fit_on))
        elif role == "page-cache write" and base is not None:
            profile = dataclasses.replace(profile, page_cache_write_gib_s=base.page_cache_write_gib_s)
            notes.append(f"page_cache_write_gib_s: from profile {base.name} (this bench has no page-cache case)")
        elif role == "page-cache write":
            notes.append("page_cache_write_gib_s: prior: page_cache_read_gib_s (no page-cache case)")
    rows = [{"case": c.name, "role": c.role, "measured_s": round(c.measured_s, 4),
             "predicted_s": round(predict_s(c, profile), 4), "error": round(_error(c, profile), 4)}
            for c in cases]
    return dataclasses.replace(profile, notes=notes, fidelity=rows)


def fidelity_table(profile: IoProfile) -> str:
    """The fidelity rows; ``!`` marks an error beyond ``TOLERANCE``."""
    head = f"{'bench case':<42} {'role':<17} {'measured s':>10} {'kvsim s':>9} {'error':>7}"
    lines = [head, "-" * len(head)]
    for r in profile.fidelity:
        mark = " !" if abs(r["error"]) > TOLERANCE else ""
        lines.append(f"{r['case']:<42} {r['role']:<17} {r['measured_s']:>10.3f} {r['predicted_s']:>9.3f} "
                     f"{r['error']:>+7.1%}{mark}")
    lines.append(f"! = more than {TOLERANCE:.0%} off (docs/kvsim.md says which cases, and why)")
    return "\n".join(lines)


def load_bench(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise BenchError(f"{path}: not JSON: {e.msg} at line {e.lineno}") from None
