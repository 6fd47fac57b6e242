"""`python -m kvoffload.bench`: kvoffload's throughput next to the ceilings of the same machine.

In one run on one file system: raw O_DIRECT and buffered file IO at the block size
(best of queue depths 1-16), the pinned copy rate, then kvoffload's store, cold
load and warm load (O_DIRECT and page cache; slots encrypted, checksummed or neither), the DRAM
backend, the device seam alone, and striping over several paths. Every loaded
byte is compared with what was stored. The table (or ``--json``) comes last.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from kvoffload.bench.ceilings import (
    QUEUE_DEPTHS, RawFile, Stopwatch, Timed, copy_rate, drop_page_cache, memcpy_rate, resident_of, run_io,
    sweep, warm,
)
from kvoffload.bench.dram_backend import CpuBackend
from kvoffload.device import BlockLayout, alloc_host, make_device
from kvoffload.disk_backend import DEFAULT_IO_THREADS, DEFAULT_IO_UNIT_BYTES, DiskBackend
from kvoffload.slot_file import round_up

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Layout:
    name: str
    tensor_bytes: tuple[int, ...]  # bytes per block of each cache tensor
    note: str

    @property
    def block_bytes(self) -> int:
        return sum(self.tensor_bytes)


LAYOUTS = {
    "llama": Layout("llama", (32 * 1024,) * 64, "Llama-3-8B-like: 64 tensors x 32 KiB = 2 MiB"),
    "small": Layout("small", (1024,) * 64, "small blocks: 64 tensors x 1 KiB = 64 KiB"),
    # 576 latent values x bf16 x 16 tokens per layer, 61 layers: 1,124,352 B, not a multiple of 4096.
    "mla": Layout("mla", (576 * 2 * 16,) * 61, "DeepSeek-MLA-like: 61 tensors x 18,432 B, not 4096-aligned"),
    "many": Layout("many", (8 * 1024,) * 128, "many tensors: 128 x 8 KiB = 1 MiB"),
}
# Larger than the last-level cache (300 MiB on the H200 host), so the copy reaches DRAM.
MEMCPY_BYTES = GiB
# How the backend seals slots by default (its init's encrypt=True): the striping cases use it.
DEFAULT_SEAL = "aes-gcm"
SEALS = ("aes-gcm", "xxh3", "off")
# The device-seam and striping cases run on this layout (2 MiB blocks).
SEAM_LAYOUT = "llama"


@dataclass
class Case:
    """One measured case of one run."""

    name: str  # unique within a run, e.g. "llama direct aes-gcm cold-load"
    group: str  # raw | copy | disk | dram | seam | stripe
    layout: str
    timed: Timed
    ceiling: Optional[str] = None  # name of the case it is compared with
    verified: Optional[bool] = None  # None where nothing is loaded back
    info: dict = field(default_factory=dict)


@dataclass
class Config:
    device: torch.device
    dirs: list[str]
    layouts: list[Layout]
    modes: list[str]
    seals: list[str]
    case_bytes: Optional[int]  # None: sized from a probe
    case_seconds: float
    raw_seconds: float
    job_bytes: int
    io_threads: Optional[int]
    slots: str
    allow_drop_caches: bool
    quick: bool
    seed: int
    max_blocks: int = 16384


# --- the run ------------------------------------------------------------------------


class Bench:
    def __init__(self, cfg: Config, profiler: Optional["ThreadProfiler"]) -> None:
        self.cfg = cfg
        self.prof = profiler
        self.cases: list[Case] = []
        self.drops: list[dict] = []
        self.dev = make_device(cfg.device)

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def add(self, case: Case) -> Case:
        self.cases.append(case)
        t = case.timed
        v = "" if case.verified is None else f"  verified={case.verified}"
        self.log(f"  {case.name:<40} {t.gib_s:8.2f} GiB/s  {t.nbytes / MiB:9.1f} MiB in {t.seconds:6.3f} s{v}")
        return case

    def run(self, run_idx: int, sizes: dict[str, int], work: list[str]) -> None:
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + run_idx)
        raw_size = max(round_up(min(sizes[L.name] // L.block_bytes, cfg.max_blocks) * L.block_bytes, 4096) + 8192
                       for L in cfg.layouts)
        self.log(f"run {run_idx + 1}: raw scratch file of {raw_size / MiB:.0f} MiB in {work[0]}")
        raw = RawFile(work[0], raw_size)
        try:
            raw.fill()
            warm([raw])
            for L in cfg.layouts:
                self.run_layout(L, sizes[L.name], raw, work, rng)
        finally:
            raw.close()

    def run_layout(self, L: Layout, nbytes: int, raw: RawFile, work: list[str], rng) -> None:
        cfg = self.cfg
        n = max(1, min(nbytes // L.block_bytes, cfg.max_blocks))
        slot = round_up(L.block_bytes, 4096)
        self.log(f"{L.name}: {n} blocks of {L.block_bytes} B ({L.note})")
        # Ceilings at this block size.
        for kind in ("direct-write", "direct-read", "buffered-read"):
            io = L.block_bytes if kind == "buffered-read" else slot
            self.add(Case(f"{L.name} raw {kind}", "raw", L.name, sweep([raw], io, kind, cfg.raw_seconds)))
        caches, ref = make_caches(cfg.device, n, L.tensor_bytes, int(rng.integers(1 << 31)))
        try:
            staging_rows = max(1, min(n, GiB // slot))
            host = alloc_host(staging_rows * slot, 4096)
            host.zero_()
            self.dev.pin(host)
            try:
                # The ceiling uses torch's own pinned allocator; the seam below uses the
                # backend's registered staging.
                pinned = torch.zeros(staging_rows * slot, dtype=torch.uint8, pin_memory=cfg.device.type == "cuda")
                devbuf = torch.zeros(staging_rows * slot, dtype=torch.uint8, device=cfg.device)
                for to_dev, nm in ((True, "h2d"), (False, "d2h")):
                    t = copy_rate(cfg.device, pinned, devbuf, L.block_bytes, to_dev, cfg.raw_seconds)
                    self.add(Case(f"{L.name} pinned {nm}", "copy", L.name, t, info={"what": self.copy_what()}))
                del devbuf, pinned
                t = memcpy_rate(MEMCPY_BYTES if not cfg.quick else 16 * MiB, os.cpu_count() or 1, cfg.raw_seconds)
                self.add(Case(f"{L.name} host memcpy", "copy", L.name, t))
                if L.name == SEAM_LAYOUT:
                    self.seam(L, caches, ref, host.view(staging_rows, slot))
            finally:
                self.dev.unpin(host)
                del host
            perm = rng.permutation(n) if cfg.slots == "random" else np.arange(n)
            load_order = rng.permutation(n) if cfg.slots == "random" else np.arange(n)
            store_jobs, load_jobs = make_jobs(n, perm, load_order, max(1, cfg.job_bytes // L.block_bytes))
            for mode in cfg.modes:
                for seal in cfg.seals:
                    self.disk(L, caches, ref, [os.path.join(work[0], "kv.bin")], mode, seal, store_jobs, load_jobs,
                              prefix=f"{L.name} {mode} {seal}", warm_load=True)
            self.dram(L, caches, ref, store_jobs, load_jobs)
            if L.name == SEAM_LAYOUT:
                one_disk = [os.path.join(work[0], f"p{i}", "kv.bin") for i in range(2)]
                for p in one_disk:
                    os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
                self.disk(L, caches, ref, one_disk, "direct", DEFAULT_SEAL, store_jobs, load_jobs,
                          prefix=f"{L.name} stripe 2 paths 1 disk", warm_load=False, group="stripe")
                if len(work) > 1:
                    self.multi_dir(L, caches, ref, work, store_jobs, load_jobs, slot, n)
        finally:
            del caches, ref
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()

    def copy_what(self) -> str:
        return "torch pinned copy on CUDA" if self.cfg.device.type == "cuda" else "memcpy (CPU tensors)"

    # -- kvoffload cases ---------------------------------------------------------

    def disk(self, L, caches, ref, paths, mode, seal, store_jobs, load_jobs, prefix, warm_load,
             group="disk", ceilings=None) -> None:
        cfg = self.cfg
        ceilings = ceilings or {"write": f"{L.name} raw direct-write", "read": f"{L.name} raw direct-read"}
        n = sum(len(s) for s, _ in store_jobs)
        b = DiskBackend()
        with self.profiled():  # IO threads start here: each gets its profiler
            b.init(caches, cfg.device, None, None, paths[0], n, L.block_bytes, use_page_cache=(mode == "pagecache"),
                   disk_paths=paths if len(paths) > 1 else None, encrypt=seal == "aes-gcm",
                   checksums=seal == "xxh3", io_threads=cfg.io_threads, report_load_errors=True,
                   capacity_bytes=n * round_up(L.block_bytes, 4096))
        try:
            fds = [(f.fd, f.size) for f in b.files]
            # "rewrite" runs the same stores again. A fresh slot file is fallocated, and
            # ext4 converts the unwritten extent under each first write (20-30% slower on
            # the dev VM); once slots are reused every store is an overwrite, as in the
            # raw ceiling.
            for op in ("store", "rewrite"):
                with self.profiled():
                    t, ok = run_jobs(b, store_jobs, True, cfg.device, L.block_bytes)
                ok = ok and not b.get_failed_store_slots()
                self.add(Case(f"{prefix} {op}", group, L.name, t, ceilings["write"], None,
                              {"mode": mode, "seal": seal, "store_ok": ok, "paths": len(paths)}))
            drop = drop_page_cache(fds, cfg.allow_drop_caches)
            self.drops.append({"case": prefix, "mode": mode, **drop.as_dict()})
            poison(caches)
            with self.profiled():
                t, ok = run_jobs(b, load_jobs, False, cfg.device, L.block_bytes)
            good = ok and not b.get_block_ids_with_load_errors() and verify(caches, ref)
            self.add(Case(f"{prefix} cold-load", group, L.name, t, ceilings["read"], good,
                          {"mode": mode, "seal": seal, "resident_before": drop.resident_after,
                           "paths": len(paths)}))
            if warm_load:
                resident = resident_of(fds)
                poison(caches)
                with self.profiled():
                    t, ok = run_jobs(b, load_jobs, False, cfg.device, L.block_bytes)
                good = ok and not b.get_block_ids_with_load_errors() and verify(caches, ref)
                ceil = f"{L.name} pinned h2d" if mode == "pagecache" else ceilings["read"]
                self.add(Case(f"{prefix} warm-load", group, L.name, t, ceil, good,
                              {"mode": mode, "seal": seal, "resident_before": resident}))
        finally:
            b.shutdown()

    def dram(self, L, caches, ref, store_jobs, load_jobs) -> None:
        cfg = self.cfg
        n = sum(len(s) for s, _ in store_jobs)
        b = CpuBackend()
        b.init(caches, cfg.device, None, None, n, L.block_bytes)
        try:
            with self.profiled():
                t, ok = run_jobs(b, store_jobs, True, cfg.device, L.block_bytes)
            self.add(Case(f"{L.name} dram store", "dram", L.name, t, f"{L.name} pinned d2h", None))
            poison(caches)
            with self.profiled():
                t, ok = run_jobs(b, load_jobs, False, cfg.device, L.block_bytes)
            self.add(Case(f"{L.name} dram load", "dram", L.name, t, f"{L.name} pinned h2d", ok and verify(caches, ref)))
        finally:
            b.shutdown()

    def seam(self, L, caches, ref, staging: torch.Tensor) -> None:
        """The device copy alone through ``Device.copy_to_host/copy_to_device``, as the backend
        drives it: IO-unit calls from ``io_threads`` threads, each on the stream ``bind_thread`` gives it."""
        cfg = self.cfg
        layout = BlockLayout.from_caches(caches)
        n, rows = layout.num_blocks, staging.shape[0]
        unit = max(1, DEFAULT_IO_UNIT_BYTES // staging.shape[1])  # rows per call, as the backend's units
        threads = cfg.io_threads or DEFAULT_IO_THREADS
        d2h = Timed(0, 0.0, 0.0)
        h2d = Timed(0, 0.0, 0.0)

        def copy_units(k: int, ids: list[int], is_store: bool) -> None:
            stream = self.dev.bind_thread(None, layout, unit)
            event = self.dev.new_event()  # one per thread, re-recorded: its stream is in order
            ev = None
            for u in range(k * unit, len(ids), threads * unit):
                blk = ids[u : u + unit]
                r = list(range(u, u + len(blk)))
                if is_store:
                    ev = self.dev.copy_to_host(stream, layout, blk, staging, r, event=event)
                else:
                    ev = self.dev.copy_to_device(stream, layout, staging, r, blk, event=event)
            if ev is not None:
                ev.synchronize()

        for c0 in range(0, n, rows):  # staging-sized chunks; each timed per direction
            ids = list(range(c0, min(n, c0 + rows)))
            for is_store, acc in ((True, d2h), (False, h2d)):
                if not is_store:
                    poison_blocks(caches, ids)
                sw = Stopwatch(cfg.device)
                with self.profiled(), sw:
                    ts = [threading.Thread(target=copy_units, args=(k, ids, is_store)) for k in range(threads)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                acc.nbytes += len(ids) * L.block_bytes
                acc.seconds += sw.seconds
                acc.cpu_seconds += sw.cpu_seconds
        good = verify(caches, ref)
        info = {"rows_per_call": unit, "threads": threads}
        self.add(Case(f"{L.name} seam d2h", "seam", L.name, d2h, f"{L.name} pinned d2h", None, info))
        self.add(Case(f"{L.name} seam h2d", "seam", L.name, h2d, f"{L.name} pinned h2d", good, info))

    def multi_dir(self, L, caches, ref, work, store_jobs, load_jobs, slot, n) -> None:
        """Stripe over every --dir, against all of them driven at once by the raw loop."""
        cfg = self.cfg
        per = round_up(-(-n // len(work)) * slot, 4096) + 8192
        raws = [RawFile(d, per) for d in work]
        try:
            for r in raws:
                r.fill()
            qd = next(c.timed.detail["qd"] for c in reversed(self.cases) if c.name == f"{L.name} raw direct-write")
            for kind, is_write in (("direct-write", True), ("direct-read", False)):
                t = run_io(raws, [r.direct_fd for r in raws], slot, qd, is_write, cfg.raw_seconds)
                t.detail["dirs"] = len(work)
                self.add(Case(f"{L.name} raw {kind} {len(work)} dirs", "raw", L.name, t))
        finally:
            for r in raws:
                r.close()
        paths = [os.path.join(d, "kv.bin") for d in work]
        self.disk(L, caches, ref, paths, "direct", DEFAULT_SEAL, store_jobs, load_jobs,
                  prefix=f"{L.name} stripe {len(work)} dirs", warm_load=False, group="stripe",
                  ceilings={"write": f"{L.name} raw direct-write {len(work)} dirs",
                            "read": f"{L.name} raw direct-read {len(work)} dirs"})

    @contextlib.contextmanager
    def profiled(self):
        if self.prof is None:
            yield
            return
        self.prof.start()
        try:
            yield
        finally:
            self.prof.stop()


# --- data -----------------------------------------------------------------------------


def make_caches(device, n, tensor_bytes, seed) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random int8 caches ``[n, bytes]`` per tensor, and a copy to compare loads against."""
    g = torch.Generator(device=device).manual_seed(seed)
    caches = {
        f"layer{i}": torch.randint(-128, 128, (n, b), dtype=torch.int8, device=device, generator=g)
        for i, b in enumerate(tensor_bytes)
    }
    return caches, {k: v.clone() for k, v in caches.items()}


