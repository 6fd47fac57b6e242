"""One replay of a trace against one tier, and its summary metrics."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvsim.engine import Engine
from kvsim.events import Event, EventLoop, Kind
from kvsim.gpu import GpuProfile, load_gpu
from kvsim.hardware import Hardware
from kvsim.models import ModelShape
from kvsim.profile import DEFAULT_PROFILE, IoProfile, bytes_per_ns, load_profile
from kvsim.request import Request, block_size_error
from kvsim.router import Router, RouterSpec
from kvsim.tiering import Tier, TwoLevelTier, make_tier
from kvsim.tiers import TierSpec
from kvsim.trace import TraceRequest

Progress = Callable[[int], None]  # called with the number of requests finished so far
# Queueing for admission above this share of all TTFT: the GPU, not the tier, sets TTFT,
# and the tier's summary warns so (its warning holds QUEUE_WARNING).
OVERLOAD_QUEUE_SHARE = 0.5
QUEUE_WARNING = "queueing for the GPU"


@dataclass(frozen=True)
class ReplayConfig:
    model: ModelShape
    hw: Hardware = Hardware()
    load_policy: str = "faster"
    profile: IoProfile = field(default_factory=lambda: load_profile(DEFAULT_PROFILE))
    gpu: GpuProfile = field(default_factory=lambda: load_gpu(Hardware.gpu))
    replicas: int = 1
    router: RouterSpec = RouterSpec()


def _ms(v_ns: float) -> float:
    return round(float(v_ns) / 1e6, 3)  # ms, rounded for stable JSON


def _pcts(ns: np.ndarray) -> dict:
    if not len(ns):
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(ns, (50, 90, 99))
    return {"p50": _ms(p50), "p90": _ms(p90), "p99": _ms(p99)}


@dataclass(frozen=True)
class Workload:
    """What a replay serves: stages of requests, arrivals relative to each stage's start.
    A stage after the first starts ``gap_ns`` after every request of the one before has
    finished, as inference-perf runs its rate stages; a trace is one stage."""

    stages: tuple[Sequence[TraceRequest], ...]
    gap_ns: int = 0
    # A closed loop: this many requests in flight, the next sent as one finishes
    # (inference-perf's concurrent load, vLLM's bench at --max-concurrency with no rate);
    # the trace's arrival times are not used. None: each request at its arrival time.
    concurrency: Optional[int] = None

    @classmethod
    def of(cls, requests: "Sequence[TraceRequest] | Workload") -> "Workload":
        return requests if isinstance(requests, Workload) else cls((requests,))

    def __len__(self) -> int:
        return sum(len(s) for s in self.stages)

    def all(self) -> list[TraceRequest]:
        return [r for s in self.stages for r in s]


def replay(
    requests: "Sequence[TraceRequest] | Workload",
    spec: TierSpec,
    cfg: ReplayConfig,
    progress: Optional[Progress] = None,
) -> tuple[dict, list[float]]:
    """Replay ``requests`` with offload tier ``spec`` (each replica its own): the summary
    (JSON-ready) and TTFTs in ms."""
    work = Workload.of(requests)
    loop, engines, feed = build(work.stages[0], spec, cfg, progress, work)
    # The replay allocates millions of small objects and frees few: the cyclic
    # collector found nothing to free but cost ~10% of the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        loop.run()
        offset = len(work.stages[0])
        for stage in work.stages[1:]:  # each once the one before has drained
            feed.start(stage, loop.clock.now() + work.gap_ns, offset)
            offset += len(stage)
            loop.run()
    finally:
        if enabled:
            gc.enable()
    assert not any(e.running or e.waiting or e.num_parked for e in engines)
    summary = summarize(engines, spec, cfg.profile, loop.clock.now(), loop.num_events)
    return summary, sorted((r.first_token_ns - r.arrival_ns) / 1e6 for e in engines for r in e.finished)


def build(
    requests: Sequence[TraceRequest],
    spec: TierSpec,
    cfg: ReplayConfig,
    progress: Optional[Progress] = None,
    work: Optional[Workload] = None,
) -> tuple[EventLoop, list[Engine], "Feed"]:
    """The loop with ``requests``' arrivals queued and the replicas' engines wired to it,
    not yet run, and what sends a stage's requests. ``work``: the whole workload, when
    ``requests`` is its first stage."""
    hw, model = cfg.hw, cfg.model
    work = work if work is not None else Workload.of(requests)
    unit_blocks, make = _tier_maker(work, spec, cfg)
    loop = EventLoop()
    feed = Feed(loop, work.concurrency)
    engines = []
    for _ in range(cfg.replicas):
        engines.append(Engine(model, hw, make(), feed.next_arrival, cfg.load_policy, cfg.gpu))
    router = _router(cfg, engines, unit_blocks)
    finished = [0]

    def on_arrival(ev: Event) -> list[Event]:
        r: Request = ev.payload
        eng = engines[router.pick(r.trace.hash_ids)]
        before = len(eng.rejected)
        out = eng.on_arrival(ev)
        if len(eng.rejected) != before:  # refused at once: its place in a closed loop goes to the next
            feed.finished(len(eng.rejected) - before, ev.time_ns)
        return out

    def on_step(ev: Event) -> list[Event]:
        eng: Engine = ev.target
        before = len(eng.finished)
        out = eng.on_step(ev)
        if len(eng.finished) != before:
            feed.finished(len(eng.finished) - before, ev.time_ns)
            if progress is not None:
                finished[0] += len(eng.finished) - before
                progress(finished[0])
        return out

    loop.on(Kind.ARRIVAL, on_arrival)
    loop.on(Kind.IO_DONE, lambda ev: ev.target.on_io_done(ev))
    loop.on(Kind.STEP, on_step)
    feed.start(requests, 0, 0)
    return loop, engines, feed


class Feed:
    """Sends a stage's requests: each at its arrival time (open loop), or ``concurrency``
    at the stage's start and then one as each finishes (closed loop)."""

    def __init__(self, loop: EventLoop, concurrency: Optional[int]) -> None:
        self.loop, self.concurrency = loop, concurrency
        self._pending: Iterator[tuple[int, TraceRequest]] = iter(())

    def start(self, stage: Sequence[TraceRequest], start_ns: int, first_id: int) -> None:
        if self.concurrency is None:
            _push(self.loop, stage, start_ns, first_id)
            return
        self._pending = enumerate(stage, first_id)
        self.finished(self.concurrency, start_ns)

    def finished(self, n: int, now_ns: int) -> None:
        """``n`` requests finished at ``now_ns``: in a closed loop, as many more are sent."""
        if self.concurrency is None:
            return
        for rid, t in itertools.islice(self._pending, n):
            r = Request(rid, now_ns, t.input_length, max(1, t.output_length), t)
            self.loop.push(Event(now_ns, Kind.ARRIVAL, payload=r))

    def next_arrival(self) -> Optional[int]:
        """The earliest time a request may arrive: in a closed loop, also any pending
        event's, since another replica's step may finish a request and send the next
        (an engine's fast-forward of decode steps stops before it)."""
        arrival = self.loop.next_arrival()
        if self.concurrency is None:
            return arrival
        other = self.loop.next_time()
        return other if arrival is None else arrival if other is None else min(arrival, other)


