"""The benchmark's output: rows from the runs, the full table, and a compact summary of several runs.

``python -m kvoffload.bench.report A.json B.json ...`` prints the compact summary of
``python -m kvoffload.bench --json`` outputs, one run per file.
"""

from __future__ import annotations

import json
import statistics
import sys
import textwrap
from typing import Optional

from kvoffload import cli_args

OPS = {"disk": ("store", "rewrite", "cold-load", "warm-load"), "stripe": ("store", "rewrite", "cold-load"),
       "dram": ("store", "load"), "seam": ("d2h", "h2d")}


def own_ceilings(case, by_name: dict) -> tuple[str, ...]:
    """The cases ``case`` is compared with, its main ceiling first: those the suite named,
    except where one of them does not bound it, which gave ratios far above 1 "of
    ceiling" (8.90 in issue 45's table):

    - a page-cache store or rewrite ends in the page cache (writeback comes later and is
      not timed), so the drive's raw O_DIRECT write is no limit of it. Like a page-cache
      load it moves each byte through host memory three times (the device copy writes
      staging, the kernel reads staging and writes the page cache): the host-memory bound;
    - on CPU the "pinned" copies are one torch copy per block on one thread, not a link
      that every copy shares, while the seam copies from every IO thread at once: a CPU
      seam or DRAM-backend case is compared with the host memcpy on every CPU instead.
    """
    names = tuple(case.ceilings)
    info = case.info
    bound, memcpy = f"{case.layout} host-memory bound", f"{case.layout} host memcpy"
    if case.group in ("disk", "stripe") and info.get("mode") == "pagecache" and info.get("op") in ("store", "rewrite"):
        names = (bound,) + tuple(n for n in names if not n.startswith(f"{case.layout} raw direct-write"))
    elif case.group in ("seam", "dram") and names:
        first = by_name.get(names[0])
        if first is not None and first.group == "copy" and str(first.info.get("what", "")).startswith("memcpy"):
            names = (memcpy,) + names
    return names


def summarize(runs: list) -> list[dict]:
    """One row per case: best and worst GiB/s over the runs; ratios to the ceilings of the
    run where the case was fastest (``own_ceilings``)."""
    rows: list[dict] = []
    for c0 in runs[0] if runs else ():
        per_run = []
        ceilings = own_ceilings(c0, {c.name: c for c in runs[0]})
        for cases in runs:
            by_name = {c.name: c for c in cases}
            c = by_name.get(c0.name)
            if c is None:  # a run cut short by an interrupt
                continue
            ratios = {}
            for name in ceilings:
                ceil = by_name.get(name)
                if ceil is not None and ceil.timed.gib_s > 0:
                    ratios[name] = (c.timed.gib_s / ceil.timed.gib_s, ceil.timed.gib_s)
            per_run.append((c, ratios))
        best_c, ratios = max(per_run, key=lambda x: x[0].timed.gib_s)
        main = ratios.get(ceilings[0]) if ceilings else None
        # Each run measured the case and its ceilings back to back (interleaved rounds): the
        # ratio within each run, then their median and range, settle what one run cannot.
        per_round = [r[ceilings[0]][0] for _, r in per_run if ceilings and ceilings[0] in r]
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
            "ceiling": ceilings[0] if ceilings else None,
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


def per_case(case_seconds: float) -> str:
    """How each case was timed: one pass (``--quick``, ``--case-seconds 0``) or passes
    adding up to at least ``case_seconds``."""
    return "one pass per case" if case_seconds <= 0 else f"each case timed over >= {case_seconds:g} s"


# A ratio this far above 1 is flagged: the case outran what was measured as its ceiling.
ABOVE_CEILING = 1.05
ABOVE_NOTE = ("* above its ceiling: the two were timed apart, on a shared machine or one pass each (--quick), "
              "and differ by more than the noise of either")