def poison(caches) -> None:
    # Any block a load skipped then differs from the reference.
    for t in caches.values():
        t.fill_(0x5A)


def poison_blocks(caches, ids) -> None:
    idx = torch.as_tensor(ids, dtype=torch.long, device=next(iter(caches.values())).device)
    for t in caches.values():
        t.index_fill_(0, idx, 0x5A)


def verify(caches, ref) -> bool:
    return all(torch.equal(caches[k], ref[k]) for k in caches)


def make_jobs(n, perm, load_order, per_job) -> tuple[list, list]:
    """Store jobs (blocks -> slots perm[b]) in block order; load jobs back, in ``load_order``."""
    store = [(list(range(i, min(n, i + per_job))), [int(perm[b]) for b in range(i, min(n, i + per_job))])
             for i in range(0, n, per_job)]
    load = []
    for i in range(0, n, per_job):
        blocks = [int(b) for b in load_order[i : i + per_job]]
        load.append(([int(perm[b]) for b in blocks], blocks))
    return store, load


def run_jobs(backend, jobs, is_store, device, block_bytes) -> tuple[Timed, bool]:
    """Launch every job at once (as a busy scheduler step would), then wait for all."""
    events: list = []
    sw = Stopwatch(device)
    with sw:
        for k, (src, dst) in enumerate(jobs):
            backend.launch_copy(src, dst, is_store, k, events)
        for _, ev in events:
            ev.synchronize()
    # JobEvent has .ok; the DRAM backend's CUDA events fail only by raising.
    ok = all(getattr(ev, "ok", True) is not False for _, ev in events)
    return Timed(sum(len(s) for s, _ in jobs) * block_bytes, sw.seconds, sw.cpu_seconds), ok


