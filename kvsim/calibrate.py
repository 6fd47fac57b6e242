"""``python -m kvsim calibrate BENCH.json -o hw.json``: an IO profile from kvoffload's bench.

Two steps. The ceilings give the shape, where the bench has two block sizes as a
fixed cost per IO plus one per byte: the drive's time for an IO alone (``raw
direct-*`` at queue depth 1) and busy (at its best queue depth: small IOs are capped
per IO, not per byte), one thread's page-cache read (``raw buffered-read`` at its
highest queue depth), the pinned and batched copies (``pinned *``; ``seam *``, per
row and per byte), sealing (``seal * 1 thread``), host memory (``host memcpy``),
the serialised Python cost per IO of the raw page-cache reads (the shape of
kvoffload's per-slot CPU) and what a first write into a fresh slot file adds per
slot (the single-file ``store`` against the ``rewrite`` of the same run: ext4
converts the fallocated extent; a buffered first write allocates its pages).
Then one factor per path is fitted, replaying kvoffload's own cases through kvsim's
tier code with the bench's jobs (all launched at once, as the bench does): on the
largest layout the drive's read rate (O_DIRECT loads), its write rate (rewrites),
the page-cache write rate (page-cache rewrites), the host-memory bound (page-cache
warm loads) and the first writes (stores), and the per-slot CPU on a smaller
layout's page-cache warm loads. A factor is needed because the raw ceilings are
timed over short windows and a virtual disk swings more than that between windows
(docs/performance.md). Everything else is predicted, not fitted: the other cases of
the smaller layout, page-cache cold loads, striping over several paths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

from kvoffload.cli_args import InputError, finite_number, integer_at_least, read_json, require
from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, slot_bytes_for
from kvsim.hardware import Hardware
from kvsim.limits import (MAX_BENCH_BLOCKS, MAX_BYTES, MAX_CPUS, MAX_DRIVES, MAX_GIB_S, MAX_QUEUE_DEPTH, MAX_ROWS,
                          MAX_THREADS, MIN_GIB_S, number_in, shown)
from kvsim.offload import OffloadTier
from kvsim.profile import HOST_PASSES, SEALS, DiskDirection, GiB, IoCost, IoProfile
from kvsim.tiers import KVOFFLOAD, TierSpec

# One thread sealing a slot, measured on the 2-core dev VM (shared notes
# measured-2026-12.md: cryptography 50 AES-128-GCM 9.4 GiB/s per thread; README:
# xxh3_64 44 GiB/s): for a bench run without its seal cases (``--only seal``).
SEAL_GIB_S = {"aes-gcm": 9.4, "xxh3": 44.0}
COPY_CALL_US = 7.0  # notes §4.3, when the bench has one block size only
# kvsim's claim for the bench's own jobs (docs/kvsim.md, tests/test_kvsim_calibrate.py).
TOLERANCE = 0.10


class BenchError(InputError):
    """The bench JSON lacks what calibration needs; the message says what (and where)."""


_OPS = ("store", "rewrite", "cold-load", "warm-load")


def check_bench(bench: Any, path: str) -> None:
    """Refuse a bench document that lacks, or holds the wrong type of, anything calibration
    reads; the error names ``path`` and the line (``read_json``'s documents know it)."""
    def need(ok: bool, container: Any, key: Any, message: str) -> None:
        require(ok, path, container, key, message, BenchError)

    # Each figure in its range (kvsim/limits.py): rates in GiB/s, counts of bytes, threads,
    # paths, rows; calibration replays every case block by block, dozens of times.
    def number(container: Any, key: str, what: str) -> None:
        v = container.get(key)
        need(finite_number(v) and v > 0, container, key, f"{what}{key} must be a number > 0, got {shown(v)}")
        need(number_in(v, MIN_GIB_S, MAX_GIB_S), container, key,
             f"{what}{key} must be a rate in [{MIN_GIB_S:g}, {MAX_GIB_S:g}] GiB/s, got {shown(v)}")

    def count(container: Any, key: str, what: str, optional: bool = False, most: int = MAX_BYTES) -> None:
        v = container.get(key)
        need((optional and v is None) or integer_at_least(v, 1), container, key,
             f"{what}{key} must be an integer >= 1, got {shown(v)}")
        need(v is None or v <= most, container, key, f"{what}{key} must be an integer in [1, {most}], got {shown(v)}")

    need(isinstance(bench, dict) and isinstance(bench.get("cases"), list), bench, "cases",
         "not the output of `python -m kvoffload.bench --json` (no 'cases' list)")
    machine, cfg = bench.get("machine"), bench.get("config")
    need(isinstance(machine, dict) and integer_at_least(machine.get("cpus"), 1), bench, "machine",
         "the bench machine lists no cpus (machine.cpus: an integer >= 1)")
    count(machine, "cpus", "machine.", most=MAX_CPUS)
    need(isinstance(machine.get("dirs", []), list), machine, "dirs", "machine.dirs must be a list")
    need(len(machine.get("dirs", [])) <= MAX_DRIVES, machine, "dirs",
         f"machine.dirs must list at most {MAX_DRIVES} directories (a profile's drives)")
    need(isinstance(cfg, dict) and isinstance(cfg.get("layouts"), dict) and cfg["layouts"], bench, "config",
         "the bench config lists no layouts")
    layouts = cfg["layouts"]
    for name, layout in layouts.items():
        need(isinstance(layout, dict), layouts, name, f"layout {name!r} must be an object")
        count(layout, "block_bytes", f"layout {name!r}: ")
    count(cfg, "job_bytes", "config.")
    count(cfg, "io_threads", "config.", optional=True, most=MAX_THREADS)
    count(cfg, "io_unit_bytes", "config.", optional=True)
    seen: set[str] = set()
    for i, c in enumerate(bench["cases"]):
        need(isinstance(c, dict) and isinstance(c.get("case"), str) and isinstance(c.get("group"), str)
             and isinstance(c.get("detail"), dict), bench["cases"], i,
             "a case must be an object with a 'case' name, a 'group' and a 'detail' object")
        name, group, d = c["case"], c["group"], c["detail"]
        what = f"case {name!r}: "
        need(name not in seen, c, "case", f"{what}given twice")
        seen.add(name)
        number(c, "gib_s_best", what)
        count(c, "bytes", what)
        if group in ("disk", "stripe", "seam"):
            need(isinstance(c.get("layout"), str) and c["layout"] in layouts, c, "layout",
                 f"{what}layout {c.get('layout')!r} is not in config.layouts")
        if group == "raw":
            count(d, "io_bytes", what + "detail.")
            qd = d.get("by_qd")
            need(isinstance(qd, dict) and "1" in qd and all(k.isascii() and k.isdigit() and len(k) <= 9
                                                            and 1 <= int(k) <= MAX_QUEUE_DEPTH for k in qd),
                 d, "by_qd", f"{what}detail.by_qd must be an object of rates by queue depth (1 to {MAX_QUEUE_DEPTH}), "
                             f"depth 1 included")
            for k in qd:
                number(qd, k, f"{what}detail.by_qd.")
        elif group == "seam":
            count(d, "rows_per_call", what + "detail.", most=MAX_ROWS)
            count(d, "threads", what + "detail.", optional=True, most=MAX_THREADS)
        elif group in ("disk", "stripe"):
            need(name.rsplit(" ", 1)[-1] in _OPS, c, "case", f"{what}the name must end in one of {', '.join(_OPS)}")
            need(d.get("mode") in ("direct", "pagecache"), d, "mode", f"{what}detail.mode must be direct or pagecache")
            need(d.get("seal") in SEALS, d, "seal", f"{what}detail.seal must be one of {', '.join(SEALS)}")
            count(d, "paths", what + "detail.", optional=True, most=MAX_DRIVES)
            count(d, "io_threads", what + "detail.", optional=True, most=MAX_THREADS)
            count(d, "io_unit_bytes", what + "detail.", optional=True)
            block = layouts[c["layout"]]["block_bytes"]
            need(c["bytes"] >= block, c, "bytes", f"{what}bytes must be at least one block")
            need(c["bytes"] // block <= MAX_BENCH_BLOCKS, c, "bytes",
                 f"{what}bytes must be at most {MAX_BENCH_BLOCKS} blocks of {block} bytes, got {c['bytes']}")


def _cases(bench: dict) -> dict[str, dict]:
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


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Seconds per IO as (fixed, per byte), through the smallest and largest of
    ``(bytes, seconds)`` points; through zero with one size, or when the smaller IO
    costs no less, and the fixed part is never below zero."""
    points = sorted(points)
    (b0, t0), (b1, t1) = points[0], points[-1]
    if b1 > b0 and t1 > t0:
        per_byte = (t1 - t0) / (b1 - b0)
        return max(0.0, t0 - b0 * per_byte), per_byte
    return 0.0, t1 / b1


def _direction(cases: dict[str, dict], layouts: dict[str, int], kind: str) -> DiskDirection:
    """An IO alone (latency + size / rate) from the raw ceilings' queue-depth-1 rates, and
    the drive busy (per IO + size / best rate) from their best rates, at up to two IO sizes."""
    alone, busy = [], []
    for name in layouts:
        c = cases.get(f"{name} raw direct-{kind}")
        if c is not None:
            io = c["detail"]["io_bytes"]
            alone.append((io, io / (c["detail"]["by_qd"]["1"] * GiB)))
            # The best of the sweep's short windows and the longer one at its best depth:
            # the virtual disk drifts between them, and a drive is never slower busy than alone.
            best = max(c["gib_s_best"], *c["detail"]["by_qd"].values())
            busy.append((io, io / (best * GiB)))
    if not alone:
        raise BenchError(f"the bench has no 'raw direct-{kind}' case")
    latency, per_byte = _line(alone)
    per_io, busy_per_byte = _line(busy)
    return DiskDirection(round(latency * 1e6, 3), round(1 / per_byte / GiB, 4), round(1 / busy_per_byte / GiB, 4),
                         round(per_io * 1e6, 3))


def _raw_call_us(cases: dict[str, dict], layouts: dict[str, int]) -> Optional[float]:
    """The serialised cost per IO of the raw page-cache reads (Python threads calling
    ``preadv``: the wall time per IO at the highest queue depth, at two IO sizes)."""
    points = []
    for name in layouts:
        c = cases.get(f"{name} raw buffered-read")
        if c is not None:
            qd = max(c["detail"]["by_qd"], key=int)
            points.append((c["detail"]["io_bytes"], c["detail"]["io_bytes"] / (c["detail"]["by_qd"][qd] * GiB)))
    if len({b for b, _ in points}) < 2:
        return None
    return round(_line(points)[0] * 1e6, 3)


def _first_write(cases: list["Case"], mode_page_cache: bool) -> Optional[IoCost]:
    """What a first write adds per slot, from the single-file ``store`` against ``rewrite``
    of the same layout and mode (both seals averaged), at up to two slot sizes."""
    extra: dict[int, list[float]] = {}
    by_name = {c.name: c for c in cases}
    for c in cases:
        rewrite = by_name.get(c.name.removesuffix(" store") + " rewrite")
        if c.first and c.paths == 1 and c.page_cache == mode_page_cache and rewrite is not None:
            slot = slot_bytes_for(c.block_bytes, MIN_DIRECT_ALIGNMENT, c.page_cache)
            extra.setdefault(slot, []).append(c.measured_s / c.num_blocks - rewrite.measured_s / rewrite.num_blocks)
    points = [(b, max(0.0, sum(v) / len(v))) for b, v in extra.items()]
    if not points:
        return None
    fixed, per_byte = _line(points)
    return IoCost(round(fixed * 1e6, 3), round(per_byte * (1 << 20) * 1e6, 3))


def _measured_or_base(notes: list[str], fields: tuple[str, ...], measured: Optional[tuple], how: str,
                      base: Optional[IoProfile], prior: tuple, prior_how: str) -> tuple:
    """``fields``' values as measured (noted as ``how``), else a base profile's, else ``prior``."""
    names = ", ".join(fields)
    if measured is not None:
        notes.append(f"{names}: {how}")
        return measured
    if base is not None:
        notes.append(f"{names}: from profile {base.name} (this bench does not measure it)")
        return tuple(getattr(base, f) for f in fields)
    notes.append(f"{names}: prior: {prior_how}")
    return prior


def _per_size(cases: dict[str, dict], layouts: dict[str, int], case: str) -> list[tuple[int, float]]:
    """(block bytes, seconds per block) of ``{layout} {case}`` for each layout the bench ran it on."""
    return [(b, b / (cases[f"{name} {case}"]["gib_s_best"] * GiB)) for name, b in layouts.items()
            if f"{name} {case}" in cases]


def ceilings(bench: dict, name: str, source: str, base: Optional[IoProfile] = None,
             drives: Optional[int] = None) -> IoProfile:
    """The profile from the ceilings alone, before any factor is fitted; ``notes`` say
    where each figure came from. What the bench cannot give comes from ``base`` (a
    profile of the same host), else from a prior. ``drives``: how many of the bench's
    drives the profile has (default: all its directories); every rate is one drive's."""
    cases = _cases(bench)
    dirs = len(bench.get("machine", {}).get("dirs", [])) or 1
    layouts = _layouts(bench)
    big = max(layouts, key=layouts.get)
    sizes = ", ".join(f"{b:,} B" for b in sorted(layouts.values()))
    notes = [f"disk_read, disk_write: an IO alone (latency, rate) from the raw direct ceilings at queue depth 1, "
             f"the drive busy (per IO, best rate) from their best rates over queue depths, at {sizes}"]
    if drives is not None:
        notes.append(f"drives: {drives} of the bench's {dirs} (its single-file cases each ran on one drive)")
    h2d, d2h = (_need(cases, f"{big} pinned {d}")["gib_s_best"] for d in ("h2d", "d2h"))
    notes.append(f"pcie_h2d_gib_s, pcie_d2h_gib_s: {big} pinned copy ceilings")
    memcpy = _need(cases, f"{big} host memcpy")["gib_s_best"]
    host = round(memcpy * 2 / HOST_PASSES, 4)
    notes.append(f"host_io_gib_s: host memcpy {memcpy} x 2/{HOST_PASSES} (DRAM passes of a memcpy / of a file load)")
    buffered = cases.get(f"{big} raw buffered-read")
    pc_read = host
    if buffered is not None:
        qd = max(buffered["detail"]["by_qd"], key=int)
        pc_read = round(buffered["detail"]["by_qd"][qd] / int(qd), 4)
        notes.append(f"page_cache_read_gib_s: raw buffered-read at queue depth {qd}, per thread")
    else:
        notes.append("page_cache_read_gib_s: prior: host_io_gib_s (no buffered-read ceiling)")
    pinned = _per_size(cases, layouts, "pinned h2d")
    (call,) = _measured_or_base(
        notes, ("copy_call_us",), (round(_line(pinned)[0] * 1e6, 3),) if len(pinned) > 1 else None,
        f"pinned h2d per copy at {sizes}", base, (COPY_CALL_US,), f"{COPY_CALL_US} us (simulation notes 4.3)")
    seam = []
    for d, pinned_rate in (("h2d", h2d), ("d2h", d2h)):
        points = _per_size(cases, layouts, f"seam {d}")
        row, per_byte = _line(points) if points else (0.0, 0.0)
        seam += _measured_or_base(
            notes, (f"seam_{d}_gib_s", f"seam_{d}_row_us"),
            (round(1 / per_byte / GiB, 4), round(row * 1e6, 3)) if points else None,
            f"the seam cases at {', '.join(f'{b:,} B' for b, _ in sorted(points))} (per row and per byte)", base,
            (pinned_rate, 0.0), "the pinned copy rate, nothing per row")
    sealed = {k: cases[f"seal {k} 1 thread"]["gib_s_best"] for k in SEAL_GIB_S if f"seal {k} 1 thread" in cases}
    (seal,) = _measured_or_base(notes, ("seal_gib_s",), (sealed,) if len(sealed) == len(SEAL_GIB_S) else None,
                                "the seal cases, 1 thread", base, (dict(SEAL_GIB_S),),
                                "one thread on the 2-core dev VM (AES-GCM: cryptography 50; xxh3_64)")
    raw_call = _raw_call_us(cases, layouts)
    (slot_cpu,) = _measured_or_base(notes, ("slot_cpu_us",), (raw_call,) if raw_call is not None else None,
                                    f"raw buffered-read per IO at {sizes} (Python threads taking turns)", base,
                                    (0.0,), "0 (no buffered-read ceiling at two block sizes)")
    return IoProfile(
        name=name, source=source, drives=drives or dirs, cpus=_cpus(bench),
        disk_read=_direction(cases, layouts, "read"), disk_write=_direction(cases, layouts, "write"),
        page_cache_read_gib_s=pc_read, page_cache_write_gib_s=pc_read,
        host_io_gib_s=host, pcie_h2d_gib_s=h2d, pcie_d2h_gib_s=d2h, copy_call_us=call,
        seam_h2d_gib_s=seam[0], seam_h2d_row_us=seam[1], seam_d2h_gib_s=seam[2], seam_d2h_row_us=seam[3],
        seal_gib_s=seal, slot_cpu_us=slot_cpu, notes=notes,
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
    first: bool  # a store into a fresh slot file: every write is a slot's first
    page_cache: bool
    warm: bool  # page cache: every slot resident
    seal: str
    paths: int
    drives: int
    threads: Optional[int]  # per lane; None: kvoffload's rule from the host's cores
    unit_bytes: Optional[int]  # None: kvoffload's default
    role: str  # which factor it fits ("read", "write", ...) or "predicted"


def _role(op: str, mode: str, layout: str, layouts: dict[str, int], group: str) -> str:
    """Which factor a case fits: kvoffload's cases on one file of the largest layout fit
    the drive, the page cache and host memory; the page-cache warm loads of a smaller
    layout fit the per-slot CPU; everything else is predicted."""
    if group != "disk":
        return "predicted"
    if layout != max(layouts, key=layouts.get):
        return "slot cpu" if mode == "pagecache" and op == "warm-load" else "predicted"
    if mode == "direct":
        return {"store": "first write", "rewrite": "write"}.get(op, "read")
    return {"store": "page-cache first write", "rewrite": "page-cache write", "warm-load": "host memory"}.get(
        op, "predicted")


def bench_cases(bench: dict) -> list[Case]:
    """kvoffload's store and load cases of a bench run, with what kvsim needs to replay them."""
    layouts = _layouts(bench)
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
        out.append(Case(name, c["bytes"] / (c["gib_s_best"] * GiB), block, c["bytes"] // block,
                        max(1, cfg["job_bytes"] // block), op in ("store", "rewrite"), op == "store",
                        mode == "pagecache", mode == "pagecache" and op == "warm-load", d["seal"], d.get("paths", 1),
                        drives, d.get("io_threads", threads), d.get("io_unit_bytes", unit),
                        _role(op, mode, layout, layouts, c["group"])))
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
        done = max(done, tier.submit_job(0, n, case.is_store, n if case.warm else 0, n if case.first else 0))
    return done / 1e9


def _error(case: Case, profile: IoProfile) -> float:
    return predict_s(case, profile) / case.measured_s - 1


def _scaled(d: DiskDirection, f: float) -> DiskDirection:
    """The drive ``f`` times as fast: its rates, not its per-IO times."""
    return dataclasses.replace(d, qd1_gib_s=round(d.qd1_gib_s * f, 4), max_gib_s=round(d.max_gib_s * f, 4))


def _times(c: IoCost, f: float) -> IoCost:
    return IoCost(round(c.us * f, 3), round(c.us_per_mib * f, 3))


# Each fitted factor, in the order they are fitted (per-slot CPU and host memory bound
# the drives' cases too): the profile field it scales and how.
_FACTORS: dict[str, tuple[str, Callable[[IoProfile, float], IoProfile]]] = {
    "slot cpu": ("slot_cpu_us", lambda p, f: dataclasses.replace(p, slot_cpu_us=round(p.slot_cpu_us * f, 3))),
    "host memory": ("host_io_gib_s", lambda p, f: dataclasses.replace(p, host_io_gib_s=round(p.host_io_gib_s * f, 4))),
    "page-cache write": ("page_cache_write_gib_s", lambda p, f: dataclasses.replace(
        p, page_cache_write_gib_s=round(p.page_cache_write_gib_s * f, 4))),
    "read": ("disk_read", lambda p, f: dataclasses.replace(p, disk_read=_scaled(p.disk_read, f))),
    "write": ("disk_write", lambda p, f: dataclasses.replace(p, disk_write=_scaled(p.disk_write, f))),
    "first write": ("first_write", lambda p, f: dataclasses.replace(p, first_write=_times(p.first_write, f))),
    "page-cache first write": ("first_write_page_cache", lambda p, f: dataclasses.replace(
        p, first_write_page_cache=_times(p.first_write_page_cache, f))),
}
# What a bench without cases for a factor takes from a base profile of the same host.
_FROM_BASE = ("page-cache write", "first write", "page-cache first write")


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


def calibrate(bench: dict, name: str, source: str, base: Optional[IoProfile] = None,
              drives: Optional[int] = None) -> IoProfile:
    """Fit a profile to a bench run; its ``fidelity`` lists every kvoffload case.
    ``base``: a profile of the same host, for what this bench does not measure;
    ``drives``: how many of the bench's drives the profile has (``ceilings``);
    ``source``: where the bench came from (a bad document's errors name it)."""
    check_bench(bench, source)
    profile = ceilings(bench, name, source, base, drives)
    cases = bench_cases(bench)
    threads, unit, where = _pipeline(bench)
    notes = list(profile.notes)
    notes.append(f"bench pipeline (from {where}): {threads or 'default'} IO threads per lane, "
                 + (f"{unit:,}-byte units" if unit else "kvoffload's default units"))
    for page_cache, field_name in ((False, "first_write"), (True, "first_write_page_cache")):
        cost = _first_write(cases, page_cache)
        if cost is not None:
            profile = dataclasses.replace(profile, **{field_name: cost})
            sizes = sorted({c.block_bytes for c in cases if c.first and c.page_cache == page_cache and c.paths == 1})
            notes.append(f"{field_name}: single-file store minus rewrite per slot, both seals, at "
                         + ", ".join(f"{b:,} B" for b in sizes))
    for role, (field_name, apply) in _FACTORS.items():
        fit_on = [c for c in cases if c.role == role]
        if fit_on:
            f = _fit_factor(profile, fit_on, apply)
            profile = apply(profile, f)
            notes.append(f"{field_name}: x{f:.3f}, fitted on " + ", ".join(c.name for c in fit_on))
        elif role in _FROM_BASE and base is not None:
            profile = dataclasses.replace(profile, **{field_name: getattr(base, field_name)})
            notes.append(f"{field_name}: from profile {base.name} (this bench has no case for it)")
        elif role in _FROM_BASE:
            notes.append(f"{field_name}: not fitted (this bench has no case for it)")
    rows = [{"case": c.name, "role": c.role, "measured_s": round(c.measured_s, 4),
             "predicted_s": round(predict_s(c, profile), 4), "error": round(_error(c, profile), 4)}
            for c in cases]
    return dataclasses.replace(profile, notes=notes, fidelity=rows)


def fidelity_table(profile: IoProfile) -> str:
    """The fidelity rows; ``!`` marks an error beyond ``TOLERANCE``."""
    head = f"{'bench case':<42} {'role':<22} {'measured s':>10} {'kvsim s':>9} {'error':>7}"
    lines = [head, "-" * len(head)]
    for r in profile.fidelity:
        mark = " !" if abs(r["error"]) > TOLERANCE else ""
        lines.append(f"{r['case']:<42} {r['role']:<22} {r['measured_s']:>10.3f} {r['predicted_s']:>9.3f} "
                     f"{r['error']:>+7.1%}{mark}")
    lines.append(f"! = more than {TOLERANCE:.0%} off (docs/kvsim.md says which cases, and why)")
    return "\n".join(lines)


def load_bench(path: str) -> dict[str, Any]:
    """The bench JSON at ``path``, as ``cli_args.read_json`` reads it (each object knows its
    line); ``calibrate`` checks it."""
    try:
        return read_json(path)
    except InputError as e:
        raise BenchError(str(e)) from None
