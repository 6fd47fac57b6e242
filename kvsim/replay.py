"""One replay of a trace against one tier, and its summary metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvsim.engine import Engine
from kvsim.events import Event, EventLoop, Kind
from kvsim.hardware import Hardware
from kvsim.models import ModelShape
from kvsim.offload import OffloadTier
from kvsim.request import Request
from kvsim.tiers import TierSpec
from kvsim.trace import TraceRequest

Progress = Callable[[int], None]  # called with the number of requests finished so far


@dataclass(frozen=True)
class ReplayConfig:
    model: ModelShape
    hw: Hardware = Hardware()
    load_policy: str = "faster"


def _pct(sorted_ns: np.ndarray, q: float) -> Optional[float]:
    if not len(sorted_ns):
        return None
    return round(float(np.percentile(sorted_ns, q)) / 1e6, 3)  # ms, rounded for stable JSON


def replay(
    requests: Sequence[TraceRequest],
    spec: TierSpec,
    cfg: ReplayConfig,
    progress: Optional[Progress] = None,
) -> tuple[dict, list[float]]:
    """Replay ``requests`` with offload tier ``spec``: the summary (JSON-ready) and TTFTs in ms."""
    loop, engine = build(requests, spec, cfg, progress)
    loop.run()
    assert not engine.running and not engine.waiting and not engine.num_parked
    summary = summarize(engine, engine.tier, spec, loop.clock.now(), loop.num_events)
    return summary, sorted((r.first_token_ns - r.arrival_ns) / 1e6 for r in engine.finished)


def build(
    requests: Sequence[TraceRequest],
    spec: TierSpec,
    cfg: ReplayConfig,
    progress: Optional[Progress] = None,
) -> tuple[EventLoop, Engine]:
    """The loop with every arrival queued and the engine wired to it, not yet run."""
    hw, model = cfg.hw, cfg.model
    block_bytes = model.kv_bytes_per_token * hw.block_size
    tier = OffloadTier(spec, hw, block_bytes) if spec.kind != "none" else None
    loop = EventLoop()
    engine = Engine(model, hw, tier, loop.next_time, cfg.load_policy)
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


def summarize(engine: Engine, tier: Optional[OffloadTier], spec: TierSpec, end_ns: int, num_events: int) -> dict:
    hw, bs = engine.hw, engine.bs
    done = sorted(engine.finished, key=lambda r: r.rid)
    prompt = sum(r.prompt for r in done)
    gpu_hit = sum(r.gpu_hit_blocks for r in done) * bs
    off_hit = sum(r.load_blocks for r in done) * bs
    ttft = np.sort(np.array([r.first_token_ns - r.arrival_ns for r in done], dtype=np.int64))
    span_s = max(end_ns, 1) / 1e9
    out = {
        "tier": spec.text,
        "requests": len(done),
        "rejected": len(engine.rejected),
        "prompt_tokens": prompt,
        "gpu_hit_rate": round(gpu_hit / prompt, 4) if prompt else 0.0,
        "offload_hit_rate": round(off_hit / prompt, 4) if prompt else 0.0,
        "recomputed_tokens": sum(r.recomputed_tokens for r in done),
        "ttft_ms": {
            "mean": round(float(ttft.mean()) / 1e6, 3) if len(ttft) else None,
            "p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99),
        },
        "bytes_stored": tier.bytes_stored if tier else 0,
        "bytes_loaded": tier.bytes_loaded if tier else 0,
        "disk_read_util": 0.0, "disk_write_util": 0.0,
        "pcie_h2d_util": 0.0, "pcie_d2h_util": 0.0,
        "gpu_evictions": engine.gpu.num_evictions,
        "tier_evictions": tier.pool.num_evictions if tier else 0,
        "makespan_s": round(span_s, 3),
        "steps": engine.num_steps,
        "events": num_events,
    }
    if tier is not None:
        out["pcie_h2d_util"] = round(tier.bytes_loaded / hw.h2d_gbps / 1e9 / span_s, 4)
        out["pcie_d2h_util"] = round(tier.bytes_stored / hw.d2h_gbps / 1e9 / span_s, 4)
        out["disk_read_util"] = round(tier.disk_bytes_read / hw.disk_read_gbps / 1e9 / span_s, 4)
        out["disk_write_util"] = round(tier.disk_bytes_written() / hw.disk_write_gbps / 1e9 / span_s, 4)
    return out

