"""The benchmark's output: rows from the runs, the full table, and a compact summary of several runs.

``python -m kvoffload.bench.report A.json B.json ...`` prints the compact summary of
``python -m kvoffload.bench --json`` outputs (scripts/h200_bench.sh ends with it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Optional

OPS = {"disk": ("store", "rewrite", "cold-load", "warm-load"), "stripe": ("store", "rewrite", "cold-load"),
       "dram": ("store", "load"), "seam": ("d2h", "h2d")}


def summarize(runs: list) -> list[dict]:
    """One row per case: best and worst GiB/s over the runs; ratios to the ceilings of the
    run where the case was fastest."""
    rows: list[dict] = []
    for c0 in runs[0] if runs else ():
        per_run = []
        for cases in runs:
            by_name = {c.name: c for c in cases}
            c = by_name.get(c0.name)
            if c is None:  # a run cut short by an interrupt
                continue
            ratios = {}
            for name in c.ceilings:
                ceil = by_name.get(name)
                if ceil is not None and ceil.timed.gib_s > 0:
                    ratios[name] = (c.timed.gib_s / ceil.timed.gib_s, ceil.timed.gib_s)
            per_run.append((c, ratios))
        best_c, ratios = max(per_run, key=lambda x: x[0].timed.gib_s)
        main = ratios.get(c0.ceilings[0]) if c0.ceilings else None
        # Each run measured the case and its ceilings back to back (interleaved rounds): the
        # ratio within each run, then their median and range, settle what one run cannot.
        per_round = [r[c0.ceilings[0]][0] for _, r in per_run if c0.ceilings and c0.ceilings[0] in r]
        gib = best_c.timed.nbytes / 2**30
        checks = [c.verified for c, _ in per_run]
        rows.append({
            "case": c0.name,
            "group": c0.group,
            "layout": c0.layout,
            "bytes": best_c.timed.nbytes,
            "seconds": round(best_c.timed.seconds, 4),
            "gib_s_best": round(best_c.timed.gib_s, 4),
            "gib_s_worst": round(min(c.timed.gib_s for c, _ in per_run), 4),
            "ceiling": c0.ceilings[0] if c0.ceilings else None,
            "ratio": None if main is None else round(main[0], 4),
            "ceiling_gib_s": None if main is None else round(main[1], 4),
            "ratios": {name: round(r, 4) for name, (r, _) in ratios.items()},
            "ratio_per_run": [round(x, 4) for x in per_round],
            "ratio_median": round(statistics.median(per_round), 4) if per_round else None,
            "cpu_s_per_gib": round(best_c.timed.cpu_seconds / gib, 4) if gib else None,
            "verified": None if checks[0] is None else all(checks),
            "detail": {**best_c.timed.detail, **best_c.info},
        })
    return rows


def seal_cost(rows: list[dict]) -> list[dict]:
    """Encryption against checksums alone, case by case of the same run: 1 - aes-gcm / xxh3."""
    by: dict[tuple, dict[str, float]] = {}
    for r in rows:
        d = r["detail"]
        if r["group"] in ("disk", "stripe") and "op" in d:
            key = (r["layout"], r["group"], d["mode"], d["paths"], d["drives"], d["op"])
            by.setdefault(key, {})[d["seal"]] = r["gib_s_best"]
    out = []
    for (layout, group, mode, paths, drives, op), v in by.items():
        if "aes-gcm" in v and v.get("xxh3"):
            out.append({"layout": layout, "group": group, "mode": mode, "paths": paths, "drives": drives, "op": op,
                        "aes_gcm_gib_s": v["aes-gcm"], "xxh3_gib_s": v["xxh3"],
                        "cost": round(1 - v["aes-gcm"] / v["xxh3"], 4)})
    return out


def drop_summary(drops: list[dict]) -> str:
    fadv = sorted({d["fadvise"] for d in drops}) or ["not needed"]
    glob = sorted({d["drop_caches"] for d in drops}) or ["not needed"]
    res = [d["resident_after"] for d in drops if d["resident_after"] is not None]
    worst = f"{max(res) * 100:.1f}%" if res else "unknown"
    return (f"page cache before cold loads: fsync+fadvise(DONTNEED) {', '.join(fadv)}; "
            f"/proc/sys/vm/drop_caches {', '.join(glob)}; most still resident after: {worst}")


# --- the full table ---------------------------------------------------------------------


def _label(r: dict) -> str:
    d = r["detail"]
    if r["group"] == "raw" and "qd" in d:
        return f"{r['case']} (qd {d['qd']})"
    return r["case"]


def table(rows: list[dict]) -> str:
    head = (f"{'case':<46} {'GiB/s':>8} {'worst':>8} {'ratio':>6} {'ceiling':>8}  {'of ceiling':<33} "
            f"{'CPU s/GiB':>9}  check  {'ratio per run: median (range)'}")
    out = [head, "-" * len(head)]
    layout = None
    for r in rows:
        if r["layout"] != layout and layout is not None:
            out.append("")
        layout = r["layout"]
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        ceil = "" if r["ceiling_gib_s"] is None else f"{r['ceiling_gib_s']:.2f}"
        check = {None: "-", True: "ok", False: "FAIL"}[r["verified"]]
        rounds = r.get("ratio_per_run") or []
        spread = (f"{r['ratio_median']:.2f} ({min(rounds):.2f}-{max(rounds):.2f}) of {len(rounds)}"
                  if len(rounds) > 1 else "")
        out.append(f"{_label(r):<46} {r['gib_s_best']:8.2f} {r['gib_s_worst']:8.2f} {ratio:>6} {ceil:>8}  "
                   f"{(r['ceiling'] or ''):<33} {(r['cpu_s_per_gib'] or 0):9.3f}  {check:<5}  {spread}".rstrip())
    return "\n".join(out)


def seal_lines(result: dict) -> list[str]:
    """The seals alone (GIL scaling) and what encryption costs against checksums alone."""
    out = []
    for r in result["cases"]:
        d = r["detail"]
        if r["group"] == "seal" and d.get("threads", 1) > 1:
            one = r["ceiling_gib_s"] or 0
            impl = " (native core)" if d.get("impl") == "native" else ""
            out.append(f"seal {d['seal']}{impl} alone on {d['buffer_bytes'] >> 20} MiB buffers: 1 thread {one:.2f} GiB/s, "
                       f"{d['threads']} threads {r['gib_s_best']:.2f} GiB/s: scaling {d['scaling']:.2f} of "
                       f"{d['ideal']}")
    groups: dict[tuple, list[str]] = {}
    for c in result.get("seal_cost", []):
        where = (f"{c['layout']} {c['mode']}" if c["group"] == "disk"
                 else f"{c['layout']} stripe, {c['paths']} files on {c['drives']} drive(s)")
        groups.setdefault((where,), []).append(f"{c['op']} {c['cost'] * 100:+.1f}%")
    for (where,), items in groups.items():
        out.append(f"encryption cost vs checksums (1 - aes-gcm/xxh3), {where}: {', '.join(items)}")
    return out


def metrics_lines(result: dict) -> list[str]:
    """Load with kvoffload's metric collection on against off (--only metrics)."""
    out = []
    for r in result["cases"]:
        d = r["detail"]
        if r["group"] == "metrics" and d.get("collect"):
            q, c = d["on_off"], d["cpu_s_per_gib_on_off"]
            out.append(f"metric collection, {r['layout']} {d['mode']} load: on {r['gib_s_best']:.3f} GiB/s, off "
                       f"{r['ceiling_gib_s'] or 0:.3f} GiB/s over all passes; on/off per pair median {q['median']:.4f} "
                       f"(min {q['min']:.4f}, max {q['max']:.4f}, {d['pairs']} pairs, order alternating); "
                       f"CPU s/GiB on/off median {c['median']:.4f} (min {c['min']:.4f}, max {c['max']:.4f})")
    return out


