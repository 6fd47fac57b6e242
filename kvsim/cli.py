"""``python -m kvsim``: argument parsing, validation and wiring only.

Every numeric flag is checked where it is parsed (one line naming it); a flag that
would do nothing in the mode given (a trace flag without a trace, a scenario flag
with one, ``--host-free`` without a page-cache tier, ...) is refused, not ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Optional

from kvoffload import budget, cli_args

from kvsim import limits
from kvsim.calibrate import BenchError, calibrate, fidelity_table, load_bench
from kvsim.engine import LOAD_POLICIES
from kvsim.generate import ReloadScenario, SharedPrefixStages
from kvsim.gpu import DEFAULT_GPU, GPUS, load_gpu
from kvsim.hardware import Hardware
from kvsim.hitrate import lru_hit_rate
from kvsim.models import DEFAULT_MODEL, MODELS, get_model
from kvsim.profile import BUILTIN, DEFAULT_PROFILE, VM_DISK_PROFILE, load_profile
from kvsim.overload import (first_replicas, first_time_scale, largest_burst, overload_line, overloaded, search, serves,
                            worst_first)
from kvsim.replay import QUEUE_WARNING, ReplayConfig, Workload, check, replay
from kvsim.scenarios import DEFAULT_SCENARIO, SCENARIOS, Scenario, get_scenario
from kvsim.router import MAX_PREFIX_TOKENS, SCORERS, RouterSpec
from kvsim.tiers import UNITS, has_no_unit, parse_tier, refuse_repeats
from kvsim.trace import TraceError, TraceRequest, read_trace, write_kvsim
from kvsim.units import size

# A scenario names its own tiers (scenarios.py); a real trace needs more than they hold
# (the Mooncake conversation trace: ~12 TB of KV at Llama-3-8B).
TRACE_TIERS = ("none", "cpu:8GiB", "vllm-disk:1TiB", "disk:1TiB")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
TRACE_FILE = cli_args.InputFile()
COMMANDS = """commands:
  trace replay [TRACE]        replay a trace (default: a built-in reload scenario) once per tier
  trace generate reload       write the reload scenario as a kvsim trace
  trace hitrate TRACE         untimed LRU token hit rate at given capacities (the oracle)
  calibrate BENCH.json        fit an IO hardware profile to `python -m kvoffload.bench --json`
  calibrate gpu               time engine steps on this machine's GPU and fit the step-time model
  calibrate gpu --allreduce N time tensor parallelism's all-reduce across N of this machine's GPUs
"""


# Every numeric flag has a range (kvsim/limits.py says why each bound is where it is).
TOKENS = limits.TOKENS
TOKENS_OR_NONE = limits.TOKENS_OR_NONE
COUNT = limits.COUNT
SEED = limits.SEED
RATE = limits.RATE
FRACTION = cli_args.FRACTION


class Size(cli_args.Size):
    """kvoffload's size rules with the unit required: ``--gpu-kv 64`` is refused, not
    taken for 64 bytes (``64B`` is)."""

    def __call__(self, text: str) -> int:
        n = super().__call__(text)
        if has_no_unit(text):
            raise argparse.ArgumentTypeError(f"size {text.strip()!r} has no unit: write it with one, e.g. "
                                             f"{text.strip()}GiB ({UNITS}; {text.strip()}B for bytes)")
        return n


SIZE = Size()
# Arrival times are integer nanoseconds: beyond a million-fold stretch they stop being
# a trace's (and past ~1e300 they overflow a float).
TIME_SCALE = cli_args.Number(above=0.0, maximum=1e6)
# Each replica is its own engine in one event loop: a few tens is a cluster.
MAX_REPLICAS = 256
TP = cli_args.Integer(1, limits.MAX_TP)
# Generous bytes per hash id a generated request holds (measured ~26 with the default
# scenario: the tuple slot, the id, the request's share).
SCENARIO_BYTES_PER_ID = 40


def _tier(text: str):
    try:
        return parse_tier(text, need_unit=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SCORER_NAMES = cli_args.Names(SCORERS)
WEIGHT = limits.WEIGHT


def _router_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``queue=2,gpu-prefix=3``: the router's scorers and their weights."""
    pairs = [part.partition("=") for part in text.split(",")]
    if any(not sep or not name.strip() for name, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"expected SCORER=WEIGHT pairs separated by commas (scorers: "
                                         f"{', '.join(SCORERS)}), got {text!r}")
    try:
        names = SCORER_NAMES(",".join(name for name, _, _ in pairs))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(str(e).rsplit(", got ", 1)[0] + f", got {text!r}") from None
    return tuple(zip(names, (WEIGHT(w) for _, _, w in pairs)))


