"""The cases of one bench run: what a case is (``Case``), what the run measures (``Config``)
and the run itself (``Bench``): per layout the ceilings, then kvoffload's disk, stripe,
DRAM, seam and metric-cost cases next to them. ``suite.py`` is its command line."""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from kvoffload import native_engine
from kvoffload.bench import engine
from kvoffload.bench.ceilings import (
    RawFile, Stopwatch, Timed, copy_rate, drop_page_cache, memcpy_rate, resident_of, run_all_threads, sweep, warm,
)
from kvoffload.bench.dram_backend import CpuBackend
from kvoffload.bench.seal_rate import seal_rate
from kvoffload.bench.sizing import blocks_for, raw_bytes
from kvoffload.bench.workload import Layout, make_caches, make_jobs, passes, poison, poison_blocks, run_jobs, verify
from kvoffload.device import BlockLayout, alloc_host, make_device
from kvoffload.disk_backend import DEFAULT_IO_THREADS, DiskBackend, default_io_threads, default_io_unit_bytes
from kvoffload.slot_file import round_up
from kvoffload.slot_seal import SEALS as SEAL_CLASSES

GiB = 2**30
MiB = 2**20
# Larger than the last-level cache (300 MiB on the H200 host), so the copy reaches DRAM.
MEMCPY_BYTES = GiB
# A page-cache load moves each byte through host memory 3 times (the kernel reads the
# page cache and writes staging, the DMA reads staging); a memcpy moves it 2 times.
HOST_BOUND_SHARE = 2 / 3
HOST_BOUND_FORMULA = ("host-memory bound = 2/3 x host memcpy (a page-cache load moves each byte through host "
                      "memory 3 times: kernel reads the page cache, writes staging, DMA reads staging; memcpy 2)")
# How the backend seals slots by default (its init's encrypt=True).
DEFAULT_SEAL = "aes-gcm"
SEALS = tuple(SEAL_CLASSES)
GROUPS = ("disk", "stripe", "dram", "seam", "seal", "engine", "metrics")
DISK_OPS = ("store", "rewrite", "cold-load", "warm-load")


@dataclass
class Case:
    """One measured case of one run."""

    name: str  # unique within a run, e.g. "llama direct aes-gcm cold-load"
    group: str  # raw | copy | seal | disk | stripe | dram | seam
    layout: str
    timed: Timed
    ceilings: tuple[str, ...] = ()  # cases of the same run it is compared with; the first is the main one
    verified: Optional[bool] = None  # None where nothing is loaded back
    info: dict = field(default_factory=dict)


@dataclass
class Config:
    device: torch.device
    dirs: list[str]
    layouts: list[Layout]
    modes: list[str]
    seals: list[str]
    only: frozenset[str]
    case_bytes: Optional[int]  # None: sized from a probe
    case_seconds: float  # every case is timed over at least this long (0: one pass)
    raw_seconds: float  # per queue depth of a raw sweep
    job_bytes: int
    io_threads: Optional[int]
    io_unit_bytes: Optional[int]  # None: the backend's default
    slots: str
    allow_drop_caches: bool
    quick: bool
    seed: int
    max_blocks: int = 16384
    dram_streams: tuple[int, ...] = (1,)
    engine_seconds: float = 1.0  # per segment of an engine case
    engine_paths: tuple[str, ...] = engine.PATHS
    engine_shares: tuple[float, ...] = engine.SHARES
    engine_min_repeats: int = 3
    engine_max_repeats: int = 8
    engine_switch_ms: Optional[float] = None  # sys.setswitchinterval for the engine group
    engine_tier_unit_bytes: Optional[int] = None  # the tier path's io_unit_bytes (None: the tier's default)
    metrics_pairs: int = 5  # on/off load pairs of the metrics group
    io_paths: tuple[str, ...] = ("auto",)  # the backend's IO path per disk case: auto, native, python

    @property
    def ceiling_seconds(self) -> float:
        return max(self.case_seconds, self.raw_seconds)

    @property
    def threads(self) -> int:
        """IO threads per lane the backend runs with (its default where none is given)."""
        return self.io_threads or DEFAULT_IO_THREADS

    def threads_for(self, paths: int) -> int:
        """The backend's IO threads per lane over ``paths`` disk paths (its default where none is given)."""
        return self.io_threads or default_io_threads(paths)

    def unit_bytes(self, paths: int) -> int:
        """The backend's io_unit_bytes over ``paths`` disk paths (its default where none is given)."""
        return self.io_unit_bytes or default_io_unit_bytes(paths, self.threads_for(paths))


