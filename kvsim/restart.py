"""A server restart between a reload scenario's fill and its reload: what the reload costs
with and without a persistent disk tier (kvoffload's ``"persist": true``).

``python -m kvsim.restart [--scenario NAME] [--tier SPEC ...] [--contexts N] [--json]``

For each tier, three replays: no restart (the scenario as ``kvsim trace replay`` runs it);
a restart without persistence (after the fill phase the server stops and starts again:
the GPU prefix cache, a DRAM tier and the disk tier start empty, as kvoffload's anonymous
file does); a restart with persistence (the disk tier keeps every block whose store
completed before the stop, in its LRU order; stores still in flight at the stop are lost,
as a real stop loses them). The fill phase is the same in all three. Prints the reload
phase's TTFT and offload hit rate per case, or one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Optional

from kvoffload import cli_args
from kvsim.engine import Engine
from kvsim.hardware import Hardware
from kvsim.models import get_model
from kvsim.offload import OffloadTier
from kvsim.profile import load_profile
from kvsim.replay import ReplayConfig, build, summarize
from kvsim.scenarios import DEFAULT_SCENARIO, SCENARIOS, get_scenario
from kvsim.tiering import TwoLevelTier, make_tier
from kvsim.tiers import TierSpec, parse_tier, refuse_repeats
from kvsim.trace import TraceRequest

PROG = "python -m kvsim.restart"
CASES = ("no restart", "restart", "restart, persist")


def _disk_level(tier: object) -> Optional[OffloadTier]:
    """The level a persistent kvoffload tier keeps: the disk tier, alone or under a CPU primary."""
    if isinstance(tier, TwoLevelTier):
        return tier.disk
    if isinstance(tier, OffloadTier) and tier.pipe is not None:
        return tier
    return None


def _run(requests: Sequence[TraceRequest], spec: TierSpec, cfg: ReplayConfig, tier: object) -> tuple[Engine, dict]:
    """Replay ``requests`` on ``tier`` (made for the whole trace, so both halves of a
    restart size their pool alike); the engine and its summary."""
    loop, (engine,), _ = build(requests, spec, cfg)  # one replica: the restart is one server's
    engine.tier = tier
    loop.run()
    summary = summarize([engine], spec, cfg.profile, loop.clock.now(), loop.num_events)
    reload = [r for r in engine.finished if r.trace.phase == "reload"]
    prompt = sum(r.prompt for r in reload)
    summary["reload_offload_hit_rate"] = round(sum(r.load_blocks for r in reload) * engine.bs / prompt, 4) \
        if prompt else 0.0
    return engine, summary


def _new_tier(requests: Sequence[TraceRequest], spec: TierSpec, cfg: ReplayConfig) -> object:
    if spec.kind == "none":
        return None
    unit_blocks = requests[0].block_tokens // cfg.hw.block_size
    distinct = len({h for r in requests for h in r.hash_ids})
    return make_tier(spec, cfg.hw, cfg.profile, cfg.model.kv_bytes_per_token * cfg.hw.block_size, unit_blocks,
                     distinct)


def _carry_over(old: object, new: object) -> int:
    """What a persistent disk tier keeps across the restart: its cached blocks, in their LRU
    order, and which slots were ever written; returns the blocks kept."""
    src, dst = _disk_level(old), _disk_level(new)
    if src is None or dst is None:
        return 0
    cached = {slot: key for key, slot in src.pool.cached_slots().items()}
    queue = src.pool.free_queue()  # LRU order; a slot a load still held counts as just used
    entries = [(slot, cached[slot]) for slot in queue if slot in cached]
    queued = set(queue)
    entries += [(slot, key) for slot, key in cached.items() if slot not in queued]
    dst.pool.restore(entries)
    dst._written[:] = src._written
    return len(entries)


def restart_cases(requests: Sequence[TraceRequest], spec: TierSpec, cfg: ReplayConfig) -> dict[str, dict]:
    """The three cases' summaries for one tier (``CASES``), each with its reload phase."""
    fill = [r for r in requests if r.phase == "fill"]
    reload = [r for r in requests if r.phase != "fill"]
    if not fill or not reload:
        raise ValueError("a restart needs a trace with a fill and a reload phase")
    out = {CASES[0]: _run(requests, spec, cfg, _new_tier(requests, spec, cfg))[1]}
    for case, persist in ((CASES[1], False), (CASES[2], True)):
        before, _ = _run(fill, spec, cfg, _new_tier(requests, spec, cfg))
        tier = _new_tier(requests, spec, cfg)
        kept = _carry_over(before.tier, tier) if persist else 0
        _, summary = _run(reload, spec, cfg, tier)
        summary["restored_units"] = kept
        out[case] = summary
    return out


def build_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--scenario", type=cli_args.Names(tuple(SCENARIOS)), default=[DEFAULT_SCENARIO],
                   help=f"the reload scenario (default {DEFAULT_SCENARIO})")
    p.add_argument("--tier", action="append", default=None, help="an offload tier (repeatable; default: the "
                   "scenario's disk tiers)")
    p.add_argument("--contexts", type=cli_args.Integer(1, 10_000), default=None, help="user contexts (default: the "
                   "scenario's)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_args.main(PROG, lambda: _main(argv), (ValueError,))


def _main(argv: Optional[Sequence[str]]) -> int:
    a = build_parser().parse_args(argv)
    if len(a.scenario) != 1:
        raise cli_args.UsageError("--scenario: one scenario")
    sc = get_scenario(a.scenario[0])
    workload = sc.workload if a.contexts is None else dataclasses.replace(sc.workload, contexts=a.contexts)
    tiers = ([parse_tier(t, need_unit=True) for t in a.tier] if a.tier
             else [parse_tier(t) for t in sc.tiers if t.startswith(("disk", "cpu:8GiB+"))])
    refuse_repeats(tiers)
    hw = dataclasses.replace(Hardware(), gpu_kv_bytes=sc.gpu_kv_bytes, host_free_bytes=sc.host_free_bytes)
    cfg = ReplayConfig(get_model(sc.model), hw, sc.load_policy, load_profile(sc.hardware))
    requests = workload.requests()
    results = {spec.text: restart_cases(requests, spec, cfg) for spec in tiers}
    if a.json:
        json.dump({"scenario": sc.name, "contexts": workload.contexts, "tiers": results}, sys.stdout, indent=1,
                  sort_keys=True)
        sys.stdout.write("\n")
        return 0
    print(f"scenario {sc.name}, {workload.contexts} contexts: the reload phase after the fill, per tier")
    print(f"{'tier':<28} {'case':<18} {'TTFT P50':>10} {'P90':>10} {'P99':>10} {'offload hits':>13} "
          f"{'kept':>6}")
    for tier, cases in results.items():
        for case, s in cases.items():
            ttft = s["phases"]["reload"]["ttft_ms"]
            hits = s["reload_offload_hit_rate"]
            print(f"{tier:<28} {case:<18} {_ms(ttft['p50']):>10} {_ms(ttft['p90']):>10} {_ms(ttft['p99']):>10} "
                  f"{hits:>12.1%} {s.get('restored_units', '-'):>6}")
    return 0


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


if __name__ == "__main__":
    sys.exit(main())
