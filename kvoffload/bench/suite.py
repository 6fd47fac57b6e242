"""`python -m kvoffload.bench`: kvoffload's throughput next to the ceilings of the same machine.

This is its command line and the run's outline; the cases themselves are ``cases.py``.

In one run on one file system: raw O_DIRECT and buffered file IO at the block size
(best of queue depths 1-16), pinned copies and host memcpy, the seals alone, then
kvoffload's store, rewrite, cold load and warm load (O_DIRECT and page cache;
slots encrypted, checksummed or neither), the DRAM backend, the device seam alone,
and striping over several drives; on request (``--only metrics``) the load rate with
kvoffload's metric collection on and off. Every case runs for at least --case-seconds;
every loaded byte is compared with what was stored. The table (or ``--json``) comes last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvoffload import cli_args
from kvoffload.bench import engine, report
from kvoffload.bench.cases import (
    GROUPS, HOST_BOUND_FORMULA, HOST_BOUND_SHARE, SEALS, Bench, Case, Config, GiB, MiB, ThreadProfiler,
)
from kvoffload.bench.ceilings import QUEUE_DEPTHS, RawFile, Stopwatch, run_io
from kvoffload.bench.ram_array import RamArray, preflight, termination_as_interrupt
from kvoffload.bench.seal_rate import SEAL_BUFFER_BYTES
from kvoffload.bench.sizing import case_memory, largest_fit, mem_available, misfit, usable_bytes
from kvoffload.bench.workload import LAYOUTS, Layout
from kvoffload.cli_args import UsageError
from kvoffload.disk_backend import DEFAULT_STAGING_BYTES, MAX_DEFAULT_IO_UNIT_BYTES
from kvoffload.engine_choice import choose as engine_choice

# What a run measures unless --only says: the engine group (the backend beside a busy
# engine thread) and the metric-collection cost run on request.
DEFAULT_GROUPS = ("disk", "stripe", "dram", "seam", "seal")
# Case sizes found by the probe stay within these.
MIN_CASE_BYTES = 256 * MiB
MAX_CASE_BYTES = 4 * GiB
PROBE_BYTES = 512 * MiB


# --- sizing -----------------------------------------------------------------------------


def case_size(cfg: Config, work: list[str], given: Optional[str], array: Optional[RamArray]) -> int:
    """Bytes per case: ``cfg.case_bytes`` if it fits the drives (else one line saying why),
    otherwise from a probe of the first drive, within memory and what fits."""
    sizes = [L.block_bytes for L in cfg.layouts]
    usable = [usable_bytes(w) for w in work]
    why = misfit(0, sizes, cfg.dirs, usable, cfg.max_blocks)
    if why:
        raise UsageError(f"no case fits: {why}")
    fit = largest_fit(sizes, cfg.dirs, usable, cfg.max_blocks, max(cfg.case_bytes or 0, MAX_CASE_BYTES))
    if cfg.case_bytes is not None:
        why = misfit(cfg.case_bytes, sizes, cfg.dirs, usable, cfg.max_blocks)
        if why:
            raise UsageError(f"{given}: {why}; at most --gib {fit / GiB:.2f} fits")
        return cfg.case_bytes
    mem = mem_available() - (array.unfilled_bytes() if array is not None else 0)
    mem_cap = max(0, mem) // case_memory(1, cfg.device.type == "cpu")
    rate = probe_rate(work[0], min(PROBE_BYTES, max(4 * MiB, usable[0] // 4)))
    # Half a case per pass: 2-3 passes reach --case-seconds without overshooting by a whole pass.
    want = int(rate * cfg.case_seconds / 2)
    n = max(min(want, MAX_CASE_BYTES, mem_cap), min(MIN_CASE_BYTES, mem_cap))
    if n > fit:
        print(f"kvoffload bench: cases cut to {fit / MiB:.0f} MiB (of {n / MiB:.0f}) to fit the drives",
              file=sys.stderr)
    return min(n, fit)


def probe_rate(directory: str, nbytes: int) -> float:
    """Bytes/s of the slower of an O_DIRECT write and read at 4 MiB, queue depth 8."""
    f = RawFile(directory, nbytes)
    try:
        sw = Stopwatch(torch.device("cpu"))
        with sw:
            f.fill()
        w = f.size / sw.seconds
        r = run_io([f], [f.direct_fd], 4 * MiB, 8, False, 0.3).gib_s * GiB
    finally:
        f.close()
    return min(w, r)


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


# --- command line -------------------------------------------------------------------------

PROG = "python -m kvoffload.bench"


def layout_spec(text: str) -> Layout:
    """``--layout NAME:TENSORSxBYTES``, checked where it is parsed."""
    try:
        name, shape = text.split(":")
        count, nbytes = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME:TENSORSxBYTES, e.g. big:80x65536") from None
    if not name or count < 1 or nbytes < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a name, and tensors and bytes >= 1")
    return Layout(name, (nbytes,) * count, f"custom: {count} tensors x {nbytes} B")


def engine_config(cfg: Config, work: list[str]) -> engine.EngineConfig:
    """The engine group's run: the first layout, --gib of blocks per path (1 GiB; --quick 16 MiB)."""
    footprint = cfg.case_bytes if cfg.case_bytes is not None else GiB
    return engine.EngineConfig(
        device=cfg.device, dirs=work, tensor_bytes=cfg.layouts[0].tensor_bytes, footprint_bytes=footprint,
        job_bytes=max(cfg.job_bytes, footprint // 4), depth=3, seconds=cfg.engine_seconds,
        min_repeats=2 if cfg.quick else cfg.engine_min_repeats, max_repeats=2 if cfg.quick else cfg.engine_max_repeats,
        io_threads=cfg.io_threads, io_unit_bytes=cfg.io_unit_bytes, paths=cfg.engine_paths,
        shares=cfg.engine_shares, seed=cfg.seed, tier_unit_bytes=cfg.engine_tier_unit_bytes,
    )


def engine_shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        shares = ()
    if not shares or not all(0 < x < 1 for x in shares):  # nan and inf are outside too
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of fractions in (0, 1), e.g. 0.25,0.75")
    return shares


def dram_streams(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of distinct integers >= 1, e.g. 1,4")
    return counts


def build_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--dir", action="append", default=None, type=cli_args.Directory(),
                   help="directory for the files (repeat to stripe over several; default: the current directory)")
    p.add_argument("--make-array", type=cli_args.Integer(1), metavar="N",
                   help="root only: build N RAM-backed drives (loop devices over /dev/shm files), run on them "
                        "(one drive alone, all N striped), then tear them down")
    p.add_argument("--array-gib", type=cli_args.Number(above=0.0), default=14.0,
                   help="GiB per --make-array drive (14)")
    p.add_argument("--fs", choices=("ext4", "xfs"), default="ext4", help="file system of --make-array drives")
    p.add_argument("--layouts", type=cli_args.Names(tuple(LAYOUTS)), default=list(LAYOUTS),
                   help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--layout", action="append", default=[], type=layout_spec, metavar="NAME:TENSORSxBYTES",
                   help="add a layout, e.g. big:80x65536 (repeatable)")
    p.add_argument("--only", type=cli_args.Names(GROUPS), default=list(DEFAULT_GROUPS),
                   help=f"comma list of the kvoffload cases to run: {', '.join(GROUPS)} (default all but engine and metrics); "
                        "the ceilings they are compared with always run")
    p.add_argument("--gib", dest="case_bytes", type=cli_args.Amount(GiB, "GiB"), default=None,
                   help="GiB moved per pass of a case (default: sized from a probe, at most 4, to fit the drives)")
    p.add_argument("--max-blocks", type=cli_args.Integer(1), default=16384,
                   help="at most this many blocks per pass (16384: 1 GiB of 64 KiB blocks)")
    p.add_argument("--case-seconds", type=cli_args.Number(minimum=0.0), default=None,
                   help="time every case over at least this many seconds, repeating passes (2; --quick: one pass)")
    p.add_argument("--raw-seconds", type=cli_args.Number(above=0.0), default=0.3,
                   help="seconds per queue depth in a raw sweep (0.3); the best depth then runs --case-seconds")
    p.add_argument("--modes", type=cli_args.Names(("direct", "pagecache")), default=["direct", "pagecache"],
                   help="comma list of direct, pagecache")
    p.add_argument("--seals", type=cli_args.Names(SEALS), default=list(SEALS),
                   help="comma list of how slots are sealed: aes-gcm (the default: encrypted), xxh3 (checksums), off")
    p.add_argument("--job-mib", dest="job_bytes", type=cli_args.Amount(MiB, "MiB"), default=32 * MiB,
                   help="MiB per launch_copy job (32)")
    p.add_argument("--io-threads", type=cli_args.Integer(1, cli_args.MAX_IO_THREADS), default=None,
                   help="DiskBackend io_threads (default: the backend's)")
    p.add_argument("--dram-streams", type=dram_streams, default=(1,),
                   help="comma list: streams per direction of the DRAM backend, one case each (1: vLLM's DMA backend)")
    p.add_argument("--io-unit-mib", dest="io_unit_bytes", type=cli_args.Amount(MiB, "MiB"), default=None,
                   help="DiskBackend io_unit_bytes in MiB (default: the backend's, up to "
                        f"{MAX_DEFAULT_IO_UNIT_BYTES // MiB} MiB within {DEFAULT_STAGING_BYTES // MiB} MiB of staging)")
    p.add_argument("--slots", choices=("random", "sequential"), default="random",
                   help="slot placement: random (a warm free list, one IO per block) or sequential")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--metrics-pairs", type=cli_args.Integer(1), default=5,
                   help="--only metrics: on/off load timings, interleaved, the order alternating (5)")
    p.add_argument("--engine-seconds", type=cli_args.Number(above=0.0), default=None,
                   help="engine group: seconds per segment (1; --quick: 0.1); each case repeats its three "
                        "segments until the ratios' spread is within 5%% (3 to 8 repeats)")
    p.add_argument("--engine-paths", type=cli_args.Names(engine.PATHS), default=list(engine.PATHS),
                   help="engine group: comma list of gpu (DiskBackend on --device) and tier (SlotTier on host rows)")
    p.add_argument("--engine-shares", type=engine_shares, default=engine.SHARES,
                   help="engine group: comma list of Python's share of a 20 ms step, each in (0, 1)")
    p.add_argument("--engine-max-repeats", type=cli_args.Integer(3), default=8,
                   help="engine group: at most this many repeats per case (8; at least 3)")
    p.add_argument("--engine-min-repeats", type=cli_args.Integer(3), default=3,
                   help="engine group: at least this many repeats per case (3; at most --engine-max-repeats)")
    p.add_argument("--engine-switch-ms", type=cli_args.Number(above=0.0), default=None,
                   help="engine group: run with sys.setswitchinterval at this many ms (Python's default: 5), "
                        "to measure how the GIL hand-over interval trades the two ratios")
    p.add_argument("--engine-tier-unit-mib", type=cli_args.Integer(1), default=None,
                   help="engine group: the tier path's IO unit in MiB (default: the backend's)")
    p.add_argument("--io-paths", type=cli_args.Names(("auto", "native", "python")), default=["auto"],
                   help="comma list of the backend's IO paths to run each disk and stripe case on: auto (the "
                        "default: the native core where it was built), native, python; CPU s/GiB is per case")
    p.add_argument("--runs", type=cli_args.Integer(1), default=1,
                   help="repeat everything N times; report best and worst")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="never write /proc/sys/vm/drop_caches (fadvise only)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, every figure, every byte checked")
    p.add_argument("--seed", type=cli_args.Integer(0), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--profile", metavar="FILE", type=cli_args.OutputFile(),
                   help="write a cProfile (pstats) of the kvoffload cases")
    return p


