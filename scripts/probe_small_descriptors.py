"""Small per-tensor pieces: DMA descriptors against GPU kernels on mapped pinned memory.

For each layout, ``--threads`` threads move 16 MiB units between registered host
staging ([rows, slot] packed) and the per-tensor device caches, each on its own
stream, two ways:

  dma      Device.copy_to_device / copy_to_host on a plain stream: one
           cuMemcpyBatchAsync descriptor per (tensor, block)
  staged   the same calls on a stream from bind_thread(layout, rows, to_host): where
           ``CudaDevice.stages`` says so for that direction, through device staging
           rows (one descriptor per row, then the gather/scatter kernels)
  kernel   per cache tensor one index_copy_ (H2D) or index_select + copy (D2H)
           kernel that reads or writes the host staging directly through its
           device mapping (zero-copy over PCIe), no DMA descriptors

Every byte is checked after each case. Run on the GPU host:
``PYTHONPATH=. python3 scripts/probe_small_descriptors.py``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from kvoffload.bench.ceilings import run_threads
from kvoffload.cuda_device import CudaDevice
from kvoffload.device import BlockLayout, alloc_host, copy_rows, resolve_device

MiB, GiB = 1 << 20, 1 << 30
LAYOUTS = {"llama": (64, 32 << 10), "mla": (61, 18432), "many": (128, 8 << 10), "small": (64, 1 << 10)}


class _Mapped:
    """Registered host memory seen as a CUDA array (UVA: the device uses the host address)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    a = p.parse_args()
    device = resolve_device("cuda")
    dev = CudaDevice(device)
    table = []
    for name in a.layouts.split(","):
        count, tb = LAYOUTS[name]
        slot = count * tb
        rows = max(1, (16 * MiB) // slot)
        n_blocks = max(4 * rows, (1 * GiB) // slot)
        caches = {f"l{i}": torch.randint(-128, 128, (n_blocks, tb), dtype=torch.int8, device=device)
                  for i in range(count)}
        ref = {k: v.clone() for k, v in caches.items()}
        layout = BlockLayout.from_caches(caches)
        staging = [alloc_host(rows * slot, 4096) for _ in range(a.threads)]
        for s in staging:
            dev.pin(s)
        hosts = [s.view(rows, slot) for s in staging]
        mapped = [torch.as_tensor(_Mapped(s.data_ptr(), s.numel()), device=device).view(torch.int8).view(rows, slot)
                  for s in staging]
        # Each thread owns a disjoint share of the blocks, so the device side can be checked.
        shares = np.array_split(np.random.default_rng(0).permutation(n_blocks), a.threads)

        def body(how, to_dev, k, deadline):
            stream = dev.bind_thread(None, layout, rows, to_host=not to_dev) if how == "staged" else dev.bind_thread(None)
            ev = dev.new_event()
            mine = shares[k]
            units = [mine[i:i + rows] for i in range(0, len(mine) - rows + 1, rows)]
            u = moved = 0
            ids: list[int] = []
            while time.perf_counter() < deadline:
                ids = [int(x) for x in units[u % len(units)]]
                if how in ("dma", "staged"):
                    if to_dev:
                        dev.copy_to_device(stream, layout, hosts[k], range(len(ids)), ids, event=ev)
                    else:
                        dev.copy_to_host(stream, layout, ids, hosts[k], range(len(ids)), event=ev)
                else:
                    with torch.cuda.stream(stream):
                        idx = torch.tensor(ids, dtype=torch.long, device=device)
                        copy_rows(layout, idx, mapped[k], None, to_host=not to_dev)
                    ev.record(stream)
                ev.synchronize()
                moved += len(ids) * slot
                u += 1
            return moved, ids

        for how in ("dma", "staged", "kernel"):
            for to_dev in (False, True):
                wall, out = run_threads(a.threads, lambda k, d: body(how, to_dev, k, d), a.seconds)
                # The last unit each thread moved: staging rows and device blocks must agree,
                # and after a store both must equal the reference.
                ok = all(_same(caches, ref if not to_dev else None, layout, hosts[k], ids)
                         for k, (_, ids) in enumerate(out))
                table.append((name, how, "h2d" if to_dev else "d2h", sum(m for m, _ in out) / wall / GiB,
                              "ok" if ok else "FAIL"))
                print(f"  {table[-1]}", file=sys.stderr, flush=True)
                if to_dev:  # the loads wrote staging bytes into blocks: restore for the next case
                    for key in caches:
                        caches[key].copy_(ref[key])
        for s in staging:
            dev.unpin(s)
        del caches, ref, staging, hosts, mapped
        torch.cuda.empty_cache()
    print(f"\nsmall pieces on {torch.cuda.get_device_name()}, {a.threads} threads, 16 MiB units, {a.seconds} s")
    print(f"{'layout':<8} {'how':<7} {'dir':<4} {'GiB/s':>7}  check")
    for name, how, d, g, ok in table:
        print(f"{name:<8} {how:<7} {d:<4} {g:7.2f}  {ok}")
    return 0


def _same(caches, ref, layout, host, ids) -> bool:
    """Block ids[j] of every cache equals staging row j (and the reference, when given)."""
    h = host.view(torch.int8)
    for j, blk in enumerate(ids):
        for (key, cache), off in zip(caches.items(), layout.offsets):
            b = cache.shape[1]
            row = h[j, off:off + b]
            if not torch.equal(cache[blk].cpu(), row):
                return False
            if ref is not None and not torch.equal(ref[key][blk].cpu(), row):
                return False
    return True


if __name__ == "__main__":
    sys.exit(main())