def table(rows: list[dict], width: Optional[int] = None) -> str:
    """The cases, one line each, no wider than ``width`` (``cli_args.output_width``: the
    terminal's, 100 into a pipe). ``of ceiling`` is the case's GiB/s over its main
    ceiling's (a fraction: 0.89 is 89% of it; ``*`` beyond ``ABOVE_CEILING``), then the
    ceiling's GiB/s and which case it is (named without the layout, which is the row's).
    Where the columns do not fit, the longest case and ceiling names are cut short
    (``--json`` has them whole), then the columns that still do not fit continue in a
    table below."""
    width = cli_args.output_width() if width is None else width
    runs = max((len(r.get("ratio_per_run") or []) for r in rows), default=0)
    worst = any(r["gib_s_worst"] != r["gib_s_best"] for r in rows)
    cols: list[tuple[tuple[str, str], str, list[str]]] = [(("", "case"), "<", [_label(r) for r in rows])]
    cols.append((("", "GiB/s"), ">", [f"{r['gib_s_best']:.2f}" for r in rows]))
    if worst:
        cols.append((("", "worst"), ">", [f"{r['gib_s_worst']:.2f}" for r in rows]))
    cols.append((("of", "ceiling"), ">", [_of_ceiling(r) for r in rows]))
    cols.append((("ceiling", "GiB/s"), ">", ["" if r["ceiling_gib_s"] is None else f"{r['ceiling_gib_s']:.2f}"
                                              for r in rows]))
    cols.append((("", "ceiling"), "<", [_ceiling_name(r) for r in rows]))
    cols.append((("CPU", "s/GiB"), ">", ["" if r["cpu_s_per_gib"] is None else f"{r['cpu_s_per_gib']:.3f}"
                                         for r in rows]))
    cols.append((("", "check"), "<", [{None: "-", True: "ok", False: "FAIL"}[r["verified"]] for r in rows]))
    if runs > 1:
        cols.append((("of ceiling per run:", "median (range) of N"), "<", [_spread(r) for r in rows]))
    breaks = [i > 0 and r["layout"] != rows[i - 1]["layout"] for i, r in enumerate(rows)]
    name = next(i for i, (head, _, _) in enumerate(cols) if head == ("", "ceiling"))
    return "\n".join(_fit(cols, breaks, width, shrink=(0, name)))


def _of_ceiling(r: dict) -> str:
    if r["ratio"] is None:
        return ""
    return f"{r['ratio']:.2f}" + ("*" if r["ratio"] > ABOVE_CEILING else "")


def _ceiling_name(r: dict) -> str:
    name = r["ceiling"] or ""
    for prefix in (f"{r['layout']} ", "seal "):  # the row's layout; a seal's ceiling is a seal
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _spread(r: dict) -> str:
    rounds = r.get("ratio_per_run") or []
    if len(rounds) < 2:
        return ""
    return f"{r['ratio_median']:.2f} ({min(rounds):.2f}-{max(rounds):.2f}) of {len(rounds)}"


