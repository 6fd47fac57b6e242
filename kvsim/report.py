"""Output: side-by-side tables (rich) that fit the terminal, or a plot (matplotlib)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import IO, Any, Optional

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from kvsim.units import size

# Output that is not a terminal (a pipe, a file) gets this width unless COLUMNS says
# otherwise: the same text from run to run.
PIPE_WIDTH = 100


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else (f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms")


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _busy(s: dict) -> str:
    b = s["io_threads_busy"]
    return "-" if b is None else f"{_pct(b['load']['mean'])} / {_pct(b['store']['mean'])}"


def _pending(s: dict) -> str:
    p = s["stores_pending_at_end"]
    if not p or not p["jobs"]:
        return "-" if p is None else "0"
    return f"{p['jobs']} jobs, {size(p['bytes'])}, {p['drain_s']:.1f} s"


Row = tuple[str, Callable[[dict], str]]
HEAD: tuple[Row, ...] = (
    ("GPU token hit rate", lambda s: _pct(s["gpu_hit_rate"])),
    ("offload token hit rate", lambda s: _pct(s["offload_hit_rate"])),
)
TAIL: tuple[Row, ...] = (
    ("queueing share of TTFT", lambda s: _pct(s["queue_share_of_ttft"])),
    ("bytes stored", lambda s: size(s["bytes_stored"])),
    ("bytes loaded", lambda s: size(s["bytes_loaded"])),
    ("disk util read/write", lambda s: f"{_pct(s['disk_read_util'])} / {_pct(s['disk_write_util'])}"),
    ("IO threads busy load/store", _busy),
    ("stores queued at the end", _pending),
    ("PCIe util H2D/D2H", lambda s: f"{_pct(s['pcie_h2d_util'])} / {_pct(s['pcie_d2h_util'])}"),
    ("recomputed tokens", lambda s: f"{s['recomputed_tokens']:,}"),
    ("requests (rejected)", lambda s: f"{s['requests']:,} ({s['rejected']})"),
    ("makespan", lambda s: f"{s['makespan_s']:.1f} s"),
)


def _ttft_rows(summaries: Sequence[dict]) -> list[Row]:
    """TTFT percentiles overall, or per phase (fill, reload) when the trace has phases."""
    phases = list(dict.fromkeys(p for s in summaries for p in s["phases"]))
    rows: list[Row] = []
    for q in ("p50", "p90", "p99"):
        if not phases:
            rows.append((f"TTFT {q.upper()}", lambda s, q=q: _ms(s["ttft_ms"][q])))
    for p in phases:
        for q in ("p50", "p90", "p99"):
            rows.append((f"{p} TTFT {q.upper()}",
                         lambda s, p=p, q=q: _ms(s["phases"][p]["ttft_ms"][q]) if p in s["phases"] else "-"))
    return rows


def output_width(file: IO[str]) -> int:
    """Columns to fill: COLUMNS when set, else the terminal's, else ``PIPE_WIDTH``."""
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) >= 20:
        return int(cols)
    try:
        if file.isatty():
            return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        pass
    return PIPE_WIDTH


def print_grid(title: str, header: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]], file: IO[str],
               lines_before: Sequence[str] = (), lines_after: Sequence[str] = ()) -> None:
    """``rows`` under ``header`` as tables no wider than the output: when the columns do not
    fit side by side they continue in a second table below (row labels repeated), so no
    line is ever wrapped by the terminal. Lines before and after are word-wrapped."""
    width = output_width(file)
    console = Console(file=file, width=width)
    for line in (title, *lines_before) if title else lines_before:
        console.print(line, highlight=False)

    def need(i: int) -> int:  # a column's cells, its padding and its border
        return max(cell_len(header[i]), *(cell_len(r[1][i]) for r in rows)) + 3

    label = max(cell_len(r[0]) for r in rows) + 4  # the label column and the table's last border
    groups: list[list[int]] = [[]]
    used = label
    for i in range(len(header)):
        if groups[-1] and used + need(i) > width:
            groups.append([])
            used = label
        groups[-1].append(i)
        used += need(i)
    for cols in groups:
        table = Table()
        table.add_column("")
        for i in cols:
            table.add_column(header[i], justify="right")
        for name, cells in rows:
            table.add_row(name, *(cells[i] for i in cols))
        console.print(table)
    for line in lines_after:
        console.print(line, highlight=False)


def print_table(title: str, summaries: Sequence[dict], file: IO[str], lines_before: Sequence[str] = (),
                phases: bool = True) -> None:
    """The tiers side by side, then each tier's warnings. ``phases``: the TTFT rows (else
    a table before this one gave them, and the title too)."""
    ttft = _ttft_rows(summaries) if phases else []
    rows = [(name, [fmt(s) for s in summaries]) for name, fmt in (*HEAD, *ttft, *TAIL)]
    print_grid(title if phases else "", [s["tier"] for s in summaries], rows, file, lines_before,
               [f"warning: {w}" for s in summaries for w in s["warnings"]])


# A stage collapses when it serves less than this share of the tokens it is offered:
# its queue then grows for the whole stage.
COLLAPSE_SERVED = 0.85
_METRICS = (("mean TTFT", 0), ("P90 TTFT", 1), ("mean E2E", 2), ("P90 E2E", 3), ("tokens/s", 4))


