"""Two ranks, one directory: per-rank slot files, concurrent stores and loads, faults in one rank.

Run as ``python scripts/two_ranks.py``. Each rank is a spawned process with its own
``DiskBackend`` on ``f"{disk_path}.rank_{rank}"`` in the shared directory (one GPU
per rank when there are two, else both on one GPU, else CPU). For ``--seconds`` a
rank stores fresh random blocks and loads earlier ones back at the same time,
checking every byte it loads against what it stored. One rank's OS calls fail every
Nth pwritev/preadv with EIO; the other rank must never see an error. No NCCL: the
ranks share nothing but the directory, and a multiprocessing barrier starts them.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback
from typing import Optional

from kvoffload import cli_args
from kvoffload.cli_args import UsageError

PROG = "scripts/two_ranks.py"
GiB = 2**30
MiB = 2**20


def _device_for(rank: int, want: str, ngpu: int) -> str:
    if want == "cuda" and ngpu >= 2:
        return f"cuda:{rank}"
    if want == "cuda" and ngpu == 1:
        return "cuda:0"
    return "cpu"


def rank_main(rank: int, a: dict, barrier, results) -> None:
    """One rank: its own backend and caches; reports one dict on ``results``."""
    try:
        results.put(_rank_body(rank, a, barrier))
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        try:
            barrier.abort()
        except Exception:
            pass


class _CountWarnings(logging.Handler):
    """Counts kvoffload's warnings instead of printing one line per injected fault."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _rank_body(rank: int, a: dict, barrier) -> dict:
    import numpy as np
    import torch

    from kvoffload.disk_backend import DiskBackend

    device = torch.device(a["devices"][rank])
    if device.type == "cpu":
        torch.set_num_threads(1)  # two ranks share the cores with their IO threads
    else:
        torch.cuda.set_device(device)
    faulty = rank == a["fault_rank"]
    warned = _CountWarnings()
    log = logging.getLogger("kvoffload")
    log.addHandler(warned)
    log.propagate = False
    osc = None
    if faulty:
        from faults import FaultyOsCalls

        osc = FaultyOsCalls().fail_every("pwritev", a["fault_every"]).fail_every("preadv", a["fault_every"])
    nb, k = a["blocks"], a["job_blocks"]
    half = nb // 2  # blocks [0, half) are stored from, [half, nb) are loaded into
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    caches = {
        f"layer{i}": torch.zeros((nb, a["tensor_bytes"]), dtype=torch.int8, device=device)
        for i in range(a["tensors"])
    }
    block_bytes = a["tensors"] * a["tensor_bytes"]
    rng = np.random.default_rng(rank)
    b = DiskBackend()
    b.init(caches, device, None, None, os.path.join(a["dir"], f"kv.bin.rank_{rank}"), a["slots"], block_bytes,
           named_file=True, io_threads=a["io_threads"], report_load_errors=True, os_calls=osc)
    st = {"rank": rank, "device": str(device), "faulty": faulty, "store_jobs": 0, "load_jobs": 0,
          "failed_stores": 0, "load_errors": 0, "blocks_verified": 0, "mismatches": 0,
          "bytes_stored": 0, "bytes_loaded": 0, "faults_fired": 0}
    # What each slot should hold: a copy of every block this rank stored successfully.
    mirror = {name: torch.zeros((a["slots"], a["tensor_bytes"]), dtype=torch.int8, device=device) for name in caches}
    valid = np.zeros(a["slots"], dtype=bool)
    idx = 0
    try:
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < a["seconds"]:
            for t in caches.values():  # fresh content for the blocks stored from
                t[:half].random_(-128, 128, generator=g)
                t[half:].fill_(0x5A)  # a load that skips a block leaves this behind
            written = None
            if device.type == "cuda":
                # As vLLM does: the store waits on an event recorded after the writes
                # (the backend's copies run on their own streams). Loads take no
                # wait_event: the engine does not touch their target blocks, so the
                # fill must be over before the load starts.
                written = torch.cuda.Event()
                written.record()
                written.synchronize()
            src = rng.choice(half, size=k, replace=False).tolist()
            stored = np.flatnonzero(valid)
            load_slots = rng.choice(stored, size=min(k, len(stored)), replace=False).tolist() if len(stored) else []
            busy = set(load_slots)  # never store into a slot that is being loaded
            free = [s for s in rng.permutation(a["slots"]).tolist() if s not in busy][:k]
            dst_blocks = (half + rng.choice(nb - half, size=len(load_slots), replace=False)).tolist()
            events: list = []
            # A store and a load in flight together, as in a busy engine step.
            b.launch_copy(src, free, True, idx, events, wait_event=written)
            if load_slots:
                b.launch_copy(load_slots, dst_blocks, False, idx + 1, events)
            idx += 2
            for _, ev in events:
                ev.synchronize()
            _mirror_stores(b, st, caches, mirror, valid, free, src, block_bytes)
            if load_slots:
                _check_loads(b, st, caches, mirror, load_slots, dst_blocks, block_bytes)
        st["seconds"] = time.perf_counter() - t0
    finally:
        b.shutdown()
    st["faults_fired"] = osc.fired_total() if osc is not None else 0
    st["warnings_logged"] = warned.count
    return st


