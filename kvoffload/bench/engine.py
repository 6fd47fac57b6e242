"""``--only engine``: the backend beside a busy engine thread, both ways of harm measured.

In vLLM the backend's IO threads live in the worker process (the tier's in the
scheduler process) and need its GIL for every Python line, as does the engine's own
thread. Here a worker-shaped main thread repeats steps of ``STEP_S``: a fixed amount
of pure-Python work (calibrated to the case's share of the step, GIL held), then the
rest of the step with the GIL released (the GPU's turn), then it polls finished jobs
and launches the next one per direction, from that thread, as vLLM's worker does once
per step. Three segments per repeat, in rotating order:

- ``alone``: the same steps, nothing launched (the backend's threads idle on their queues);
- ``busy``: the steps with the backend moving data;
- ``ref``: the same launch pattern with no Python per step (the GPU wait is the whole step).

Beside kvoffload's two paths, ``raw`` is the bound of any design that moves a whole IO
unit in one call without the GIL (a native unit executor, io_uring): IO threads that
take a unit from a queue and make one ``preadv``/``pwritev`` of it, nothing else.

``engine_step_ratio`` = Python seconds per step busy / alone (what the backend costs the
engine); ``bandwidth_ratio`` = GiB/s busy / ref (what the engine costs the backend).
Repeats go on until both ratios' spread is within ``tol`` (or ``max_repeats``); the
best repeat is reported with the median and the spread.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvoffload.bench.ceilings import RawFile
from kvoffload.device import alloc_host
from kvoffload.disk_backend import DiskBackend, default_io_threads, default_io_unit_bytes
from kvoffload.slot_file import round_up
from kvoffload.vllm_tier import SlotTier, TierConfig

STEP_S = 0.020  # one engine step: a decode step of a mid-size model
# A segment that launches IO runs past its time until one IO unit has finished (a rate over
# no unit is no rate: a short segment on a loaded machine may see none), at most this long.
UNIT_WAIT_S = 10.0
SHARES = (0.25, 0.5, 0.75)  # Python's share of a step (0 is the ref segment)
PATHS = ("gpu", "tier", "raw")
DIRECTIONS = ("load", "store")
GiB = 2**30
MiB = 2**20


def spin(n: int) -> int:
    """Pure-Python work holding the GIL (bytecode, small ints, a dict), like scheduler code."""
    d: dict[int, int] = {}
    x = 0
    for i in range(n):
        x = (x * 31 + i) & 0xFFFF
        d[x & 255] = i
    return x + len(d)


def calibrate(seconds: float) -> int:
    """Iterations of ``spin`` that take ``seconds`` on an idle process (best of 5)."""
    n = 20000
    best = min(_timed(spin, n) for _ in range(5))
    return max(1, int(n * seconds / best))


def _timed(fn: Callable[[int], Any], n: int) -> float:
    t0 = time.perf_counter()
    fn(n)
    return time.perf_counter() - t0


class GpuPath:
    """``DiskBackend`` over the run's device caches (CUDA on a GPU host, CPU tensors otherwise),
    launched and polled the way vLLM's worker does (``launch_copy``, then pop finished
    events from the front of the list)."""

    def __init__(self, device: torch.device, paths: list[str], tensor_bytes: tuple[int, ...], num_blocks: int,
                 io_threads: Optional[int], io_unit_bytes: Optional[int]) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.caches = {f"layer{i}": torch.randint(-128, 128, (num_blocks, b), dtype=torch.int8, device=device,
                                                   generator=g) for i, b in enumerate(tensor_bytes)}
        self.block_bytes = sum(tensor_bytes)
        self.num_blocks = num_blocks
        self.backend = DiskBackend()
        self.backend.init(self.caches, device, None, None, paths[0], num_blocks, self.block_bytes,
                          disk_paths=paths, capacity_bytes=num_blocks * round_up(self.block_bytes, 4096),
                          report_load_errors=True, io_threads=io_threads, io_unit_bytes=io_unit_bytes)
        self.events: dict[bool, list] = {True: [], False: []}
        self.jobs = 0
        self.failed = 0

    def launch(self, is_store: bool, blocks: list[int], slots: list[int]) -> None:
        src, dst = (blocks, slots) if is_store else (slots, blocks)
        self.backend.launch_copy(src, dst, is_store, self.jobs, self.events[is_store])
        self.jobs += 1

    def poll(self, is_store: bool) -> int:
        """Jobs finished since the last poll, in launch order (vLLM's high-water mark)."""
        events, n = self.events[is_store], 0
        while events and events[0][1].query():
            self.failed += not events.pop(0)[1].ok
            n += 1
        return n

    def in_flight(self, is_store: bool) -> int:
        return len(self.events[is_store])

    def moved(self, is_store: bool) -> int:
        return moved_bytes(self.backend, is_store)

    def close(self) -> None:
        self.backend.shutdown()


class TierPath:
    """kvoffload's secondary tier (``SlotTier`` on ``HostDevice``) over a host primary,
    as vLLM's tiering manager drives it: submit, then poll ``get_finished_jobs``."""

    def __init__(self, paths: list[str], block_bytes: int, num_blocks: int, io_threads: Optional[int],
                 io_unit_bytes: Optional[int]) -> None:
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.primary = alloc_host(num_blocks * block_bytes, 4096)
        self.primary.random_(0, 256, generator=torch.Generator().manual_seed(0))
        view = memoryview(self.primary.numpy()).cast("B", (num_blocks, block_bytes))
        kw: dict[str, Any] = {"io_threads": io_threads}
        if io_unit_bytes is not None:
            kw["io_unit_bytes"] = io_unit_bytes
        self.tier = SlotTier(view, TierConfig(disk_paths=tuple(paths),
                                              disk_capacity_bytes=num_blocks * round_up(block_bytes, 4096), **kw))
        self.pending: dict[bool, set[int]] = {True: set(), False: set()}
        self.jobs = 0
        self.keys = 0
        self.failed = 0

    def launch(self, is_store: bool, blocks: list[int], slots: list[int]) -> None:
        # Stores: new keys each time (a key on disk is skipped), evicting the oldest;
        # loads: the keys the slots were filled with.
        if is_store:
            keys = [("k", self.keys + i) for i in range(len(blocks))]
            self.keys += len(blocks)
            self.tier.submit_store(self.jobs, keys, blocks)
        else:
            self.tier.submit_load(self.jobs, [("k", s) for s in slots], blocks)
        self.pending[is_store].add(self.jobs)
        self.jobs += 1

    def poll(self, is_store: bool) -> int:
        n = 0
        for f in self.tier.poll():
            self.failed += not f.success
            for d in (True, False):
                if f.job_id in self.pending[d]:
                    self.pending[d].discard(f.job_id)
                    n += d == is_store
        return n

    def in_flight(self, is_store: bool) -> int:
        return len(self.pending[is_store])

    def moved(self, is_store: bool) -> int:
        return moved_bytes(self.tier.backend, is_store)

    def close(self) -> None:
        self.tier.close()


def moved_bytes(backend: DiskBackend, is_store: bool) -> int:
    """Bytes a backend's IO units have moved to (stores) or from (loads) its files so far."""
    return backend.stats()["bytes_written" if is_store else "bytes_read"]


class RawPath:
    """The bound: per drive ``threads`` threads, each unit one ``preadv``/``pwritev`` of
    ``unit_bytes`` at a random aligned offset, its buffers cycling through two units."""

    def __init__(self, dirs: list[str], block_bytes: int, num_blocks: int, threads: int, unit_bytes: int) -> None:
        self.block_bytes, self.num_blocks = block_bytes, num_blocks
        self.unit_bytes = max(4096, unit_bytes // 4096 * 4096)
        per_file = num_blocks * round_up(block_bytes, 4096) // len(dirs)
        self.files = [RawFile(d, max(per_file, 2 * self.unit_bytes)) for d in dirs]
        for f in self.files:
            f.fill()
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.files]
        self.lock = threading.Lock()
        self.done: dict[int, int] = {}  # job -> units left
        self.finished: dict[bool, list[int]] = {True: [], False: []}
        self.pending: dict[bool, set[int]] = {True: set(), False: set()}
        self.moved_by: dict[bool, int] = {True: 0, False: 0}  # bytes of units done
        self.jobs = 0
        self.failed = 0
        self.threads = [threading.Thread(target=self._serve, args=(f, q), daemon=True)
                        for f, q in zip(self.files, self.queues) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _serve(self, f: RawFile, q: queue.SimpleQueue) -> None:
        bufs = [memoryview(alloc_host(self.unit_bytes, 4096).numpy()).cast("B") for _ in range(2)]
        units = f.size // self.unit_bytes
        rng = np.random.default_rng(f.direct_fd)
        turn = 0
        while True:
            item = q.get()
            if item is None:
                return
            job, is_store = item
            off = int(rng.integers(units)) * self.unit_bytes
            call = os.pwritev if is_store else os.preadv
            ok = call(f.direct_fd, [bufs[turn]], off) == self.unit_bytes
            turn ^= 1
            with self.lock:
                self.failed += not ok
                self.moved_by[is_store] += self.unit_bytes if ok else 0
                self.done[job] -= 1
                if not self.done[job]:
                    del self.done[job]
                    self.finished[is_store].append(job)

    def launch(self, is_store: bool, blocks: list[int], slots: list[int]) -> None:
        n = max(1, len(blocks) * self.block_bytes // self.unit_bytes)
        with self.lock:
            self.done[self.jobs] = n
        for i in range(n):
            self.queues[i % len(self.queues)].put((self.jobs, is_store))
        self.pending[is_store].add(self.jobs)
        self.jobs += 1

    def poll(self, is_store: bool) -> int:
        with self.lock:
            got, self.finished[is_store] = self.finished[is_store], []
        self.pending[is_store].difference_update(got)
        return len(got)

    def in_flight(self, is_store: bool) -> int:
        return len(self.pending[is_store])

    def moved(self, is_store: bool) -> int:
        with self.lock:
            return self.moved_by[is_store]

    def close(self) -> None:
        for q in self.queues:
            for _ in range(len(self.threads) // len(self.queues)):
                q.put(None)
        for t in self.threads:
            t.join()
        for f in self.files:
            f.close()


@dataclass
class Segment:
    steps: int
    python_s: list[float]  # Python work seconds of each step
    wall_s: float
    jobs: int  # jobs finished during the segment
    bytes_moved: int  # by the IO units that finished during it

    @property
    def python_ms_per_step(self) -> float:
        """The median step's: a step the host took the CPU away from is not the GIL's doing."""
        return 1e3 * statistics.median(self.python_s) if self.python_s else 0.0

    @property
    def gib_s(self) -> float:
        # Bytes of IO units, not of whole jobs: a segment holds only a few jobs (a quarter of the
        # footprint each), and counting whole ones quantised the rate to steps of a third or a
        # quarter (commit 6525cc7 and before: every bandwidth_ratio was 0.67, 0.75 or 1.0 +- noise).
        return self.bytes_moved / self.wall_s / GiB


@dataclass
class EngineCaseResult:
    path: str
    direction: str
    drives: int
    share: float
    python_ms_alone: float
    gib_s_busy: float
    gib_s_ref: float
    engine_step_ratio: float  # best repeat (lowest)
    engine_step_ratio_median: float
    engine_step_ratio_spread: tuple[float, float]
    bandwidth_ratio: float  # best repeat (highest)
    bandwidth_ratio_median: float
    bandwidth_ratio_spread: tuple[float, float]
    repeats: int
    launch_ms_per_step: float  # the engine thread's own poll + launch_copy time
    failed_jobs: int = 0  # jobs that did not complete whole (should be none)
    detail: dict = field(default_factory=dict)


class Driver:
    """Steps of the worker-shaped main thread over one path and direction."""

    def __init__(self, path: Any, is_store: bool, job_blocks: int, depth: int, rng: np.random.Generator) -> None:
        self.path, self.is_store = path, is_store
        self.job_blocks, self.depth = job_blocks, depth
        self.rng = rng
        self.launch_s = 0.0
        self.unit_wait_s = UNIT_WAIT_S

    def _job(self) -> tuple[list[int], list[int]]:
        n = self.path.num_blocks
        blocks = self.rng.choice(n, self.job_blocks, replace=False).tolist()
        slots = self.rng.choice(n, self.job_blocks, replace=False).tolist()
        return blocks, slots

    def segment(self, iters: int, seconds: float, launch: bool) -> Segment:
        """Steps of ``STEP_S`` for ``seconds``: ``iters`` of Python, the rest of the step with
        the GIL released (none if the Python overran it), then poll and launch. A step's
        length does not depend on the Python, so every segment launches at the same pace. A
        segment that launches lasts until one IO unit has finished too (``unit_wait_s`` at most)."""
        steps, py, done = 0, [], 0
        moved0 = self.path.moved(self.is_store)
        t0 = time.perf_counter()
        end = t0 + seconds
        while True:
            a = time.perf_counter()
            if iters:
                spin(iters)
            b = time.perf_counter()
            py.append(b - a)
            rest = a + STEP_S - b
            if rest > 0:
                time.sleep(rest)
            if launch:
                c = time.perf_counter()
                done += self.path.poll(self.is_store)
                if self.path.in_flight(self.is_store) < self.depth:
                    self.path.launch(self.is_store, *self._job())
                self.launch_s += time.perf_counter() - c
            steps += 1
            now = time.perf_counter()
            if now >= end and (not launch or now >= end + self.unit_wait_s or self.path.moved(self.is_store) > moved0):
                break
        wall = time.perf_counter() - t0
        moved = self.path.moved(self.is_store) - moved0
        self.drain()
        return Segment(steps, py, wall, done, moved)

    def drain(self) -> None:
        """Let in-flight jobs finish outside the timed window (not counted)."""
        while self.path.in_flight(self.is_store):
            self.path.poll(self.is_store)
            time.sleep(0.0005)


def run_case(driver: Driver, share: float, seconds: float, min_repeats: int, max_repeats: int, tol: float,
             iters_per_s: float) -> EngineCaseResult:
    iters = int(iters_per_s * share * STEP_S)
    step_r, bw_r, segs = [], [], []
    launch0, failed0 = driver.launch_s, driver.path.failed
    launched_steps = 0
    for r in range(max_repeats):
        kinds = ["alone", "busy", "ref"]
        kinds = kinds[r % 3:] + kinds[:r % 3]
        got = {}
        for k in kinds:
            got[k] = driver.segment(0 if k == "ref" else iters, seconds, launch=k != "alone")
            if k != "alone":
                launched_steps += got[k].steps
        segs.append(got)
        if not got["ref"].bytes_moved:
            raise RuntimeError(f"engine case {'store' if driver.is_store else 'load'}: the reference segment moved "
                               f"nothing in {got['ref'].wall_s:.1f} s: the backend made no progress")
        step_r.append(got["busy"].python_ms_per_step / got["alone"].python_ms_per_step)
        bw_r.append(got["busy"].gib_s / got["ref"].gib_s)
        if r + 1 >= min_repeats and _spread(step_r) <= tol and _spread(bw_r) <= tol:
            break
    med = statistics.median
    return EngineCaseResult(
        path="", direction="store" if driver.is_store else "load", drives=0, share=share,
        python_ms_alone=med(s["alone"].python_ms_per_step for s in segs),
        gib_s_busy=med(s["busy"].gib_s for s in segs), gib_s_ref=med(s["ref"].gib_s for s in segs),
        engine_step_ratio=min(step_r), engine_step_ratio_median=med(step_r),
        engine_step_ratio_spread=(min(step_r), max(step_r)),
        bandwidth_ratio=max(bw_r), bandwidth_ratio_median=med(bw_r), bandwidth_ratio_spread=(min(bw_r), max(bw_r)),
        repeats=len(step_r), launch_ms_per_step=1e3 * (driver.launch_s - launch0) / max(1, launched_steps),
        failed_jobs=driver.path.failed - failed0,
        detail={"python_ms_per_step_busy": [round(s["busy"].python_ms_per_step, 4) for s in segs],
                "python_ms_per_step_alone": [round(s["alone"].python_ms_per_step, 4) for s in segs],
                "gib_s_busy": [round(s["busy"].gib_s, 4) for s in segs],
                "gib_s_ref": [round(s["ref"].gib_s, 4) for s in segs]},
    )


def _spread(xs: list[float]) -> float:
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else float("inf")


@dataclass
class EngineConfig:
    device: torch.device
    dirs: list[str]  # one directory per drive
    tensor_bytes: tuple[int, ...]
    footprint_bytes: int  # device blocks (and slots) per path
    # One job per direction per step, as vLLM's worker launches: large enough that the
    # backend, not the launch pattern, sets the pace of the ref segment.
    job_bytes: int
    depth: int  # jobs in flight per direction at most
    seconds: float  # per segment
    min_repeats: int = 3
    max_repeats: int = 8
    tol: float = 0.05
    io_threads: Optional[int] = None
    io_unit_bytes: Optional[int] = None  # None: the backend's default
    paths: tuple[str, ...] = PATHS
    directions: tuple[str, ...] = DIRECTIONS
    shares: tuple[float, ...] = SHARES
    seed: int = 0
    tier_unit_bytes: Optional[int] = None  # the tier path's io_unit_bytes (None: the backend's default)


def drive_sets(dirs: list[str]) -> list[list[str]]:
    """One drive, and all of them when there are several."""
    return [dirs[:1]] + ([dirs] if len(dirs) > 1 else [])


def run_engine_group(cfg: EngineConfig, log: Callable[[str], None]) -> list[EngineCaseResult]:
    block_bytes = sum(cfg.tensor_bytes)
    num_blocks = max(2, cfg.footprint_bytes // block_bytes)
    job_blocks = max(1, min(num_blocks // (cfg.depth + 1), cfg.job_bytes // block_bytes))
    iters_per_s = calibrate(0.01) / 0.01
    log(f"engine: {num_blocks} blocks of {block_bytes} B, jobs of {job_blocks} blocks, <= {cfg.depth} in flight, "
        f"steps of {STEP_S * 1e3:.0f} ms, segments of {cfg.seconds:g} s; spin calibrated at {iters_per_s:.3g} it/s")
    rng = np.random.default_rng(cfg.seed)
    out = []
    for dirs in drive_sets(cfg.dirs):
        for name in cfg.paths:
            paths = [os.path.join(d, f"engine-{name}.kv") for d in dirs]
            if name == "gpu":
                path = GpuPath(cfg.device, paths, cfg.tensor_bytes, num_blocks, cfg.io_threads, cfg.io_unit_bytes)
            elif name == "tier":
                path = TierPath(paths, block_bytes, num_blocks, cfg.io_threads, cfg.tier_unit_bytes)
            else:
                # The backend's own defaults for as many drives: the same threads and units.
                threads = cfg.io_threads or default_io_threads(len(dirs))
                path = RawPath(dirs, block_bytes, num_blocks, threads,
                               cfg.io_unit_bytes or default_io_unit_bytes(len(dirs), threads))
            try:
                _fill(path, job_blocks)
                for direction in cfg.directions:
                    driver = Driver(path, direction == "store", job_blocks, cfg.depth, rng)
                    for share in cfg.shares:
                        r = run_case(driver, share, cfg.seconds, cfg.min_repeats, cfg.max_repeats, cfg.tol,
                                     iters_per_s)
                        r.path, r.drives = name, len(dirs)
                        out.append(r)
                        log(f"  {name:<4} {r.direction:<5} {len(dirs)} drive(s) {share:4.0%} Python: "
                            f"step x{r.engine_step_ratio:.3f} (median {r.engine_step_ratio_median:.3f}, "
                            f"{r.engine_step_ratio_spread[0]:.3f}-{r.engine_step_ratio_spread[1]:.3f}), "
                            f"bandwidth x{r.bandwidth_ratio:.3f} (median {r.bandwidth_ratio_median:.3f}, "
                            f"{r.bandwidth_ratio_spread[0]:.3f}-{r.bandwidth_ratio_spread[1]:.3f}); "
                            f"{r.gib_s_busy:.2f} of {r.gib_s_ref:.2f} GiB/s; {r.repeats} repeats")
            finally:
                path.close()
    return out


def _fill(path: Any, job_blocks: int) -> None:
    """Store every slot once, so loads read written slots (and the tier holds its keys)."""
    if isinstance(path, RawPath):
        return  # its files were filled at creation
    n = path.num_blocks
    for i in range(0, n, job_blocks):
        ids = list(range(i, min(n, i + job_blocks)))
        if isinstance(path, TierPath):
            path.tier.submit_store(path.jobs, [("k", s) for s in ids], ids)
            path.pending[True].add(path.jobs)
            path.jobs += 1
        else:
            path.launch(True, ids, ids)
    while path.in_flight(True):
        path.poll(True)
        time.sleep(0.001)
    if isinstance(path, TierPath):
        path.keys = n  # later stores take new keys and evict these oldest first


def table(rows: list[EngineCaseResult]) -> str:
    """The engine group's table: one line per case, ratios with their spread."""
    head = ("| path | dir | drives | Python share | engine_step_ratio (best; median; spread) | "
            "bandwidth_ratio (best; median; spread) | GiB/s busy / ref | Python ms/step alone | repeats |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.path} | {r.direction} | {r.drives} | {r.share:.0%} | {r.engine_step_ratio:.3f}; "
            f"{r.engine_step_ratio_median:.3f}; {r.engine_step_ratio_spread[0]:.3f}-{r.engine_step_ratio_spread[1]:.3f} | "
            f"{r.bandwidth_ratio:.3f}; {r.bandwidth_ratio_median:.3f}; "
            f"{r.bandwidth_ratio_spread[0]:.3f}-{r.bandwidth_ratio_spread[1]:.3f} | "
            f"{r.gib_s_busy:.2f} / {r.gib_s_ref:.2f} | {r.python_ms_alone:.2f} | {r.repeats} |")
    return "\n".join(lines)


def as_json(rows: list[EngineCaseResult]) -> list[dict]:
    return [asdict(r) for r in rows]