def _bench_or_gpu(text: str) -> str:
    """``gpu``, or a bench JSON that exists."""
    return text if text == "gpu" else TRACE_FILE(text)


# The layer stacks calibrate gpu times by default: what the scenarios and the trace
# default run (Qwen3-32B on one H200, and as one of two H100s of llm-d's TP=2 replicas;
# Llama-3-8B for a trace).
CAL_MODELS = ("qwen3-32b", "qwen3-32b:tp2", "llama3-8b")
GPU_MODELS = cli_args.Names(tuple(f"{m}{tp}" for m in sorted(MODELS) if MODELS[m].buildable
                                  for tp in ("", ":tp2", ":tp4", ":tp8")))


def _scenario_args(p: argparse.ArgumentParser) -> None:
    d = SCENARIOS[DEFAULT_SCENARIO].workload
    g = p.add_argument_group(f"reload scenario (no TRACE; defaults: {DEFAULT_SCENARIO}'s)")
    g.add_argument("--scenario", choices=sorted(SCENARIOS),
                   help=f"the deployment and workload to replay (default {DEFAULT_SCENARIO}; docs/kvsim.md)")
    g.add_argument("--contexts", type=COUNT, help=f"distinct user contexts ({d.contexts})")
    g.add_argument("--prefix-len", type=TOKENS, help=f"shared system prompt tokens ({d.prefix_len})")
    g.add_argument("--context-len", type=TOKENS, help=f"tokens per user context ({d.context_len})")
    g.add_argument("--suffix-len", type=TOKENS, help=f"new question tokens per request ({d.suffix_len})")
    g.add_argument("--output-len", type=TOKENS_OR_NONE, help=f"output tokens per request ({d.output_len})")
    g.add_argument("--fill-rate", type=RATE, help=f"requests/s in the fill phase ({d.fill_rate})")
    g.add_argument("--reload-rate", type=RATE, help=f"requests/s in the reload phase ({d.reload_rate})")