def config_from(a: argparse.Namespace) -> Config:
    """The run's configuration; what the flags' own checks cannot see (two flags together,
    the machine) is refused here, still before anything is made."""
    if a.make_array is not None and a.dir:
        raise UsageError("--make-array builds its own drives: give it or --dir, not both")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU")
    if a.engine_min_repeats > a.engine_max_repeats:
        raise UsageError(f"--engine-min-repeats {a.engine_min_repeats} is more than --engine-max-repeats "
                         f"{a.engine_max_repeats}")
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    case_seconds = a.case_seconds if a.case_seconds is not None else (0.0 if a.quick else 2.0)
    return Config(
        device=device, dirs=a.dir or [os.getcwd()],
        layouts=[LAYOUTS[n] for n in a.layouts] + a.layout, modes=a.modes, seals=a.seals, only=frozenset(a.only),
        case_bytes=a.case_bytes if a.case_bytes is not None else (8 * MiB if a.quick else None),
        case_seconds=case_seconds, raw_seconds=0.02 if a.quick else a.raw_seconds,
        job_bytes=2 * MiB if a.quick else a.job_bytes, io_threads=a.io_threads,
        io_unit_bytes=a.io_unit_bytes, slots=a.slots, allow_drop_caches=not a.no_drop_caches,
        quick=a.quick, seed=a.seed, max_blocks=a.max_blocks, dram_streams=a.dram_streams,
        engine_seconds=a.engine_seconds if a.engine_seconds is not None else (0.1 if a.quick else 1.0),
        engine_paths=tuple(a.engine_paths), engine_shares=a.engine_shares, engine_max_repeats=a.engine_max_repeats,
        engine_min_repeats=a.engine_min_repeats,
        engine_switch_ms=a.engine_switch_ms, metrics_pairs=a.metrics_pairs, io_paths=tuple(a.io_paths),
        engine_tier_unit_bytes=None if a.engine_tier_unit_mib is None else a.engine_tier_unit_mib * MiB,
    )


