"""Where does a page-cache load lose its time? Pieces of the load path, one at a time.

Each case runs ``--threads`` threads for ``--seconds`` over random 2 MiB slots of a
warm scratch file (or over staging memory only), for each unit size in ``--units``
(2 MiB rows per unit), and prints GiB/s and the mean ``preadv`` time per call:

  read reuse       preadv into one 2 MiB buffer per thread (the benchmark's ceiling)
  read ring        preadv into rows cycling through two registered units per thread
  dma              copy_to_device of one unit at a time from that staging, no reads
  read+dma         "read ring" and "dma" at the same time, on separate threads
  pipeline         each thread reads a unit, starts its device copy, reads the next
                   (the backend's loop, minus its bookkeeping)
  backend ck-*     DiskBackend page-cache warm load, preadv timed through the OS seam
  memcpy           torch CPU tensor copy with --threads threads (host memory bandwidth)

Run on the GPU host: ``PYTHONPATH=. python3 scripts/probe_pagecache_load.py --dir /tmp``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from kvoffload.bench.workload import make_caches, make_jobs, poison, run_jobs, verify
from kvoffload.bench.ceilings import RawFile, run_threads, warm
from kvoffload.device import BlockLayout, alloc_host, make_device, resolve_device
from kvoffload.disk_backend import DiskBackend
from kvoffload.os_calls import OsCalls

MiB, GiB = 1 << 20, 1 << 30
SLOT = 2 * MiB
TENSORS = 64  # llama layout: 64 x 32 KiB per 2 MiB block


class TimedOsCalls(OsCalls):
    """Counts preadv calls and their wall time (all threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.seconds = 0.0

    def preadv(self, fd, buffers, offset):
        t0 = time.perf_counter()
        try:
            return super().preadv(fd, buffers, offset)
        finally:
            dt = time.perf_counter() - t0
            with self.lock:
                self.calls += 1
                self.seconds += dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".")
    p.add_argument("--threads", default="8,16")
    p.add_argument("--units", default="1,2,4,8", help="rows (2 MiB slots) per unit, comma-separated")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--file-gib", type=float, default=4.0)
    p.add_argument("--backend-gib", type=float, default=2.0)
    a = p.parse_args()
    device = resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    dev = make_device(device)
    table: list[tuple[str, int, int, float, str]] = []

    def add(name, threads, rows, gib_s, extra=""):
        table.append((name, threads, rows, gib_s, extra))
        print(f"  {name:<22} {threads:>3} thr {rows:>2} rows {gib_s:7.2f} GiB/s  {extra}", file=sys.stderr, flush=True)

    work = tempfile.mkdtemp(prefix="kvoffload-probe-", dir=a.dir)
    raw = RawFile(work, int(a.file_gib * GiB))
    raw.fill()
    warm([raw])
    nslots = raw.size // SLOT
    n_blocks = int(a.backend_gib * GiB) // SLOT
    caches, ref = make_caches(device, n_blocks, [SLOT // TENSORS] * TENSORS, 1)
    layout = BlockLayout.from_caches(caches)

    def reader(buf_rows: list[torch.Tensor]):
        mvs = [memoryview(b.numpy()).cast("B") for b in buf_rows]

        def body(k, deadline):
            rng = np.random.default_rng(k)
            moved = calls = 0
            spent = 0.0
            while time.perf_counter() < deadline:
                off = int(rng.integers(nslots)) * SLOT
                t0 = time.perf_counter()
                got = os.preadv(raw.buffered_fd, [mvs[calls % len(mvs)]], off)
                spent += time.perf_counter() - t0
                assert got == SLOT
                moved += got
                calls += 1
            return moved, calls, spent
        return body

    def report(name, t, rows, wall, res):
        moved = sum(r[0] for r in res)
        calls = sum(r[1] for r in res)
        us = 1e6 * sum(r[2] for r in res) / calls if calls else 0.0
        add(name, t, rows, moved / wall / GiB, f"preadv {us:5.0f} us" if calls else "")

    def dma(k, deadline, ring, rows, first_row, seed):
        stream = dev.bind_thread(None)
        moved, u = 0, 0
        blocks = np.random.default_rng(seed + k).permutation(n_blocks)
        while time.perf_counter() < deadline:
            r0 = first_row if first_row is not None else (u % 2) * rows
            ids = [int(b) for b in blocks[(u * rows) % (n_blocks - rows):][:rows]]
            dev.copy_to_device(stream, layout, ring[k], range(r0, r0 + rows), ids).synchronize()
            moved += rows * SLOT
            u += 1
        return moved, 0, 0.0

    def pipeline(k, deadline, ring, rows):
        """The backend's load loop without its bookkeeping: read a unit, start its copy, read the next."""
        stream = dev.bind_thread(None)
        mv = memoryview(ring[k].numpy()).cast("B")
        rng = np.random.default_rng(k)
        moved = calls = u = 0
        spent = 0.0
        ev = None
        while time.perf_counter() < deadline:
            half = u % 2
            for r in range(rows):
                row = half * rows + r
                t0 = time.perf_counter()
                got = os.preadv(raw.buffered_fd, [mv[row * SLOT:(row + 1) * SLOT]], int(rng.integers(nslots)) * SLOT)
                spent += time.perf_counter() - t0
                assert got == SLOT
                calls += 1
            if ev is not None:
                ev.synchronize()
            ids = [int(b) for b in rng.choice(n_blocks, rows, replace=False)]
            ev = dev.copy_to_device(stream, layout, ring[k], range(half * rows, half * rows + rows), ids)
            moved += rows * SLOT
            u += 1
        if ev is not None:
            ev.synchronize()
        return moved, calls, spent

    def backend(t, rows, ck):
        for name in caches:  # the dma cases wrote staging bytes into the caches
            caches[name].copy_(ref[name])
        osc = TimedOsCalls()
        b = DiskBackend()
        b.init(caches, device, None, None, os.path.join(work, "kv.bin"), n_blocks, layout.block_bytes,
               use_page_cache=True, checksums=ck, io_threads=t, io_unit_bytes=rows * SLOT, os_calls=osc, report_load_errors=True)
        try:
            perm = np.random.default_rng(2).permutation(n_blocks)
            order = np.random.default_rng(3).permutation(n_blocks)
            store, load = make_jobs(n_blocks, perm, order, 16)
            run_jobs(b, store, True, device, layout.block_bytes)
            run_jobs(b, load, False, device, layout.block_bytes)  # warms the page cache
            poison(caches)
            osc.calls, osc.seconds = 0, 0.0
            timed, ok = run_jobs(b, load, False, device, layout.block_bytes)
            ok = ok and not b.get_block_ids_with_load_errors() and verify(caches, ref)
            us = 1e6 * osc.seconds / max(1, osc.calls)
            add(f"backend ck-{'on' if ck else 'off'}", t, rows, timed.gib_s,
                f"preadv {us:5.0f} us, cpu {timed.cpu_seconds / (timed.nbytes / GiB):.2f} s/GiB, verified={ok}")
        finally:
            b.shutdown()

    for t in [int(x) for x in a.threads.split(",")]:
        small = [alloc_host(SLOT, 4096) for _ in range(t)]
        for s in small:
            s.fill_(1)  # first touch outside the timing
        wall, res = run_threads(t, lambda k, d: reader([small[k]])(k, d), a.seconds)
        report("read reuse", t, 1, wall, res)
        del small
        for rows in [int(x) for x in a.units.split(",")]:
            # Per thread: two units of staging, as a load thread's two buffers, registered.
            staging = [alloc_host(2 * rows * SLOT, 4096) for _ in range(t)]
            ring = [s.view(2 * rows, SLOT) for s in staging]
            for s in staging:
                s.fill_(1)
                dev.pin(s)
            try:
                wall, res = run_threads(t, lambda k, d: reader(list(ring[k]))(k, d), a.seconds)
                report("read ring", t, rows, wall, res)
                wall, res = run_threads(t, lambda k, d: dma(k, d, ring, rows, None, 0), a.seconds)
                report("dma", t, rows, wall, res)
                both: list = [None, None]

                def group(i):  # reads into the first unit of each buffer, DMA from the second
                    if i == 0:
                        both[0] = run_threads(t, lambda k, d: reader(list(ring[k][:rows]))(k, d), a.seconds)
                    else:
                        both[1] = run_threads(t, lambda k, d: dma(k, d, ring, rows, rows, 100), a.seconds)

                gs = [threading.Thread(target=group, args=(i,)) for i in range(2)]
                for g in gs:
                    g.start()
                for g in gs:
                    g.join()
                report("read+dma: the reads", t, rows, *both[0])
                report("read+dma: the dma", t, rows, *both[1])
                wall, res = run_threads(t, lambda k, d: pipeline(k, d, ring, rows), a.seconds)
                report("pipeline", t, rows, wall, res)
            finally:
                for s in staging:
                    dev.unpin(s)
            del staging, ring
            for ck in (False, True):
                backend(t, rows, ck)

        torch.set_num_threads(t)
        src = torch.ones(GiB, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        add("memcpy 1 GiB", t, 0, 4 / (time.perf_counter() - t0), "(read+write: twice that in DRAM traffic)")
        del src, dst

    raw.close()
    os.rmdir(work)
    print(f"\npage-cache load pieces on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"{os.cpu_count()} CPUs, {a.seconds} s per case, random 2 MiB slots of a warm {a.file_gib} GiB file")
    print("rows: 2 MiB slots per unit (staging per thread = 2 units); preadv: mean time of one 2 MiB preadv")
    print(f"{'case':<22} {'thr':>4} {'rows':>4} {'GiB/s':>8}  notes")
    for name, t, r, g, extra in table:
        print(f"{name:<22} {t:>4} {r:>4} {g:8.2f}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
