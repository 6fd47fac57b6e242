"""Where the time goes on fast drives: DiskBackend variants against raw IO, with stage seconds.

Run on the GPU host over RAM-backed drives (docs/performance.md, "fast storage"):
``PYTHONPATH=. python3 scripts/probe_fast_storage.py --dir /mnt/d0 [--dir /mnt/d1 ...] --gib 8``.
For each variant (IO threads per lane, unit MiB, seal, blocking events) it stores every block
of a llama-like layout (64 x 32 KiB = 2 MiB) to random slots of a fresh file, rewrites them,
loads them back cold, checks every byte, and prints GiB/s with the IO threads' seconds per
stage (``DiskBackend.stats()``). Raw O_DIRECT ceilings are measured twice: each thread with
one reused 2 MiB buffer (what the benchmark's raw case does), and cycling through as much
memory as the backend's staging (on a RAM drive the kernel copies with the CPU, so a buffer
that stays in the cache is faster than any real pipeline's).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

from kvoffload.bench.ceilings import RawFile, run_io
from kvoffload.device import alloc_host, random_caches, resolve_device
from kvoffload.disk_backend import DiskBackend

MiB, GiB = 1 << 20, 1 << 30
BLOCK = 2 * MiB


def raw_cycling(files: list[RawFile], qd: int, footprint: int, is_write: bool, seconds: float) -> float:
    """GiB/s of ``qd`` threads per file, each cycling through footprint/qd bytes of buffers."""
    import threading

    per_thread = max(BLOCK, footprint // (qd * len(files)))
    moved = [0] * (qd * len(files))
    start = threading.Barrier(len(moved) + 1)

    def worker(k: int, f: RawFile) -> None:
        buf = alloc_host(per_thread, 4096)
        views = [memoryview(buf.numpy())[i:i + BLOCK] for i in range(0, per_thread - BLOCK + 1, BLOCK)]
        rng = np.random.default_rng(k)
        offs = (rng.permutation(f.size // BLOCK) * BLOCK).tolist()
        call = os.pwritev if is_write else os.preadv
        start.wait()
        deadline = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < deadline:
            moved[k] += call(f.direct_fd, [views[i % len(views)]], offs[i % len(offs)])
            i += 1

    ts = [threading.Thread(target=worker, args=(k, files[k % len(files)])) for k in range(len(moved))]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return sum(moved) / (time.perf_counter() - t0) / GiB


def one_variant(dirs, n, caches, ref, threads, unit_mib, seal, blocking, device):
    from kvoffload.cuda_device import CudaDevice

    b = DiskBackend()
    paths = [os.path.join(d, "kv.bin") for d in dirs]
    b.init(caches, device, None, None, paths[0], n, BLOCK, disk_paths=paths if len(paths) > 1 else None,
           encrypt=seal == "aes-gcm", checksums=seal == "xxh3", io_threads=threads,
           io_unit_bytes=unit_mib * MiB, report_load_errors=True,
           device_impl=CudaDevice(device, blocking_events=blocking) if device.type == "cuda" else None)
    rng = np.random.default_rng(0)
    slots = rng.permutation(n).tolist()
    per_job = 16  # 32 MiB jobs, as the benchmark
    out = {}
    try:
        for op in ("store", "rewrite", "load"):
            before = b.stats()["stage_seconds"]
            if op == "load":
                for t in caches.values():
                    t.fill_(0x5A)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ev = []
            t0 = time.perf_counter()
            c0 = time.process_time()
            for i in range(0, n, per_job):
                blocks = list(range(i, min(n, i + per_job)))
                s = [slots[x] for x in blocks]
                if op == "load":
                    b.launch_copy(s, blocks, False, i, ev)
                else:
                    b.launch_copy(blocks, s, True, i, ev)
            for _, e in ev:
                e.synchronize()
            dt = time.perf_counter() - t0
            cpu = time.process_time() - c0
            ok = all(e.ok for _, e in ev)
            after = b.stats()["stage_seconds"]
            d = "load" if op == "load" else "store"
            stages = {k: after[d].get(k, 0) - before[d].get(k, 0) for k in after[d]}
            out[op] = (n * BLOCK / dt / GiB, ok, stages, cpu / (n * BLOCK / GiB))
        good = all(torch.equal(caches[k], ref[k]) for k in caches)
    finally:
        b.shutdown()
    return out, good


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", action="append", required=True)
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--raw-seconds", type=float, default=1.5)
    p.add_argument("--variants", default="8:16:aes-gcm:0,8:16:off:0,8:16:aes-gcm:1,8:2:aes-gcm:0,16:4:aes-gcm:0",
                   help="threads:unit_mib:seal:blocking, comma separated")
    a = p.parse_args()
    device = resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(a.gib * GiB) // BLOCK
    work = [tempfile.mkdtemp(prefix=".probe-", dir=d) for d in a.dir]
    rows = []
    try:
        per = (n // len(work) + 8) * BLOCK
        raws = [RawFile(w, per) for w in work]
        try:
            for r in raws:
                r.fill()
            for qd in (2, 8):
                for kind, is_write in (("write", True), ("read", False)):
                    reused = run_io(raws, [r.direct_fd for r in raws], BLOCK, qd, is_write, a.raw_seconds).gib_s
                    footprint = len(work) * 8 * 2 * 16 * MiB  # the backend's load staging per lane
                    cyc = raw_cycling(raws, qd, footprint, is_write, a.raw_seconds)
                    rows.append(f"raw {kind:<5} qd {qd:>2} per drive: reused buffer {reused:6.2f}  "
                                f"cycling {footprint // MiB} MiB {cyc:6.2f} GiB/s")
                    print(rows[-1], file=sys.stderr, flush=True)
        finally:
            for r in raws:
                r.close()
        caches = random_caches(device, n, [32 * 1024] * 64, seed=1)
        ref = {k: v.clone() for k, v in caches.items()}
        for spec in a.variants.split(","):
            th, unit, seal, blocking = spec.split(":")
            res, good = one_variant(work, n, caches, ref, int(th), int(unit), seal, blocking == "1", device)
            for op, (gib, ok, stages, cpu) in res.items():
                st = " ".join(f"{k}={v:.1f}" for k, v in sorted(stages.items()))
                rows.append(f"{spec:<18} {op:<8} {gib:6.2f} GiB/s  cpu {cpu:.2f} s/GiB  ok={ok and good}  {st}")
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        for w in work:
            for name in os.listdir(w):
                os.unlink(os.path.join(w, name))
            os.rmdir(w)
    print(f"\nprobe_fast_storage: {len(work)} dir(s) {a.dir}, {n} blocks of 2 MiB ({a.gib} GiB), "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, {os.cpu_count()} CPUs")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
