"""How long one ``cuMemcpyBatchAsync`` of an IO unit takes: what holding the GIL for it would cost.

Each thread, on its own stream, launches units of ``--rows`` 2 MiB llama blocks
(64 x 32 KiB pieces, one DMA descriptor each: 512 per 16 MiB unit) with the
descriptors the backend builds, records its ``DriverEvent`` and waits for the copy.
The batch call is made with the GIL held (``ctypes.PYFUNCTYPE``), so its timing is the
driver's alone, not a wait for the GIL, and any other thread of the process, the
engine's included, would be kept waiting that long. Prints the call's median, 99th
percentile and maximum in microseconds, and the GiB/s moved. (cuda_driver.py: why
the backend gives the GIL up for this call, or makes it inside unit_io's call.)
Run on the GPU host: ``PYTHONPATH=. python3 scripts/probe_batch_launch.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np
import torch

from kvoffload.bench.ceilings import run_threads
from kvoffload.cuda_device import CudaDevice
from kvoffload.cuda_driver import _PROTOS
from kvoffload.device import BlockLayout, alloc_host, piece_descriptors, random_caches, resolve_device

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
    caches = random_caches(device, n_blocks, [SLOT // TENSORS] * TENSORS)
    layout = BlockLayout.from_caches(caches)
    threads = [int(x) for x in a.threads.split(",")]
    staging = [alloc_host(a.rows * SLOT, 4096) for _ in range(max(threads))]
    for s in staging:
        dev.pin(s)
    views = [s.view(a.rows, SLOT) for s in staging]

    drv = dev._driver
    held = ctypes.PYFUNCTYPE(*_PROTOS["cuMemcpyBatchAsync"][1])(drv.addresses["cuMemcpyBatchAsync"])

    def body(to_host: bool, k: int, deadline: float) -> list[float]:
        stream = dev.bind_thread(None, layout, a.rows, to_host=to_host)
        ev = dev.new_event()
        attr = dev._attr_store if to_host else dev._attr_load
        rng = np.random.default_rng(k)
        launches = []
        fail, idx = ctypes.c_size_t(0), ctypes.c_size_t(0)
        while time.perf_counter() < deadline:
            ids = [int(b) for b in rng.choice(n_blocks, a.rows, replace=False)]
            dsts, srcs, sizes = piece_descriptors(layout, ids, views[k], range(a.rows), to_host)
            t0 = time.perf_counter()
            rc = held(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes), ctypes.byref(attr),
                      ctypes.byref(idx), 1, ctypes.byref(fail), stream.cuda_stream)
            launches.append(time.perf_counter() - t0)
            assert rc == 0, rc
            ev.record(stream)
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
    print(f"\ncuMemcpyBatchAsync (GIL held) on {torch.cuda.get_device_name()}, units of {a.rows} x 2 MiB, {a.seconds} s each")
    print(f"{'dir':<4} {'thr':>4} {'calls':>6} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'GiB/s':>7}")
    for d, t, n, p50, p99, mx, g in rows:
        print(f"{d:<4} {t:>4} {n:>6} {p50:8.1f} {p99:8.1f} {mx:8.1f} {g:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