# --- profiling --------------------------------------------------------------------


class ThreadProfiler:
    """cProfile of the main thread and of every thread started while it is on.

    Python 3.12+ profiles all threads from one ``cProfile.Profile`` (it sits on
    sys.monitoring, which is per interpreter); before 3.12 each new thread gets its
    own profiler through ``threading.setprofile`` and the stats are merged.
    """

    def __init__(self) -> None:
        self.main = cProfile.Profile()
        self.threads: list[cProfile.Profile] = []
        self.lock = threading.Lock()
        self.per_thread = sys.version_info < (3, 12)

    def _hook(self, frame, event, arg) -> None:
        p = cProfile.Profile()
        with self.lock:
            self.threads.append(p)
        p.enable()

    def start(self) -> None:
        if self.per_thread:
            threading.setprofile(self._hook)
        self.main.enable()

    def stop(self) -> None:
        self.main.disable()
        if self.per_thread:
            threading.setprofile(None)

    def dump(self, path: str) -> pstats.Stats:
        st = pstats.Stats(self.main)
        with self.lock:
            for p in self.threads:
                try:
                    st.add(p)
                except TypeError:  # a thread that never made a call
                    pass
        st.dump_stats(path)
        return st


# --- sizing, summary, output ----------------------------------------------------------


def probe_bytes(cfg: Config, work: list[str]) -> int:
    """Bytes per case so that a case takes about ``case_seconds`` at this disk's rate.

    A 512 MiB O_DIRECT write and read at 4 MiB, queue depth 8; the slower of the two
    sets the size, clamped to [256 MiB, 4 GiB] and to what memory and disk hold.
    """
    f = RawFile(work[0], 512 * MiB)
    try:
        sw = Stopwatch(torch.device("cpu"))
        with sw:
            f.fill()
        w = f.size / sw.seconds
        r = run_io([f], [f.direct_fd], 4 * MiB, 8, False, 0.3).gib_s * GiB
    finally:
        f.close()
    want = int(min(w, r) * cfg.case_seconds)
    # The raw file and a slot file exist at once; caches + reference (+ DRAM slots) sit in memory.
    disk_cap = shutil.disk_usage(work[0]).free // 4
    mem_cap = _mem_available() // (6 if cfg.device.type == "cpu" else 3)
    return max(min(want, 4 * GiB, disk_cap, mem_cap), min(256 * MiB, disk_cap, mem_cap))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


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