def _kvsim_row(phase: dict) -> tuple[float, ...]:
    t, e = phase["ttft_ms"], phase["e2e_ms"]
    return t["mean"] / 1e3, t["p90"] / 1e3, e["mean"] / 1e3, e["p90"] / 1e3, phase["tokens_per_s"]


def _offered(phase_name: str, phase: dict) -> Optional[float]:
    """Tokens per second a rate stage offers (its rate times a request's tokens)."""
    try:
        rate = float(phase_name.split()[0])
    except ValueError:
        return None
    return rate * phase["tokens_per_request"]


def _output_rate(phase: dict, published_total: float) -> dict:
    """Output tokens per second, kvsim's and the published: a source that gives only the
    total (input and output over the stage's span) gives its output share too, the stage's
    own split of tokens, since every request has fixed lengths (``ignore_eos``)."""
    share = phase["output_tokens_per_s"] / phase["tokens_per_s"]
    theirs = published_total * share
    return {"kvsim": round(phase["output_tokens_per_s"], 1), "published": round(theirs, 1),
            "ratio": round(phase["output_tokens_per_s"] / theirs, 3),
            "published_is": f"the published total x the stage's output share ({share:.5f})"}


def comparison(summaries: Sequence[dict], published: Any) -> dict:
    """kvsim's figures beside a published table: per phase and tier, each metric's kvsim
    value, the published one and their ratio; and where each run collapses."""
    rows = []
    for s in summaries:
        for name, ph in s["phases"].items():
            pub = published.row(name, s["tier"])
            if pub is None:
                continue
            ours = _kvsim_row(ph)
            rows.append({"phase": name, "tier": s["tier"], "configuration": published.configurations[
                "none" if s["tier"] == "none" else "offload"],
                **{m: {"kvsim": round(ours[i], 3), "published": pub[i], "ratio": round(ours[i] / pub[i], 3)}
                   for m, i in _METRICS},
                "output tokens/s": _output_rate(ph, pub[4])})
    collapse = {}
    for s in summaries:
        offered = {n: _offered(n, ph) for n, ph in s["phases"].items()}
        ours = next((n for n, ph in s["phases"].items() if offered[n] and ph["tokens_per_s"] < COLLAPSE_SERVED
                     * offered[n]), None)
        theirs = next((n for n, ph in s["phases"].items() if offered[n] and (p := published.row(n, s["tier"]))
                       and p[4] < COLLAPSE_SERVED * offered[n]), None)
        collapse[s["tier"]] = {"kvsim": ours, "published": theirs}
    return {"source": published.source, "rows": rows, "collapses_at": collapse,
            "collapse_rule": f"the first stage serving less than {COLLAPSE_SERVED:.0%} of the tokens it offers"}


def _s(v: float) -> str:
    return f"{v:.2f} s" if v < 100 else f"{v:.0f} s"


def print_published(title: str, summaries: Sequence[dict], published: Any, file: IO[str]) -> None:
    """Per stage and tier: mean and P90 TTFT and throughput, kvsim's beside the published."""
    doc = comparison(summaries, published)
    header = ["mean TTFT kvsim / published", "P90 TTFT", "tokens/s (in + out)", "output tokens/s"]
    rows = []
    for r in doc["rows"]:
        cells = []
        for m, fmt in (("mean TTFT", _s), ("P90 TTFT", _s), ("tokens/s", lambda v: f"{v / 1e3:,.0f}K"),
                       ("output tokens/s", lambda v: f"{v:,.0f}")):
            c = r[m]
            cells.append(f"{fmt(c['kvsim'])} / {fmt(c['published'])}  x{c['ratio']:.2f}")
        rows.append((f"{r['phase']} {r['tier']}", cells))
    col = doc["collapses_at"]
    after = [f"collapses at ({doc['collapse_rule']}): "
             + "; ".join(f"{t}: kvsim {c['kvsim'] or 'none'}, published {c['published'] or 'none'}"
                         for t, c in col.items()),
             f"published: {doc['source']}; its output tokens/s: its total (in + out) times the stage's "
             f"output share, every request of fixed lengths"]
    print_grid(title, header, rows, file, lines_after=after)


# Overlapping curves stay visible: each tier its own dash pattern and width.
_STYLES = ("-", "--", "-.", ":")


def plot(path: str, summaries: Sequence[dict], ttfts: Sequence[Sequence[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (s, t) in enumerate(zip(summaries, ttfts)):
        n = len(t)
        ax_cdf.step([v / 1000 for v in t], [(j + 1) / n for j in range(n)], where="post", label=s["tier"],
                    linestyle=_STYLES[i % len(_STYLES)], linewidth=2.5 - 0.4 * (i % 4))
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.legend()
    names = [s["tier"] for s in summaries]
    gpu = [s["gpu_hit_rate"] for s in summaries]
    off = [s["offload_hit_rate"] for s in summaries]
    ax_hit.bar(names, gpu, label="GPU")
    ax_hit.bar(names, off, bottom=gpu, label="offload")
    ax_hit.set_ylabel("token hit rate")
    ax_hit.set_title("hit rate per tier")
    ax_hit.tick_params(axis="x", labelrotation=20)
    ax_hit.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
