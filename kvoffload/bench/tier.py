"""`python -m kvoffload.bench.tier`: kvoffload's secondary tier beside vLLM's ``fs`` tier.

Both tiers are built the way ``vllm serve`` builds them, by vLLM 0.33's
``TieringOffloadingSpec.get_manager()`` (a CPU primary in shared memory and the tier from
its ``secondary_tiers`` entry), on the same directories, and driven through the same
``SecondaryTierManager`` calls the tiering manager makes: ``submit_store`` of every
chunk at once, twice (the second round, new keys of new bytes, finds kvoffload's tier full:
every store evicts and overwrites a written slot, the steady state; ``again`` in the
table), then ``submit_load`` of the second round in waves the primary can hold, polling
``get_finished_jobs`` until all are done. Every loaded byte is compared with what was
stored. Per tier: store, store again and load GiB/s, process CPU seconds per GiB (all
threads) and the files it created; beside them the raw O_DIRECT ceiling of the same directories at
the chunk size (best queue depth). ``--repeat N`` runs every case N times, each round in the
opposite order to the one before, pairs kvoffload and fs rows of one round, and gives each
ratio's median and range over the rounds. The table (or ``--json``) comes last.

vLLM's ``fs`` tier takes one ``root_dir``: with several ``--dir`` it runs on the first
one, and the row ``fs sharded`` gives it one ``fs`` tier per directory with chunks split
between them by the bench (vLLM itself would send every chunk to every tier).

``--tiers kvoffload-direct`` needs no vLLM: it drives kvoffload's ``SlotTier`` (the whole
tier under the vLLM class) over an anonymous-memory primary with the same jobs, for
hosts where vLLM cannot be installed (the GPU host here). ``--tiers fs-core`` is vLLM's
``fs`` tier there: its IO module, thread pool and compiled ``fs_io_C`` loaded from the
vLLM 0.33 wheel's files (``--fs-wheel``, ``--fs-files``, or an installed vLLM) and driven
as ``FileSystemTierManager`` drives them, on the same kind of primary
(``kvoffload/bench/fs_core.py``); ``fs-core sharded`` is one per directory. Every ``fs``
row says which IO path ran: ``C`` (the extension) or ``Python`` (its fallback, where the
extension does not load, as over a CPU-only torch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvoffload import budget, cli_args
from kvoffload.bench import fs_core
from kvoffload.bench.ceilings import RawFile, Timed, sweep
from kvoffload.cli_args import UsageError
from kvoffload.slot_file import SlotFileError
from kvoffload.vllm_tier import SlotTier, TierConfig

GiB = 2**30
MiB = 2**20
POLL_S = 0.0005  # between get_finished_jobs calls while jobs run


@dataclass
class TierRun:
    """One tier's store and load of the same chunks."""

    name: str
    dirs: list[str]
    store: Optional[Timed] = None  # the first fill: kvoffload's first writes into a fresh file
    store_again: Optional[Timed] = None  # new keys into a full tier: evictions, rewrites of written slots
    load: Optional[Timed] = None
    files: int = 0
    failed_jobs: int = 0
    verified: Optional[bool] = None
    info: dict = field(default_factory=dict)


def _vllm() -> Any:
    """vLLM's tiering classes; without them, a ``UsageError`` saying what to install."""
    try:
        from vllm.v1.kv_offload import base, config
        from vllm.v1.kv_offload.tiering import base as tiering
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    except ImportError as e:
        raise UsageError(f"--tiers kvoffload and fs need vLLM 0.33 importable (its fs tier is the baseline): {e}; "
                         "--tiers kvoffload-direct needs none") from None
    return base, config, tiering, TieringOffloadingSpec


