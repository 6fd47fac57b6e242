"""``calibrate gpu --allreduce TP``: time tensor parallelism's all-reduce on this machine's GPUs.

A replica of tensor parallelism ``tp`` all-reduces its hidden state twice a layer (after
the attention's output projection and after the MLP's down projection), ``T x hidden``
bf16 values a step. gpu.py models one as ``allreduce_us + bytes / allreduce_gb_s``; this
module times it, one process a GPU, and fits those two terms.

vLLM does not run one all-reduce for every size. On Hopper (vLLM 0.32,
``vllm/distributed/device_communicators``: ``custom_all_reduce.py``, ``cuda_communicator.py``,
``all_reduce_utils.py``) it runs its own custom all-reduce below ``min(8 MiB,
CUSTOM_ALL_REDUCE_MAX_SIZES)`` (one stage, each GPU reading its peers' buffers over
NVLink, at two GPUs always, and at four below 512 KiB; two stages above), torch's
symmetric-memory two-shot all-reduce up to ``SYMM_MEM_ALL_REDUCE_MAX_SIZES`` (64 MiB at
two GPUs), NCCL above. vLLM's custom kernel is in its own compiled library, not here:
torch's symmetric-memory one-shot and two-shot all-reduces, the same algorithms over
the same NVLink peer access, stand in for its one and two stages. Every size is timed
with each implementation that runs here; the fit takes, for each size, the one vLLM
would run (``vllm_path``).

How: each size and implementation is captured in a CUDA graph of ``CALLS`` all-reduces
(vLLM replays its steps from graphs, so a launch is not paid per call), warmed up, then
replayed between CUDA events; the median of the replays over ``CALLS`` is kept. On a CPU
(``--device cpu --smoke``) gloo's all-reduce runs the same code path between two
processes and times nothing an engine runs.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.cli_args import require
from kvsim.limits import MAX_BYTES, MAX_MS, MAX_TP, MIN_MS, integer_in, integer_range, number_in, number_range

MiB = 1 << 20
# The hidden sizes of the models calibrate gpu times at tp > 1 (Qwen3-32B 5,120, Llama-3-70B
# 8,192) and the tokens of a step, from one decode to a whole 8,192-token chunk.
HIDDEN = (5120, 8192)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SMOKE_HIDDEN, SMOKE_TOKENS = (64,), (1, 16)
CALLS = 16  # all-reduces per graph replay
# vLLM's thresholds on Hopper (compute capability 9.0), by GPUs; its custom all-reduce's
# own buffer caps it at 8 MiB (max_size=8192 * 1024) below these.
CUSTOM_MAX = {2: 64 * MiB, 4: 32 * MiB, 6: MiB // 2, 8: MiB // 4}
CUSTOM_BUFFER = 8 * MiB
SYMM_MAX = {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB}
IMPLS = ("one-shot", "two-shot", "nccl")
# NVLink multicast stays off wherever this runs: the workplace's multi-GPU machines require
# it (a program using it can take the host's shared GPUs out of service), and vLLM's paths
# at these sizes do not use it (multimem is its symmetric-memory path at 4 GPUs and more).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def vllm_path(nbytes: int, tp: int) -> str:
    """The all-reduce vLLM runs on Hopper for ``nbytes`` at ``tp`` GPUs (module docstring)."""
    if nbytes < min(CUSTOM_MAX.get(tp, 0), CUSTOM_BUFFER):
        one_stage = tp == 2 or (tp <= 4 and nbytes < 512 * 1024) or (tp <= 8 and nbytes < 256 * 1024)
        return "one-shot" if one_stage else "two-shot"
    return "two-shot" if nbytes <= SYMM_MAX.get(tp, 0) else "nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(tp: int, device: str, hidden: Sequence[int], tokens: Sequence[int], warmup: int = 3,
            repeats: int = 15, timeout_s: float = 600.0, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time each ``(hidden, tokens)`` all-reduce across ``tp`` processes, one GPU each."""
    import torch
    import torch.multiprocessing as mp

    if device == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(f"--allreduce {tp}: this machine has {torch.cuda.device_count()} GPU(s); the all-reduce "
                         f"needs {tp}")
    os.environ.update(NO_MULTICAST)  # inherited by the spawned workers
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, tp, port, device, tuple(hidden), tuple(tokens), warmup,
                                                repeats, queue), daemon=True) for rank in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    records: list[dict[str, Any]] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(f"--allreduce {tp}: not finished in {timeout_s:.0f} s; "
                                 f"{len(records)} sizes timed")
            try:
                kind, item = queue.get(timeout=min(left, 5.0))
            except queue_mod.Empty:  # nothing yet: see whether a worker died
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise ValueError(f"--allreduce {tp}: a worker failed (exit codes "
                                     f"{[p.exitcode for p in procs]})") from None
                continue
            if kind == "error":
                raise ValueError(f"--allreduce {tp}: {item}")
            if kind == "done":
                break
            records.append(item)
            say(f"  all-reduce tp={tp} {item['impl']:8} hidden {item['hidden']:5} x {item['tokens']:5} tokens "
                f"({item['bytes'] / MiB:8.3f} MiB): {item['us']:9.2f} us{' (vLLM runs this)' if item['vllm'] else ''}"
                f"{'' if item['graph'] or device == 'cpu' else ', eager'}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return records


def _worker(rank: int, tp: int, port: int, device: str, hidden: tuple[int, ...], tokens: tuple[int, ...],
            warmup: int, repeats: int, queue: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST)
        if device == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=120),
                                    device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=120))
        group = dist.group.WORLD.group_name
        for h in hidden:
            for t in tokens:
                nbytes = t * h * 2
                for impl in IMPLS if device == "cuda" else ("nccl",):
                    us, graphed = _time_one(torch, dist, impl, t * h, device, group, warmup, repeats)
                    if rank == 0:
                        queue.put(("record", dict(tp=tp, hidden=h, tokens=t, bytes=nbytes,
                                                  impl=impl if device == "cuda" else "gloo",
                                                  vllm=device == "cuda" and impl == vllm_path(nbytes, tp),
                                                  us=round(statistics.median(us), 3),
                                                  us_range=[round(min(us), 3), round(max(us), 3)],
                                                  graph=graphed, calls=CALLS, repeats=repeats)))
        dist.barrier()
        if rank == 0:
            queue.put(("done", None))
    except Exception as e:  # said once, by whichever rank fails first
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _time_one(torch: Any, dist: Any, impl: str, numel: int, device: str, group: str, warmup: int,
              repeats: int) -> tuple[list[float], bool]:
    """Microseconds per all-reduce of ``numel`` bf16 values by ``impl``: ``CALLS`` of them
    replayed from one CUDA graph between events (wall clock on a CPU)."""
    if device == "cpu":
        x = torch.zeros(numel, dtype=torch.bfloat16)
        for _ in range(warmup):
            dist.all_reduce(x)
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(CALLS):
                dist.all_reduce(x)
            out.append((time.perf_counter() - t0) * 1e6 / CALLS)
        return out, False
    if impl == "nccl":
        x = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")

        def op() -> None:
            dist.all_reduce(x)
    else:
        import torch.distributed._symmetric_memory as symm

        x = symm.empty(numel, dtype=torch.bfloat16, device="cuda")
        x.zero_()
        symm.rendezvous(x, group)
        if impl == "one-shot":
            def op() -> None:
                torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group)
        else:
            def op() -> None:
                torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", group)

    def calls() -> None:
        for _ in range(CALLS):
            op()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture stream, as torch's docs ask
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # every rank captures the same calls: a failure is every rank's
        calls()
    for _ in range(warmup):
        graph.replay()
    out = []
    for _ in range(repeats):
        dist.barrier()  # the ranks start each replay together: the wait for a late peer is not timed
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / CALLS)
    del graph
    return out, True


