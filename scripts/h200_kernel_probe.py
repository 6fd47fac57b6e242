"""Which kernels the H200 runs for the step shapes kvsim's GPU model misses (docs/kvsim.md,
"The GPU's step time"): each linear layer's GEMM alone, and a prefill chunk's attention
alone after a cached context, timed from CUDA graphs, with the kernel names the profiler
saw; each GEMM in both layouts (x @ W, and vLLM's F.linear with W as outputs x inputs).
A record of a probe, not part of the package:

    PYTHONPATH=. python3 scripts/h200_kernel_probe.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from kvsim import gpucal
from kvsim.gpu import gemm_shapes
from kvsim.models import get_model

STACKS = (("qwen3-32b", 1), ("qwen3-32b", 2), ("llama3-70b", 4), ("llama3-8b", 1))
TOKENS = (64, 96, 128, 160, 192, 256, 320, 384, 512)
CHUNKS = ((256, 0), (256, 1024), (256, 2048), (256, 4096), (256, 8192), (256, 16384), (2048, 0), (2048, 4096))


def timed(fn) -> tuple[float, list[str]]:
    """Median ms of 30 graph replays of ``fn``, and the CUDA kernels one run launches."""
    ms, _ = gpucal._time(torch, fn, "cuda", 5, 30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return statistics.median(ms), names


def main(out: str) -> None:
    doc = {"machine": gpucal.machine("cuda"), "flash_impls": [], "gemms": [], "attention": []}
    try:
        from torch.nn.attention import list_flash_attention_impls
        doc["flash_impls"] = list(list_flash_attention_impls())
    except ImportError as e:
        doc["flash_impls"] = [f"none: {e}"]
    dt = torch.bfloat16
    for name, tp in STACKS:
        m = get_model(name)
        for label, (n, k) in zip(("qkv", "o", "gate_up", "down"), gemm_shapes(m, tp)):
            # Both layouts: x @ W with W (K, N), and vLLM's F.linear(x, W) with W (N, K).
            w_kn = torch.randn(k, n, device="cuda", dtype=dt)
            w_nk = w_kn.t().contiguous()
            for t in TOKENS:
                x = torch.randn(t, k, device="cuda", dtype=dt)
                for layout, fn in (("x@W", lambda: x @ w_kn), ("linear", lambda: torch.nn.functional.linear(x, w_nk))):
                    ms, kernels = timed(fn)
                    doc["gemms"].append(dict(model=name, tp=tp, gemm=label, layout=layout, m=t, n=n, k=k, ms=ms,
                                             kernels=kernels))
                    print(f"{name:10} tp={tp} {label:7} {layout:6} M={t:4} N={n:6} K={k:6} {ms * 1e3:8.1f} us  "
                          f"{kernels}", flush=True)
            del w_kn, w_nk
    st = gpucal.LayerStack(get_model("llama3-70b"), 4, 1, "cuda")
    paths = dict(gpucal._sdpa_paths(torch))
    for n, c in CHUNKS:
        p = gpucal.Point(prefills=((n, c),))
        inp = st.inputs(p)
        q = torch.randn(1, st.hq, n, st.dh, device="cuda", dtype=dt)
        (kc, vc), = inp["caches"][0][0]
        with torch.no_grad(), gpucal._backends(torch, "cuda"):
            ms, kernels = timed(lambda: paths["gqa"](q, kc, vc))
        flops = get_model("llama3-70b").attention_flops(n, c) / get_model("llama3-70b").layers / 4
        doc["attention"].append(dict(model="llama3-70b", tp=4, new=n, cached=c, ms=ms, tflops=flops / ms / 1e9,
                                     kernels=kernels))
        print(f"attention llama3-70b tp=4 new={n} cached={c}: {ms * 1e3:8.1f} us, {flops / ms / 1e9:6.1f} TFLOP/s "
              f"{kernels}", flush=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("flash attention impls:", doc["flash_impls"])


if __name__ == "__main__":
    main(sys.argv[1])
