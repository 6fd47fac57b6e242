"""Issue 45: long work shows progress on a terminal and stays quiet in a pipe; ``--help``
lists every command; the bench's table fits the terminal and its "of ceiling" is a
fraction of the case's own ceiling.

The terminal is a pseudo-terminal (``os.openpty``) on the child's stderr; the same
command into a pipe must write nothing on stderr. What is asserted is what the child
wrote, never how fast: progress shows each phase's first update at once, however
short the phase.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import cli_args
from kvoffload.bench import report
from kvoffload.bench.ceilings import Timed
from kvoffload.bench.suite import Case

ROOT = Path(__file__).resolve().parents[1]
CLEAR = "\r\x1b[K"


def run_on_terminal(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """(exit code, what reached the terminal on stderr, stdout) of ``python args``."""
    master, slave = os.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("COLUMNS", None)
    p = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not data:
            break
        seen += data
    os.close(master)
    out = p.stdout.read().decode()
    p.stdout.close()
    return p.wait(timeout=600), seen.decode(errors="replace"), out


def run_in_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


def updates(terminal: str, prog: str) -> list[str]:
    """The progress lines written over one another: the text between each ``CLEAR``."""
    return [u for u in terminal.split(CLEAR) if u.startswith(f"{prog}: ")]


# -- python -m kvoffload --dir D --mib N ---------------------------------------------------

ROUND_TRIP = ["-m", "kvoffload", "--mib", "16", "--tensors", "8", "--tensor-kib", "64"]


def test_kvoffload_round_trip_shows_its_progress_on_a_terminal(tmp_path, cache_dir):
    rc, terminal, out = run_on_terminal([*ROUND_TRIP, "--dir", str(cache_dir)], tmp_path)
    assert rc == 0, terminal
    shown = updates(terminal, "python -m kvoffload")
    for phase in ("making 16 MiB of random blocks", "storing", "loading", "comparing"):
        assert any(phase in u for u in shown), (phase, shown)
    assert terminal.endswith(CLEAR), repr(terminal[-200:])  # erased before the result
    assert all("\n" not in u for u in shown)  # one line, rewritten
    assert len(out.splitlines()) == 3 and "bytes verified: True" in out, out
    assert os.listdir(cache_dir) == []


def test_kvoffload_round_trip_is_quiet_in_a_pipe(tmp_path, cache_dir):
    r = run_in_pipe([*ROUND_TRIP, "--dir", str(cache_dir)], tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert len(r.stdout.splitlines()) == 3 and "bytes verified: True" in r.stdout, r.stdout


def test_progress_writes_nothing_where_stderr_is_not_a_terminal(tmp_path):
    with open(tmp_path / "err", "w") as f:
        with cli_args.Progress("prog", f) as progress:
            progress("making", "make")
            progress("storing", "store")
    assert (tmp_path / "err").read_text() == ""


# -- python -m faults sweep ------------------------------------------------------------------

SWEEP = ["-m", "faults", "sweep", "--calls", "fstatvfs", "--workloads", "standard", "--file-modes", "anonymous",
         "--io", "direct", "--kinds", "transient"]


def test_faults_sweep_shows_where_it_is_on_a_terminal(tmp_path, cache_dir):
    rc, terminal, out = run_on_terminal([*SWEEP, "--dir", str(cache_dir)], tmp_path)
    shown = updates(terminal, "python -m faults")
    assert shown and all(re.match(r"python -m faults: sweep: call site 1 of 1 \(fstatvfs\): \d+ points", u)
                         for u in shown), shown
    assert "fault points in" in out and rc in (0, 1), (rc, terminal)
    assert os.listdir(cache_dir) == []


def test_faults_sweep_is_quiet_in_a_pipe(tmp_path, cache_dir):
    r = run_in_pipe([*SWEEP, "--dir", str(cache_dir)], tmp_path)
    assert "fault points in" in r.stdout
    assert "sweep: call site" not in r.stderr and CLEAR not in r.stderr, r.stderr


# -- --help ------------------------------------------------------------------------------------


def test_kvoffload_help_lists_forget(tmp_path):
    r = run_in_pipe(["-m", "kvoffload", "--help"], tmp_path)
    assert r.returncode == 0 and r.stderr == ""
    assert "python -m kvoffload forget" in r.stdout  # its usage
    assert re.search(r"^commands:\n  forget +\S", r.stdout, re.M), r.stdout


def test_kvoffload_a_mistyped_command_is_one_line(tmp_path):
    r = run_in_pipe(["-m", "kvoffload", "forgte", "/x"], tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("python -m kvoffload: error: unknown command 'forgte' (did you mean forget?); "
                        "the commands are forget, or none for the round trip\n"), r.stderr


# -- the bench's table -------------------------------------------------------------------------


def case(name: str, group: str, gib_s: float, ceilings: tuple[str, ...] = (), layout: str = "llama",
         **info) -> Case:
    return Case(name, group, layout, Timed(int(gib_s * 2**30), 1.0, 0.5), ceilings, None, info)


def pagecache_run(memcpy: bool = False) -> list[Case]:
    """A run's cases as the suite names their ceilings: a page-cache store and rewrite
    against the raw O_DIRECT write (the store then against the rewrite)."""
    what = "memcpy (CPU tensors)" if memcpy else "torch pinned copy on CUDA"
    return [
        case("llama raw direct-write", "raw", 1.0, qd=8),
        case("llama pinned h2d", "copy", 2.0, what=what),
        case("llama pinned d2h", "copy", 2.0, what=what),
        case("llama host memcpy", "copy", 12.0),
        case("llama host-memory bound", "copy", 8.0, ("llama host memcpy",)),
        case("llama seam h2d", "seam", 6.0, ("llama pinned h2d",)),
        case("llama pagecache off store", "disk", 6.0, ("llama raw direct-write", "llama pagecache off rewrite"),
             mode="pagecache", op="store", seal="off"),
        case("llama pagecache off rewrite", "disk", 8.9, ("llama raw direct-write",), mode="pagecache",
             op="rewrite", seal="off"),
        case("llama direct off store", "disk", 0.9, ("llama raw direct-write", "llama direct off rewrite"),
             mode="direct", op="store", seal="off"),
        case("llama direct off rewrite", "disk", 0.95, ("llama raw direct-write",), mode="direct", op="rewrite",
             seal="off"),
    ]


def test_a_page_cache_store_is_not_a_fraction_of_the_raw_direct_write():
    # Issue 45's "8.90 of ceiling": a page-cache rewrite (into the page cache, writeback
    # untimed) against the drive's O_DIRECT write. Its ceiling is the host-memory bound.
    rows = {r["case"]: r for r in report.summarize([pagecache_run()])}
    rewrite, store = rows["llama pagecache off rewrite"], rows["llama pagecache off store"]
    assert rewrite["ceiling"] == "llama host-memory bound" and rewrite["ratio"] == pytest.approx(8.9 / 8.0, abs=1e-3)
    assert "llama raw direct-write" not in rewrite["ratios"]
    assert store["ceiling"] == "llama host-memory bound"
    assert store["ratios"]["llama pagecache off rewrite"] == pytest.approx(6.0 / 8.9, abs=1e-3)
    # An O_DIRECT store keeps the drive's write as its ceiling.
    assert rows["llama direct off rewrite"]["ceiling"] == "llama raw direct-write"
    # On CUDA the seam is a fraction of the pinned copy; on CPU, where "pinned" is one
    # copy at a time and the seam copies from every IO thread, of the host memcpy.
    assert rows["llama seam h2d"]["ceiling"] == "llama pinned h2d"
    cpu = {r["case"]: r for r in report.summarize([pagecache_run(memcpy=True)])}
    assert cpu["llama seam h2d"]["ceiling"] == "llama host memcpy"
    assert cpu["llama seam h2d"]["ratio"] == pytest.approx(6.0 / 12.0, abs=1e-3)


@pytest.mark.parametrize("width", [200, 100, 80, 60, 40])
def test_the_table_fits_the_width_and_of_ceiling_is_the_ratio(width):
    rows = report.summarize([pagecache_run()])
    lines = report.table(rows, width).splitlines()
    assert max(map(len, lines)) <= width, "\n".join(lines)
    if width >= 100:
        heads = lines[:2]
        assert "of" in heads[0] and "ceiling" in heads[1], heads
        row = next(line for line in lines if line.startswith("llama pagecache off rewrite"))
        # of ceiling, then the ceiling's GiB/s and which case it is (without the layout).
        assert re.search(r"  8\.90  +1\.11\*  +8\.00  host-memory bound  ", row), row
        assert all(not line.startswith(" ") or line in heads for line in lines)


def test_a_pipe_gets_a_table_of_100_columns(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    with open(os.devnull, "w") as f:
        assert cli_args.output_width(f) == 100
    monkeypatch.setenv("COLUMNS", "132")
    assert cli_args.output_width() == 132


def test_the_header_says_one_pass_not_over_0_s():
    assert report.per_case(0.0) == "one pass per case"
    assert report.per_case(2.0) == "each case timed over >= 2 s"
    rows = report.summarize([pagecache_run()])
    result = {
        "machine": {"device": "cpu", "cpus": 2, "torch": "x", "dirs": [{"path": "/d", "fs": "ext4"}]},
        "config": {"bytes_per_case": 8 << 20, "case_seconds": 0.0, "runs": 1, "slots": "random",
                   "job_bytes": 2 << 20, "io_threads_used": 8, "io_unit_bytes": None, "queue_depths": [1, 2],
                   "host_bound": {"formula": "host-memory bound = 2/3 x host memcpy " + "x" * 150}, "layouts": {}},
        "cache_drop": {"summary": "page cache before cold loads: ok"},
        "leftover_files": [], "cases": rows, "seal_cost": [], "ok": True,
    }
    text = report.full(result, 100)
    assert "one pass per case" in text and ">= 0 s" not in text
    assert max(map(len, text.splitlines())) <= 100
    assert any(line.startswith("host-memory bound = 2/3 x host memcpy") for line in text.splitlines())
    assert "one pass per case" in report.compact(result, "t")[0]


@pytest.mark.parametrize("argv, words", [([], "the following arguments are required: files"),
                                         (["--bogus", "a.json"], "unrecognized arguments: --bogus")])
def test_bench_report_mistakes_are_one_line(capsys, argv, words):
    assert report.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"python -m kvoffload.bench.report: error: {words}\n", err