def _tier_maker(work: Workload, spec: TierSpec, cfg: ReplayConfig) -> tuple[int, Callable[[], Optional[Tier]]]:
    """The workload's unit in vLLM blocks, and what makes one replica's tier (None for
    ``none``)."""
    every = work.all()
    tokens = {r.block_tokens for r in every}
    if len(tokens) > 1:
        raise ValueError(f"the trace mixes trace blocks of {sorted(tokens)} tokens; kvsim needs one size")
    if tokens and next(iter(tokens)) % cfg.hw.block_size:  # refused here, before any replica is built
        raise ValueError(block_size_error(next(iter(tokens)), cfg.hw.block_size))
    unit_blocks = next(iter(tokens)) // cfg.hw.block_size if tokens else 1
    if spec.kind == "none":
        return unit_blocks, lambda: None
    distinct = len({h for r in every for h in r.hash_ids})
    block_bytes = cfg.model.kv_bytes_per_token * cfg.hw.block_size
    return unit_blocks, lambda: make_tier(spec, cfg.hw, cfg.profile, block_bytes, unit_blocks, distinct)


def check(requests: "Sequence[TraceRequest] | Workload", spec: TierSpec, cfg: ReplayConfig) -> None:
    """Refuse what ``replay`` would refuse in setting up ``spec``'s tier, before any replay."""
    _tier_maker(Workload.of(requests), spec, cfg)[1]()


