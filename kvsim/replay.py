"""One replay of a trace against one tier, and its summary metrics."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvsim.engine import Engine
from kvsim.events import Event, EventLoop, Kind
from kvsim.gpu import GpuProfile, load_gpu
from kvsim.hardware import Hardware
from kvsim.models import ModelShape
from kvsim.profile import DEFAULT_PROFILE, IoProfile, bytes_per_ns, load_profile
from kvsim.request import Request
from kvsim.tiering import Tier, TwoLevelTier, make_tier
from kvsim.tiers import TierSpec
from kvsim.trace import TraceRequest

Progress = Callable[[int], None]  # called with the number of requests finished so far
# Queueing for admission above this share of all TTFT: the GPU, not the tier, sets TTFT.
OVERLOAD_QUEUE_SHARE = 0.5


@dataclass(frozen=True)
class ReplayConfig:
    model: ModelShape
    hw: Hardware = Hardware()
    load_policy: str = "faster"
    profile: IoProfile = field(default_factory=lambda: load_profile(DEFAULT_PROFILE))
    gpu: GpuProfile = field(default_factory=lambda: load_gpu(Hardware.gpu))


def _ms(v_ns: float) -> float:
    return round(float(v_ns) / 1e6, 3)  # ms, rounded for stable JSON


def _pcts(ns: np.ndarray) -> dict:
    if not len(ns):
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(ns, (50, 90, 99))
    return {"p50": _ms(p50), "p90": _ms(p90), "p99": _ms(p99)}


def replay(
    requests: Sequence[TraceRequest],
    spec: TierSpec,
    cfg: ReplayConfig,
    progress: Optional[Progress] = None,
) -> tuple[dict, list[float]]:
    """Replay ``requests`` with offload tier ``spec``: the summary (JSON-ready) and TTFTs in ms."""
    loop, engine = build(requests, spec, cfg, progress)
    # The replay allocates millions of small objects and frees few: the cyclic
    # collector found nothing to free but cost ~10% of the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        loop.run()
    finally:
        if enabled:
            gc.enable()
    assert not engine.running and not engine.waiting and not engine.num_parked
    summary = summarize(engine, spec, cfg.profile, loop.clock.now(), loop.num_events)
    return summary, sorted((r.first_token_ns - r.arrival_ns) / 1e6 for r in engine.finished)


def build(
    requests: Sequence[TraceRequest],
    spec: TierSpec,
    cfg: ReplayConfig,
    progress: Optional[Progress] = None,
) -> tuple[EventLoop, Engine]:
    """The loop with every arrival queued and the engine wired to it, not yet run."""
    hw, model = cfg.hw, cfg.model
    tokens = {r.block_tokens for r in requests}
    if len(tokens) > 1:
        raise ValueError(f"the trace mixes trace blocks of {sorted(tokens)} tokens; kvsim needs one size")
    tier = None
    if spec.kind != "none":
        unit_blocks = tokens.pop() // hw.block_size if tokens else 1
        distinct = len({h for r in requests for h in r.hash_ids})
        tier = make_tier(spec, hw, cfg.profile, model.kv_bytes_per_token * hw.block_size, unit_blocks, distinct)
    loop = EventLoop()
    engine = Engine(model, hw, tier, loop.next_time, cfg.load_policy, cfg.gpu)
    loop.on(Kind.ARRIVAL, engine.on_arrival)
    loop.on(Kind.IO_DONE, engine.on_io_done)
    if progress is None:
        loop.on(Kind.STEP, engine.on_step)
    else:
        def on_step(ev: Event) -> list[Event]:
            out = engine.on_step(ev)
            progress(len(engine.finished))
            return out
        loop.on(Kind.STEP, on_step)
    for i, t in enumerate(requests):
        r = Request(i, t.arrival_ns, t.input_length, max(1, t.output_length), t)
        loop.push(Event(t.arrival_ns, Kind.ARRIVAL, payload=r))
    return loop, engine


def _ttft(reqs: Sequence[Request]) -> np.ndarray:
    return np.array([r.first_token_ns - r.arrival_ns for r in reqs], dtype=np.int64)


def summarize(engine: Engine, spec: TierSpec, profile: IoProfile, end_ns: int, num_events: int) -> dict:
    tier: Optional[Tier] = engine.tier
    bs = engine.bs
    done = sorted(engine.finished, key=lambda r: r.rid)
    prompt = sum(r.prompt for r in done)
    ttft = _ttft(done)
    queue = np.array([r.admitted_ns - r.arrival_ns for r in done], dtype=np.int64)
    queue_share = float(queue.sum() / ttft.sum()) if len(done) and ttft.sum() else 0.0
    phases = {}
    for name in dict.fromkeys(r.trace.phase for r in done if r.trace.phase is not None):
        reqs = [r for r in done if r.trace.phase == name]
        phases[name] = {"requests": len(reqs), "ttft_ms": _pcts(_ttft(reqs))}
    loaded = [r for r in done if r.load_blocks]
    late = np.array([r.resumed_ns - r.load_eta_ns for r in loaded], dtype=np.int64)
    out = {
        "tier": spec.text,
        "requests": len(done),
        "rejected": len(engine.rejected),
        "prompt_tokens": prompt,
        "gpu_hit_rate": round(sum(r.gpu_hit_blocks for r in done) * bs / prompt, 4) if prompt else 0.0,
        "offload_hit_rate": round(sum(r.load_blocks for r in done) * bs / prompt, 4) if prompt else 0.0,
        "recomputed_tokens": sum(r.recomputed_tokens for r in done),
        "ttft_ms": {"mean": _ms(ttft.mean()) if len(ttft) else None, **_pcts(ttft)},
        "queue_ms": _pcts(queue),
        "queue_share_of_ttft": round(queue_share, 4),
        "phases": phases,
        # How much later than the engine expected loads were seen complete (the
        # load-or-recompute choice rests on that expectation).
        "load_seen_late_ms": {"mean": _ms(late.mean()), "max": _ms(late.max())} if len(late) else None,
        "bytes_stored": tier.bytes_stored if tier else 0,
        "bytes_loaded": tier.bytes_loaded if tier else 0,
        "disk_read_util": 0.0, "disk_write_util": 0.0,
        "pcie_h2d_util": 0.0, "pcie_d2h_util": 0.0,
        "io_threads_busy": None,
        "stores_pending_at_end": None,
        "gpu_evictions": engine.gpu.num_evictions,
        "tier_evictions": tier.num_evictions if tier else 0,
        "makespan_s": round(max(end_ns, 1) / 1e9, 3),
        "steps": engine.num_steps,
        "events": num_events,
        "warnings": [],
    }
    if queue_share > OVERLOAD_QUEUE_SHARE:
        out["warnings"].append(
            f"{spec.text}: queueing for the GPU is {queue_share:.0%} of TTFT (P50 {out['queue_ms']['p50']:,.0f} ms): "
            f"the simulated GPU is overloaded or the arrivals come in bursts, so the GPU sets TTFT, not the "
            f"tier; slow the arrivals (a trace: --time-scale, --sample; a scenario: --fill-rate, --reload-rate)")
    if tier is not None:
        _add_io(out, tier, profile, end_ns)
    if isinstance(tier, TwoLevelTier):
        out["bytes_promoted"] = tier.bytes_promoted  # disk -> CPU: the reloads the CPU level missed
    return out


def _add_io(out: dict, tier: Tier, profile: IoProfile, end_ns: int) -> None:
    """Utilisation over the run and the drain of the stores still queued at its end."""
    jobs, nbytes, drain_ns = tier.pending_stores(end_ns)
    out["stores_pending_at_end"] = {"jobs": jobs, "bytes": nbytes, "drain_s": round(drain_ns / 1e9, 3)}
    span = max(end_ns, 1) + drain_ns
    x = tier.xfer
    out["pcie_h2d_util"] = round(tier.bytes_loaded / bytes_per_ns(profile.pcie_h2d_gib_s) / span, 4)
    out["pcie_d2h_util"] = round(tier.bytes_stored / bytes_per_ns(profile.pcie_d2h_gib_s) / span, 4)
    if tier.pipe is None:
        return
    for key, nbytes, d in (("disk_read_util", tier.disk_bytes_read, profile.disk_read),
                           ("disk_write_util", tier.disk_bytes_written(), profile.disk_write)):
        ios = nbytes / x.block_bytes  # one IO per slot
        out[key] = round(ios * d.busy_ns(x.slot_bytes) / x.drives / span, 4)
    busy = {}
    for name, station in (("load", tier.stations[False]), ("store", tier.stations[True])):
        per = [b / span for b in station.busy_ns]
        busy[name] = {"mean": round(sum(per) / len(per), 4), "max": round(max(per), 4)}
    out["io_threads_busy"] = busy