def _mirror_stores(b, st: dict, caches: dict, mirror: dict, valid, slots: list, blocks: list,
                   block_bytes: int) -> None:
    """Copy what each successful store wrote into ``mirror`` (what its slot must hold now);
    a failed store's slot holds unknown content: a later load must fail, not return it."""
    import torch

    failed = b.get_failed_store_slots()
    ok_pairs = [(s, blk) for s, blk in zip(slots, blocks) if s not in failed]
    valid[list(failed)] = False
    if ok_pairs:
        device = next(iter(caches.values())).device
        slots_t = torch.as_tensor([s for s, _ in ok_pairs], device=device)
        blocks_t = torch.as_tensor([blk for _, blk in ok_pairs], device=device)
        for name, t in caches.items():
            mirror[name].index_copy_(0, slots_t, t.index_select(0, blocks_t))
        valid[[s for s, _ in ok_pairs]] = True
    st["store_jobs"] += 1
    st["failed_stores"] += len(failed)
    st["bytes_stored"] += len(ok_pairs) * block_bytes


def _check_loads(b, st: dict, caches: dict, mirror: dict, slots: list, blocks: list, block_bytes: int) -> None:
    """Compare every block a load reported good with what its slot must hold."""
    import torch

    errs = b.get_block_ids_with_load_errors()
    st["load_jobs"] += 1
    st["load_errors"] += len(errs)
    good = [(s, blk) for s, blk in zip(slots, blocks) if blk not in errs]
    if good:
        device = next(iter(caches.values())).device
        slots_t = torch.as_tensor([s for s, _ in good], device=device)
        blocks_t = torch.as_tensor([blk for _, blk in good], device=device)
        same = torch.ones(len(good), dtype=torch.bool, device=device)
        for name, t in caches.items():
            same &= (t.index_select(0, blocks_t) == mirror[name].index_select(0, slots_t)).all(dim=1)
        st["blocks_verified"] += len(good)
        st["mismatches"] += int((~same).sum())
        st["bytes_loaded"] += len(good) * block_bytes


def raw_ceiling(directory: str, block_bytes: int, mib: int, seconds: float) -> dict:
    from kvoffload.bench.ceilings import RawFile, sweep
    from kvoffload.slot_file import round_up

    f = RawFile(directory, max(mib * MiB, 4 * round_up(block_bytes, 4096)))
    try:
        f.fill()
        io = round_up(block_bytes, 4096)
        w = sweep([f], io, "direct-write", seconds)
        r = sweep([f], io, "direct-read", seconds)
    finally:
        f.close()
    return {"write_gib_s": w.gib_s, "write_qd": w.detail["qd"], "read_gib_s": r.gib_s, "read_qd": r.detail["qd"]}


