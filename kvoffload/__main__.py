"""`python -m kvoffload`: a store/load round trip through a real slot file, with throughput.

A quick check that a disk path works (O_DIRECT, space, permissions) and how fast
the whole pipeline moves blocks on this machine. Runs on CPU tensors unless
``--device cuda`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from kvoffload.disk_backend import DiskBackend
from kvoffload.slot_file import round_up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvoffload", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory for the slot file (default: a temp dir here)")
    p.add_argument("--mib", type=int, default=256, help="MiB to store and load (default 256)")
    p.add_argument("--tensors", type=int, default=64, help="cache tensors per block (default 64)")
    p.add_argument("--tensor-kib", type=int, default=32, help="KiB per tensor per block (default 32)")
    p.add_argument("--page-cache", action="store_true", help="use the page cache instead of O_DIRECT")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    block = a.tensors * a.tensor_kib * 1024
    nblocks = max(1, (a.mib << 20) // block)
    caches = {
        f"layer{i}": torch.randint(-128, 128, (nblocks, a.tensor_kib * 1024), dtype=torch.int8).to(device)
        for i in range(a.tensors)
    }
    want = {k: v.clone() for k, v in caches.items()}
    with tempfile.TemporaryDirectory(dir=a.dir or os.getcwd(), prefix=".kvoffload-") as d:
        b = DiskBackend()
        b.init(caches, device, None, None, os.path.join(d, "kv.bin"), nblocks, block,
               use_page_cache=a.page_cache, report_load_errors=True, capacity_bytes=nblocks * round_up(block, 4096))
        try:
            rates = {}
            for name, is_store in (("store", True), ("load", False)):
                if not is_store:
                    for t in caches.values():
                        t.zero_()
                ev: list = []
                t0 = time.perf_counter()
                b.launch_copy(list(range(nblocks)), list(range(nblocks)), is_store, 0, ev)
                ev[0][1].synchronize()
                rates[name] = nblocks * block / (time.perf_counter() - t0) / 2**30
                if not ev[0][1].ok:
                    print(f"{name} failed: see the log", file=sys.stderr)
                    return 1
        finally:
            b.shutdown()
    ok = all(torch.equal(caches[k], want[k]) for k in caches)
    print(f"kvoffload round trip: {nblocks} blocks x {block // 1024} KiB on {device}, "
          f"{'page cache' if a.page_cache else 'O_DIRECT'}")
    print(f"  store {rates['store']:.2f} GiB/s   load {rates['load']:.2f} GiB/s   bytes verified: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