def _router(cfg: ReplayConfig, engines: list[Engine], unit_blocks: int) -> Router:
    """The router over the replicas: each believed to hold its GPU cache and its tier (or
    what ``cfg.router`` says the tier scorer is told), in units."""
    spec = cfg.router
    tier = engines[0].tier
    if tier is None:
        spec = spec.untiered()
    if spec.tier_capacity_tokens is not None:
        tier_units = spec.tier_capacity_tokens // (unit_blocks * cfg.hw.block_size)
    else:
        tier_units = tier.capacity_units if tier is not None else 0
    return Router(spec, engines, engines[0].gpu.num_blocks // unit_blocks, tier_units,
                  unit_blocks * cfg.hw.block_size)


def _push(loop: EventLoop, stage: Sequence[TraceRequest], start_ns: int, first_id: int) -> None:
    for i, t in enumerate(stage):
        r = Request(first_id + i, start_ns + t.arrival_ns, t.input_length, max(1, t.output_length), t)
        loop.push(Event(r.arrival_ns, Kind.ARRIVAL, payload=r))


def _ttft(reqs: Sequence[Request]) -> np.ndarray:
    return np.array([r.first_token_ns - r.arrival_ns for r in reqs], dtype=np.int64)


def _phase(reqs: Sequence[Request]) -> dict:
    """A phase's (a stage's) TTFT and end-to-end latency, and its throughput as
    inference-perf counts it: prompt and output tokens over the time from its first
    arrival to its last finish."""
    ttft = _ttft(reqs)
    e2e = np.array([r.finish_ns - r.arrival_ns for r in reqs], dtype=np.int64)
    first, last = min(r.arrival_ns for r in reqs), max(r.finish_ns for r in reqs)
    span = (last - first) / 1e9
    out_tokens = sum(r.output for r in reqs)
    return {"requests": len(reqs), "first_arrival_s": round(first / 1e9, 3), "last_finish_s": round(last / 1e9, 3), "tokens_per_request": round(sum(r.prompt + r.output for r in reqs) / len(reqs), 1),
            "ttft_ms": {"mean": _ms(ttft.mean()), **_pcts(ttft)},
            "e2e_ms": {"mean": _ms(e2e.mean()), **_pcts(e2e)},
            "tokens_per_s": round((sum(r.prompt for r in reqs) + out_tokens) / span, 1) if span else None,
            "output_tokens_per_s": round(out_tokens / span, 1) if span else None}