WORKLOAD_FLAGS = ("contexts", "prefix_len", "context_len", "suffix_len", "output_len", "fill_rate", "reload_rate")
SCENARIO_FLAGS = ("scenario", *WORKLOAD_FLAGS)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _scenario(a: argparse.Namespace, reload_only: bool = False) -> tuple[Scenario, Workload]:
    """The scenario named (or the default) and its workload with the flags given."""
    sc = get_scenario(a.scenario or DEFAULT_SCENARIO)
    given = {k: getattr(a, k) for k in WORKLOAD_FLAGS if getattr(a, k) is not None}
    if not isinstance(sc.workload, ReloadScenario):
        if reload_only:
            raise ValueError(f"--scenario {sc.name}: not a reload scenario (each of its stages starts when the one "
                             f"before has drained); replay it with trace replay --scenario {sc.name}")
        _refuse(a, WORKLOAD_FLAGS, f"reload-scenario flags; scenario {sc.name} is not a reload scenario")
    if a.seed is not None:
        given["seed"] = a.seed
    workload = dataclasses.replace(sc.workload, **given)
    if isinstance(workload, ReloadScenario):
        # Every request holds its hash ids: a scenario that cannot fit in memory is refused
        # before it is built (--contexts 1e30 would otherwise build until the host gave out).
        requests = 2 * workload.contexts
        ids = -(-(workload.prefix_len + workload.context_len + workload.suffix_len) // workload.block_tokens)
        need = requests * ids * SCENARIO_BYTES_PER_ID
        if need > budget.mem_available():
            raise ValueError(f"{', '.join(_flag(k) for k in given if k != 'seed') or sc.name}: the scenario's "
                             f"{requests} requests of {ids} hash ids need about {need} bytes of memory, "
                             f"{budget.mem_available()} available")
        return sc, Workload.of(workload.requests())
    return sc, Workload(tuple(workload.stages()), round(workload.interval_s * 1e9))


def _model_args(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument("--model", choices=sorted(MODELS), help=f"model shape (default: {default_help})")
    p.add_argument("--kv-bytes-per-token", type=limits.KV_BYTES_PER_TOKEN,
                   help="override the model's KV bytes per token")
    p.add_argument("--block-size", type=TOKENS, default=Hardware.block_size,
                   help=f"vLLM block size in tokens ({Hardware.block_size})")


def _model(a: argparse.Namespace, default: str):
    model = get_model(a.model or default)
    if a.kv_bytes_per_token:
        model = dataclasses.replace(model, kv_bytes_per_token=a.kv_bytes_per_token)
    return model


def build_parser() -> argparse.ArgumentParser:
    top = cli_args.Parser(prog="kvsim", description="Discrete-event simulator of vLLM KV-cache offload.",
                          epilog=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = top.add_subparsers(dest="cmd", required=True, metavar="trace|calibrate")
    trace = cmds.add_parser("trace", help="replay, generate or measure traces")
    sub = trace.add_subparsers(dest="action", required=True, metavar="replay|generate|hitrate")

    r = sub.add_parser("replay", help="replay a trace once per tier and compare",
                       description="With no TRACE, replays the built-in reload scenario (docs/kvsim.md).")
    r.add_argument("trace", nargs="?", type=TRACE_FILE, help="Mooncake or kvsim jsonl (default: the reload scenario)")
    r.add_argument("--tier", action="append", type=_tier, metavar="SPEC",
                   help="none | cpu:SIZE | disk:SIZE[:OPTION...] | vllm-disk:SIZE[:OPTION...]; repeatable. "
                        "disk = kvoffload's DiskBackend, vllm-disk = vLLM 0.33's. Options: pagecache, threads=N "
                        "(IO threads per slot file and direction), ios-per-thread=N (IOs in flight per IO thread: "
                        "its queue depth); disk only: "
                        "unit=SIZE, seal=aes-gcm|xxh3|off, paths=N. Default: the scenario's, "
                        + " ".join(TRACE_TIERS) + " for a trace")
    _model_args(r, f"the scenario's, {DEFAULT_MODEL} for a trace")
    r.add_argument("--hardware", metavar="PROFILE",
                   help=f"IO profile: {', '.join(BUILTIN)}, or a JSON file from `kvsim calibrate` "
                        f"(default: the scenario's, {DEFAULT_PROFILE} for a trace)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    r.add_argument("--plot", metavar="FILE", type=cli_args.OutputFile(PLOT_SUFFIXES),
                   help=f"write TTFT CDFs and hit rates per tier ({', '.join(PLOT_SUFFIXES)})")
    r.add_argument("--load-policy", choices=LOAD_POLICIES,
                   help="always load offloaded blocks (vLLM), or recompute when that finishes sooner "
                        "(default: the scenario's, faster for a trace)")
    r.add_argument("--max-num-batched-tokens", type=TOKENS,
                   help=f"vLLM's token budget per step (default {Hardware.max_num_batched_tokens})")
    r.add_argument("--max-num-seqs", type=COUNT,
                   help=f"vLLM's running requests at most (default: the scenario's, {Hardware.max_num_seqs})")
    r.add_argument("--gpu", choices=GPUS, help=f"the GPU's step-time profile (default: the scenario's, "
                                                f"{DEFAULT_GPU} for a trace; docs/kvsim.md)")
    r.add_argument("--tp", type=TP, help="GPUs per replica, tensor parallel (default: the scenario's, 1 for a "
                                         "trace)")
    r.add_argument("--replicas", type=cli_args.Integer(1, MAX_REPLICAS),
                   help="replicas behind a prefix-aware router, each with its GPUs and its own tier (default: the "
                        "scenario's, 1 for a trace)")
    r.add_argument("--router-prefix-tokens", type=TOKENS_OR_NONE, metavar="TOKENS",
                   help=f"leading tokens of a prompt the router's prefix scorers hash (with --replicas; default "
                        f"{MAX_PREFIX_TOKENS:,}: llm-d's 256 blocks of 16; 0: the whole prompt)")
    r.add_argument("--router-weights", type=_router_weights, metavar="SCORER=W,...",
                   help="the router's scorers and their weights for every tier, from " + ", ".join(SCORERS)
                        + " (with --replicas; default: the scenario's, each at 1 for a trace; replicas without "
                          "an offload tier leave tier-prefix out)")
    r.add_argument("--gpu-kv", type=SIZE, metavar="SIZE",
                   help="GPU KV cache (default: the scenario's, else what vLLM allots on one H200 at 0.9 "
                        "memory utilisation)")
    r.add_argument("--host-free", type=SIZE, metavar="SIZE",
                   help="free host memory: the page cache's capacity (page-cache tiers only; default: the "
                        "scenario's, 256GiB for a trace)")
    t = r.add_argument_group("trace (with TRACE)")
    t.add_argument("--time-scale", type=TIME_SCALE, help="multiply arrival times (2 = half the rate)")
    t.add_argument("--sample", type=FRACTION, help="keep this fraction of conversations")
    t.add_argument("--limit", type=COUNT, help="replay only the first N requests (after sampling)")
    t.add_argument("--concurrency", type=COUNT, metavar="N",
                   help="a closed loop: N requests in flight, the next in the trace's order sent as one finishes "
                        "(inference-perf's concurrent load); its arrival times are not used")
    r.add_argument("--seed", type=SEED,
                   help="seed of --sample (trace) or of the reload order (scenario); default 0")
    _scenario_args(r)

    g = sub.add_parser("generate", help="write a built-in scenario, or shared-prefix requests, as a kvsim trace")
    g.add_argument("kind", choices=["reload", "shared-prefix"])
    g.add_argument("-o", "--out", type=cli_args.OutputFile(), help="output file (default: stdout)")
    g.add_argument("--seed", type=SEED, help="seed of the reload order, or of the prompts' shuffle (0)")
    _scenario_args(g)
    d = SharedPrefixStages()
    sp = g.add_argument_group("shared-prefix (inference-perf's shared_prefix data, sent as its concurrent load: "
                              "replay it with --concurrency N)")
    sp.add_argument("--groups", type=COUNT, help=f"system prompts ({d.groups})")
    sp.add_argument("--prompts-per-group", type=COUNT, help=f"questions behind each ({d.prompts_per_group})")
    sp.add_argument("--system-len", type=TOKENS, help=f"tokens of a system prompt ({d.system_len})")
    sp.add_argument("--question-len", type=TOKENS, help=f"tokens of a question ({d.question_len})")
    sp.add_argument("--requests", type=COUNT, help="requests, the i-th with the i-th of the shuffled prompts "
                                                     "(default: each prompt once)")

    h = sub.add_parser("hitrate", help="untimed LRU token hit rate at given capacities")
    h.add_argument("trace", type=TRACE_FILE)
    h.add_argument("--capacity", type=SIZE, action="append", required=True, metavar="SIZE")
    _model_args(h, DEFAULT_MODEL)
    h.add_argument("--sample", type=FRACTION, help="keep this fraction of conversations")
    h.add_argument("--seed", type=SEED, help="seed of --sample (0)")
    h.add_argument("--json", action="store_true", help="one JSON object, rates at full precision")

    c = cmds.add_parser("calibrate", help="fit an IO profile to kvoffload's bench, or the GPU's step time",
                        description="BENCH.json: fit kvsim's IO profile to `python -m kvoffload.bench --json` "
                                    "output. gpu: time engine steps of layer stacks on this machine's GPU and fit "
                                    "the step-time model. Each prints how well the fit predicts what it measured.")
    c.add_argument("bench", metavar="BENCH.json|gpu", type=_bench_or_gpu)
    c.add_argument("-o", "--out", metavar="FILE", type=cli_args.OutputFile(),
                   help="write the profile here (default: stdout, table on stderr)")
    c.add_argument("--name", help="profile name (default: the output file's stem, or the bench file's)")
    io_ = c.add_argument_group("IO (calibrate BENCH.json)")
    io_.add_argument("--base", metavar="PROFILE",
                     help="a profile of the same host for what this bench does not measure (e.g. page-cache writes)")
    io_.add_argument("--drives", type=limits.DRIVES,
                     help="drives the profile has (default: the bench's directories; every rate is one drive's)")
    gg = c.add_argument_group("GPU (calibrate gpu)")
    gg.add_argument("--models", type=GPU_MODELS, metavar="MODEL[:tpN],...",
                    help=f"layer stacks to time, each as one GPU of tensor parallelism N holds it "
                         f"(default {','.join(CAL_MODELS)})")
    gg.add_argument("--depth", type=cli_args.Integer(1, 16), help="layers in each timed stack (default 4)")
    gg.add_argument("--budget-s", type=cli_args.Number(above=0.0, maximum=3600.0),
                    help="stop timing new shapes after this many seconds (default 200)")
    gg.add_argument("--device", choices=("cuda", "cpu"), help="where to time (default cuda; cpu with --smoke "
                                                             "checks the code path)")
    gg.add_argument("--kernels", type=cli_args.Names(("eager", "compiled")), metavar="KIND,...",
                    help="the layers' own ops to time each step with: eager (each torch op its own kernel) and/or "
                         "compiled (fused by torch.compile, as vLLM runs them); default eager")
    gg.add_argument("--smoke", action="store_true", help="a few tiny shapes: every code path once, no real timing")
    gg.add_argument("--measurements", metavar="FILE", type=TRACE_FILE, action="append",
                    help="fit to the measurements in FILE (a GPU profile or a `calibrate gpu` output) instead of "
                         "timing again; repeat it to add an --allreduce output's all-reduces to a run's steps")
    gg.add_argument("--allreduce", metavar="TP", type=cli_args.Integer(2, limits.MAX_TP),
                    help="time tensor parallelism's all-reduce of the hidden state across TP GPUs of this machine "
                         "(one process each) instead of layer stacks, and write the measurements: give them with "
                         "--measurements beside a run's steps to fit a profile's all-reduce")
    gg.add_argument("--check", metavar="GPU", choices=GPUS,
                    help=f"with --measurements: print how GPU's profile ({', '.join(GPUS)}) predicts the steps "
                         f"measured, fitting and writing nothing (a derived profile against the GPU it stands for)")
    return top


def _refuse(a: argparse.Namespace, flags: Sequence[str], why: str) -> None:
    given = [_flag(f) for f in flags if getattr(a, f) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: {why}")


def _plot_target(path: str) -> None:
    # The file name was checked where it was parsed; this is checked now, not after the whole simulation.
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'kvoffload[plot]'")


def _replay(a: argparse.Namespace) -> int:
    sc = None
    if a.trace is None:
        sc = get_scenario(a.scenario or DEFAULT_SCENARIO)
        _refuse(a, ("time_scale", "sample", "limit", "concurrency"), f"trace flags; without a TRACE scenario {sc.name} replays "
                + ("its reload workload (its rates: --fill-rate, --reload-rate)"
                   if isinstance(sc.workload, ReloadScenario) else "its own stages at the rates its source states"))
        sc, work = _scenario(a)
    else:
        _refuse(a, SCENARIO_FLAGS, "reload-scenario flags; they do nothing with a TRACE")
        if a.sample is None:
            _refuse(a, ("seed",), "--seed only seeds --sample for a trace")
    tiers = a.tier or [parse_tier(t) for t in (sc.tiers if sc else TRACE_TIERS)]
    refuse_repeats(tiers)
    if all(t.kind == "none" for t in tiers):
        _refuse(a, ("load_policy",), "no offload tier to load from")
    if not any(t.page_cache for t in tiers):
        _refuse(a, ("host_free",), "only page-cache tiers (disk:SIZE:pagecache) use free host memory")
    if a.plot:
        _plot_target(a.plot)
    model = _model(a, sc.model if sc else DEFAULT_MODEL)
    gpu = load_gpu(a.gpu or (sc.gpu if sc else DEFAULT_GPU))
    gpu_kv = a.gpu_kv or (sc.gpu_kv_bytes if sc else None)
    if gpu_kv is None and sc is not None and sc.gpu_kv_tokens is not None:
        gpu_kv = sc.gpu_kv_tokens * model.kv_bytes_per_token  # as the source states it, in tokens
    hw = Hardware(gpu=gpu.name, tp=a.tp or (sc.tp if sc else 1), block_size=a.block_size,
                  max_num_batched_tokens=a.max_num_batched_tokens or Hardware.max_num_batched_tokens,
                  max_num_seqs=a.max_num_seqs or (sc.max_num_seqs if sc and sc.max_num_seqs else Hardware.max_num_seqs),
                  gpu_kv_bytes=gpu_kv,
                  host_free_bytes=a.host_free or (sc.host_free_bytes if sc else Hardware.host_free_bytes))
    profile = load_profile(a.hardware or (sc.hardware if sc else DEFAULT_PROFILE))
    policy = a.load_policy or (sc.load_policy if sc else "faster")
    replica_kv = hw.kv_bytes(model, gpu)  # refuses a model that leaves no KV cache, before anything is printed
    replicas = a.replicas or (sc.replicas if sc else 1)
    if replicas == 1:
        _refuse(a, ("router_prefix_tokens", "router_weights"), "one replica: no router (--replicas N)")
    time_scale = a.time_scale or 1.0
    # What this run models, said once its first tier has replayed: a mistake found while
    # setting them up stays one line.
    if sc is not None:
        title = f"scenario {sc.name}"
        said = [f"kvsim: scenario {sc.name}: {sc.summary}"]
    else:
        if a.concurrency is not None:
            _refuse(a, ("time_scale",), "arrival times; --concurrency sends each request as one finishes")
        work = Workload((read_trace(a.trace, time_scale, a.sample or 1.0, a.seed or 0, a.limit),),
                        concurrency=a.concurrency)
        title = a.trace
        said = [f"kvsim: trace {a.trace}"]
    runs = _deployment(replicas, hw.tp, gpu.name)
    said.append(f"kvsim: hardware {runs} running {model.name}; IO profile {profile.name} (fitted to "
                f"{profile.source}); load policy {policy}")
    if profile.name == VM_DISK_PROFILE:
        said.append(f"kvsim: warning: IO profile {profile.name} is the H200 VM's own virtual disk (about 1.5 GiB/s): "
                    f"not a deployment's drive; --hardware h200-ramdrive models one fast local drive")

    def say() -> None:
        while said:
            print(said.pop(0), file=sys.stderr)

    loop = f" in a closed loop of {work.concurrency}" if work.concurrency else ""
    title = (f"{title}: {len(work):,} request{'s' if len(work) != 1 else ''}{loop}, {model.name} on {runs}, "
             f"GPU KV {size(replica_kv)}{' each' if replicas > 1 else ''}, IO profile {profile.name}, "
             f"load policy {policy}")
    router = sc.router if sc else RouterSpec()
    if a.router_prefix_tokens is not None:
        router = dataclasses.replace(router, max_prefix_tokens=a.router_prefix_tokens or None)
    if a.router_weights is not None:
        router = dataclasses.replace(router, weights=a.router_weights, untiered_weights=None)
    cfg = ReplayConfig(model, hw, policy, profile, gpu, replicas, router)
    for spec in tiers:  # a tier that cannot be set up is refused before anything replays or is said
        check(work, spec, cfg)
    summaries, ttfts = [], []
    with _progress() as bar:
        for spec in tiers:
            s, t = replay(work, spec, cfg, bar.task(spec.text, len(work)))
            say()
            summaries.append(s)
            ttfts.append(t)
        overload = served_by = None
        # A scenario's rates are its point; a trace's come from a cluster kvsim may be smaller
        # than; a closed loop sends no more than is served.
        if sc is None and work.concurrency is None and any(overloaded(s) for s in summaries):
            overload, served_by = _overload(a, work, tiers, summaries, cfg, time_scale, bar,
                                            f"{runs} serving {model.name}")
            for s in summaries:  # the line says why they queue
                if overloaded(s):
                    s["warnings"] = [w for w in s["warnings"] if QUEUE_WARNING not in w]
    published = sc.published if sc else None
    if a.json:
        resolved = dataclasses.replace(hw, gpu_kv_bytes=replica_kv)
        doc = {"title": title, "scenario": sc.name if sc else None, "model": dataclasses.asdict(model),
               "hardware": dataclasses.asdict(resolved), "gpu": gpu.name, "replicas": replicas,
               "io_profile": profile.name, "load_policy": cfg.load_policy, "tiers": summaries, "overload": overload,
               "served_by": served_by, "concurrency": work.concurrency}
        if replicas > 1:  # what the router was told: its scorers' weights and its prefix belief
            doc["router"] = {"weights": dict(router.weights),
                             "untiered_weights": dict(router.untiered().weights),
                             "max_prefix_tokens": router.max_prefix_tokens,
                             "tier_belief_tokens": router.tier_capacity_tokens}
        if published is not None:
            from kvsim.report import comparison
            doc["published"] = comparison(summaries, published)
        json.dump(doc, sys.stdout, indent=1, sort_keys=True)
        sys.stdout.write("\n")
        if overload:
            print(f"kvsim: {overload}", file=sys.stderr)
    else:
        from kvsim.report import print_published, print_table
        if published is not None:
            print_published(title, summaries, published, sys.stdout)
        print_table(title, summaries, sys.stdout, [f"kvsim: {overload}"] if overload else (),
                    phases=published is None)
    if a.plot:
        from kvsim.report import plot
        plot(a.plot, summaries, ttfts, title)
        print(f"kvsim: wrote {a.plot}", file=sys.stderr)
    return 0


def _deployment(replicas: int, tp: int, gpu: str) -> str:
    """What a replay runs on: ``one H200``, ``2 H100s (TP=2)``, ``8 replicas of 2 H100s (TP=2)``."""
    one = f"{tp} {gpu.upper()}s (TP={tp})" if tp > 1 else f"one {gpu.upper()}"
    return one if replicas == 1 else f"{replicas} replicas of {one}"


class _Bar:
    """Progress of the replays on stderr, when stderr is a terminal (whatever stdout is: a
    table, JSON, a pipe); nothing otherwise."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def task(self, label: str, total: int) -> Optional[Callable[[int], None]]:
        if self.progress is None:
            return None
        for t in self.progress.tasks:  # one line at a time: the replays run one after the other
            self.progress.update(t.id, visible=False)
        task = self.progress.add_task(label, total=total)
        return lambda n: self.progress.update(task, completed=n)


@contextlib.contextmanager
def _progress() -> Iterator[_Bar]:
    if not sys.stderr.isatty():
        yield _Bar(None)
        return
    from rich.console import Console
    from rich.progress import Progress
    with Progress(console=Console(stderr=True), transient=True) as progress:
        yield _Bar(progress)


def _overload(a: argparse.Namespace, work: Workload, tiers: list, summaries: list[dict], cfg: ReplayConfig,
              time_scale: float, bar: _Bar, what: str) -> tuple[str, dict]:
    """The overload line, and the ``--replicas`` and ``--time-scale`` found to serve the
    trace: each value tried is replayed on every tier (the likeliest to fail first) as a
    rerun with it would replay it (kvsim/overload.py)."""
    worst = max(f for f in map(overloaded, summaries) if f)
    order = [tiers[i] for i in worst_first(summaries)]

    def check(flag: str, w: Workload, c: ReplayConfig) -> Optional[dict]:
        for spec in order:
            s, _ = replay(w, spec, c, bar.task(f"{flag} {spec.text}", len(w)))
            if not serves(s):
                return s
        return None

    def by_replicas(n: float) -> Optional[dict]:
        return check(f"--replicas {n:g}:", work, dataclasses.replace(cfg, replicas=int(n)))

    def by_time_scale(x: float) -> Optional[dict]:
        stretched = Workload((read_trace(a.trace, x, a.sample or 1.0, a.seed or 0, a.limit),))
        return check(f"--time-scale {x:g}:", stretched, cfg)

    most = min(MAX_REPLICAS, max(cfg.replicas, len(work)))
    replicas = search(first_replicas(worst, cfg.replicas), most, by_replicas, integer=True)
    stretch = None
    if summaries[0]["arrival_span_s"]:  # arrivals all at once have no rate to stretch
        stretch = search(first_time_scale(worst, time_scale), TIME_SCALE.maximum, by_time_scale, integer=False,
                         limit_first=True)
    line = overload_line(summaries, what, replicas, stretch, largest_burst(work))
    found = {"replicas": replicas.found and int(replicas.found),
             "time_scale": stretch.found if stretch is not None else None}
    return line, found


SHARED_PREFIX_FLAGS = ("groups", "prompts_per_group", "system_len", "question_len", "requests")


def _generate(a: argparse.Namespace) -> int:
    if a.kind == "reload":
        _refuse(a, SHARED_PREFIX_FLAGS, "shared-prefix flags; they do nothing with reload")
        requests = _scenario(a, reload_only=True)[1].all()
    else:
        _refuse(a, tuple(f for f in SCENARIO_FLAGS if f != "output_len"), "reload-scenario flags; they do nothing "
                "with shared-prefix")
        requests = _shared_prefix(a)
    if a.out:
        text = io.StringIO()
        write_kvsim(requests, text)
        cli_args.write_output(a.out, text.getvalue())  # whole or not at all
    else:
        write_kvsim(requests, sys.stdout)
    return 0


def _shared_prefix(a: argparse.Namespace) -> list[TraceRequest]:
    """inference-perf's shared_prefix requests in order, as ``trace generate shared-prefix`` writes them."""
    given = {k: getattr(a, k) for k in ("groups", "prompts_per_group", "system_len", "question_len", "output_len",
                                        "seed") if getattr(a, k) is not None}
    d = SharedPrefixStages()
    system, question = given.get("system_len", d.system_len), given.get("question_len", d.question_len)
    # A trace block: the largest power of two up to 512 tokens that divides both lengths,
    # so that no unit is partial; at least vLLM's 16-token block.
    unit = next((b for b in (512, 256, 128, 64, 32, 16) if not system % b and not question % b), None)
    if unit is None:
        raise ValueError(f"--system-len {system} and --question-len {question}: kvsim hashes prompts in blocks of "
                         f"16 tokens or a power of two above; both must be multiples of 16")
    sp = dataclasses.replace(d, block_tokens=unit, **given)
    n = a.requests or sp.groups * sp.prompts_per_group
    ids = n * (sp.system_len + sp.question_len) // unit
    if ids * SCENARIO_BYTES_PER_ID > budget.mem_available():
        raise ValueError(f"--requests {n}: {ids} hash ids need about {ids * SCENARIO_BYTES_PER_ID} bytes of memory, "
                         f"{budget.mem_available()} available")
    return sp.closed_loop(n)


def _hitrate(a: argparse.Namespace) -> int:
    if a.sample is None:
        _refuse(a, ("seed",), "--seed only seeds --sample")
    requests = read_trace(a.trace, sample=a.sample or 1.0, seed=a.seed or 0)
    model = _model(a, DEFAULT_MODEL)
    block_bytes = model.kv_bytes_per_token * a.block_size
    rates = [(cap, lru_hit_rate(requests, cap // block_bytes, a.block_size)) for cap in a.capacity]
    if a.json:
        doc = {"trace": a.trace, "requests": len(requests), "model": model.name, "block_size": a.block_size,
               "capacities": [{"bytes": cap, "token_hit_rate": rate} for cap, rate in rates]}
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for cap, rate in rates:
            print(f"{size(cap)}: token hit rate {rate:.4f}")
    return 0


def _emit(out: Optional[str], doc: str, table: str) -> int:
    """A calibration's document to ``out`` and its table to stdout, or the document to
    stdout and the table to stderr (so that stdout stays the document alone)."""
    if out:
        cli_args.write_output(out, doc)
        print(table)
        print(f"kvsim: wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(doc)
        print(table, file=sys.stderr)
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    if a.bench == "gpu":
        return _calibrate_gpu(a)
    _refuse(a, ("models", "depth", "budget_s", "device", "measurements", "kernels", "allreduce", "check"),
            "GPU flags; they need calibrate gpu")
    if a.smoke:
        raise ValueError("--smoke: a GPU flag; it needs calibrate gpu")
    name = a.name or Path(a.out or a.bench).stem.replace("_", "-")
    base = load_profile(a.base) if a.base else None
    profile = calibrate(load_bench(a.bench), name, a.bench, base, a.drives)
    text = json.dumps(profile.to_json(), indent=1) + "\n"
    table = fidelity_table(profile)
    return _emit(a.out, text, table)


def _calibrate_gpu(a: argparse.Namespace) -> int:
    from kvsim import gpucal

    _refuse(a, ("base", "drives"), "IO flags; they need calibrate BENCH.json")
    command = "python -m kvsim " + " ".join(sys.argv[1:] if a.argv is None else a.argv)
    if a.measurements:
        _refuse(a, ("models", "depth", "budget_s", "device", "kernels", "allreduce"),
                "timing flags; --measurements fits without timing")
        if a.smoke:
            raise ValueError("--smoke: a timing flag; --measurements fits without timing")
        doc = gpucal.merge(a.measurements)
        if a.check:
            _refuse(a, ("out", "name"), "--check fits and writes nothing")
            print(gpucal.check(load_gpu(a.check), doc))
            return 0
    elif a.check:
        raise ValueError(f"--check {a.check}: needs --measurements FILE, the steps to hold the profile against")
    elif a.allreduce:
        return _calibrate_allreduce(a, command)
    else:
        device = a.device or "cuda"
        if a.smoke and device == "cuda" or not a.smoke and device == "cpu":
            raise ValueError("--device cpu and --smoke go together: a CPU times nothing an engine runs, and the "
                             "smoke shapes are too small to fit")
        gpucal.require_torch(device)
        models = [(get_model(m.split(":")[0]), int(m.split(":tp")[1]) if ":tp" in m else 1)
                  for m in (a.models or CAL_MODELS)]
        doc = gpucal.run(models, a.out, device, a.depth or 4, a.budget_s or 200.0, a.smoke, command,
                         cli_args.write_output, a.kernels or ("eager",))
    name = a.name or (Path(a.out).stem.replace("_", "-").removeprefix("gpu-") if a.out else "gpu")
    profile, text = gpucal.profile_of(doc, name, command if a.measurements else None)
    return _emit(a.out, json.dumps(profile.to_json(), indent=1) + "\n", text)


def _calibrate_allreduce(a: argparse.Namespace, command: str) -> int:
    """``calibrate gpu --allreduce TP``: the all-reduces timed, as measurements to fit beside a run's steps."""
    from kvsim import allreduce, gpucal

    _refuse(a, ("models", "depth", "kernels", "budget_s", "name"), "layer-stack flags; --allreduce times no layers")
    device = a.device or "cuda"
    if a.smoke != (device == "cpu"):
        raise ValueError("--device cpu and --smoke go together: a CPU times nothing an engine runs, and the "
                         "smoke shapes are too small to fit")
    gpucal.require_torch(device)
    doc = {"commands": [command], "machine": gpucal.machine(device), "measurements": [],
           "allreduce": allreduce.run(a.allreduce, device, a.smoke)}
    text = json.dumps(doc, indent=1) + "\n"
    if any(r["vllm"] for r in doc["allreduce"]):
        us, gb_s = allreduce.fit(doc["allreduce"])
        table = f"{allreduce.table(doc['allreduce'], us, gb_s)}\nfit: allreduce_us {us:.3f}, allreduce_gb_s {gb_s:.1f}"
    else:
        table = f"{len(doc['allreduce'])} all-reduces timed ({device}, smoke): none by a path vLLM runs, nothing fitted"
    return _emit(a.out, text, table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_args.main("kvsim", lambda: _run(argv), errors=(TraceError, BenchError, ValueError, OSError))


def _run(argv: Optional[Sequence[str]]) -> int:
    a = build_parser().parse_args(argv)
    a.argv = list(argv) if argv is not None else None  # for the command a profile records
    run = {"replay": _replay, "generate": _generate, "hitrate": _hitrate}.get(getattr(a, "action", None), _calibrate)
    return run(a)