def summarize(runs: list[list[Case]]) -> list[dict]:
    """One row per case: best and worst GiB/s over the runs, ratio to the same run's ceiling."""
    rows = []
    for c0 in runs[0]:
        per_run = []
        for cases in runs:
            by_name = {c.name: c for c in cases}
            c = by_name[c0.name]
            ceil = by_name.get(c.ceiling) if c.ceiling else None
            ratio = c.timed.gib_s / ceil.timed.gib_s if ceil and ceil.timed.gib_s > 0 else None
            per_run.append((c, ratio))
        best_c, best_ratio = max(per_run, key=lambda x: x[0].timed.gib_s)
        gib = best_c.timed.nbytes / GiB
        checks = [c.verified for c, _ in per_run]
        rows.append({
            "case": c0.name,
            "group": c0.group,
            "layout": c0.layout,
            "bytes": best_c.timed.nbytes,
            "gib_s_best": round(best_c.timed.gib_s, 4),
            "gib_s_worst": round(min(c.timed.gib_s for c, _ in per_run), 4),
            "ceiling": c0.ceiling,
            "ratio": None if best_ratio is None else round(best_ratio, 4),
            "cpu_s_per_gib": round(best_c.timed.cpu_seconds / gib, 4) if gib else None,
            "verified": None if checks[0] is None else all(checks),
            "detail": {**best_c.timed.detail, **best_c.info},
        })
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'case':<42} {'GiB/s':>8} {'worst':>8} {'ratio':>6}  {'of ceiling':<31} {'CPU s/GiB':>9}  check"
    out = [head, "-" * len(head)]
    layout = None
    for r in rows:
        if r["layout"] != layout and layout is not None:
            out.append("")
        layout = r["layout"]
        name = r["case"]
        if r["group"] == "raw" and "qd" in r["detail"]:
            name += f" (qd {r['detail']['qd']})"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        check = {None: "-", True: "ok", False: "FAIL"}[r["verified"]]
        out.append(
            f"{name:<42} {r['gib_s_best']:8.2f} {r['gib_s_worst']:8.2f} {ratio:>6}  {(r['ceiling'] or ''):<31} "
            f"{(r['cpu_s_per_gib'] or 0):9.3f}  {check}"
        )
    return "\n".join(out)


