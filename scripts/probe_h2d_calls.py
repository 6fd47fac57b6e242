"""What one ``copy_to_device`` call costs, and which part of it caps the calls per second.

Threads copy units of ``--rows`` 2 MiB llama blocks (64 x 32 KiB) from registered
staging to device memory for ``--seconds``, each on its own stream, in variants
that differ only in how the call is issued and waited for:

  new event     Device.copy_to_device with a new event per call (the backend before
                event reuse), then synchronize it
  reused        the same call recording one event per staging half, created once
  reused+block  the same, events created with blocking=True (the waiter sleeps)
  depth2        reused+block, waiting only for the call before the last

Prints GiB/s and calls/s.
Run on the GPU host: ``PYTHONPATH=. python3 scripts/probe_h2d_calls.py``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from kvoffload.bench.ceilings import run_threads
from kvoffload.cuda_device import CudaDevice
from kvoffload.device import BlockLayout, alloc_host, random_caches, resolve_device

MiB, GiB = 1 << 20, 1 << 30
SLOT = 2 * MiB
TENSORS = 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,4,8,16")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--seconds", type=float, default=1.0)
    a = p.parse_args()
    device = resolve_device("cuda")
    dev = CudaDevice(device)
    n_blocks = 512
    caches = random_caches(device, n_blocks, [SLOT // TENSORS] * TENSORS)
    layout = BlockLayout.from_caches(caches)
    threads_list = [int(x) for x in a.threads.split(",")]
    rows_list = [int(x) for x in a.rows.split(",")]
    max_rows = max(rows_list)
    staging = [alloc_host(2 * max_rows * SLOT, 4096) for _ in range(max(threads_list))]
    for s in staging:
        s.fill_(1)
        dev.pin(s)
    views = [s.view(2 * max_rows, SLOT) for s in staging]

    def body(variant: str, k: int, rows: int, deadline: float) -> int:
        stream = dev.bind_thread(None)
        blocking = variant in ("reused+block", "depth2")
        evs = [torch.cuda.Event(blocking=blocking) for _ in range(2)]
        rng = np.random.default_rng(k)
        calls, prev = 0, None
        while time.perf_counter() < deadline:
            half = calls % 2
            ids = [int(b) for b in rng.choice(n_blocks, rows, replace=False)]
            r = range(half * max_rows, half * max_rows + rows)
            ev = dev.copy_to_device(stream, layout, views[k], r, ids,
                                    event=None if variant == "new event" else evs[half])
            if variant == "depth2":
                if prev is not None:
                    prev.synchronize()
                prev = ev
            else:
                ev.synchronize()
            calls += 1
        if prev is not None:
            prev.synchronize()
        return calls

    table = []
    for rows in rows_list:
        for t in threads_list:
            for variant in ("new event", "reused", "reused+block", "depth2"):
                wall, out = run_threads(t, lambda k, d: body(variant, k, rows, d), a.seconds)
                calls = sum(out)
                table.append((variant, t, rows, calls * rows * SLOT / wall / GiB, calls / wall))
                print(f"  {variant:<12} {t:>3} thr {rows:>2} rows {table[-1][3]:7.2f} GiB/s {table[-1][4]:8.0f} calls/s",
                      file=sys.stderr, flush=True)
    for s in staging:
        dev.unpin(s)
    print(f"\nH2D calls on {torch.cuda.get_device_name()}, {a.seconds} s per case, units of 2 MiB llama blocks")
    print(f"{'variant':<12} {'thr':>4} {'rows':>4} {'GiB/s':>8} {'calls/s':>9}")
    for v, t, r, g, c in table:
        print(f"{v:<12} {t:>4} {r:>4} {g:8.2f} {c:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