@dataclass
class Outcome:
    """What a bench process measured so far: complete at the end, partial after an interrupt."""

    nbytes: int = 0
    runs: list[list[Case]] = field(default_factory=list)  # the last one may be cut short
    drops: list[dict] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    dirs: list[dict] = field(default_factory=list)
    engine: list[engine.EngineCaseResult] = field(default_factory=list)
    interrupted: Optional[str] = None


def main(argv: Optional[list[str]] = None) -> int:
    return cli_args.main(PROG, lambda: _run(argv))


def _run(argv: Optional[list[str]]) -> int:
    a = build_parser().parse_args(argv)
    cfg = config_from(a)
    given = f"--gib {a.case_bytes / GiB:.10g}" if a.case_bytes is not None else "--quick (8 MiB per case)"
    prof = ThreadProfiler() if a.profile else None
    array: Optional[RamArray] = None
    got = Outcome()
    try:
        with termination_as_interrupt(), contextlib.ExitStack() as stack:
            if a.make_array is not None:
                preflight(a.make_array, a.array_gib, a.fs,
                          case_memory(cfg.case_bytes or MIN_CASE_BYTES, cfg.device.type == "cpu"))
                array = stack.enter_context(RamArray(a.make_array, a.array_gib, a.fs))
                cfg.dirs = array.mountpoints
                print(f"kvoffload bench: {a.make_array} RAM-backed {a.fs} drive(s) of {a.array_gib:g} GiB at "
                      f"{', '.join(cfg.dirs)}", file=sys.stderr)
            got.dirs = [{"path": d, "fs": fs_type(d)} for d in cfg.dirs]  # while an array is still mounted
            run_all(cfg, given, array, prof, a.runs, got)
    except KeyboardInterrupt as e:
        got.interrupted = str(e) or "Ctrl-C"
        removed = "its files were removed"
        if array is not None:
            removed = ("its files and drives were removed" if not array.teardown_errors
                       else "its files were removed, its drives NOT fully (see above)")
        print(f"kvoffload bench: interrupted ({got.interrupted}); {removed}"
              + ("; the cases measured so far follow" if got.runs and got.runs[0] else ""), file=sys.stderr)
        if not (got.runs and got.runs[0]):
            return 130
    rows = report.summarize([r for r in got.runs if r])
    torn_down = array is None or not array.teardown_errors
    ok = (all(r["verified"] is not False for r in rows) and not got.leftovers and torn_down
          and got.interrupted is None and not any(r.failed_jobs for r in got.engine))
    if prof is not None:
        st = prof.dump(a.profile)
        if not a.json:
            st.stream = sys.stderr
            st.sort_stats("tottime").print_stats(20)
    machine = {
        "device": torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda"
        else platform.processor() or "cpu",
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dirs": got.dirs,
        # The IO engine the backend takes here by default, and why where it is Python's.
        "io_path": engine_choice("aes-gcm", None)[1],
    }
    result = {
        "machine": machine,
        "config": {
            "device": str(cfg.device), "runs": a.runs, "quick": a.quick, "bytes_per_case": got.nbytes,
            "layouts": {L.name: {"block_bytes": L.block_bytes, "tensors": len(L.tensor_bytes), "note": L.note}
                        for L in cfg.layouts},
            "modes": cfg.modes, "seals": cfg.seals, "only": sorted(cfg.only), "slots": cfg.slots,
            "job_bytes": cfg.job_bytes, "io_threads": cfg.io_threads, "io_threads_used": cfg.threads,
            "dram_streams": list(cfg.dram_streams),
            "engine_switch_ms": cfg.engine_switch_ms or sys.getswitchinterval() * 1e3,
            "io_unit_bytes": cfg.io_unit_bytes, "queue_depths": list(QUEUE_DEPTHS), "raw_seconds": cfg.raw_seconds,
            "case_seconds": cfg.case_seconds, "seal_buffer_bytes": SEAL_BUFFER_BYTES,
            "host_bound": {"formula": HOST_BOUND_FORMULA, "share": round(HOST_BOUND_SHARE, 4)},
        },
        "array": array.describe() if array is not None else None,
        "cache_drop": {"summary": report.drop_summary(got.drops), "cases": got.drops},
        "cases": rows,
        "engine": engine.as_json(got.engine),
        "seal_cost": report.seal_cost(rows),
        "leftover_files": got.leftovers,
        "all_verified": all(r["verified"] is not False for r in rows),
        "interrupted": got.interrupted,
        "ok": ok,
    }
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        if rows:
            print(report.full(result))
        if got.engine:
            print(engine.table(got.engine))
    return 130 if got.interrupted else 0 if ok else 1


