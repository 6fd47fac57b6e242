"""docs/performance.md's ceiling table, in one device call: every ratio of the engine issue,
measured in interleaved pairs on RAM-backed drives, then one table (median, range, target).

    OUT=/dir python3 scripts/ceiling_table.py --fs-files .whl/vllm-fs

As root (it builds loop devices over /dev/shm: ``kvoffload.bench.ram_array``, the recipe of
``../shared/notes/measured-2026-12.md``). Four parts, each a subprocess whose JSON lands in
$OUT, each with its share of ``--budget-s`` (what finished is tabled even when a later part
ran out of time):

- the engine group at 75% Python per 20 ms step, one drive and four, GPU path, tier and the
  raw design (``python -m kvoffload.bench --only engine``): bandwidth kept and the engine
  step's ratio, busy against alone, each a median over interleaved repeats;
- the tier against vLLM 0.33's fs C core, 2 MiB chunks on four drives and on one, 256 KiB on
  four (``python -m kvoffload.bench.tier --tiers kvoffload-direct,fs-core``, rounds in
  alternating order): load, steady store and first store, kvoffload over fs;
- the stripe bench on four drives and on one (``python -m kvoffload.bench --only stripe
  --runs N``): cold load over reads cycling through the staging's worth of memory, first
  store over raw O_DIRECT writes.

``--fs-files``: vLLM 0.33.0's fs files unpacked from its wheel, paths kept
(``vllm/fs_io_C.abi3.so`` and ``vllm/v1/kv_offload/tiering/fs/{io,thread_pool}.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run(name: str, cmd: list[str], out: Path, timeout: float) -> dict | None:
    """Run one part; its JSON, or None (the reason on stderr)."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, timeout=max(10.0, timeout), text=True,
                               cwd=HERE)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {timeout:.0f} s", file=sys.stderr)
            return None
    (out / f"{name}.json").write_text(p.stdout)
    print(f"{name}: exit {p.returncode} after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    try:
        return json.loads(p.stdout)
    except ValueError:
        return None


def spread(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def row(what: str, xs: list[float], target: str, ok: bool) -> str:
    if not xs:
        return f"| {what} | {target} | not measured | | 0 | - |"
    m, lo, hi = spread(xs)
    return f"| {what} | {target} | {m:.3f} | {lo:.3f}-{hi:.3f} | {len(xs)} | {'met' if ok else 'NOT met'} |"


def engine_rows(data: dict) -> list[str]:
    out = []
    cases = data.get("engine", [])
    raw_step = {(c["drives"], c["direction"]): c["detail"] for c in cases if c["path"] == "raw"}
    for c in cases:
        if c["path"] == "raw":
            continue
        busy, alone = c["detail"]["python_ms_per_step_busy"], c["detail"]["python_ms_per_step_alone"]
        bw = [b / r for b, r in zip(c["detail"]["gib_s_busy"], c["detail"]["gib_s_ref"]) if r]
        step = [b / a for b, a in zip(busy, alone) if a]
        where = f"{c['path']} {c['direction']}, {c['drives']} drive(s)"
        out.append(row(f"{where}: bandwidth kept beside the engine", bw, ">= 0.95",
                       bool(bw) and statistics.median(bw) >= 0.95))
        r = raw_step.get((c["drives"], c["direction"]))
        raw = [b / a for b, a in zip(r["python_ms_per_step_busy"], r["python_ms_per_step_alone"]) if a] if r else []
        ok = bool(step and raw) and statistics.median(step) <= statistics.median(raw) + 0.05
        out.append(row(f"{where}: engine step busy/alone (raw design: "
                       f"{statistics.median(raw) if raw else float('nan'):.3f})", step, "<= raw's + 0.05", ok))
    return out


def tier_rows(name: str, data: dict, steady: float, first: float) -> list[str]:
    out = []
    rs = [r for r in data.get("ratios", []) if r["fs_io"] == "C"]
    for metric, label, target in (("load", "load", steady), ("store_again", "steady store", steady),
                                  ("store", "first store", first)):
        xs = [r[metric] for r in rs if r[metric] is not None]
        out.append(row(f"tier {name}: {label}, kvoffload / fs C core", xs, f">= {target:g}",
                       bool(xs) and statistics.median(xs) >= target))
    return out


def stripe_rows(data: dict) -> list[str]:
    out = []
    by = {c["case"]: c for c in data.get("cases", [])}
    for case, ceiling, label, target in (
            ("llama stripe 4 dirs aes-gcm cold-load", "cycling", "4 drives: cold load / reads cycling", 0.95),
            ("llama stripe 4 dirs aes-gcm store", "write", "4 drives: first store / raw write", 0.8),
            ("llama stripe 2 paths 1 disk cold-load", "cycling", "1 drive: cold load / reads cycling", 0.95),
            ("llama stripe 2 paths 1 disk store", "write", "1 drive: first store / raw write", 0.8)):
        c = by.get(case)
        xs = c["ratio_per_run"] if c else []
        out.append(row(f"stripe {label}", xs, f">= {target:g}", bool(xs) and statistics.median(xs) >= target))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fs-files", required=True, help="vLLM 0.33.0's fs files, unpacked from its wheel")
    p.add_argument("--budget-s", type=float, default=530.0, help="seconds for all parts together (530)")
    p.add_argument("--drive-gib", type=float, default=12.0, help="GiB per RAM drive (12)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved rounds of the tier and stripe parts (3)")
    p.add_argument("--repeats", type=int, default=7, help="repeats of each engine case (7)")
    a = p.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    from kvoffload.bench.ram_array import RamArray

    start = time.monotonic()
    py = sys.executable
    with RamArray(4, a.drive_gib) as array:
        d = array.mountpoints
        dirs = [x for m in d for x in ("--dir", m)]
        parts = [
            ("engine", [py, "-m", "kvoffload.bench", *dirs, "--only", "engine", "--layouts", "llama", "--gib", "2",
                        "--engine-shares", "0.75", "--engine-seconds", "0.4", "--engine-paths", "gpu,tier,raw",
                        "--engine-min-repeats", str(a.repeats), "--engine-max-repeats", str(a.repeats), "--json"],
             0.40),
            ("tier-2mib-4", [py, "-m", "kvoffload.bench.tier", *dirs, "--tiers", "kvoffload-direct,fs-core",
                             "--fs-files", a.fs_files, "--fs-dirs", "all", "--gib", "6", "--repeat", str(a.pairs),
                             "--json"], 0.16),
            ("tier-2mib-1", [py, "-m", "kvoffload.bench.tier", "--dir", d[0], "--tiers", "kvoffload-direct,fs-core",
                             "--fs-files", a.fs_files, "--gib", "3", "--repeat", str(a.pairs), "--json"], 0.12),
            ("tier-256kib-4", [py, "-m", "kvoffload.bench.tier", *dirs, "--tiers", "kvoffload-direct,fs-core",
                               "--fs-files", a.fs_files, "--fs-dirs", "all", "--chunk-mib", "0.25", "--gib", "3",
                               "--repeat", str(a.pairs), "--json"], 0.14),
            ("stripe", [py, "-m", "kvoffload.bench", *dirs, "--only", "stripe", "--layouts", "llama", "--seals",
                        "aes-gcm", "--gib", "3", "--runs", str(a.pairs), "--json"], 0.18),
        ]
        got = {}
        for name, cmd, share in parts:
            left = a.budget_s - (time.monotonic() - start)
            (out / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
            got[name] = run(name, cmd, out, min(left, share * a.budget_s + 30))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    lines = [f"commit {commit.stdout.strip() or 'unknown'}; {gpu.stdout.strip() or 'no GPU'}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}; four RAM-backed ext4 drives of {a.drive_gib:g} GiB",
             "command: OUT=... python3 scripts/ceiling_table.py --fs-files ... (each part's command: $OUT/*.log)",
             "", "| ratio | target | median | range | n | |", "|---|---|---|---|---|---|"]
    if got.get("engine"):
        lines += engine_rows(got["engine"])
    for name, label, steady, first in (("tier-2mib-4", "2 MiB chunks, 4 drives", 1.1, 1.0),
                                       ("tier-2mib-1", "2 MiB chunks, 1 drive", 1.1, 1.0),
                                       ("tier-256kib-4", "256 KiB chunks, 4 drives", 1.0, 1.0)):
        if got.get(name):
            lines += tier_rows(label, got[name], steady, first)
    if got.get("stripe"):
        lines += stripe_rows(got["stripe"])
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