# -- the fit ----------------------------------------------------------------------------------


def check(records: Any, path: str, doc: Any) -> list[dict[str, Any]]:
    """``records`` as a list of all-reduce measurements; an error names the bad field."""
    require(isinstance(records, list), path, doc, "allreduce", "allreduce must be a list of measurements")
    for i, r in enumerate(records):
        require(isinstance(r, dict), path, records, i, "an all-reduce measurement is an object")
        require(integer_in(r.get("tp"), 2, MAX_TP), path, r, "tp", f"tp must be {integer_range(2, MAX_TP)}")
        require(integer_in(r.get("bytes"), 1, MAX_BYTES), path, r, "bytes",
                f"bytes must be {integer_range(1, MAX_BYTES)}")
        # Measured times in the ranges a step's are (kvsim/limits.py), in microseconds.
        require(number_in(r.get("us"), MIN_MS * 1e3, MAX_MS * 1e3), path, r, "us",
                f"us must be {number_range(MIN_MS * 1e3, MAX_MS * 1e3)}")
        require(isinstance(r.get("vllm"), bool), path, r, "vllm", "vllm must be true or false")
    return records


def fit(records: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """``(allreduce_us, allreduce_gb_s)`` closest in relative terms to the times of the
    implementations vLLM runs (``vllm``): least squares of ``(us + bytes / rate) / t - 1``."""
    import numpy as np

    used = [r for r in records if r["vllm"]]
    if len(used) < 2:
        raise ValueError("the all-reduce fit needs at least two sizes timed with the path vLLM runs")
    t = np.array([r["us"] * 1e-6 for r in used])
    x = np.array([float(r["bytes"]) for r in used])
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)
    if a < 0:  # no fixed cost: the rate alone
        a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if b <= 0:
        raise ValueError("the all-reduce times do not grow with the bytes: no rate to fit")
    return float(a) * 1e6, 1.0 / float(b) / 1e9


def predicted_us(allreduce_us: float, allreduce_gb_s: float, nbytes: int) -> float:
    return allreduce_us + nbytes / (allreduce_gb_s * 1e9) * 1e6


def table(records: Sequence[dict[str, Any]], allreduce_us: float, allreduce_gb_s: float) -> str:
    """Measured against the fitted all-reduce, one row a size vLLM runs."""
    lines = [f"{'tp':>2} {'MiB':>9} {'path':8} {'measured us':>11} {'profile us':>10} {'error':>7}"]
    for r in sorted((r for r in records if r["vllm"]), key=lambda r: (r["tp"], r["bytes"])):
        p = predicted_us(allreduce_us, allreduce_gb_s, r["bytes"])
        lines.append(f"{r['tp']:>2} {r['bytes'] / MiB:9.3f} {r.get('impl', '?'):8} {r['us']:11.2f} {p:10.2f} "
                     f"{100 * (p / r['us'] - 1):+6.1f}%")
    return "\n".join(lines)


def run(tp: int, device: str, smoke: bool, say: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
        ) -> list[dict[str, Any]]:
    hidden, tokens = (SMOKE_HIDDEN, SMOKE_TOKENS) if smoke else (HIDDEN, TOKENS)
    return measure(tp, device, hidden, tokens, repeats=3 if smoke else 15, say=say)