def build_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=cli_args.Directory(), default=None,
                   help="shared directory (default: a temp dir in the current directory)")
    p.add_argument("--seconds", type=cli_args.Number(above=0.0, maximum=86400.0), default=60.0,
                   help="how long both ranks run (60)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--tensors", type=cli_args.Integer(1, 4096), default=64, help="cache tensors per block (64)")
    p.add_argument("--tensor-kib", type=cli_args.Number(above=0.0, maximum=2**20), default=32,
                   help="KiB per tensor per block (32: 2 MiB blocks)")
    p.add_argument("--blocks", type=cli_args.Integer(2, 2**20), default=512, help="device blocks per rank (512)")
    p.add_argument("--slots", type=cli_args.Integer(2, 2**24), default=1024, help="disk slots per rank (1024)")
    p.add_argument("--job-blocks", type=cli_args.Integer(1, 2**19), default=32,
                   help="blocks per store job and per load job (32)")
    p.add_argument("--io-threads", type=cli_args.Integer(1, cli_args.MAX_IO_THREADS), default=None,
                   help="IO threads per lane (default: the backend's)")
    p.add_argument("--fault-rank", type=int, default=1, choices=(0, 1))
    p.add_argument("--fault-every", type=cli_args.Integer(1), default=7, help="fail every Nth pwritev and preadv (7)")
    p.add_argument("--raw-mib", type=cli_args.Integer(1, 2**20), default=2048,
                   help="size of the raw-ceiling scratch file (2048)")
    p.add_argument("--raw-seconds", type=cli_args.Number(above=0.0, maximum=3600.0), default=0.4)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def run(argv: Optional[list[str]] = None) -> dict:
    """Run both ranks and return the result object (what ``--json`` prints)."""
    a = build_parser().parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # house rule, should anyone add torch.distributed
    import torch

    ngpu = torch.cuda.device_count() if a.device in ("auto", "cuda") else 0
    if a.device == "cuda" and ngpu == 0:
        raise UsageError("--device cuda: torch sees no GPU")
    want = "cuda" if ngpu else "cpu"
    devices = [_device_for(r, want, ngpu) for r in range(2)]
    tensor_bytes = int(a.tensor_kib * 1024)
    block_bytes = a.tensors * tensor_bytes
    if a.job_blocks * 2 > a.blocks or a.job_blocks * 2 > a.slots:
        raise UsageError("--blocks and --slots must be at least twice --job-blocks")
    own: list[str] = []
    procs: list = []
    try:
        d = cli_args.private_dir(own, ".kvoffload-ranks-", os.getcwd()) if a.dir is None else a.dir
        before = set(os.listdir(d))
        ceiling = raw_ceiling(d, block_bytes, a.raw_mib, a.raw_seconds)
        args = {"dir": d, "devices": devices, "tensors": a.tensors, "tensor_bytes": tensor_bytes,
                "blocks": a.blocks, "slots": a.slots, "job_blocks": a.job_blocks, "io_threads": a.io_threads,
                "fault_rank": a.fault_rank, "fault_every": a.fault_every, "seconds": a.seconds}
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        for r in range(2):
            procs.append(ctx.Process(target=rank_main, args=(r, args, barrier, results), name=f"rank{r}"))
            procs[-1].start()
        got = []
        deadline = time.monotonic() + a.seconds + 300
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                got.append(results.get(timeout=1.0))
            except Exception:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=60)
        exitcodes = [p.exitcode for p in procs]
        leftovers = sorted(set(os.listdir(d)) - before)
    finally:
        # An interrupt (or an error) here leaves the ranks running: they go before their directory.
        for p in procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.terminate()
            p.join(timeout=60)
        for w in own:
            shutil.rmtree(w, ignore_errors=True)
    ranks = sorted(got, key=lambda r: r["rank"])
    return summarize(ranks, ceiling, leftovers, exitcodes, devices, block_bytes, a)