def full(result: dict) -> str:
    m, c = result["machine"], result["config"]
    fs = ", ".join(f"{d['path']} ({d['fs']})" for d in m["dirs"])
    lines = [f"kvoffload bench on {m['device']}, {m['cpus']} CPUs, torch {m['torch']}; files in {fs}"]
    if result.get("array"):
        a = result["array"]
        down = "ok" if a["teardown"] == "ok" else f"FAILED: {a['teardown']}"
        lines.append(f"RAM-backed array: {a['drives']} {a['fs']} drive(s) of {a['bytes_each'] / 2**30:g} GiB over "
                     f"{a['shm_dir']}; teardown {down}")
    lines += [
        f"{c['bytes_per_case'] / 2**20:.0f} MiB per pass, every case over >= {c['case_seconds']:g} s, "
        f"{c['runs']} run(s), slots {c['slots']}, {c['job_bytes'] / 2**20:g} MiB per job, {c['io_threads_used']} IO threads per lane, "
        + (f"{c['io_unit_bytes'] / 2**20:g} MiB IO units" if c["io_unit_bytes"] else "the backend's default IO units")
        + f"; raw = best of queue depths {c['queue_depths']}",
        result["cache_drop"]["summary"],
        c["host_bound"]["formula"],
        "ratio: store / raw write (then / rewrite), load / raw read, striped / all drives' raw (then one drive's), "
        "page-cache warm load / host-memory bound (then pinned h2d), DRAM and seam / pinned copies",
    ]
    if result["leftover_files"]:
        lines.append(f"LEFT BEHIND: {result['leftover_files']}")
    if result.get("interrupted"):
        lines.append(f"INTERRUPTED ({result['interrupted']}): only the cases measured before it")
    lines += seal_lines(result) + metrics_lines(result)
    lines += ["", table(result["cases"])]
    return "\n".join(lines)


