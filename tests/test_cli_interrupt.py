"""Issue 45: Ctrl-C ends every command line with one line on stderr and exit code 130,
its files removed (``kvoffload.cli_args.main``).

Each CLI runs as a child process in a pipe, with an empty working directory and an
empty private TMPDIR (where anything it makes under /tmp would go: the real /tmp is
shared with whatever else runs on the machine). The test waits until the child is
observably at work (a line it prints, a file or an open file of its own), sends
SIGINT, and requires exit code 130, no traceback, exactly one line on stderr after
the signal besides the command's own progress lines (those a line away when the
signal came), and nothing left in its directories. Nothing waits a fixed time: each
wait is for something the child does, with a generous limit, so a loaded machine is
slower, never wrong.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload import cli_args

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "tests" / "kvsim_fixtures" / "mini_mooncake.jsonl"
# Generous: the children import torch and a loaded 2-core machine can take minutes.
WAIT_S = 300.0


def _default_sigint() -> None:
    # A child started by a shell in the background inherits SIGINT ignored, and Python
    # keeps it so: the test's children take it as a terminal's would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Child:
    """A CLI as a child process: stderr read line by line as it comes, stdout kept."""

    def __init__(self, args: list[str], cwd: Path, tmp: Path) -> None:
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
        self.args = args
        self.p = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=_default_sigint)
        self.lines: list[str] = []
        self.out: list[str] = []
        self.lock = threading.Lock()
        self.readers = [threading.Thread(target=self._read, args=(self.p.stderr, self.lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.p.stdout, self.out), daemon=True)]
        for t in self.readers:
            t.start()
        self.mark = 0

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            with self.lock:
                into.append(line.rstrip("\n"))

    def stderr(self) -> list[str]:
        with self.lock:
            return list(self.lines)

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            if self.p.poll() is not None:
                self.finish()
                pytest.fail(f"{self.args} ended (exit code {self.p.returncode}) before {what}:\n"
                            + "\n".join(self.lines[-20:]))
            if time.monotonic() > deadline:
                self.p.kill()
                self.finish()
                pytest.fail(f"{self.args}: no {what} within {WAIT_S:.0f} s:\n" + "\n".join(self.lines[-20:]))
            time.sleep(0.01)

    def interrupt(self) -> int:
        with self.lock:
            self.mark = len(self.lines)
        self.p.send_signal(signal.SIGINT)
        try:
            rc = self.p.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.finish()
            pytest.fail(f"{self.args} still running {WAIT_S:.0f} s after SIGINT:\n" + "\n".join(self.lines[-20:]))
        self.finish()
        return rc

    def finish(self) -> None:
        self.p.wait()
        for t in self.readers:
            t.join(30)

    def after_signal(self, progress: str) -> list[str]:
        """stderr's lines after the signal, less the command's progress lines (``progress``:
        a regular expression) that were on their way when it came."""
        return [line for line in self.lines[self.mark:] if not re.match(progress, line)]


def run_and_interrupt(args: list[str], tmp_path: Path, what: str, ready: Callable[[Child], bool],
                      progress: str, interrupted: str, dirs: tuple[Path, ...] = ()) -> Child:
    """Start ``args``, wait for ``ready``, SIGINT; exit 130, one line ``interrupted`` after
    the signal, no traceback, and the working directory, TMPDIR and ``dirs`` left empty."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    child = Child(args, cwd, tmp)
    child.wait_for(what, lambda: ready(child))
    rc = child.interrupt()
    everything = "\n".join(child.lines)
    assert rc == 130, f"exit code {rc}:\n{everything}"
    assert "Traceback" not in everything and "KeyboardInterrupt" not in everything, everything
    after = child.after_signal(progress)
    assert len(after) == 1 and re.fullmatch(interrupted, after[0]), f"after SIGINT: {after}\n{everything}"
    assert child.lines[-1] == after[0], everything  # the last line it wrote
    for d in (cwd, tmp, *dirs):
        left = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        assert left == [], f"left in {d}: {left}"
    return child


