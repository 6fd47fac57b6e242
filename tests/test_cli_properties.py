"""Every command line, fed argument lists drawn from its own flag table (issue 23).

Each draw is good, holds a mistake, or asks for something huge (``tests/cli_flags.py``).
A mistake is exit 2 with one line on stderr, nothing on stdout and nothing left in any
directory; a good list is exit 0 with the documented output, or, where running the job
would be slow (the bench, the sweep, calibration), a configuration the command accepts
(its own parse and checks, the same code ``main`` runs first). Huge is exit 2 in one
line or a run that copes. The CLIs run in this process through their ``main(argv)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults.__main__ import build_parser as faults_parser
from faults.__main__ import main as faults_main
from kvoffload.__main__ import build_forget_parser
from kvoffload.__main__ import build_parser as kvoffload_parser
from kvoffload.__main__ import main as kvoffload_main
from kvoffload.bench import suite, tier
from kvoffload.cli_args import UsageError, write_output
from kvsim.cli import build_parser as kvsim_parser
from kvsim.cli import main as kvsim_main
from kvsim.profile import BUILTIN
from tests.cli_flags import BAD, GOOD, HUGE, Paths, arguments, assert_refused, listing, run, subparser

MINI = str(Path(__file__).parent / "kvsim_fixtures" / "mini_mooncake.jsonl")
BENCH_JSON = str(Path(__file__).parent / "data" / "bench_h200_disk.json")
# Examples per test: CLI_EXAMPLES=1000 (say) runs every test here with that many, to
# flush out a wrong model of what a flag list means; the defaults keep the suite quick.
MORE = int(os.environ.get("CLI_EXAMPLES", "0") or 0)
# Each example runs in the same directories; the health check would object to the fixture.
FAST = settings(max_examples=max(40, MORE), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=max(15, MORE), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# With CLI_EXAMPLES, a test runs that many commands: its time limit grows with them (two
# seconds a command, ten times what one takes on a loaded 2-core machine).
pytestmark = pytest.mark.timeout(max(120, 2 * MORE))
NO_CUDA = [] if torch.cuda.is_available() else ["cuda"]


@pytest.fixture
def paths(tmp_path) -> Paths:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    f = tmp_path / "f"
    f.write_text("not a directory\n")
    return Paths(d, f)


# -- python -m kvoffload ---------------------------------------------------------------

KVOFFLOAD = dict(
    good={"--mib": st.integers(1, 4).map(str), "--tensors": st.integers(1, 8).map(str),
          "--tensor-kib": st.integers(1, 64).map(str), "--device": st.just("cpu")},
    bad={"--device": st.sampled_from(["tpu9", "cuda:7", "", *NO_CUDA])},
)


@FAST
@given(data=st.data())
def test_kvoffload(paths, data):
    argv, kind = data.draw(arguments(kvoffload_parser(), paths, **KVOFFLOAD))
    with contextlib.chdir(paths.directory):  # where the default private directory goes
        # Small defaults first (the documented 256 MiB would make each example slow);
        # a drawn flag comes later and wins.
        r = run(kvoffload_main, ["--mib=1", "--tensors=4", "--tensor-kib=16", *argv])
    if kind == GOOD:  # tiny round trips: every one must pass
        assert r.rc == 0, (argv, r.err)
        assert "kvoffload round trip in " in r.out and "bytes verified: True" in r.out and r.err == "", argv
    else:  # a mistake, or more than any disk holds: one line, before anything is made
        assert_refused(r, "python -m kvoffload", argv)
    assert listing(paths.directory) == {str(paths.directory): []}


# -- python -m kvoffload forget ----------------------------------------------------------

KEY_HEX = "ab" * 32  # a well-formed operator key; what it verifies is test_persist.py's
KEY_ENV = "KVOFFLOAD_TEST_FORGET_KEY"
# What a DISK_PATH names, and whether wiping it is the right answer: only a plain data
# file with --without-index is (nothing else here is proved a pool).
TARGETS = ("missing", "directory", "data", "data+garbage index", "garbage index alone")


def _forget_files(root: Path, target: str) -> Path:
    """The files ``target`` describes in ``root``, and the DISK_PATH naming them."""
    path = root / "pool"
    if target == "directory":
        path.mkdir()
    if target.startswith("data"):
        path.write_bytes(b"kv" * 2048)
    if target.endswith("garbage index") or target == "garbage index alone":
        (root / "pool.index").write_bytes(b"not an index" * 400)
    return path


@FAST
@given(data=st.data(), target=st.sampled_from(TARGETS))
def test_kvoffload_forget(paths, data, target, monkeypatch):
    """forget's flags (--key-file and --key-env exclude each other) and what DISK_PATH names:
    a mistake anywhere is one line, exit 2, every file as it was; a plain data file with
    --without-index is wiped and removed, exit 0."""
    key_file = paths.directory.parent / "key"
    key_file.write_text(KEY_HEX + "\n")
    key_file.chmod(0o600)
    loose_key = paths.directory.parent / "loose-key"  # others may read it: refused
    loose_key.write_text(KEY_HEX + "\n")
    loose_key.chmod(0o644)
    monkeypatch.setenv(KEY_ENV, KEY_HEX)
    monkeypatch.setenv(KEY_ENV + "_BAD", "not hex")
    monkeypatch.delenv(KEY_ENV + "_UNSET", raising=False)
    argv, kind = data.draw(arguments(build_forget_parser(), paths, good={
        "--key-file": st.just(str(key_file)), "--key-env": st.just(KEY_ENV)}, bad={
        "--key-file": st.sampled_from([str(paths.missing), str(loose_key), str(paths.file), str(paths.directory)]),
        "--key-env": st.sampled_from([KEY_ENV + "_BAD", KEY_ENV + "_UNSET", ""])}))
    root = Path(tempfile.mkdtemp(dir=paths.directory))
    try:
        disk_path = _forget_files(root, target)
        before = {p.name: p.read_bytes() if p.is_file() else None for p in root.iterdir()}
        r = run(kvoffload_main, ["forget", str(disk_path), *argv])
        if kind == GOOD and target == "data" and "--without-index" in argv:
            assert r.rc == 0 and r.err == "" and str(disk_path) in r.out, (argv, r)
            assert list(root.iterdir()) == [], argv
        else:
            assert_refused(r, "python -m kvoffload forget", argv)
            assert {p.name: p.read_bytes() if p.is_file() else None for p in root.iterdir()} == before, argv
    finally:
        shutil.rmtree(root)


# -- python -m kvoffload.bench -----------------------------------------------------------

BENCH = dict(
    good={"--layout": st.sampled_from(["big:2x4096", "one:1x1"]), "--dram-streams": st.sampled_from(["1", "1,3"]),
          "--device": st.just("cpu"), "--engine-shares": st.sampled_from(["0.5", "0.25,0.75"]),
          # Above --engine-max-repeats (drawn or 8) now and then: _bench_rule says so.
          "--engine-min-repeats": st.integers(3, 10).map(str)},
    bad={"--layout": st.sampled_from(["big", "big:0x4096", "big:2xq", ":2x4096", "a:b:c"]),
         "--dram-streams": st.sampled_from(["0", "1,1", "x", "", "1,-2"]),
         "--device": st.sampled_from(["bogus", *NO_CUDA]),
         "--engine-shares": st.sampled_from(["0", "1", "nan", "0.5,inf", "", "x"])},
    # --make-array builds loop devices as root: its refusals have their own tests (test_bench_array.py).
    skip=("--make-array", "--array-gib", "--fs"),
)


def _last(argv: list[str], flag: str, default: str) -> str:
    """The value the last ``FLAG=VALUE`` in ``argv`` gives (argparse keeps the last), or ``default``."""
    return next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith(f"{flag}=")), default)


def _bench_rule(argv: list[str]) -> str | None:
    """The bench's rule between two flags that a list of good values can break (its others
    involve --make-array, which is not drawn): what the refusal names, or None."""
    low, high = int(_last(argv, "--engine-min-repeats", "3")), int(_last(argv, "--engine-max-repeats", "8"))
    return f"--engine-min-repeats {low} is more than --engine-max-repeats {high}" if low > high else None


@FAST
@given(data=st.data())
def test_bench(paths, data):
    argv, kind = data.draw(arguments(suite.build_parser(), paths, **BENCH))
    broken = _bench_rule(argv) if kind != BAD else None
    if broken:  # refused in one line by the run itself, before anything is made
        r = run(suite.main, ["--quick", f"--dir={paths.directory}", *argv])
        assert_refused(r, "python -m kvoffload.bench", argv)
        assert broken in r.err, (argv, r.err)
        assert listing(paths.directory) == {str(paths.directory): []}
        return
    if kind == BAD:
        # --quick first: were a mistake not refused at once, the run would at least be short.
        r = run(suite.main, ["--quick", f"--dir={paths.directory}", *argv])
        assert_refused(r, "python -m kvoffload.bench", argv)
        assert listing(paths.directory) == {str(paths.directory): []}
        return
    # A good list (huge sizes too: the run refuses them once it sees the drives) is a
    # configuration the bench accepts; the whole bench would take minutes.
    cfg = suite.config_from(suite.build_parser().parse_args(argv))
    assert cfg.layouts and cfg.modes and cfg.seals and cfg.only and cfg.job_bytes >= 1
    assert cfg.io_unit_bytes is None or cfg.io_unit_bytes >= 1


# -- python -m kvoffload.bench.tier ------------------------------------------------------

TIER = dict(
    good={"--gib": st.sampled_from(["0.001", "0.002"]), "--chunk-mib": st.sampled_from(["0.0625", "0.125"]),
          "--primary-gib": st.sampled_from(["0.0005", "0.001"]), "--job-chunks": st.integers(1, 4).map(str),
          "--tiers": st.just("kvoffload-direct"), "--raw-seconds": st.just("0.01"),
          "--io-unit-mib": st.sampled_from(["0.0625", "1"])},
)


@SLOW
@given(data=st.data())
def test_bench_tier(paths, data):
    argv, kind = data.draw(arguments(tier.build_parser(), paths, **TIER))
    # Its tiers' files go in --dir (required); the vLLM-free tier unless the list says otherwise.
    r = run(tier.main, [f"--dir={paths.directory}", "--tiers=kvoffload-direct", "--gib=0.001",
                        "--chunk-mib=0.0625", "--primary-gib=0.0005", "--raw-seconds=0.01", *argv])
    assert listing(paths.directory) == {str(paths.directory): []}
    if kind == BAD or (kind == HUGE and r.rc != 0):
        assert_refused(r, "python -m kvoffload.bench.tier", argv)
        return
    assert r.rc == 0, (argv, r.err)
    if "--json" in argv:
        out = json.loads(r.out)
        # One row per round (--repeat), each of the one tier asked for.
        assert out["ok"] and {t["tier"] for t in out["tiers"]} == {"kvoffload-direct"}, out
    else:
        assert r.out.startswith("tier bench: ") and "kvoffload-direct" in r.out and r.out.rstrip().endswith("ok")


def test_bench_tier_without_vllm_is_one_line_before_anything_runs(paths):
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    r = run(tier.main, [f"--dir={paths.directory}", "--tiers=kvoffload,kvoffload-direct"])
    assert_refused(r, "python -m kvoffload.bench.tier", [])
    assert "need vLLM 0.33 importable" in r.err and "kvoffload-direct needs none" in r.err
    assert listing(paths.directory) == {str(paths.directory): []}


# -- python -m faults sweep --------------------------------------------------------------


@FAST
@given(data=st.data())
def test_faults_sweep(paths, data):
    argv, kind = data.draw(arguments(subparser(faults_parser(), "sweep"), paths))
    if kind == BAD:
        assert_refused(run(faults_main, ["sweep", *argv]), "python -m faults", argv)
        assert listing(paths.directory) == {str(paths.directory): []}
    else:  # a whole sweep takes seconds to minutes; tests/test_faults_sweep_cli.py runs some
        a = faults_parser().parse_args(["sweep", *argv])
        assert a.file_modes and a.io and a.kinds


# -- python -m kvsim ---------------------------------------------------------------------

TIERS = ["none", "cpu:8GiB", "disk:32GiB", "disk:32GiB:pagecache", "vllm-disk:32GiB", "cpu:8GiB+disk:32GiB",
         "disk:1TB:threads=4:unit=4MiB:seal=xxh3:paths=2"]
BAD_TIERS = ["tape:1TB", "disk:0", "disk:1TB:threads=0", "disk:1TB:threads=100000", "disk:inf", "cpu:8GiB:pagecache",
             "", "disk:1.5B", "cpu:8GiB+cpu:8GiB", "disk:1TB:seal=rot13"]
KVSIM = dict(
    good={"--tier": st.sampled_from(TIERS), "--hardware": st.sampled_from(sorted(BUILTIN)),
          "--max-num-batched-tokens": st.sampled_from(["2048", "8192"]), "--gpu-kv": st.sampled_from(["8GiB", "16GiB"]),
          "--host-free": st.just("64GiB"), "--time-scale": st.sampled_from(["4", "8"]),
          "--sample": st.sampled_from(["0.5", "1"]), "--limit": st.integers(1, 50).map(str),
          "--concurrency": st.integers(1, 8).map(str),
          "--router-weights": st.sampled_from(["queue=2,gpu-prefix=3", "no-hit-lru=1.5"])},
    bad={"--tier": st.sampled_from(BAD_TIERS), "--hardware": st.sampled_from(["nope.json", "h200", "/"]),
         "--router-weights": st.sampled_from(["queue", "queue=0", "queue=nan", "gpu-prefx=1", "queue=1,queue=2", "",
                                              "=1", "queue=1,"])},
)
SCENARIO = ("--contexts", "--prefix-len", "--context-len", "--suffix-len", "--output-len", "--fill-rate",
            "--reload-rate")


def _kvsim_outcome(r, argv, kind, documented) -> None:
    if kind == BAD:
        assert_refused(r, "kvsim", argv)
    elif r.rc != 0:  # good values that do nothing together (a trace flag without a trace), or huge ones
        assert_refused(r, "kvsim", argv)
    else:
        documented(r)


@FAST
@given(data=st.data(), trace=st.sampled_from([(MINI, GOOD), ("missing.jsonl", BAD), ("/", BAD)]))
def test_kvsim_replay(paths, data, trace):
    argv, kind = data.draw(arguments(subparser(kvsim_parser(), "trace", "replay"), paths, **KVSIM, skip=SCENARIO))
    argv = ["trace", "replay", trace[0], *argv]
    kind = BAD if BAD in (kind, trace[1]) else kind
    r = run(kvsim_main, argv)

    def documented(r):
        if "--json" in argv:
            assert {"title", "tiers", "io_profile"} <= set(json.loads(r.out))
        else:
            assert "TTFT P50" in r.out
    _kvsim_outcome(r, argv, kind, documented)
    made = listing(paths.directory)[str(paths.directory)]
    assert made == ([] if r.rc else [Path(a.split("=", 1)[1]).name for a in argv if a.startswith("--plot=")])
    for name in made:
        (paths.directory / name).unlink()


@FAST
@given(data=st.data())
def test_kvsim_generate(paths, data):
    small = {"--contexts": st.integers(1, 6).map(str), "--prefix-len": st.sampled_from(["512", "1024"]),
             "--context-len": st.sampled_from(["512", "1024"]), "--suffix-len": st.integers(1, 600).map(str),
             "--output-len": st.integers(0, 64).map(str)}
    argv, kind = data.draw(arguments(subparser(kvsim_parser(), "trace", "generate"), paths, good=small))
    r = run(kvsim_main, ["trace", "generate", "reload", *argv])

    def documented(r):
        out = next((a.split("=", 1)[1] for a in argv if a.startswith(("--out=", "-o="))), None)
        lines = Path(out).read_text().splitlines() if out else r.out.splitlines()
        assert lines and all(json.loads(line)["phase"] in ("fill", "reload") for line in lines)
        if out:
            Path(out).unlink()
    _kvsim_outcome(r, argv, kind, documented)
    assert listing(paths.directory) == {str(paths.directory): []}  # refused: nothing half-written


@FAST
@given(data=st.data(), trace=st.sampled_from([(MINI, GOOD), ("missing.jsonl", BAD)]))
def test_kvsim_hitrate(paths, data, trace):
    argv, kind = data.draw(arguments(subparser(kvsim_parser(), "trace", "hitrate"), paths))
    argv = ["trace", "hitrate", trace[0], "--capacity=8GiB", *argv]
    kind = BAD if BAD in (kind, trace[1]) else kind
    _kvsim_outcome(run(kvsim_main, argv), argv, kind, lambda r: "token hit rate" in r.out or json.loads(r.out))


@FAST
@given(data=st.data(), bench=st.sampled_from([(BENCH_JSON, GOOD), ("missing.json", BAD), ("/", BAD)]))
def test_kvsim_calibrate(paths, data, bench):
    argv, kind = data.draw(arguments(subparser(kvsim_parser(), "calibrate"), paths,
                                     good={"--base": st.sampled_from(sorted(BUILTIN)), "--name": st.just("x")},
                                     bad={"--base": st.sampled_from(["nope.json", "/"]), "--name": st.nothing()}))
    argv = ["calibrate", bench[0], *argv]
    if BAD in (kind, bench[1]):
        assert_refused(run(kvsim_main, argv), "kvsim", argv)
        assert listing(paths.directory) == {str(paths.directory): []}
    else:  # a fit takes seconds: test_kvsim_calibrate.py runs it; here, the command accepts the list
        assert kvsim_parser().parse_args(argv).bench == BENCH_JSON


def test_every_cli_flag_has_a_checked_type():
    """A flag parsed by a bare int or float would take inf, nan or 1e-9 without a word."""
    parsers = [kvoffload_parser(), suite.build_parser(), tier.build_parser(), subparser(faults_parser(), "sweep")]
    parsers += [subparser(kvsim_parser(), *p) for p in (("trace", "replay"), ("trace", "generate"),
                                                       ("trace", "hitrate"), ("calibrate",))]
    for p in parsers:
        for action in p._actions:
            assert action.type not in (int, float), f"{p.prog} {action.option_strings}: a bare {action.type.__name__}"


def test_a_check_reports_what_it_refuses():
    with pytest.raises(UsageError, match=r"^argument --gib: must be a number of GiB, at least 1 byte, got 'inf'$"):
        suite.build_parser().parse_args(["--gib", "inf"])


def test_an_output_is_written_whole_or_not_at_all(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("the old one\n")
    with pytest.raises(UnicodeEncodeError):
        write_output(str(target), "a line\n" + "\ud800")  # fails halfway through the write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"] and target.read_text() == "the old one\n"
    write_output(str(target), "new\n")
    assert target.read_text() == "new\n" and len(list(tmp_path.iterdir())) == 1