def summarize(engines: Sequence[Engine], spec: TierSpec, profile: IoProfile, end_ns: int, num_events: int) -> dict:
    """The replay's metrics over all replicas: request figures over every request, IO
    figures the mean replica's (each has its own tier, drives and links)."""
    tiers: list[Tier] = [e.tier for e in engines if e.tier is not None]
    bs = engines[0].bs
    done = sorted((r for e in engines for r in e.finished), key=lambda r: r.rid)
    prompt = sum(r.prompt for r in done)
    ttft = _ttft(done)
    queue = np.array([r.admitted_ns - r.arrival_ns for r in done], dtype=np.int64)
    queue_share = float(queue.sum() / ttft.sum()) if len(done) and ttft.sum() else 0.0
    phases = {}
    for name in dict.fromkeys(r.trace.phase for r in done if r.trace.phase is not None):
        phases[name] = _phase([r for r in done if r.trace.phase == name])
    loaded = [r for r in done if r.load_blocks]
    late = np.array([r.resumed_ns - r.load_eta_ns for r in loaded], dtype=np.int64)
    first = min((r.arrival_ns for r in done), default=0)
    last = max((r.arrival_ns for r in done), default=0)
    whole = _phase(done) if done else {}  # the whole run as inference-perf counts a stage
    out = {
        "tier": spec.text,
        "replicas": len(engines),
        "requests": len(done),
        "rejected": sum(len(e.rejected) for e in engines),
        "prompt_tokens": prompt,
        "gpu_hit_rate": round(sum(r.gpu_hit_blocks for r in done) * bs / prompt, 4) if prompt else 0.0,
        "offload_hit_rate": round(sum(r.load_blocks for r in done) * bs / prompt, 4) if prompt else 0.0,
        "recomputed_tokens": sum(r.recomputed_tokens for r in done),
        "ttft_ms": {"mean": _ms(ttft.mean()) if len(ttft) else None, **_pcts(ttft)},
        "e2e_ms": whole.get("e2e_ms"),
        "tokens_per_s": whole.get("tokens_per_s"),
        "output_tokens_per_s": whole.get("output_tokens_per_s"),
        "queue_ms": _pcts(queue),
        "queue_share_of_ttft": round(queue_share, 4),
        "phases": phases,
        # How much later than the engine expected loads were seen complete (the
        # load-or-recompute choice rests on that expectation).
        "load_seen_late_ms": {"mean": _ms(late.mean()), "max": _ms(late.max())} if len(late) else None,
        "bytes_stored": sum(t.bytes_stored for t in tiers),
        "bytes_loaded": sum(t.bytes_loaded for t in tiers),
        "disk_read_util": 0.0, "disk_write_util": 0.0,
        "pcie_h2d_util": 0.0, "pcie_d2h_util": 0.0,
        "io_threads_busy": None,
        "stores_pending_at_end": None,
        "gpu_evictions": sum(e.gpu.num_evictions for e in engines),
        "tier_evictions": sum(t.num_evictions for t in tiers),
        # Offered against served: the arrivals' span, and the GPU time the busiest replica
        # spent on its steps (over the span: above 1, the work outlasts the arrivals).
        "first_arrival_s": round(first / 1e9, 3),
        "arrival_span_s": round((last - first) / 1e9, 3),
        # After the last arrival: how long the backlog took to drain, against how long one
        # request takes once admitted (P90).
        "drain_s": round((max((r.finish_ns for r in done), default=0) - last) / 1e9, 3),
        "service_p90_s": round(float(np.percentile([r.finish_ns - r.admitted_ns for r in done], 90)) / 1e9, 3)
        if done else 0.0,
        "gpu_busy_s": round(max(e.busy_ns for e in engines) / 1e9, 3),
        "makespan_s": round(max(end_ns, 1) / 1e9, 3),
        "steps": sum(e.num_steps for e in engines),
        "events": num_events,
        "warnings": [],
    }
    if queue_share > OVERLOAD_QUEUE_SHARE:
        q, t = out["queue_ms"]["p90"], out["ttft_ms"]["p90"]
        out["warnings"].append(
            f"{spec.text}: {QUEUE_WARNING} is {queue_share:.0%} of TTFT (P90 {q:,.0f} ms of the TTFT P90 "
            f"{t:,.0f} ms): the GPU, overloaded or hit by bursts of arrivals, sets TTFT, not the tier")
    if tiers:
        _add_io(out, tiers, profile, end_ns)
    if isinstance(tiers[0] if tiers else None, TwoLevelTier):
        out["bytes_promoted"] = sum(t.bytes_promoted for t in tiers)  # disk -> CPU: the reloads the CPU level missed
    return out


def _add_io(out: dict, tiers: Sequence[Tier], profile: IoProfile, end_ns: int) -> None:
    """Utilisation over the run and the drain of the stores still queued at its end, of the
    mean replica (its tier, drives, IO threads and PCIe links: one per GPU)."""
    pending = [t.pending_stores(end_ns) for t in tiers]
    drain_ns = max(p[2] for p in pending)
    out["stores_pending_at_end"] = {"jobs": sum(p[0] for p in pending), "bytes": sum(p[1] for p in pending),
                                    "drain_s": round(drain_ns / 1e9, 3)}
    span = (max(end_ns, 1) + drain_ns) * len(tiers)  # the replicas' spans together
    x = tiers[0].xfer
    links = tiers[0].ranks
    out["pcie_h2d_util"] = round(out["bytes_loaded"] / links / bytes_per_ns(profile.pcie_h2d_gib_s) / span, 4)
    out["pcie_d2h_util"] = round(out["bytes_stored"] / links / bytes_per_ns(profile.pcie_d2h_gib_s) / span, 4)
    if tiers[0].pipe is None:
        return
    out["disk_bytes_read"] = sum(t.disk_bytes_read for t in tiers)  # loads the page cache did not serve
    for key, nbytes, d in (("disk_read_util", sum(t.disk_bytes_read for t in tiers), profile.disk_read),
                           ("disk_write_util", sum(t.disk_bytes_written() for t in tiers), profile.disk_write)):
        ios = nbytes / x.block_bytes  # one IO per slot
        out[key] = round(ios * d.busy_ns(x.slot_bytes) / x.drives / span, 4)
    busy = {}
    for name, is_store in (("load", False), ("store", True)):
        per = [b / (span / len(tiers)) for t in tiers for b in t.stations[is_store].busy_ns]
        busy[name] = {"mean": round(sum(per) / len(per), 4), "max": round(max(per), 4)}
    out["io_threads_busy"] = busy
