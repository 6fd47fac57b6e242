"""How long a device copy's launch holds the GIL now that it keeps it (cuda_driver.py).

Each thread, on its own stream, launches units of ``--rows`` 2 MiB llama blocks
(64 x 32 KiB pieces, one DMA descriptor each: 512 per 16 MiB unit) through
``CudaDevice.copy_to_host`` / ``copy_to_device`` with its reused ``DriverEvent``, and
times the launch call alone (descriptors, ``cuMemcpyBatchAsync``, ``cuEventRecord``:
all with the GIL held), then waits for the copy. Any other thread of the process,
the engine's included, can be kept waiting for that long. Prints the launch's
median, 99th percentile and maximum in microseconds, and the GiB/s moved.
Run on the GPU host: ``PYTHONPATH=. python3 scripts/probe_gil_held_launch.py``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from kvoffload.bench.ceilings import run_threads
from kvoffload.cuda_device import CudaDevice
from kvoffload.device import BlockLayout, alloc_host, resolve_device

MiB, GiB = 1 << 20, 1 << 30
SLOT = 2 * MiB
TENSORS = 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="8,16")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seconds", type=float, default=1.0)
    a = p.parse_args()
    device = resolve_device("cuda")
    dev = CudaDevice(device)
    n_blocks = 512
    caches = {f"l{i}": torch.zeros(n_blocks, SLOT // TENSORS, dtype=torch.int8, device=device)
              for i in range(TENSORS)}
    layout = BlockLayout.from_caches(caches)
    threads = [int(x) for x in a.threads.split(",")]
    staging = [alloc_host(a.rows * SLOT, 4096) for _ in range(max(threads))]
    for s in staging:
        dev.pin(s)
    views = [s.view(a.rows, SLOT) for s in staging]

    def body(to_host: bool, k: int, deadline: float) -> list[float]:
        stream = dev.bind_thread(None, layout, a.rows, to_host=to_host)
        ev = dev.new_event()
        rng = np.random.default_rng(k)
        launches = []
        while time.perf_counter() < deadline:
            ids = [int(b) for b in rng.choice(n_blocks, a.rows, replace=False)]
            t0 = time.perf_counter()
            if to_host:
                dev.copy_to_host(stream, layout, ids, views[k], range(a.rows), None, ev)
            else:
                dev.copy_to_device(stream, layout, views[k], range(a.rows), ids, ev)
            launches.append(time.perf_counter() - t0)
            ev.synchronize()
        return launches

    rows = []
    for t in threads:
        for to_host in (True, False):
            wall, out = run_threads(t, lambda k, d: body(to_host, k, d), a.seconds)
            us = np.concatenate([np.asarray(x) for x in out]) * 1e6
            gib_s = len(us) * a.rows * SLOT / wall / GiB
            rows.append(("d2h" if to_host else "h2d", t, len(us), *np.percentile(us, [50, 99]), us.max(), gib_s))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    for s in staging:
        dev.unpin(s)
    print(f"\nlaunch with the GIL held on {torch.cuda.get_device_name()}, units of {a.rows} x 2 MiB, {a.seconds} s each")
    print(f"{'dir':<4} {'thr':>4} {'calls':>6} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'GiB/s':>7}")
    for d, t, n, p50, p99, mx, g in rows:
        print(f"{d:<4} {t:>4} {n:>6} {p50:8.1f} {p99:8.1f} {mx:8.1f} {g:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
