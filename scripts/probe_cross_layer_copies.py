"""How fast vLLM's CPU tier moves a prompt's KV between pinned host memory and the GPU.

vLLM v0.19.1's OffloadingConnector asks for the cross-layer layout, so each 16-token block
of a rank is one contiguous page (Qwen3-32B at TP 2: 64 layers x 2 x 16 tokens x 4 KV
heads x 128 x 2 B = 2 MiB), and a transfer job is one ``cudaMemcpyAsync`` per block on
its own stream (``kv_offload/worker/cpu_gpu.py``, ``swap_blocks``). This times such jobs:
``--blocks`` blocks (1,000 = a 16K-token prompt) at scattered host pages, each direction,
``--repeats`` times, beside one contiguous copy of the same bytes (the link's ceiling).
kvsim's CPU tier takes the ``h200-ramdrive`` profile's PCIe rates (48.0 GiB/s H2D, 48.8
D2H) for the llm-d scenario's H100 hosts; this checks them on the GPU it runs on.

Run on the GPU host: ``PYTHONPATH=. python3 scripts/probe_cross_layer_copies.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

MiB, GiB = 1 << 20, 1 << 30


def timed(stream: torch.cuda.Stream, fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1000, help="blocks per job (default 1000: a 16K-token prompt)")
    p.add_argument("--block-mib", type=float, default=2.0, help="bytes of one block, all layers (default 2 MiB)")
    p.add_argument("--host-blocks", type=int, default=3000, help="pinned host pages to scatter over")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    page = int(a.block_mib * MiB)
    host = torch.empty((a.host_blocks, page), dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty((a.blocks * 2, page), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)

    def job(h2d: bool) -> float:
        src_pages = torch.randperm(a.host_blocks, generator=gen)[: a.blocks].tolist()
        dst_pages = torch.randperm(a.blocks * 2, generator=gen)[: a.blocks].tolist()

        def run() -> None:
            for s, d in zip(src_pages, dst_pages):
                if h2d:
                    gpu[d].copy_(host[s], non_blocking=True)
                else:
                    host[s].copy_(gpu[d], non_blocking=True)
        return timed(stream, run)

    flat_host = host[: a.blocks].view(-1)
    flat_gpu = gpu[: a.blocks].view(-1)
    rows = {"per-block H2D": lambda: job(True), "per-block D2H": lambda: job(False),
            "one copy H2D": lambda: timed(stream, lambda: flat_gpu.copy_(flat_host, non_blocking=True)),
            "one copy D2H": lambda: timed(stream, lambda: flat_host.copy_(flat_gpu, non_blocking=True))}
    for fn in rows.values():  # warm up
        fn()
    seconds: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(a.repeats):  # interleaved
        for k, fn in rows.items():
            seconds[k].append(fn())
    nbytes = a.blocks * page
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; job: {a.blocks} blocks of "
          f"{page / MiB:g} MiB = {nbytes / GiB:.2f} GiB, {a.repeats} repeats each, interleaved")
    print(f"{'copy':16} {'median ms':>10} {'GiB/s median':>13} {'GiB/s min-max':>15}")
    for k, s in seconds.items():
        rates = [nbytes / GiB / x for x in s]
        print(f"{k:16} {statistics.median(s) * 1e3:10.1f} {statistics.median(rates):13.1f} "
              f"{min(rates):7.1f}-{max(rates):<7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
