"""``python -m kvsim trace replay|generate|hitrate``: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Optional

from kvsim.engine import LOAD_POLICIES
from kvsim.generate import ReloadScenario
from kvsim.hardware import Hardware
from kvsim.hitrate import lru_hit_rate
from kvsim.models import DEFAULT_MODEL, MODELS, get_model
from kvsim.replay import ReplayConfig, replay
from kvsim.tiers import DEFAULT_TIERS, parse_bytes, parse_tier
from kvsim.trace import TraceError, read_trace, write_kvsim


def _size(text: str) -> int:
    try:
        return parse_bytes("size", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tier(text: str):
    try:
        return parse_tier(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_scenario_args(p: argparse.ArgumentParser) -> None:
    d = ReloadScenario()
    p.add_argument("--contexts", type=int, default=d.contexts, help="distinct user contexts")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len, help="shared system prompt tokens")
    p.add_argument("--context-len", type=int, default=d.context_len, help="tokens per user context")
    p.add_argument("--suffix-len", type=int, default=d.suffix_len, help="new question tokens per request")
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--fill-rate", type=float, default=d.fill_rate, help="requests/s in the fill phase")
    p.add_argument("--reload-rate", type=float, default=d.reload_rate, help="requests/s in the reload phase")


def _scenario(a: argparse.Namespace) -> ReloadScenario:
    return ReloadScenario(a.contexts, a.prefix_len, a.context_len, a.suffix_len, a.output_len,
                          a.fill_rate, a.reload_rate)


def build_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kvsim", description="Discrete-event simulator of vLLM KV-cache offload.")
    trace = top.add_subparsers(dest="cmd", required=True).add_parser("trace", help="replay or generate traces")
    sub = trace.add_subparsers(dest="action", required=True)

    r = sub.add_parser("replay", help="replay a trace once per tier and compare",
                       description="With no TRACE, replays the built-in reload scenario.")
    r.add_argument("trace", nargs="?", help="Mooncake or kvsim jsonl (default: the reload scenario)")
    r.add_argument("--tier", action="append", type=_tier, metavar="SPEC",
                   help=f"none | cpu:SIZE | disk:SIZE[:pagecache]; repeatable (default: {' '.join(DEFAULT_TIERS)})")
    r.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    r.add_argument("--kv-bytes-per-token", type=int, help="override the model's KV bytes per token")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    r.add_argument("--plot", metavar="FILE.png", help="write TTFT CDFs and hit rates per tier")
    r.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (2 = half the rate)")
    r.add_argument("--sample", type=float, default=1.0, help="keep this fraction of conversations")
    r.add_argument("--limit", type=int, help="replay only the first N requests (after sampling)")
    r.add_argument("--seed", type=int, default=0, help="seed of --sample")
    r.add_argument("--load-policy", choices=LOAD_POLICIES, default="faster",
                   help="always load offloaded blocks (vLLM), or recompute when that finishes sooner")
    hw = Hardware()
    r.add_argument("--block-size", type=int, default=hw.block_size, help="vLLM block size in tokens")
    r.add_argument("--max-num-batched-tokens", type=int, default=hw.max_num_batched_tokens)
    r.add_argument("--max-num-seqs", type=int, default=hw.max_num_seqs)
    r.add_argument("--gpu-kv", type=_size, default=hw.gpu_kv_bytes, metavar="SIZE", help="GPU KV cache size")
    r.add_argument("--host-free", type=_size, default=hw.host_free_bytes, metavar="SIZE",
                   help="free host memory: the page cache's capacity")
    r.add_argument("--disk-read-gbps", type=float, default=hw.disk_read_gbps)
    r.add_argument("--disk-write-gbps", type=float, default=hw.disk_write_gbps)
    r.add_argument("--io-depth", type=int, default=hw.io_depth, help="IOs in flight per IO thread")
    r.add_argument("--load-threads", type=int, default=hw.load_threads)
    r.add_argument("--store-threads", type=int, default=hw.store_threads)
    r.add_argument("--io-unit-mib", type=float, default=hw.io_unit_bytes / 2**20,
                   help="split each disk job into units of this many MiB over the threads (0: whole job on one, "
                        "as vLLM 0.33; kvoffload: 16)")
    _add_scenario_args(r)

    g = sub.add_parser("generate", help="write a built-in scenario as a kvsim trace")
    g.add_argument("scenario", choices=["reload"])
    g.add_argument("-o", "--out", help="output file (default: stdout)")
    _add_scenario_args(g)

    h = sub.add_parser("hitrate", help="untimed LRU token hit rate at given capacities")
    h.add_argument("trace")
    h.add_argument("--capacity", type=_size, action="append", required=True, metavar="SIZE")
    h.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    h.add_argument("--block-size", type=int, default=hw.block_size)
    h.add_argument("--sample", type=float, default=1.0)
    h.add_argument("--seed", type=int, default=0)
    return top


def _replay(a: argparse.Namespace) -> int:
    model = get_model(a.model)
    if a.kv_bytes_per_token:
        model = dataclasses.replace(model, kv_bytes_per_token=a.kv_bytes_per_token)
    hw = dataclasses.replace(
        Hardware(), block_size=a.block_size, max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs, gpu_kv_bytes=a.gpu_kv, host_free_bytes=a.host_free,
        disk_read_gbps=a.disk_read_gbps, disk_write_gbps=a.disk_write_gbps, io_depth=a.io_depth,
        load_threads=a.load_threads, store_threads=a.store_threads, io_unit_bytes=round(a.io_unit_mib * 2**20),
    )
    if a.trace is None:
        requests = _scenario(a).requests()
        title = "reload scenario"
    else:
        requests = read_trace(a.trace, a.time_scale, a.sample, a.seed, a.limit)
        title = a.trace
    title = f"{title}: {len(requests):,} requests, {model.name}, load policy {a.load_policy}"
    tiers = a.tier or [parse_tier(t) for t in DEFAULT_TIERS]
    cfg = ReplayConfig(model, hw, a.load_policy)
    summaries, ttfts = [], []
    show = not a.json and sys.stderr.isatty()
    if show:
        from rich.progress import Progress
        with Progress(transient=True) as bar:
            for spec in tiers:
                task = bar.add_task(spec.text, total=len(requests))
                s, t = replay(requests, spec, cfg, lambda n, task=task: bar.update(task, completed=n))
                summaries.append(s)
                ttfts.append(t)
    else:
        for spec in tiers:
            s, t = replay(requests, spec, cfg)
            summaries.append(s)
            ttfts.append(t)
    if a.json:
        doc = {"title": title, "model": dataclasses.asdict(model), "hardware": dataclasses.asdict(hw),
               "load_policy": a.load_policy, "tiers": summaries}
        json.dump(doc, sys.stdout, indent=1, sort_keys=True)
        sys.stdout.write("\n")
    else:
        from kvsim.report import print_table
        print_table(title, summaries, sys.stdout)
    if a.plot:
        from kvsim.report import plot
        plot(a.plot, summaries, ttfts, title)
    return 0


def _generate(a: argparse.Namespace) -> int:
    requests = _scenario(a).requests()
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            write_kvsim(requests, f)
    else:
        write_kvsim(requests, sys.stdout)
    return 0


def _hitrate(a: argparse.Namespace) -> int:
    requests = read_trace(a.trace, sample=a.sample, seed=a.seed)
    block_bytes = get_model(a.model).kv_bytes_per_token * a.block_size
    for cap in a.capacity:
        rate = lru_hit_rate(requests, cap // block_bytes, a.block_size)
        print(f"{cap / 1e9:,.1f} GB: token hit rate {rate:.4f}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return {"replay": _replay, "generate": _generate, "hitrate": _hitrate}[a.action](a)
    except (TraceError, ValueError, OSError) as e:
        print(f"kvsim: error: {e}", file=sys.stderr)
        return 2
