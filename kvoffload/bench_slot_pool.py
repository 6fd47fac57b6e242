"""Measure SlotPool's per-step cost: ``python -m kvoffload.bench_slot_pool``.

The scheduler calls it on every step for every waiting request, so lookup + touch of
a long prefix must stay far below a decode step (milliseconds).
"""

from __future__ import annotations

import argparse
import time

from kvoffload.slot_pool import SlotPool


def _best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=100_000)
    ap.add_argument("--prefix", type=int, default=2_000)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)

    pool = SlotPool(args.slots)
    # Fill the pool, then keep storing so every allocation evicts (the steady state).
    fill = list(range(args.slots))
    t0 = time.perf_counter()
    pool.complete_store([h for h, _ in pool.prepare_store(fill)], ok=True)
    fill_s = time.perf_counter() - t0
    churn = [("c", i) for i in range(args.slots // 2)]
    t0 = time.perf_counter()
    for i in range(0, len(churn), args.prefix):
        batch = churn[i : i + args.prefix]
        pool.complete_store([h for h, _ in pool.prepare_store(batch)], ok=True)
    churn_s = time.perf_counter() - t0

    prefix = [("c", i) for i in range(len(churn) - args.prefix, len(churn))]
    assert pool.lookup(prefix) == args.prefix

    def hit() -> None:
        for _ in range(args.iters):
            pool.touch(prefix[: pool.lookup(prefix)])

    def load() -> None:
        for _ in range(args.iters):
            pool.prepare_load(prefix)
            pool.complete_load(prefix, ok=True)

    hit_us = _best_of(5, hit) / args.iters * 1e6
    load_us = _best_of(5, load) / args.iters * 1e6
    print(f"pool: {args.slots:,} slots, prefix {args.prefix:,} blocks")
    print(f"store into free slots:   {args.slots / fill_s:,.0f} blocks/s")
    print(f"store with eviction:     {len(churn) / churn_s:,.0f} blocks/s ({pool.num_evictions:,} evictions)")
    print(f"lookup+touch of prefix:  {hit_us:,.1f} us ({args.prefix * 1e6 / hit_us:,.0f} blocks/s)")
    print(f"prepare+complete_load:   {load_us:,.1f} us ({args.prefix * 1e6 / load_us:,.0f} blocks/s)")


if __name__ == "__main__":
    main()