def build_manager(tier_entries: list[dict], chunk_bytes: int, primary_chunks: int) -> Any:
    """A ``TieringOffloadingManager`` as ``vllm serve`` would build it: one rank, one
    chunk a block of ``chunk_bytes``, ``primary_chunks`` chunks of CPU primary."""
    base, config, _, spec_cls = _vllm()
    cfg = config.OffloadingConfig(
        groups=(config.OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": primary_chunks * chunk_bytes, "secondary_tiers": tier_entries},
        engine_id=f"kvoffload-tier-bench-{uuid.uuid4().hex[:12]}",
        model=config.OffloadingModelConfig(name="kvoffload-tier-bench", dtype="bfloat16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=config.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    return spec_cls(cfg).get_manager()


class Driver:
    """Submits jobs to one or more tiers (chunks split round-robin) and waits for them."""

    def __init__(self, tiers: list, chunk_bytes: int) -> None:
        base, _, tiering, _ = _vllm()
        self.tiers, self.chunk_bytes = tiers, chunk_bytes
        self._job, self._ctx, self._key = tiering.TransferJob, base.ReqContext(req_id="bench"), base.make_offload_key
        self._next_id = 0
        self.failed = 0

    def key(self, i: int) -> Any:
        # Hash-like keys, so fs spreads its files over its hash-named directories as for real prefixes.
        return self._key(fs_core.block_hash(i), 0)

    def submit(self, tier: Any, job_id: int, keys: list, chunks: np.ndarray, is_store: bool) -> None:
        job = self._job(job_id=job_id, keys=keys, chunk_ids=chunks, is_promotion=not is_store,
                        req_context=self._ctx)
        (tier.submit_store if is_store else tier.submit_load)(job)

    @staticmethod
    def finished(tier: Any) -> list:
        return list(tier.get_finished_jobs())

    def run(self, keys: list[int], chunks: list[int], is_store: bool, per_job: int) -> None:
        """Submit ``keys`` (with primary rows ``chunks``) in jobs of ``per_job``; wait for all."""
        pending: dict[int, Any] = {}
        for t, tier in enumerate(self.tiers):
            # By key, not by place in the list: a load wave must find each key in the tier that stored it.
            mine = [j for j, k in enumerate(keys) if k % len(self.tiers) == t]
            for s in range(0, len(mine), per_job):
                part = mine[s:s + per_job]
                pending[self._next_id] = tier
                self.submit(tier, self._next_id, [self.key(keys[i]) for i in part],
                            np.array([chunks[i] for i in part], dtype=np.int64), is_store)
                self._next_id += 1
        while pending:
            got = False
            for tier in self.tiers:
                for r in self.finished(tier):
                    del pending[r.job_id]
                    self.failed += not r.success
                    got = True
            if not got:
                time.sleep(POLL_S)


class DirectDriver(Driver):
    """The same jobs straight into kvoffload's ``SlotTier`` or an ``FsCoreTier``, without vLLM."""

    def __init__(self, tiers: list, chunk_bytes: int) -> None:
        self.tiers, self.chunk_bytes = tiers, chunk_bytes
        self._next_id = 0
        self.failed = 0

    def key(self, i: int) -> Any:
        return i

    def submit(self, tier: Any, job_id: int, keys: list, chunks: np.ndarray, is_store: bool) -> None:
        (tier.submit_store if is_store else tier.submit_load)(job_id, keys, chunks)

    @staticmethod
    def finished(tier: Any) -> list:
        return tier.poll()


class DirectManager:
    """What the bench needs of vLLM's tiering manager: a primary (page-aligned shared memory,
    as vLLM's CPU tier) and the tiers ``make_tiers(primary)`` builds over it."""

    def __init__(self, make_tiers: Callable[[memoryview], list], chunk_bytes: int, primary_chunks: int) -> None:
        import mmap

        self._mem = mmap.mmap(-1, primary_chunks * chunk_bytes)
        self._view = memoryview(self._mem).cast("B", (primary_chunks, chunk_bytes))
        self.primary_tier = self
        self.secondary_tiers: list = []
        try:
            self.secondary_tiers = make_tiers(self._view)
        except BaseException:
            self.shutdown()
            raise

    def get_kv_memoryview(self) -> memoryview:
        return self._view

    def shutdown(self) -> None:
        for t in self.secondary_tiers:
            t.close()
        try:
            self._view.release()
            self._mem.close()
        except BufferError:
            # Views of the primary are still alive: an exception (Ctrl-C) unwinding through
            # here holds the frames that made them. The mapping goes with the last of them;
            # closing it now would be a traceback in place of the one line that exception gets.
            pass


def timed(fn) -> Timed:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return Timed(0, time.perf_counter() - t0, time.process_time() - c0)


def count_files(dirs: list[str]) -> int:
    return sum(len(files) for d in dirs for _, _, files in os.walk(d))


def drop_caches() -> str:
    """Flush and drop the page cache (root only); say what happened."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "ok"
    except OSError as e:
        return f"not possible: {e.strerror}"


DIRECT_TIERS = ("kvoffload-direct", "fs-core")  # driven without vLLM


def run_tier(name: str, entries: list[dict], workdirs: list[str], a: argparse.Namespace, n: int,
             primary_chunks: int, chunk_bytes: int, seed: int, core: Optional[fs_core.FsCore] = None) -> TierRun:
    """Store ``n`` chunks through the tier(s), drop caches, load them back in waves; check."""
    run = TierRun(name, workdirs)
    direct = name.split()[0] in DIRECT_TIERS
    if name == "kvoffload-direct":
        manager = DirectManager(lambda view: [SlotTier(view, TierConfig.from_tier_config(entries[0]))],
                                chunk_bytes, primary_chunks)
    elif direct:
        manager = DirectManager(lambda view: _fs_core_tiers(core, view, workdirs, a.fs_threads), chunk_bytes,
                                primary_chunks)
    else:
        manager = build_manager(entries, chunk_bytes, primary_chunks)
    try:
        _store_and_load(run, manager, a, n, primary_chunks, chunk_bytes, seed, DirectDriver if direct else Driver)
        for t in manager.secondary_tiers:  # kvoffload's: the seal and IO path its backend really ran with
            slot_tier = getattr(t, "slot_tier", t)
            if isinstance(slot_tier, SlotTier):
                stats = slot_tier.backend.stats()
                run.info["seal"] = stats["seal"]
                run.info["direct_io"] = stats["direct_io"]
        if name.startswith("fs"):
            run.info["fs_io"] = core.path_name if direct else _vllm_fs_io()
    finally:
        manager.shutdown()
    return run


def _fs_core_tiers(core: fs_core.FsCore, view: memoryview, workdirs: list[str], threads: int) -> list:
    tiers: list = []
    try:
        for w in workdirs:
            tiers.append(fs_core.FsCoreTier(core, view, w, threads, threads))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def _vllm_fs_io() -> str:
    """Which IO path vLLM's own fs tier runs in this process."""
    from vllm.v1.kv_offload.tiering.fs import io

    return "C" if io._HAS_FSIO_C else "Python"


def _store_and_load(run: TierRun, manager: Any, a: argparse.Namespace, n: int, primary_chunks: int,
                    chunk_bytes: int, seed: int, driver: type = Driver) -> None:
    # The primary's rows as numpy (a view: gone when this returns, before the manager
    # shuts down and unmaps the primary).
    rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    assert rows.shape == (primary_chunks, chunk_bytes), rows.shape
    rng = np.random.default_rng(seed)
    src = [i % primary_chunks for i in range(n)]
    drv = driver(list(manager.secondary_tiers), chunk_bytes)
    # Two rounds of n new keys, each from fresh random rows: the second finds kvoffload's
    # tier full (n slots), so every store evicts a key and overwrites its slot, as once a
    # server is warm; fs writes new files. What is loaded back is the second round's.
    def store_round(key0: int) -> Timed:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        t = timed(lambda: drv.run(list(range(key0, key0 + n)), src, True, a.job_chunks))
        t.nbytes = n * chunk_bytes
        return t

    run.store, run.store_again = store_round(0), store_round(n)
    want = rows.copy()
    run.files = count_files(run.dirs)
    run.info["drop_caches"] = drop_caches()
    run.load = Timed(n * chunk_bytes, 0.0, 0.0)
    ok = True
    for w in range(0, n, primary_chunks):  # a wave fills the primary at most once
        idx = list(range(w, min(n, w + primary_chunks)))
        rows[: len(idx)] = 0
        t = timed(lambda: drv.run([n + i for i in idx], list(range(len(idx))), False, a.job_chunks))
        run.load.seconds += t.seconds
        run.load.cpu_seconds += t.cpu_seconds
        ok = ok and bool(np.array_equal(rows[: len(idx)], want[[src[i] for i in idx]]))
    run.failed_jobs = drv.failed
    run.verified = ok and drv.failed == 0


def raw_ceilings(dirs: list[str], chunk_bytes: int, nbytes: int, seconds: float) -> dict[str, Timed]:
    """Raw O_DIRECT write and read at the chunk size over all ``dirs`` at once (best queue depth)."""
    per_dir = max(chunk_bytes * 16, nbytes // len(dirs))
    files = [RawFile(d, per_dir) for d in dirs]
    try:
        for f in files:
            f.fill()
        return {kind: sweep(files, chunk_bytes, kind, seconds) for kind in ("direct-write", "direct-read")}
    finally:
        for f in files:
            f.close()


def plan(a: argparse.Namespace) -> tuple[int, int, list[tuple[str, int, Optional[bool]]]]:
    """(chunks, primary chunks, the (tier, directories, direct_io) cases to run); a run that cannot
    fit the directories or host memory is refused here, before anything is written."""
    n = max(1, a.total_bytes // a.chunk_bytes)
    primary_chunks = max(1, min(n, a.primary_bytes // a.chunk_bytes))
    ndirs = len(a.dir)
    # kvoffload's rows once per --direct-io setting (None: the tier's default), in one run with fs's.
    settings = {None: [None], "on": [True], "off": [False], "both": [False, True]}[a.direct_io]
    cases = [(k, ndirs, d) for k in ("kvoffload", "kvoffload-direct") for d in settings]
    for f in ("fs", "fs-core"):
        if ndirs == 1 or a.fs_dirs != "all":
            cases.append((f, 1, None))
        if ndirs > 1 and a.fs_dirs != "first":
            cases.append((f"{f} sharded", ndirs, None))
    cases = [c for c in cases if c[0].split()[0] in a.tiers]
    if any(c[0].split()[0] not in DIRECT_TIERS for c in cases):
        _vllm()
    # Each tier's files go before the next starts, so a directory needs the largest of them:
    # kvoffload's share of the slots; fs writes a file per chunk of both store rounds.
    need = [0] * ndirs
    if not a.no_raw:
        need = [max(a.chunk_bytes * 16, min(n * a.chunk_bytes, GiB) // ndirs)] * ndirs
    for name, k, _ in cases:
        per_dir = -(-n // k) * a.chunk_bytes * (1 if name.startswith("kvoffload") else 2)
        need[:k] = [max(x, per_dir) for x in need[:k]]
    for d, x in zip(a.dir, need):
        free = cli_args.free_bytes(d)
        if x > free:
            raise UsageError(f"--gib {a.total_bytes / GiB:g}: the run needs {x} bytes at once on {d}, "
                             f"{free} free")
    # The primary and the copy its loads are checked against.
    memory = 2 * primary_chunks * a.chunk_bytes
    if memory > budget.mem_available():
        raise UsageError(f"--primary-gib {a.primary_bytes / GiB:g}: the primary and its check copy need "
                         f"{memory} bytes of memory, {budget.mem_available()} available")
    return n, primary_chunks, cases


def bench(a: argparse.Namespace) -> dict:
    chunk_bytes = a.chunk_bytes
    n, primary_chunks, cases = plan(a)
    dirs = [os.path.abspath(d) for d in a.dir]
    out: dict = {"dirs": dirs, "chunk_bytes": chunk_bytes, "chunks": n, "primary_chunks": primary_chunks,
                 "job_chunks": a.job_chunks, "seal": a.seal,
                 "io_unit_mib": None if a.io_unit_bytes is None else a.io_unit_bytes / MiB, "host": platform.node(),
                 "cpus": os.cpu_count(), "tiers": []}
    if not a.no_raw:
        raw = raw_ceilings(dirs, chunk_bytes, min(n * chunk_bytes, GiB), a.raw_seconds)
        out["raw"] = {k: {"gib_s": round(t.gib_s, 3), "cpu_s_per_gib": round(t.cpu_seconds / (t.nbytes / GiB), 3),
                          "qd": t.detail["qd"]} for k, t in raw.items()}
        print(f"raw over {len(dirs)} dir(s): " + ", ".join(f"{k} {t.gib_s:.2f} GiB/s (qd {t.detail['qd']})"
                                                          for k, t in raw.items()), file=sys.stderr)
    core = None
    if "fs-core" in a.tiers:
        core = fs_core.load(a.fs_wheel, a.fs_files)
        out["fs_core"] = {"source": core.source, "io": core.path_name, "why_not_c": core.ext_error}
        print(f"fs-core: vLLM's fs IO from {core.source}: {core.path_name} path"
              + (f" ({core.ext_error})" if core.ext_error else ""), file=sys.stderr)
    # With --repeat, every round runs every case, in the opposite order to the round before, so
    # a drift of the drives or the host (these machines are noisy) falls on both sides of a ratio.
    rounds = [(k + 1, cases if k % 2 == 0 else cases[::-1]) for k in range(a.repeat)]
    for rnd, name, ndirs, direct_io in [(k, *c) for k, order in rounds for c in order]:
        workdirs: list[str] = []
        try:
            for d in dirs[:ndirs]:
                cli_args.private_dir(workdirs, ".kvoffload-tier-bench-", d)
            if name.startswith("kvoffload"):
                entry = {"type": "KvoffloadTier", "module_path": "kvoffload.vllm_tier",
                         "disk_paths": [os.path.join(w, "kv.bin") for w in workdirs],
                         "disk_capacity_bytes": n * chunk_bytes}
                if a.io_threads is not None:
                    entry["io_threads"] = a.io_threads
                if a.io_unit_bytes is not None:
                    entry["io_unit_bytes"] = a.io_unit_bytes
                entry.update(encrypt=a.seal == "aes-gcm", checksums=a.seal == "xxh3")
                if direct_io is not None:
                    entry["direct_io"] = direct_io
                entries = [entry]
            else:
                entries = [{"type": "fs", "root_dir": w, "n_read_threads": a.fs_threads,
                            "n_write_threads": a.fs_threads} for w in workdirs]
            # The tier's own refusal (the disk filled since the plan) is one line too.
            with cli_args.usage_errors(SlotFileError):
                r = run_tier(name, entries, workdirs, a, n, primary_chunks, chunk_bytes, a.seed, core)
        finally:
            for w in workdirs:
                shutil.rmtree(w, ignore_errors=True)
        raw_read = out.get("raw", {}).get("direct-read", {}).get("gib_s")
        out["tiers"].append({
            "tier": name, "dirs": len(workdirs),
            "store_gib_s": round(r.store.gib_s, 3), "store_again_gib_s": round(r.store_again.gib_s, 3),
            "load_gib_s": round(r.load.gib_s, 3),
            "store_cpu_s_per_gib": round(r.store.cpu_seconds / (r.store.nbytes / GiB), 3),
            "load_cpu_s_per_gib": round(r.load.cpu_seconds / (r.load.nbytes / GiB), 3),
            "load_of_raw_read": round(r.load.gib_s / raw_read, 3) if raw_read else None,
            "files": r.files, "failed_jobs": r.failed_jobs, "verified": r.verified, **r.info,
            **({"round": rnd} if a.repeat > 1 else {}),
        })
        print(f"{label(out['tiers'][-1])}: store {r.store.gib_s:.2f} GiB/s, again {r.store_again.gib_s:.2f}, load "
              f"{r.load.gib_s:.2f} GiB/s, files {r.files}, {'ok' if r.verified else 'FAIL'}", file=sys.stderr)
    by: dict[str, dict] = {}
    for t in out["tiers"]:  # the first row of each tier: with --direct-io both, its staged one
        by.setdefault(t["tier"], t)
    if "kvoffload" in by and "fs" in by and by["fs"]["load_gib_s"]:
        out["kvoffload_load_over_fs"] = round(by["kvoffload"]["load_gib_s"] / by["fs"]["load_gib_s"], 2)
    out["ratios"] = ratios(out["tiers"])
    if a.repeat > 1:
        out["ratio_spread"] = ratio_spread(out["ratios"])
    out["ok"] = all(t["verified"] for t in out["tiers"])
    return out


METRICS = ("store", "store_again", "load")


def ratios(tiers: list[dict]) -> list[dict]:
    """Each kvoffload row over each fs row on as many directories (and of the same round):
    store, again, load."""
    out = []
    for k in tiers:
        for f in tiers:
            if (k["tier"].startswith("kvoffload") and f["tier"].startswith("fs") and k["dirs"] == f["dirs"]
                    and k.get("round") == f.get("round")):
                out.append({"kvoffload": label(k), "fs": label(f), "fs_io": f.get("fs_io"), "dirs": k["dirs"],
                            **({"round": k["round"]} if "round" in k else {}),
                            **{m: round(k[f"{m}_gib_s"] / f[f"{m}_gib_s"], 2) if f[f"{m}_gib_s"] else None
                               for m in METRICS}})
    return out


def ratio_spread(rows: list[dict]) -> list[dict]:
    """Per pair of rows over the rounds: each ratio's median, lowest and highest."""
    pairs: dict[tuple, list[dict]] = {}
    for r in rows:
        pairs.setdefault((r["kvoffload"], r["fs"], r["dirs"]), []).append(r)
    out = []
    for (k, f, dirs), rs in pairs.items():
        spread = {}
        for m in METRICS:
            xs = [r[m] for r in rs if r[m] is not None]
            spread[m] = ({"median": round(float(np.median(xs)), 2), "min": min(xs), "max": max(xs)} if xs else None)
        out.append({"kvoffload": k, "fs": f, "dirs": dirs, "rounds": len(rs), **spread})
    return out


def table(out: dict) -> str:
    gib = out["chunks"] * out["chunk_bytes"] / GiB
    lines = [f"tier bench: {gib:.2f} GiB in {out['chunks']} chunks of {out['chunk_bytes'] // 1024} KiB, "
             f"{out['job_chunks']} chunks a job, primary {out['primary_chunks']} chunks, kvoffload seal {out['seal']}; "
             f"dirs {', '.join(out['dirs'])}"]
    head = (f"{'tier':<30} {'dirs':>4} {'store GiB/s':>11} {'again':>6} {'load GiB/s':>10} {'store CPU s/GiB':>15} "
            f"{'load CPU s/GiB':>14} {'load/raw':>8} {'files':>7}  check")
    lines += [head, "-" * len(head)]
    for k, r in out.get("raw", {}).items():
        rate = f"{r['gib_s']:11.2f} {'':>6} {'':>10}" if k == "direct-write" else f"{'':>11} {'':>6} {r['gib_s']:10.2f}"
        lines.append(f"{'raw ' + k.split('-')[1]:<30} {len(out['dirs']):>4} {rate} {'':>15} {'':>14} {'':>8} "
                     f"{'':>7}  qd {r['qd']}")
    for t in out["tiers"]:
        ratio = "" if t["load_of_raw_read"] is None else f"{t['load_of_raw_read']:.2f}"
        name = label(t) + (f" #{t['round']}" if "round" in t else "")
        lines.append(f"{name:<30} {t['dirs']:>4} {t['store_gib_s']:11.2f} {t['store_again_gib_s']:6.2f} "
                     f"{t['load_gib_s']:10.2f} "
                     f"{t['store_cpu_s_per_gib']:15.3f} {t['load_cpu_s_per_gib']:14.3f} {ratio:>8} {t['files']:>7}  "
                     f"{'ok' if t['verified'] else 'FAIL'}")
    if "kvoffload_load_over_fs" in out:
        lines.append(f"kvoffload load / fs load: {out['kvoffload_load_over_fs']:.2f}x")
    for r in out.get("ratios", []):
        x = {m: "-" if r[m] is None else f"{r[m]:.2f}x" for m in METRICS}
        lines.append(f"{r['kvoffload']} / {r['fs']}, {r['dirs']} dir(s){_round(r)}: store {x['store']}, "
                     f"again {x['store_again']}, load {x['load']}")
    for r in out.get("ratio_spread", []):
        x = {m: "-" if r[m] is None else f"{r[m]['median']:.2f}x ({r[m]['min']:.2f}-{r[m]['max']:.2f})"
             for m in METRICS}
        lines.append(f"{r['kvoffload']} / {r['fs']}, {r['dirs']} dir(s), median (range) of {r['rounds']} rounds: "
                     f"store {x['store']}, again {x['store_again']}, load {x['load']}")
    return "\n".join(lines)


def _round(r: dict) -> str:
    return f", round {r['round']}" if "round" in r else ""


def label(t: dict) -> str:
    """The row's tier, with the IO path an fs row ran, or whether kvoffload's loads read straight into
    the primary's rows or through staging."""
    if "fs_io" in t:
        return f"{t['tier']} ({t['fs_io']})"
    return f"{t['tier']} ({'into rows' if t['direct_io']['load'] else 'staged'})"


PROG = "python -m kvoffload.bench.tier"
TIERS = ("kvoffload", "fs", "kvoffload-direct", "fs-core")


def build_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--dir", action="append", required=True, type=cli_args.Directory(),
                   help="directory for the tiers' files (repeat: kvoffload stripes over all, fs takes the first)")
    p.add_argument("--gib", dest="total_bytes", type=cli_args.Amount(GiB, "GiB"), default=4 * GiB,
                   help="GiB stored and loaded per tier (4)")
    p.add_argument("--chunk-mib", dest="chunk_bytes", type=cli_args.Amount(MiB, "MiB", minimum=4096, multiple=4096),
                   default=2 * MiB, help="MiB per chunk, one primary row, a multiple of 4 KiB (2: Llama-3-8B, 16 tokens)")
    p.add_argument("--job-chunks", type=cli_args.Integer(1), default=16,
                   help="chunks per submit_store / submit_load job (16)")
    p.add_argument("--primary-gib", dest="primary_bytes", type=cli_args.Amount(GiB, "GiB"), default=GiB,
                   help="GiB of CPU primary; loads go in waves of it (1)")
    p.add_argument("--tiers", type=cli_args.Names(TIERS), default=["kvoffload", "fs"],
                   help="comma list of kvoffload, fs, kvoffload-direct (kvoffload's tier without vLLM), fs-core "
                        "(vLLM's fs IO core from its wheel's files, without vLLM)")
    p.add_argument("--io-threads", type=cli_args.Integer(1, cli_args.MAX_IO_THREADS), default=None,
                   help="kvoffload io_threads (default: the backend's)")
    p.add_argument("--io-unit-mib", dest="io_unit_bytes", type=cli_args.Amount(MiB, "MiB"), default=None,
                   help="kvoffload io_unit_bytes in MiB (default: the tier's)")
    p.add_argument("--seal", choices=("aes-gcm", "xxh3", "off"), default="aes-gcm",
                   help="how kvoffload's tier seals a slot: aes-gcm (its default: encrypted), xxh3 (checksums), off")
    p.add_argument("--direct-io", choices=("on", "off", "both"), default=None,
                   help="kvoffload's direct_io: file IO straight between the slot file and the primary's rows where "
                        "aligned (on), or through staging (off), or a row of each (both); default: the tier's (off)")
    p.add_argument("--fs-threads", type=cli_args.Integer(1, cli_args.MAX_IO_THREADS), default=16,
                   help="fs tier read and write threads each (16, its default)")
    p.add_argument("--fs-dirs", choices=("first", "all", "both"), default="both",
                   help="with several --dir: fs and fs-core on the first only, one tier per --dir (the 'sharded' "
                        "rows; each tier its own threads), or both (default); fs writes each round to new files")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--fs-wheel", metavar="WHL", type=cli_args.InputFile(),
                     help="fs-core: the vLLM 0.33 wheel to read the fs tier's IO from")
    src.add_argument("--fs-files", metavar="DIR", type=cli_args.Directory(),
                     help="fs-core: a directory the wheel's fs files were unpacked into "
                     f"(its paths kept: {fs_core.IO_PY}, {fs_core.POOL_PY}, {fs_core.EXT_SO})")
    p.add_argument("--raw-seconds", type=cli_args.Number(above=0.0), default=0.5,
                   help="seconds per raw queue depth (0.5)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw O_DIRECT ceilings")
    p.add_argument("--repeat", type=cli_args.Integer(1, 100), default=1,
                   help="rounds of every case, each round in the opposite order to the one before; ratios pair "
                        "rows of one round, and their median and range over the rounds come last (1)")
    p.add_argument("--seed", type=cli_args.Integer(0), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    return cli_args.main(PROG, lambda: _run(argv))


def _run(argv: Optional[list[str]]) -> int:
    a = build_parser().parse_args(argv)
    out = bench(a)
    print(json.dumps(out, indent=1) if a.json else table(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