def open_in(pid: int, directory: Path) -> bool:
    """Whether process ``pid`` has a file open in ``directory`` (an anonymous O_TMPFILE
    slot file shows as ``DIR/#INODE (deleted)``)."""
    prefix = str(directory.resolve()) + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the ranks a command spawned)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # pid (comm) state ppid ...: comm may hold spaces, so split after its ")"
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` is still a running process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- python -m kvoffload ----------------------------------------------------------------


def test_kvoffload_dir_ctrl_c_is_one_line_and_leaves_nothing(tmp_path, cache_dir):
    # Quiet into a pipe until its result: at work once its slot file is open in --dir
    # (the random blocks are made, the store is under way).
    run_and_interrupt(["-m", "kvoffload", "--dir", str(cache_dir), "--mib", "512"], tmp_path,
                      "slot file open in --dir", lambda c: open_in(c.p.pid, cache_dir),
                      progress=r"$^", interrupted=r"python -m kvoffload: interrupted", dirs=(cache_dir,))


def test_kvoffload_without_dir_removes_its_private_directory_on_ctrl_c(tmp_path):
    # Without --dir the slot file goes in a private temporary directory made in the
    # working directory: it is removed too.
    cwd = tmp_path / "cwd"

    def made(c: Child) -> bool:
        return any(p.name.startswith(".kvoffload-") for p in cwd.iterdir()) and open_in(c.p.pid, cwd)

    run_and_interrupt(["-m", "kvoffload", "--mib", "512"], tmp_path, "slot file open in its private directory",
                      made, progress=r"$^", interrupted=r"python -m kvoffload: interrupted")


# -- python -m kvsim trace replay ---------------------------------------------------------


def slow_trace(path: Path, copies: int = 20) -> Path:
    """The mini Mooncake trace ``copies`` times over, one after another in time, each
    copy with hash ids of its own: each tier's replay takes ``copies`` times as long."""
    records = [json.loads(line) for line in MINI.read_text().splitlines() if line.strip()]
    span = max(r["timestamp"] for r in records) + 1000
    ids = max(h for r in records for h in r["hash_ids"]) + 1
    with open(path, "w") as f:
        for k in range(copies):
            for r in records:
                f.write(json.dumps({**r, "timestamp": r["timestamp"] + k * span,
                                    "hash_ids": [h + k * ids for h in r["hash_ids"]]}) + "\n")
    return path


def test_kvsim_trace_replay_ctrl_c_is_one_line(tmp_path):
    # Into a pipe kvsim says what it models once the first tier has replayed: the signal
    # comes while the other three replay, each as long as the first.
    trace = slow_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    run_and_interrupt(["-m", "kvsim", "trace", "replay", str(trace), "--plot", str(out / "ttft.png")], tmp_path,
                      "first tier replayed", lambda c: any(line.startswith("kvsim: trace ") for line in c.stderr()),
                      progress=r"kvsim: (?!interrupted)", interrupted=r"kvsim: interrupted", dirs=(out,))


# -- python -m faults sweep ----------------------------------------------------------------


def test_faults_sweep_ctrl_c_is_one_line_and_removes_its_directory(tmp_path, cache_dir):
    # At work once its first fault point has a directory of its own in the sweep's.
    def point_started(c: Child) -> bool:
        return any(p.is_dir() for s in cache_dir.glob("kvoffload-sweep-*") for p in s.iterdir())

    run_and_interrupt(["-m", "faults", "sweep", "--dir", str(cache_dir)], tmp_path, "a fault point under way",
                      point_started, progress=r"$^", interrupted=r"python -m faults: interrupted",
                      dirs=(cache_dir,))


# -- python -m kvoffload.bench ---------------------------------------------------------------

# The bench's progress on stderr: its header, each case as it is measured, each layout and run.
BENCH_PROGRESS = r"(kvoffload bench: \d+ MiB per pass|  \S|run \d+: |\S+: \d+ blocks of )"


def test_bench_quick_ctrl_c_is_one_line_and_removes_its_files(tmp_path, cache_dir):
    # Its first measured case is on stderr; the signal comes during the next ones.
    child = run_and_interrupt(
        ["-m", "kvoffload.bench", "--quick", "--device", "cpu", "--dir", str(cache_dir)], tmp_path,
        "a measured case", lambda c: any(line.startswith("  seal ") for line in c.stderr()),
        progress=BENCH_PROGRESS, interrupted=r"kvoffload bench: interrupted \(Ctrl-C\); its files were removed.*",
        dirs=(cache_dir,))
    # --quick's header says each case is one pass, not "cases over >= 0 s".
    header = [line for line in child.lines if line.startswith("kvoffload bench: 8 MiB per pass")]
    assert header and "one pass per case" in header[0] and ">= 0 s" not in header[0], header


# -- python -m kvoffload.bench.tier, scripts/two_ranks.py ------------------------------------


def test_bench_tier_ctrl_c_is_one_line_and_removes_its_directories(tmp_path, cache_dir):
    # Several rounds, each in a private directory made in --dir: the signal comes as the
    # first round is reported, the moment the next round's directory is being made.
    run_and_interrupt(
        ["-m", "kvoffload.bench.tier", "--dir", str(cache_dir), "--gib", "0.25", "--primary-gib", "0.125",
         "--tiers", "kvoffload-direct", "--repeat", "50", "--raw-seconds", "0.05"], tmp_path,
        "a round reported", lambda c: any(line.startswith("kvoffload-direct") for line in c.stderr()),
        progress=r"(raw over|kvoffload-direct)", interrupted=r"python -m kvoffload.bench.tier: interrupted",
        dirs=(cache_dir,))


def test_two_ranks_ctrl_c_is_one_line_and_removes_its_directory(tmp_path):
    # Without --dir the ranks share a private directory made in the working directory; the
    # ranks (spawned processes) end before it is removed.
    cwd = tmp_path / "cwd"
    ranks: set[int] = set()

    def at_work(c: Child) -> bool:
        busy = [pid for pid in children(c.p.pid) if open_in(pid, cwd)]
        ranks.update(busy)
        return bool(busy)

    run_and_interrupt([str(ROOT / "scripts" / "two_ranks.py"), "--seconds", "120", "--blocks", "16", "--slots", "32",
                       "--job-blocks", "4", "--tensors", "4", "--tensor-kib", "4", "--raw-mib", "8",
                       "--raw-seconds", "0.05", "--device", "cpu"], tmp_path,
                      "a rank's slot file open", at_work, progress=r"$^",
                      interrupted=r"scripts/two_ranks.py: interrupted")
    assert ranks and not any(alive(pid) for pid in ranks)


# -- kvoffload.cli_args.main in this process ------------------------------------------------


def main_of(run: Callable[[], int]) -> int:
    """``cli_args.main("prog", run)``; an interrupt it lets through fails the test (pytest
    would take it for the user's Ctrl-C and stop the whole run)."""
    try:
        return cli_args.main("prog", run)
    except KeyboardInterrupt:
        pytest.fail("the interrupt went through cli_args.main")


def test_main_ends_an_interrupt_with_one_line_and_130(capsys):
    def run() -> int:
        raise KeyboardInterrupt

    assert main_of(run) == 130
    assert capsys.readouterr() == ("", "prog: interrupted\n")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(capsys, tmp_path):
    # The first SIGINT unwinds the command; one during its cleanup (a finally block
    # removing its files) is ignored, so the files still go.
    f = tmp_path / "partial"
    cleaned: list[bool] = []

    def run() -> int:
        f.write_text("half")
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler raises here
            return 0
        finally:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            f.unlink()
            cleaned.append(True)

    assert main_of(run) == 130
    assert cleaned and not f.exists()
    assert capsys.readouterr().err == "prog: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    # A command started with SIGINT ignored (a background job) is not made interruptible.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        def run() -> int:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            return 0

        assert main_of(run) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_directory_made_under_ctrl_c_is_recorded_for_its_cleanup(tmp_path):
    # private_dir makes a directory and records it in one step (cli_args.held): a SIGINT
    # that lands in between is raised once it is recorded, so the cleanup removes it.
    made: list[str] = []
    removed: list[str] = []

    def run() -> int:
        try:
            with cli_args.held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here and holds the interrupt back
                cli_args.private_dir(made, "held-", str(tmp_path))
            return 0
        finally:
            for d in made:
                os.rmdir(d)
                removed.append(d)

    assert main_of(run) == 130
    assert len(made) == 1 and removed == made and list(tmp_path.iterdir()) == []
