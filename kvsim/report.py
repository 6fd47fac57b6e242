"""Output: one side-by-side table (rich), one JSON object, or a plot (matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

from rich.console import Console
from rich.table import Table


def _bytes(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B" if n else "0"


def _ms(v) -> str:
    return "-" if v is None else (f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms")


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


ROWS = (
    ("GPU token hit rate", lambda s: _pct(s["gpu_hit_rate"])),
    ("offload token hit rate", lambda s: _pct(s["offload_hit_rate"])),
    ("TTFT P50", lambda s: _ms(s["ttft_ms"]["p50"])),
    ("TTFT P90", lambda s: _ms(s["ttft_ms"]["p90"])),
    ("TTFT P99", lambda s: _ms(s["ttft_ms"]["p99"])),
    ("bytes stored", lambda s: _bytes(s["bytes_stored"])),
    ("bytes loaded", lambda s: _bytes(s["bytes_loaded"])),
    ("disk util read/write", lambda s: f"{_pct(s['disk_read_util'])} / {_pct(s['disk_write_util'])}"),
    ("PCIe util H2D/D2H", lambda s: f"{_pct(s['pcie_h2d_util'])} / {_pct(s['pcie_d2h_util'])}"),
    ("recomputed tokens", lambda s: f"{s['recomputed_tokens']:,}"),
    ("requests (rejected)", lambda s: f"{s['requests']:,} ({s['rejected']})"),
    ("makespan", lambda s: f"{s['makespan_s']:.1f} s"),
)


def print_table(title: str, summaries: Sequence[dict], file: IO[str]) -> None:
    table = Table()
    table.add_column("")
    for s in summaries:
        table.add_column(s["tier"], justify="right")
    for name, fmt in ROWS:
        table.add_row(name, *(fmt(s) for s in summaries))
    # A fixed width keeps piped output identical from run to run.
    console = Console(file=file, width=max(100, 26 + 20 * len(summaries)))
    console.print(title, highlight=False)
    console.print(table)


def plot(path: str, summaries: Sequence[dict], ttfts: Sequence[Sequence[float]], title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("kvsim: --plot needs matplotlib: pip install 'kvoffload[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s, t in zip(summaries, ttfts):
        n = len(t)
        ax_cdf.step([v / 1000 for v in t], [(i + 1) / n for i in range(n)], where="post", label=s["tier"])
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
    ax_hit.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