def run_all(cfg: Config, given: str, array: Optional[RamArray], prof, nruns: int, got: Outcome) -> None:
    """The runs, in private directories inside each --dir that are removed afterwards.

    ``got`` fills as cases finish, so an interrupt still leaves what was measured."""
    work: list[str] = []
    try:
        for d in cfg.dirs:
            cli_args.private_dir(work, ".kvoffload-bench-", d)
        if cfg.only - {"engine"}:
            got.nbytes = case_size(cfg, work, given, array)
            print(f"kvoffload bench: {got.nbytes / MiB:.0f} MiB per pass, {report.per_case(cfg.case_seconds)}, "
                  f"{nruns} run(s), device {cfg.device}", file=sys.stderr)
            for i in range(nruns):
                b = Bench(cfg, prof, got.drops)
                got.runs.append(b.cases)
                b.run(i, got.nbytes, work)
        if "engine" in cfg.only:
            before = sys.getswitchinterval()
            if cfg.engine_switch_ms is not None:
                sys.setswitchinterval(cfg.engine_switch_ms / 1e3)
            try:
                got.engine.extend(engine.run_engine_group(engine_config(cfg, work),
                                                          lambda m: print(m, file=sys.stderr)))
            finally:
                sys.setswitchinterval(before)
    finally:
        for w in work:
            for root, _, files in os.walk(w):
                got.leftovers += [os.path.join(root, f) for f in files]
            shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