# --- the compact summary of several runs --------------------------------------------------


def _cell(r: dict) -> str:
    ratio = "" if r["ratio"] is None else f" ({r['ratio']:.2f})"
    bad = "" if r["verified"] is not False else " FAIL"
    return f"{r['gib_s_best']:.2f}{ratio}{bad}"


def compact(result: dict, title: str) -> list[str]:
    m, c = result["machine"], result["config"]
    fs = ", ".join(sorted({d["fs"] for d in m["dirs"]}))
    where = f"{len(m['dirs'])} {fs} dir(s)" + (" (RAM-backed array)" if result.get("array") else "")
    state = "ok" if result["ok"] else "NOT OK"
    if result.get("interrupted"):
        state += f", INTERRUPTED ({result['interrupted']}): partial"
    out = [f"== {title}: {m['device']}, {where}, {c['bytes_per_case'] >> 20} MiB/pass, "
           f">= {c['case_seconds']:g} s/case, {state}"]
    by = {r["case"]: r for r in result["cases"]}
    for layout in c["layouts"]:
        ceil = []
        for name, label in ((f"{layout} raw direct-write", "write"), (f"{layout} raw direct-read", "read")):
            if name in by:
                ceil.append(f"{label} {by[name]['gib_s_best']:.2f} (qd {by[name]['detail']['qd']})")
        for name in by:
            if name.startswith(f"{layout} raw direct-") and name.endswith(" dirs"):
                ceil.append(f"{name[len(layout) + 12:]} {by[name]['gib_s_best']:.2f}")
        for name, label in (("pinned h2d", "h2d"), ("pinned d2h", "d2h"), ("host memcpy", "memcpy"),
                            ("host-memory bound", "bound")):
            if f"{layout} {name}" in by:
                ceil.append(f"{label} {by[f'{layout} {name}']['gib_s_best']:.2f}")
        out.append(f"  {layout} ceilings: " + ", ".join(ceil))
    lines: dict[tuple, dict[str, dict]] = {}
    for r in result["cases"]:
        d = r["detail"]
        if r["group"] not in OPS:
            continue
        if r["group"] == "disk":
            kind = f"{d['mode']} {d['seal']}"
        elif r["group"] == "stripe":
            kind = f"stripe {d['paths']} files {d['drives']} drive{'s' if d['drives'] > 1 else ''} {d['seal']}"
        else:
            kind = r["group"]
        op = d.get("op") or r["case"].rsplit(" ", 1)[1]
        lines.setdefault((r["layout"], kind, r["group"]), {})[op] = r
    for (layout, kind, group), cells in lines.items():
        parts = [f"{op} {_cell(cells[op]):<13}" for op in OPS[group] if op in cells]
        first = cells.get("store", {}).get("ratios", {})
        rewrite = [v for k, v in first.items() if k.endswith(" rewrite")]
        if rewrite:  # the first store into a fresh file against the overwrites after it
            parts.append(f"store/rewrite {rewrite[0]:.2f}")
        out.append(f"  {layout:<6} {kind:<32} " + " ".join(parts).rstrip())
    out += ["  " + line for line in seal_lines(result) + metrics_lines(result)]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvoffload.bench.report",
                                description="Compact summary of `python -m kvoffload.bench --json` outputs")
    p.add_argument("files", nargs="+", help="JSON files; a missing or unreadable one is reported, not fatal")
    a = p.parse_args(argv)
    print("cells: GiB/s (ratio to the case's main ceiling, as in each run's full table)")
    ok = True
    for path in a.files:
        title = path.rsplit("/", 1)[-1].removesuffix(".json")
        try:
            with open(path) as fh:
                result = json.load(fh)
        except (OSError, ValueError) as e:
            print(f"== {title}: no result ({e.__class__.__name__}: {e}); see its log")
            ok = False
            continue
        print("\n".join(compact(result, title)))
        ok = ok and result["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
