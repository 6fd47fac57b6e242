"""What the benchmark moves: block layouts, caches with a reference copy, jobs, timed passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvoffload.bench.ceilings import Stopwatch, Timed


@dataclass(frozen=True)
class Layout:
    name: str
    tensor_bytes: tuple[int, ...]  # bytes per block of each cache tensor
    note: str

    @property
    def block_bytes(self) -> int:
        return sum(self.tensor_bytes)


LAYOUTS = {
    "llama": Layout("llama", (32 * 1024,) * 64, "Llama-3-8B-like: 64 tensors x 32 KiB = 2 MiB"),
    "small": Layout("small", (1024,) * 64, "small blocks: 64 tensors x 1 KiB = 64 KiB"),
    # 576 latent values x bf16 x 16 tokens per layer, 61 layers: 1,124,352 B, not a multiple of 4096.
    "mla": Layout("mla", (576 * 2 * 16,) * 61, "DeepSeek-MLA-like: 61 tensors x 18,432 B, not 4096-aligned"),
    "many": Layout("many", (8 * 1024,) * 128, "many tensors: 128 x 8 KiB = 1 MiB"),
}


def make_caches(device, n, tensor_bytes, seed) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random int8 caches ``[n, bytes]`` per tensor, and a copy to compare loads against."""
    g = torch.Generator(device=device).manual_seed(seed)
    caches = {
        f"layer{i}": torch.randint(-128, 128, (n, b), dtype=torch.int8, device=device, generator=g)
        for i, b in enumerate(tensor_bytes)
    }
    return caches, {k: v.clone() for k, v in caches.items()}


def poison(caches) -> None:
    # Any block a load skipped then differs from the reference.
    for t in caches.values():
        t.fill_(0x5A)


def poison_blocks(caches, ids) -> None:
    idx = torch.as_tensor(ids, dtype=torch.long, device=next(iter(caches.values())).device)
    for t in caches.values():
        t.index_fill_(0, idx, 0x5A)


def verify(caches, ref) -> bool:
    return all(torch.equal(caches[k], ref[k]) for k in caches)


def make_jobs(n, perm, load_order, per_job) -> tuple[list, list]:
    """Store jobs (blocks -> slots perm[b]) in block order; load jobs back, in ``load_order``."""
    store = [(list(range(i, min(n, i + per_job))), [int(perm[b]) for b in range(i, min(n, i + per_job))])
             for i in range(0, n, per_job)]
    load = []
    for i in range(0, n, per_job):
        blocks = [int(b) for b in load_order[i : i + per_job]]
        load.append(([int(perm[b]) for b in blocks], blocks))
    return store, load


def run_jobs(backend, jobs, is_store, device, block_bytes) -> tuple[Timed, bool]:
    """Launch every job at once (as a busy scheduler step would), then wait for all."""
    events: list = []
    sw = Stopwatch(device)
    with sw:
        for k, (src, dst) in enumerate(jobs):
            backend.launch_copy(src, dst, is_store, k, events)
        launched = time.perf_counter()
        for _, ev in events:
            ev.synchronize()
    # JobEvent has .ok; the DRAM backend's CUDA events fail only by raising.
    ok = all(getattr(ev, "ok", True) is not False for _, ev in events)
    # How long the caller spent in launch_copy: where the copies are enqueued by the
    # calling thread (the DRAM backend), near the whole time means that thread is the limit.
    detail = {"launch_seconds": launched - sw.t0}
    return Timed(sum(len(s) for s, _ in jobs) * block_bytes, sw.seconds, sw.cpu_seconds, detail), ok


def passes(min_seconds: float, one_pass: Callable[[], Timed]) -> Timed:
    """Repeat ``one_pass`` (it does its untimed setup and returns its timed part) until
    the timed parts add up to ``min_seconds``; at least once. Rates are over the sum."""
    total = Timed(0, 0.0, 0.0)
    count = 0
    while True:
        t = one_pass()
        total.nbytes += t.nbytes
        total.seconds += t.seconds
        total.cpu_seconds += t.cpu_seconds
        for k, v in t.detail.items():
            total.detail[k] = total.detail.get(k, 0.0) + v
        count += 1
        if total.seconds >= min_seconds:
            break
    total.detail["passes"] = count
    return total