def _fit(cols: list[tuple[tuple[str, str], str, list[str]]], breaks: list[bool], width: int,
         shrink: tuple[int, ...] = (), gap: int = 2, least: int = 12) -> list[str]:
    """Columns (two header lines, alignment, cells) as text lines no wider than ``width``.
    Where the columns ``shrink`` (names) can be cut to fit, cutting no more than a tenth of
    their cells and none below ``least`` characters, they are (a character at a time from
    the column where that cuts the fewest cells; a cut cell ends in ``~``). Otherwise the
    columns that do not fit continue in another table below, the first column repeated
    (and cut only where it and one more column are wider than ``width``). ``breaks``: the
    rows a blank line goes before."""
    natural = [max(len(h) for h in (*head, *cells)) for head, _, cells in cols]
    widths = list(natural)

    def total(idx: list[int]) -> int:
        return sum(widths[i] for i in idx) + gap * (len(idx) - 1)

    def cut(i: int) -> int:  # cells of column i that would be cut at one character less
        return sum(len(c) >= widths[i] for c in cols[i][2])

    rows = len(breaks)
    over = total(list(range(len(cols)))) - width
    while over > 0:
        can = [i for i in shrink if widths[i] > max(least, *(len(h) for h in cols[i][0]))]
        if not can:
            break
        widths[min(can, key=cut)] -= 1
        over -= 1
    if over > 0 or sum(len(c) > widths[i] for i in shrink for c in cols[i][2]) > max(1, rows // 10):
        widths = list(natural)  # cutting would not do, or would cut too much: continue below instead
    groups: list[list[int]] = [[0]]
    for i in range(1, len(cols)):
        if len(groups[-1]) > 1 and total(groups[-1] + [i]) > width:
            groups.append([0])
        groups[-1].append(i)
    widest = max(total(idx[1:]) + gap for idx in groups) if len(cols) > 1 else 0
    widths[0] = max(1, min(widths[0], width - widest))

    def cell(text: str, i: int) -> str:
        w = widths[i]
        if len(text) > w:
            text = text[: w - 1] + "~"
        return text.ljust(w) if cols[i][1] == "<" else text.rjust(w)

    def line(idx: list[int], texts: list[str]) -> str:
        return (" " * gap).join(cell(t, i) for i, t in zip(idx, texts)).rstrip()

    out: list[str] = []
    for g, idx in enumerate(groups):
        if g:
            out.append("")
        for k in (0, 1):
            head = line(idx, [cols[i][0][k] for i in idx])
            if head:
                out.append(head)
        out.append("-" * min(width, total(idx)))
        for row, brk in enumerate(breaks):
            if brk:
                out.append("")
            out.append(line(idx, [cols[i][2][row] for i in idx]))
    return out


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


def full(result: dict, width: Optional[int] = None) -> str:
    """The header lines (wrapped to ``width``: the terminal's, 100 into a pipe) and the table."""
    width = cli_args.output_width() if width is None else width
    m, c = result["machine"], result["config"]
    fs = ", ".join(f"{d['path']} ({d['fs']})" for d in m["dirs"])
    lines = [f"kvoffload bench on {m['device']}, {m['cpus']} CPUs, torch {m['torch']}; files in {fs}"]
    if result.get("array"):
        a = result["array"]
        down = "ok" if a["teardown"] == "ok" else f"FAILED: {a['teardown']}"
        lines.append(f"RAM-backed array: {a['drives']} {a['fs']} drive(s) of {a['bytes_each'] / 2**30:g} GiB over "
                     f"{a['shm_dir']}; teardown {down}")
    lines += [
        f"{c['bytes_per_case'] / 2**20:.0f} MiB per pass, {per_case(c['case_seconds'])}, "
        f"{c['runs']} run(s), slots {c['slots']}, {c['job_bytes'] / 2**20:g} MiB per job, {c['io_threads_used']} IO threads per lane, "
        + (f"{c['io_unit_bytes'] / 2**20:g} MiB IO units" if c["io_unit_bytes"] else "the backend's default IO units")
        + f"; raw = best of queue depths {c['queue_depths']}",
        result["cache_drop"]["summary"],
        c["host_bound"]["formula"],
        "of ceiling: O_DIRECT store / raw write (then / rewrite), load / raw read, striped / all drives' raw (then "
        "one drive's), page-cache store, rewrite and warm load / host-memory bound, DRAM and seam / pinned copies "
        "(on CPU / host memcpy)",
    ]
    if result["leftover_files"]:
        lines.append(f"LEFT BEHIND: {result['leftover_files']}")
    if result.get("interrupted"):
        lines.append(f"INTERRUPTED ({result['interrupted']}): only the cases measured before it")
    lines += seal_lines(result) + metrics_lines(result)
    if any(r["ratio"] is not None and r["ratio"] > ABOVE_CEILING for r in result["cases"]):
        lines.append(ABOVE_NOTE)
    wrapped = [w for line in lines for w in (textwrap.wrap(line, width, subsequent_indent="  ") or [""])]
    return "\n".join([*wrapped, "", table(result["cases"], width)])


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
           f"{per_case(c['case_seconds'])}, {state}"]
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


PROG = "python -m kvoffload.bench.report"


def main(argv: Optional[list[str]] = None) -> int:
    """A mistake in the arguments is one line and exit code 2, Ctrl-C one line and 130,
    as every command's (``cli_args.main``)."""
    return cli_args.main(PROG, lambda: _main(argv))


def _main(argv: Optional[list[str]]) -> int:
    p = cli_args.Parser(prog=PROG, description="Compact summary of `python -m kvoffload.bench --json` outputs")
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