# --- the run ------------------------------------------------------------------------


class Bench:
    def __init__(self, cfg: Config, profiler: Optional["ThreadProfiler"], drops: list[dict]) -> None:
        self.cfg = cfg
        self.prof = profiler
        self.cases: list[Case] = []
        self.drops = drops  # what each page-cache drop before a cold load did
        self.dev = make_device(cfg.device)

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def add(self, case: Case) -> Case:
        self.cases.append(case)
        t = case.timed
        v = "" if case.verified is None else f"  verified={case.verified}"
        self.log(f"  {case.name:<44} {t.gib_s:8.2f} GiB/s  {t.nbytes / MiB:9.1f} MiB in {t.seconds:6.3f} s{v}")
        return case

    def run(self, run_idx: int, nbytes: int, work: list[str]) -> None:
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + run_idx)
        if "seal" in cfg.only:
            with self.profiled():
                self.seal_rates()
        raw = None
        if cfg.only & {"disk", "stripe"}:
            size = max(raw_bytes(blocks_for(nbytes, L.block_bytes, cfg.max_blocks), L.block_bytes)
                       for L in cfg.layouts)
            self.log(f"run {run_idx + 1}: raw scratch file of {size / MiB:.0f} MiB in {work[0]}")
            raw = RawFile(work[0], size)
        try:
            if raw is not None:
                raw.fill()
                warm([raw])
            for i, L in enumerate(cfg.layouts):
                self.run_layout(L, nbytes, raw, work, rng, stripe_here=i == 0)
        finally:
            if raw is not None:
                raw.close()

    def run_layout(self, L: Layout, nbytes: int, raw: Optional[RawFile], work: list[str], rng,
                   stripe_here: bool) -> None:
        cfg = self.cfg
        n = blocks_for(nbytes, L.block_bytes, cfg.max_blocks)
        slot = round_up(L.block_bytes, 4096)
        self.log(f"{L.name}: {n} blocks of {L.block_bytes} B ({L.note})")
        if raw is not None:  # the drive's ceilings at this block size
            kinds = ("direct-write", "direct-read") + (("buffered-read",) if "disk" in cfg.only else ())
            for kind in kinds:
                io = L.block_bytes if kind == "buffered-read" else slot
                t = sweep([raw], io, kind, cfg.raw_seconds, cfg.case_seconds)
                self.add(Case(f"{L.name} raw {kind}", "raw", L.name, t))
        caches, ref = make_caches(cfg.device, n, L.tensor_bytes, int(rng.integers(1 << 31)))
        try:
            self.copies(L, n, slot)
            if "seam" in cfg.only:
                self.seam(L, caches, ref, n, slot)
            perm = rng.permutation(n) if cfg.slots == "random" else np.arange(n)
            load_order = rng.permutation(n) if cfg.slots == "random" else np.arange(n)
            jobs = make_jobs(n, perm, load_order, max(1, cfg.job_bytes // L.block_bytes))
            ceil = {"write": (f"{L.name} raw direct-write",), "read": (f"{L.name} raw direct-read",)}
            if "disk" in cfg.only:
                for mode in cfg.modes:
                    for seal in cfg.seals:
                        for io_path in cfg.io_paths:
                            self.disk(L, caches, ref, [os.path.join(work[0], "kv.bin")], mode, seal, jobs,
                                      f"{L.name} {mode} {seal}{path_label(cfg, io_path)}", "disk", 1, ceil,
                                      warm_load=True, io_path=io_path)
            if "dram" in cfg.only:
                self.dram(L, caches, ref, jobs)
            if "metrics" in cfg.only:
                for mode in cfg.modes:
                    self.metrics_cost(L, caches, ref, work[0], mode, jobs)
            if "stripe" in cfg.only and stripe_here:
                self.stripe(L, caches, ref, work, jobs, n, slot, ceil)
        finally:
            del caches, ref
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()

    # -- ceilings beside the disk ---------------------------------------------------

    def copies(self, L: Layout, n: int, slot: int) -> None:
        """Pinned copies at the block size, host memcpy, and the page-cache load's bound."""
        cfg = self.cfg
        rows = max(1, min(n, GiB // slot))
        # torch's own pinned allocator: the ceiling, not the backend's registered staging.
        pinned = torch.zeros(rows * slot, dtype=torch.uint8, pin_memory=cfg.device.type == "cuda")
        devbuf = torch.zeros(rows * slot, dtype=torch.uint8, device=cfg.device)
        what = "torch pinned copy on CUDA" if cfg.device.type == "cuda" else "memcpy (CPU tensors)"
        for to_dev, nm in ((True, "h2d"), (False, "d2h")):
            t = copy_rate(cfg.device, pinned, devbuf, L.block_bytes, to_dev, cfg.ceiling_seconds)
            self.add(Case(f"{L.name} pinned {nm}", "copy", L.name, t, info={"what": what}))
        del devbuf, pinned
        threads = os.cpu_count() or 1
        t = memcpy_rate(16 * MiB if cfg.quick else MEMCPY_BYTES, threads, cfg.ceiling_seconds)
        self.add(Case(f"{L.name} host memcpy", "copy", L.name, t))
        bound = Timed(int(t.nbytes * HOST_BOUND_SHARE), t.seconds, t.cpu_seconds,
                      {"formula": HOST_BOUND_FORMULA, "share": round(HOST_BOUND_SHARE, 4), "threads": threads})
        self.add(Case(f"{L.name} host-memory bound", "copy", L.name, bound, (f"{L.name} host memcpy",)))

    def seal_rates(self) -> None:
        """Each seal alone on 2 MiB buffers, 1 thread and N (the backend's threads per lane,
        at most the CPUs): N / 1 is how far the library's work runs outside the GIL. AES-GCM
        twice, interleaved: the native core's own and cryptography's (the Python path's)."""
        cfg = self.cfg
        many = max(1, min(os.cpu_count() or 1, cfg.threads))
        for seal in cfg.seals:
            if seal == "off":
                continue
            impls = [("python", "")] + ([("native", " native")] if seal == "aes-gcm" and native_engine.cipher_available() else [])
            for impl, label in impls:
                one = self.add(Case(f"seal {seal}{label} 1 thread", "seal", "seal",
                                    seal_rate(seal, 1, cfg.ceiling_seconds, impl), info={"seal": seal, "threads": 1,
                                                                                         "impl": impl}))
                if many > 1:
                    t = seal_rate(seal, many, cfg.ceiling_seconds, impl)
                    scaling = t.gib_s / one.timed.gib_s if one.timed.gib_s > 0 else 0.0
                    self.add(Case(f"seal {seal}{label} {many} threads", "seal", "seal", t, (one.name,),
                                  info={"seal": seal, "threads": many, "scaling": round(scaling, 3), "ideal": many,
                                        "impl": impl}))

    # -- kvoffload cases ---------------------------------------------------------

    def disk(self, L: Layout, caches, ref, paths: list[str], mode: str, seal: str, jobs, prefix: str, group: str,
             drives: int, ceil: dict, warm_load: bool, io_path: str = "auto") -> None:
        """First store into a fresh file, rewrite, cold load, warm load; each over at least
        --case-seconds (a first store repeats on a new backend, so it is always a first store)."""
        cfg = self.cfg
        store_jobs, load_jobs = jobs
        n = sum(len(s) for s, _ in store_jobs)
        geometry = {
            "mode": mode, "seal": seal, "paths": len(paths), "drives": drives, "blocks": n,
            "block_bytes": L.block_bytes, "jobs": len(store_jobs), "job_bytes": len(store_jobs[0][0]) * L.block_bytes,
            "io_threads": cfg.threads_for(len(paths)), "io_unit_bytes": cfg.unit_bytes(len(paths)),
        }
        backend: Optional[DiskBackend] = None
        oks: list[bool] = []

        def one_pass(is_store: bool) -> Timed:
            with self.profiled():
                t, ok = run_jobs(backend, store_jobs if is_store else load_jobs, is_store, cfg.device, L.block_bytes)
            if is_store:
                oks.append(ok and not backend.get_failed_store_slots())
            else:
                oks.append(ok and not backend.get_block_ids_with_load_errors() and verify(caches, ref))
            return t

        def first_store() -> Timed:
            nonlocal backend
            if backend is not None:
                backend.shutdown()
                backend = None
            b = DiskBackend()
            with self.profiled():  # IO threads start here: each gets its profiler
                b.init(caches, cfg.device, None, None, paths[0], n, L.block_bytes,
                       use_page_cache=mode == "pagecache", disk_paths=paths if len(paths) > 1 else None,
                       encrypt=seal == "aes-gcm", checksums=seal == "xxh3", io_threads=cfg.io_threads,
                       io_unit_bytes=cfg.io_unit_bytes, report_load_errors=True,
                       native_io={"auto": None, "native": True, "python": False}[io_path],
                       capacity_bytes=n * round_up(L.block_bytes, 4096))
            geometry["io_path"] = b.stats()["io_path"]
            backend = b
            return one_pass(True)

        def case(op: str, t: Timed, ceilings: tuple[str, ...], verified: Optional[bool], **extra) -> None:
            info = {**geometry, "op": op, **extra}
            if op == "store":
                info["store_ok"] = all(oks)
            self.add(Case(f"{prefix} {op}", group, L.name, t, ceilings, verified, info))
            oks.clear()

        try:
            t = passes(cfg.case_seconds, first_store)
            geometry["slot_bytes"] = backend.files[0].slot_bytes
            # ext4 and XFS convert each fallocated (unwritten) extent on its first write;
            # the rewrite overwrites, as every store does once slots are reused and as the raw ceiling does.
            case("store", t, ceil["write"] + (f"{prefix} rewrite",), None)
            t = passes(cfg.case_seconds, lambda: one_pass(True))
            case("rewrite", t, ceil["write"], None, store_ok=all(oks))
            fds = [(f.fd, f.size) for f in backend.files]
            resident: list[Optional[float]] = []

            def cold() -> Timed:
                drop = drop_page_cache(fds, cfg.allow_drop_caches)
                self.drops.append({"case": prefix, "mode": mode, **drop.as_dict()})
                resident.append(drop.resident_after)
                poison(caches)
                return one_pass(False)

            t = passes(cfg.case_seconds, cold)
            case("cold-load", t, ceil["read"], all(oks),
                 resident_before=None if None in resident else max(resident))
            if warm_load:
                before = resident_of(fds)

                def warm_pass() -> Timed:
                    poison(caches)
                    return one_pass(False)

                t = passes(cfg.case_seconds, warm_pass)
                ceilings = ((f"{L.name} host-memory bound", f"{L.name} pinned h2d") if mode == "pagecache"
                            else ceil["read"])
                case("warm-load", t, ceilings, all(oks), resident_before=before)
        finally:
            if backend is not None:
                backend.shutdown()

    def metrics_cost(self, L: Layout, caches, ref, directory: str, mode: str, jobs) -> None:
        """Load throughput with metric collection on and off (``DiskBackend.collect_metrics``):
        one backend, stored once, then its loads timed with collection on and off in turn,
        the order alternating, --metrics-pairs times; each timing over --case-seconds. The
        same file, staging and threads for both, so only the collection differs. With it
        on, the metrics are taken after every pass, as vLLM's worker does every step. The
        process's CPU seconds per GiB are compared too: on a shared machine they move far
        less than the rates."""
        cfg = self.cfg
        store_jobs, load_jobs = jobs
        n = sum(len(s) for s, _ in store_jobs)
        rates: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}  # process CPU seconds per GiB loaded
        totals = {on: Timed(0, 0.0, 0.0) for on in (True, False)}
        b = DiskBackend()
        b.init(caches, cfg.device, None, None, os.path.join(directory, "metrics.bin"), n, L.block_bytes,
               use_page_cache=mode == "pagecache", encrypt=DEFAULT_SEAL == "aes-gcm", io_threads=cfg.io_threads,
               io_unit_bytes=cfg.io_unit_bytes, report_load_errors=True, capacity_bytes=n * round_up(L.block_bytes, 4096))
        try:
            _, ok = run_jobs(b, store_jobs, True, cfg.device, L.block_bytes)
            oks = [ok]

            def load() -> Timed:
                poison(caches)
                with self.profiled():
                    t, ok = run_jobs(b, load_jobs, False, cfg.device, L.block_bytes)
                b.take_metrics()
                oks.append(ok and not b.get_block_ids_with_load_errors() and verify(caches, ref))
                return t

            for i in range(cfg.metrics_pairs):
                for on in (True, False) if i % 2 == 0 else (False, True):
                    b.collect_metrics = on
                    t = passes(cfg.case_seconds, load)
                    rates[on].append(t.gib_s)
                    cpu[on].append(t.cpu_seconds / (t.nbytes / GiB))
                    for f in ("nbytes", "seconds", "cpu_seconds"):
                        setattr(totals[on], f, getattr(totals[on], f) + getattr(t, f))
        finally:
            b.shutdown()
        ratios = [a / b for a, b in zip(rates[True], rates[False])]
        cpu_ratios = [a / b for a, b in zip(cpu[True], cpu[False])]
        info = {"mode": mode, "seal": DEFAULT_SEAL, "blocks": n, "block_bytes": L.block_bytes, "pairs": len(ratios),
                "io_threads": cfg.threads_for(1), "io_unit_bytes": cfg.unit_bytes(1)}
        prefix = f"{L.name} {mode} metrics"
        self.add(Case(f"{prefix} off load", "metrics", L.name, totals[False], (), all(oks),
                      {**info, "collect": False, "gib_s_per_pair": [round(r, 4) for r in rates[False]]}))
        self.add(Case(f"{prefix} on load", "metrics", L.name, totals[True], (f"{prefix} off load",), all(oks),
                      {**info, "collect": True, "gib_s_per_pair": [round(r, 4) for r in rates[True]],
                       "on_off": _spread(ratios), "cpu_s_per_gib_on_off": _spread(cpu_ratios)}))
        self.log(f"  {prefix}: on {statistics.median(rates[True]):.3f} GiB/s, off {statistics.median(rates[False]):.3f}"
                 f" GiB/s (medians of {len(ratios)}); on/off median {statistics.median(ratios):.4f}, "
                 f"min {min(ratios):.4f}, max {max(ratios):.4f}; CPU s/GiB on/off median "
                 f"{statistics.median(cpu_ratios):.4f}, min {min(cpu_ratios):.4f}, max {max(cpu_ratios):.4f}")

    def dram(self, L: Layout, caches, ref, jobs) -> None:
        for streams in self.cfg.dram_streams:
            self.dram_case(L, caches, ref, jobs, streams)

    def dram_case(self, L: Layout, caches, ref, jobs, streams: int) -> None:
        cfg = self.cfg
        store_jobs, load_jobs = jobs
        n = sum(len(s) for s, _ in store_jobs)
        b = CpuBackend()
        b.init(caches, cfg.device, None, None, n, L.block_bytes, streams=streams)
        oks: list[bool] = []
        name = f"{L.name} dram" + ("" if streams == 1 else f" {streams} streams")

        def one_pass(is_store: bool) -> Timed:
            if not is_store:
                poison(caches)
            with self.profiled():
                t, ok = run_jobs(b, store_jobs if is_store else load_jobs, is_store, cfg.device, L.block_bytes)
            oks.append(ok and (is_store or verify(caches, ref)))
            return t

        try:
            info = {"blocks": n, "block_bytes": L.block_bytes, "jobs": len(store_jobs), "streams": streams}
            t = passes(cfg.case_seconds, lambda: one_pass(True))
            self.add(Case(f"{name} store", "dram", L.name, t, (f"{L.name} pinned d2h",), None,
                          {**info, "op": "store"}))
            oks.clear()
            t = passes(cfg.case_seconds, lambda: one_pass(False))
            self.add(Case(f"{name} load", "dram", L.name, t, (f"{L.name} pinned h2d",), all(oks),
                          {**info, "op": "load"}))
        finally:
            b.shutdown()

    def seam(self, L: Layout, caches, ref, n: int, slot: int) -> None:
        """The device copy alone through ``Device.copy_to_host/copy_to_device``, as the backend
        drives it: IO-unit calls from its IO threads, each on the stream ``bind_thread`` gives it."""
        cfg = self.cfg
        layout = BlockLayout.from_caches(caches)
        rows = max(1, min(n, GiB // slot))
        host = alloc_host(rows * slot, 4096)
        host.zero_()
        self.dev.pin(host)
        staging = host.view(rows, slot)
        unit = max(1, cfg.unit_bytes(1) // slot)  # rows per call, as the backend's units
        threads = cfg.threads
        d2h = Timed(0, 0.0, 0.0)
        h2d = Timed(0, 0.0, 0.0)

        def copy_units(k: int, ids: list[int], is_store: bool) -> None:
            stream = self.dev.bind_thread(None, layout, unit, to_host=is_store)
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

        try:
            count = 0
            while True:
                for c0 in range(0, n, rows):  # staging-sized chunks; each timed per direction
                    ids = list(range(c0, min(n, c0 + rows)))
                    for is_store, acc in ((True, d2h), (False, h2d)):
                        if not is_store:
                            poison_blocks(caches, ids)
                        sw = Stopwatch(cfg.device)
                        with self.profiled(), sw:
                            run_all_threads([threading.Thread(target=copy_units, args=(k, ids, is_store))
                                             for k in range(threads)])
                        acc.nbytes += len(ids) * L.block_bytes
                        acc.seconds += sw.seconds
                        acc.cpu_seconds += sw.cpu_seconds
                count += 1
                if min(d2h.seconds, h2d.seconds) >= cfg.case_seconds:
                    break
        finally:
            self.dev.unpin(host)
        good = verify(caches, ref)
        info = {"rows_per_call": unit, "threads": threads, "passes": count, "blocks": n, "block_bytes": L.block_bytes}
        self.add(Case(f"{L.name} seam d2h", "seam", L.name, d2h, (f"{L.name} pinned d2h",), None, info))
        self.add(Case(f"{L.name} seam h2d", "seam", L.name, h2d, (f"{L.name} pinned h2d",), good, info))

    def load_staging(self, paths: int, slot: int) -> int:
        """Bytes of the backend's load staging over ``paths`` paths: two units per thread."""
        cfg = self.cfg
        return paths * cfg.threads_for(paths) * 2 * round_up(cfg.unit_bytes(paths), slot)

    def stripe(self, L: Layout, caches, ref, work: list[str], jobs, n: int, slot: int, ceil: dict) -> None:
        """Two files on the first drive (what more threads and files alone buy), then one file
        per --dir against all of them driven at once by the raw loop."""
        cfg = self.cfg
        two = [os.path.join(work[0], f"p{i}", "kv.bin") for i in range(2)]
        for p in two:
            os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
        # The one drive's honest read ceiling: reads cycling through as much memory as the two
        # paths' load staging (a RAM drive's read into one reused buffer is faster than any
        # pipeline can be).
        raw = RawFile(work[0], raw_bytes(n, L.block_bytes))
        try:
            raw.fill()
            t = sweep([raw], slot, "direct-read", cfg.raw_seconds, cfg.case_seconds,
                      footprint=self.load_staging(2, slot))
            self.add(Case(f"{L.name} raw direct-read cycling 1 dirs", "raw", L.name, t,
                          info={"dirs": 1, "footprint": self.load_staging(2, slot)}))
        finally:
            raw.close()
        one = {"write": ceil["write"], "read": (f"{L.name} raw direct-read cycling 1 dirs",) + ceil["read"]}
        self.disk(L, caches, ref, two, "direct", DEFAULT_SEAL, jobs, f"{L.name} stripe 2 paths 1 disk", "stripe",
                  1, one, warm_load=False)
        if len(work) < 2:
            return
        k = len(work)
        raws: list[RawFile] = []
        try:
            for d in work:
                raws.append(RawFile(d, raw_bytes(-(-n // k), L.block_bytes)))
            for r in raws:
                r.fill()
            for kind in ("direct-write", "direct-read"):
                t = sweep(raws, slot, kind, cfg.raw_seconds, cfg.case_seconds)
                self.add(Case(f"{L.name} raw {kind} {k} dirs", "raw", L.name, t, info={"dirs": k}))
            # The load's honest ceiling on RAM drives: reads into as much memory as the
            # backend's load staging (its threads' two units each, every lane).
            staging = self.load_staging(k, slot)
            t = sweep(raws, slot, "direct-read", cfg.raw_seconds, cfg.case_seconds, footprint=staging)
            self.add(Case(f"{L.name} raw direct-read cycling {k} dirs", "raw", L.name, t,
                          info={"dirs": k, "footprint": staging}))
        finally:
            for r in raws:
                r.close()
        # Against the drives together first (reads: cycling through the staging's worth
        # of memory, then into one reused buffer), then against one drive.
        agg = {"write": (f"{L.name} raw direct-write {k} dirs",) + ceil["write"],
               "read": (f"{L.name} raw direct-read cycling {k} dirs", f"{L.name} raw direct-read {k} dirs")
               + ceil["read"]}
        for seal in cfg.seals:
            for io_path in cfg.io_paths:
                self.disk(L, caches, ref, [os.path.join(d, "kv.bin") for d in work], "direct", seal, jobs,
                          f"{L.name} stripe {k} dirs {seal}{path_label(cfg, io_path)}", "stripe", k, agg,
                          warm_load=False, io_path=io_path)

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


def _spread(ratios: list[float]) -> dict:
    return {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
            "max": round(max(ratios), 4), "per_pair": [round(r, 4) for r in ratios]}


def path_label(cfg: Config, io_path: str) -> str:
    """A disk case's name suffix: its IO path where the run compares more than one."""
    return f" [{io_path}]" if len(cfg.io_paths) > 1 else ""


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
        st = pstats.Stats()  # empty: any --only selection may have profiled no thread at all
        with self.lock:
            for p in (self.main, *self.threads):
                try:
                    st.add(p)
                except TypeError:  # a profiler that saw no call
                    pass
        st.dump_stats(path)
        return st