def drop_summary(drops: list[dict]) -> str:
    fadv = sorted({d["fadvise"] for d in drops})
    glob = sorted({d["drop_caches"] for d in drops})
    res = [d["resident_after"] for d in drops if d["resident_after"] is not None]
    worst = f"{max(res) * 100:.1f}%" if res else "unknown"
    return (f"page cache before cold loads: fsync+fadvise(DONTNEED) {', '.join(fadv)}; "
            f"/proc/sys/vm/drop_caches {', '.join(glob)}; most still resident after: {worst}")


def parse_layouts(names: str, custom: list[str]) -> list[Layout]:
    out = []
    for n in [x for x in names.split(",") if x]:
        if n not in LAYOUTS:
            raise SystemExit(f"unknown layout {n!r}: pick from {', '.join(LAYOUTS)}")
        out.append(LAYOUTS[n])
    for spec in custom:
        try:
            name, shape = spec.split(":")
            count, nbytes = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layout {spec!r}: want NAME:TENSORSxBYTES, e.g. big:80x65536") from None
        out.append(Layout(name, (nbytes,) * count, f"custom: {count} tensors x {nbytes} B"))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvoffload.bench", description=__doc__.splitlines()[0])
    p.add_argument("--dir", action="append", default=None,
                   help="directory for the files (repeat to stripe over several; default: the current directory)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--layout", action="append", default=[], metavar="NAME:TENSORSxBYTES",
                   help="add a layout, e.g. big:80x65536 (repeatable)")
    p.add_argument("--gib", type=float, default=None,
                   help="GiB moved per case (default: sized so a case takes about --case-seconds, at most 4)")
    p.add_argument("--max-blocks", type=int, default=16384,
                   help="at most this many blocks per case (16384: 1 GiB of 64 KiB blocks)")
    p.add_argument("--case-seconds", type=float, default=1.5, help="target seconds per case when sizing (1.5)")
    p.add_argument("--raw-seconds", type=float, default=0.4, help="seconds per raw queue depth / copy ceiling (0.4)")
    p.add_argument("--modes", default="direct,pagecache", help="comma list of direct, pagecache")
    p.add_argument("--seals", default="aes-gcm,xxh3,off",
                   help="comma list of how slots are sealed: aes-gcm (the default: encrypted), xxh3 (checksums), off")
    p.add_argument("--job-mib", type=float, default=32, help="MiB per launch_copy job (32)")
    p.add_argument("--io-threads", type=int, default=None, help="DiskBackend io_threads (IO threads per lane) (default: the backend's)")
    p.add_argument("--slots", choices=("random", "sequential"), default="random",
                   help="slot placement: random (a warm free list, one IO per block) or sequential")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--runs", type=int, default=1, help="repeat everything N times; report best and worst")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="never write /proc/sys/vm/drop_caches (fadvise only)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, every figure, every byte checked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--profile", metavar="FILE", help="write a cProfile (pstats) of the kvoffload cases")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    layouts = parse_layouts(a.layouts, a.layout)
    modes = [m for m in a.modes.split(",") if m]
    if not layouts or any(m not in ("direct", "pagecache") for m in modes) or not modes:
        raise SystemExit("--modes: a comma list of direct, pagecache; --layouts must not be empty")
    seals = [x for x in a.seals.split(",") if x]
    if not seals or any(x not in SEALS for x in seals):
        raise SystemExit(f"--seals: a comma list of {', '.join(SEALS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    if a.runs < 1:
        raise SystemExit("--runs must be >= 1")
    cfg = Config(
        device=device, dirs=a.dir or [os.getcwd()], layouts=layouts, modes=modes, seals=seals,
        case_bytes=int(a.gib * GiB) if a.gib else (8 * MiB if a.quick else None),
        case_seconds=a.case_seconds, raw_seconds=0.02 if a.quick else a.raw_seconds,
        job_bytes=int((2 if a.quick else a.job_mib) * MiB), io_threads=a.io_threads, slots=a.slots,
        allow_drop_caches=not a.no_drop_caches, quick=a.quick, seed=a.seed, max_blocks=a.max_blocks,
    )
    work = [tempfile.mkdtemp(prefix=".kvoffload-bench-", dir=d) for d in cfg.dirs]
    prof = ThreadProfiler() if a.profile else None
    runs: list[list[Case]] = []
    drops: list[dict] = []
    leftovers: list[str] = []
    try:
        nbytes = cfg.case_bytes if cfg.case_bytes is not None else probe_bytes(cfg, work)
        sizes = {L.name: max(L.block_bytes, nbytes) for L in layouts}
        print(f"kvoffload bench: {nbytes / MiB:.0f} MiB per case, {a.runs} run(s), device {device}",
              file=sys.stderr)
        for i in range(a.runs):
            b = Bench(cfg, prof)
            b.run(i, sizes, work)
            runs.append(b.cases)
            drops.extend(b.drops)
    finally:
        for w in work:
            for root, dirs, files in os.walk(w):
                leftovers += [os.path.join(root, f) for f in files]
            shutil.rmtree(w, ignore_errors=True)
    rows = summarize(runs)
    ok = all(r["verified"] is not False for r in rows) and not leftovers
    if prof is not None:
        st = prof.dump(a.profile)
        if not a.json:
            st.stream = sys.stderr
            st.sort_stats("tottime").print_stats(20)
    machine = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dirs": [{"path": d, "fs": fs_type(d)} for d in cfg.dirs],
    }
    result = {
        "machine": machine,
        "config": {
            "device": str(device), "runs": a.runs, "quick": a.quick, "bytes_per_case": nbytes,
            "layouts": {L.name: {"block_bytes": L.block_bytes, "tensors": len(L.tensor_bytes), "note": L.note}
                        for L in layouts},
            "modes": modes, "seals": seals, "slots": cfg.slots, "job_bytes": cfg.job_bytes,
            "io_threads": cfg.io_threads, "queue_depths": list(QUEUE_DEPTHS), "raw_seconds": cfg.raw_seconds,
        },
        "cache_drop": {"summary": drop_summary(drops), "cases": drops},
        "cases": rows,
        "leftover_files": leftovers,
        "all_verified": all(r["verified"] is not False for r in rows),
        "ok": ok,
    }
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        fs = ", ".join(f"{d['path']} ({d['fs']})" for d in machine["dirs"])
        print(f"kvoffload bench on {machine['device']}, {machine['cpus']} CPUs, torch {machine['torch']}; "
              f"files in {fs}")
        print(f"{nbytes / MiB:.0f} MiB per case, {a.runs} run(s), slots {cfg.slots}, "
              f"{cfg.job_bytes / MiB:g} MiB per job; raw = best of queue depths {list(QUEUE_DEPTHS)}")
        print(drop_summary(drops))
        if leftovers:
            print(f"LEFT BEHIND: {leftovers}")
        print("ratio: store / raw direct-write, load / raw direct-read, page-cache warm load and DRAM load / "
              "pinned h2d, DRAM store / pinned d2h")
        print()
        print(table(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