def summarize(ranks, ceiling, leftovers, exitcodes, devices, block_bytes, a) -> dict:
    errors = [r for r in ranks if "error" in r]
    checks = {
        "both_ranks_reported": len(ranks) == 2 and not errors,
        "clean_exit": exitcodes == [0, 0],
        "no_files_left": leftovers == [],
    }
    agg = {"store_gib_s": 0.0, "load_gib_s": 0.0}
    if checks["both_ranks_reported"]:
        healthy = next(r for r in ranks if not r["faulty"])
        faulty = next(r for r in ranks if r["faulty"])
        checks["healthy_rank_saw_no_errors"] = (
            healthy["load_errors"] == 0 and healthy["failed_stores"] == 0 and healthy["warnings_logged"] == 0)
        checks["faults_fired_in_faulty_rank"] = faulty["faults_fired"] > 0 and (
            faulty["load_errors"] + faulty["failed_stores"] > 0)
        checks["every_loaded_byte_matches"] = all(r["mismatches"] == 0 and r["blocks_verified"] > 0 for r in ranks)
        for r in ranks:
            r["store_gib_s"] = r["bytes_stored"] / r["seconds"] / GiB
            r["load_gib_s"] = r["bytes_loaded"] / r["seconds"] / GiB
            r["store_ratio"] = r["store_gib_s"] / ceiling["write_gib_s"]
            r["load_ratio"] = r["load_gib_s"] / ceiling["read_gib_s"]
            agg["store_gib_s"] += r["store_gib_s"]
            agg["load_gib_s"] += r["load_gib_s"]
        agg["store_ratio"] = agg["store_gib_s"] / ceiling["write_gib_s"]
        agg["load_ratio"] = agg["load_gib_s"] / ceiling["read_gib_s"]
    return {
        "devices": devices,
        "block_bytes": block_bytes,
        "seconds": a.seconds,
        "fault_rank": a.fault_rank,
        "fault_every": a.fault_every,
        "raw_ceiling": ceiling,
        "ranks": ranks,
        "aggregate": agg,
        "leftover_files": leftovers,
        "exitcodes": exitcodes,
        "checks": checks,
        "ok": all(checks.values()),
    }


def table(res: dict) -> str:
    c = res["raw_ceiling"]
    out = [
        f"two ranks on {', '.join(res['devices'])}; {res['block_bytes']} B blocks; {res['seconds']:g} s; "
        f"EIO every {res['fault_every']}th pwritev/preadv in rank {res['fault_rank']}",
        f"raw ceiling in the same directory: write {c['write_gib_s']:.2f} GiB/s (qd {c['write_qd']}), "
        f"read {c['read_gib_s']:.2f} GiB/s (qd {c['read_qd']})",
        "",
        f"{'rank':<10} {'faults':>6} {'stores':>7} {'failed':>7} {'loads':>7} {'errors':>7} {'verified':>9} "
        f"{'wrong':>6} {'store GiB/s':>12} {'load GiB/s':>11}",
    ]
    for r in res["ranks"]:
        if "error" in r:
            out.append(f"rank {r['rank']}: FAILED\n{r['error']}")
            continue
        name = f"{r['rank']}{' (faulty)' if r['faulty'] else ''}"
        out.append(
            f"{name:<10} {r['faults_fired']:>6} {r['store_jobs']:>7} {r['failed_stores']:>7} {r['load_jobs']:>7} "
            f"{r['load_errors']:>7} {r['blocks_verified']:>9} {r['mismatches']:>6} "
            f"{r['store_gib_s']:>6.2f} ({r['store_ratio']:.2f}) {r['load_gib_s']:>5.2f} ({r['load_ratio']:.2f})"
        )
    g = res["aggregate"]
    if "store_ratio" in g:
        out.append(f"{'both':<10} {'':>6} {'':>7} {'':>7} {'':>7} {'':>7} {'':>9} {'':>6} "
                   f"{g['store_gib_s']:>6.2f} ({g['store_ratio']:.2f}) {g['load_gib_s']:>5.2f} ({g['load_ratio']:.2f})")
    out.append("")
    out.append("(ratio) = share of the raw ceiling; checks: "
               + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in res["checks"].items()))
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    """A mistake is one line and exit code 2, Ctrl-C one line and 130 (its directory removed),
    as every command's (``cli_args.main``); 1 where a check failed."""
    return cli_args.main(PROG, lambda: _main(argv))


def _main(argv: Optional[list[str]]) -> int:
    res = run(argv)
    print(json.dumps(res, indent=1) if "--json" in (argv if argv is not None else sys.argv[1:]) else table(res))
    return 0 if res["ok"] else 1
