"""``python -m kvsim calibrate gpu``: time engine steps of real layer shapes, fit gpu.py's model.

What is timed: a stack of ``depth`` decoder layers of a dense model (kvsim.models)
with random bf16 weights, as one GPU of a replica of tensor parallelism ``tp`` holds
them (heads and MLP width divided by ``tp``; the all-reduce is not timed), and the
model's head (input embedding rows, final norm, the LM head on one token per
sequence). Each layer is what vLLM runs for a dense GQA model: RMSNorm, one QKV GEMM,
per-head q/k RMSNorm (Qwen3), RoPE, attention, the output GEMM, RMSNorm, one
gate-and-up GEMM, SiLU-and-multiply, the down GEMM, two residual adds. Attention is
torch's ``scaled_dot_product_attention`` restricted to its flash and cuDNN kernels
(no flash-attn package and no vLLM there): a prefill chunk attends causally to its
cached context and itself (``causal_lower_right``, KV heads shared by ``enable_gqa``,
else expanded); a decode batch reads each sequence's cached KV once, its query heads
grouped per KV head as the queries of one row. KV lives in each layer's own dense
cache, the chunk's new KV written into it. A step = prefill chunks and decode tokens
in one forward, as vLLM batches them.

How: each shape is captured once in a CUDA graph (as vLLM replays its steps), warmed
up, then replayed ``repeats`` times between CUDA events; the median is kept. The full
model's step is ``head + layers / depth * stack``: the stack's time per layer times
the model's layers (the graph's own start, a few microseconds, is counted once per
``depth`` layers).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvoffload.cli_args import read_json, require
from kvsim import allreduce
from kvsim.limits import (MAX_BYTES, MAX_COUNT, MAX_MS, MAX_TOKENS, MAX_TP, MIN_MS, integer_in, integer_range,
                          number_in, number_range)
from kvsim.gpu import SMS, SPLITS, TILES, EngineKernels, GpuProfile, StepFit
from kvsim.models import MODELS, ModelShape, get_model

# The sizes kvsim's engine runs: chunks up to max_num_batched_tokens (8192), contexts up
# to 32K, decode batches up to 512 sequences; decode KV kept within what one GPU holds
# (a quarter million tokens: the 32B model's 58-78 GB of KV).
PREFILL = ((16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0),
           (256, 4096), (2048, 4096), (8192, 4096), (256, 16384), (2048, 16384), (8192, 16384),
           (256, 32768), (1024, 32768))
DECODE = ((1, 512), (1, 16384), (4, 4096), (16, 512), (16, 4096), (16, 16384), (32, 2048), (64, 512),
          (64, 4096), (128, 512), (128, 2048), (256, 512), (256, 1024), (512, 512))
# Mixed steps: one prefill chunk beside a decode batch, what chunked prefill forms.
MIXED = (((2048, 0), (32, 4096)), ((512, 8192), (64, 2048)), ((7936, 0), (256, 512)), ((256, 16000), (16, 16384)))
# A smoke-test grid (CPU, tiny shapes): every path once.
SMOKE_PREFILL = ((16, 0), (64, 32))
SMOKE_DECODE = ((2, 64),)
SMOKE_MIXED = (((32, 0), (2, 64)),)


@dataclass(frozen=True)
class Point:
    """One step's shape: prefill chunks ``(new, cached)`` and decodes ``(sequences, context)``."""

    prefills: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, int] = (0, 0)

    @property
    def kind(self) -> str:
        return "mixed" if self.prefills and self.decode[0] else "prefill" if self.prefills else "decode"

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + self.decode[0]

    @property
    def seqs(self) -> int:
        return len(self.prefills) + self.decode[0]


def grid(smoke: bool = False) -> list[Point]:
    pre, dec, mix = (SMOKE_PREFILL, SMOKE_DECODE, SMOKE_MIXED) if smoke else (PREFILL, DECODE, MIXED)
    return ([Point(prefills=(p,)) for p in pre] + [Point(decode=d) for d in dec]
            + [Point(prefills=(p,), decode=d) for p, d in mix])


@dataclass
class Measurement:
    model: str
    tp: int
    prefills: list[list[int]]
    decode: list[int]
    depth: int  # layers in the timed stack
    stack_ms: float  # median of the stack's replays
    stack_ms_range: list[float]  # min, max
    head_ms: float
    step_ms: float  # the full model: head + layers / depth * stack
    attention: str  # which attention path ran
    graph: bool  # replayed from a CUDA graph
    repeats: int
    kind: str = ""
    tokens: int = 0
    seqs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    kernels: str = "eager"  # the layers' own ops: each its own kernel, or fused by torch.compile


def _torch():
    import torch
    return torch


class LayerStack:
    """``depth`` decoder layers and the head of ``m`` as one GPU of ``tp`` holds them."""

    def __init__(self, m: ModelShape, tp: int, depth: int, device: str) -> None:
        torch = _torch()
        if not m.buildable:
            raise ValueError(f"{m.name}: not a dense transformer kvsim can build")
        if m.q_heads % tp or m.intermediate % tp or (m.kv_heads % tp and tp % m.kv_heads):
            raise ValueError(f"{m.name}: its heads and MLP do not divide by tp={tp}")
        self.torch = torch
        self.m, self.tp, self.depth, self.device = m, tp, depth, device
        self.hq, self.hkv, self.dh = m.q_heads // tp, max(1, m.kv_heads // tp), m.head_dim
        self.group = self.hq // self.hkv
        inter = m.intermediate // tp
        dt = torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)

        # A linear layer's weight is (outputs, inputs) and runs as F.linear, x @ W^T: vLLM's
        # layout and call for unquantized layers (default_unquantized_gemm). cuBLAS picks
        # its kernel per layout and shape, so x @ W with W (inputs, outputs) times other kernels.
        def w(out: int, inp: int) -> Any:  # random weights, scaled so activations stay finite
            return torch.randn(out, inp, generator=g, device=device, dtype=dt) * (inp ** -0.5)

        h = m.hidden
        self.layers = []
        for _ in range(depth):
            self.layers.append(dict(
                ln1=torch.ones(h, device=device, dtype=dt), ln2=torch.ones(h, device=device, dtype=dt),
                qkv=w((self.hq + 2 * self.hkv) * self.dh, h), o=w(h, self.hq * self.dh),
                gate_up=w(2 * inter, h), down=w(h, inter),
                qn=torch.ones(self.dh, device=device, dtype=dt) if m.qk_norm else None,
                kn=torch.ones(self.dh, device=device, dtype=dt) if m.qk_norm else None))
        vocab = m.vocab // tp  # vocabulary-parallel embedding and LM head
        self.embed = w(vocab, h)
        self.lm_head = w(vocab, h)
        self.final_norm = torch.ones(h, device=device, dtype=dt)
        # vLLM compiles each layer's code between attention calls with torch.compile
        # (inductor, the token count symbolic) and replays the pieces from CUDA graphs:
        # the "compiled" kernels time that, the norms, RoPE, SiLU and residual adds fused
        # by inductor around the same GEMMs; "eager" runs each torch op as its own kernel.
        # (torch.compile is lazy: nothing compiles until a "compiled" step runs.)
        self.kernels = {"eager": (self._pre, self._post),
                        "compiled": (torch.compile(self._pre, dynamic=True, fullgraph=True),
                                     torch.compile(self._post, dynamic=True, fullgraph=True))}

    # -- one step ---------------------------------------------------------------------------

    def inputs(self, p: Point) -> dict[str, Any]:
        """The step's activations and each layer's KV cache for shape ``p``."""
        torch = self.torch
        dev, dt = self.device, torch.bfloat16
        t = p.tokens
        pos = torch.arange(t, device=dev, dtype=torch.float32)
        inv = 1.0 / (1e6 ** (torch.arange(0, self.dh, 2, device=dev, dtype=torch.float32) / self.dh))
        ang = torch.outer(pos, inv)
        caches = []
        for _ in range(self.depth):
            pre = [(torch.zeros(1, self.hkv, c + n, self.dh, device=dev, dtype=dt),
                    torch.zeros(1, self.hkv, c + n, self.dh, device=dev, dtype=dt)) for n, c in p.prefills]
            b, ctx = p.decode
            dec = ((torch.randn(b, self.hkv, ctx, self.dh, device=dev, dtype=dt),
                    torch.randn(b, self.hkv, ctx, self.dh, device=dev, dtype=dt)) if b else None)
            caches.append((pre, dec))
        return dict(x=torch.randn(t, self.m.hidden, device=dev, dtype=dt),
                    ids=torch.randint(0, self.m.vocab // self.tp, (t,), device=dev),
                    last=torch.tensor(_last_tokens(p), device=dev),
                    cos=torch.cat([ang.cos()] * 2, dim=-1).to(dt)[:, None, :],
                    sin=torch.cat([ang.sin()] * 2, dim=-1).to(dt)[:, None, :],
                    caches=caches, point=p)

    def stack(self, inp: dict[str, Any], attention: Callable, kernels: str = "eager") -> Any:
        """The layers' forward over the step's tokens, with the ``kernels`` named."""
        x, cos, sin = inp["x"], inp["cos"], inp["sin"]
        pre, post = self.kernels[kernels]
        for layer, cache in zip(self.layers, inp["caches"]):
            q, k, v = pre(x, layer["ln1"], layer["qkv"], layer["qn"], layer["kn"], cos, sin)
            x = post(x, attention(q, k, v, cache, inp["point"]), layer["o"], layer["ln2"], layer["gate_up"],
                          layer["down"])
        return x

    def _pre(self, x, ln1, qkv, qn, kn, cos, sin):
        """A layer before attention: RMSNorm, the QKV GEMM, q/k RMSNorm, RoPE."""
        F = self.torch.nn.functional
        t, hq, hkv, dh = x.shape[0], self.hq, self.hkv, self.dh
        hs = F.rms_norm(x, (x.shape[-1],), ln1, 1e-6)
        q, k, v = F.linear(hs, qkv).split([hq * dh, hkv * dh, hkv * dh], dim=-1)
        q, k, v = q.view(t, hq, dh), k.view(t, hkv, dh), v.view(t, hkv, dh)
        if qn is not None:
            q = F.rms_norm(q, (dh,), qn, 1e-6)
            k = F.rms_norm(k, (dh,), kn, 1e-6)
        q = q * cos + self.torch.cat([-q[..., dh // 2:], q[..., : dh // 2]], dim=-1) * sin
        k = k * cos + self.torch.cat([-k[..., dh // 2:], k[..., : dh // 2]], dim=-1) * sin
        return q, k, v

    def _post(self, x, o, wo, ln2, gate_up, down):
        """A layer after attention: the output GEMM, the residual, RMSNorm, the MLP, the residual."""
        F = self.torch.nn.functional
        x = x + F.linear(o, wo)
        hs = F.rms_norm(x, (x.shape[-1],), ln2, 1e-6)
        gate, up = F.linear(hs, gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, down)

    def head(self, inp: dict[str, Any]) -> Any:
        """Embedding rows of the step's tokens, the final norm, logits of one token per sequence."""
        F = self.torch.nn.functional
        e = self.embed[inp["ids"]]
        hs = F.rms_norm(e, (e.shape[-1],), self.final_norm, 1e-6)
        return F.linear(hs[inp["last"]], self.lm_head)


def _last_tokens(p: Point) -> list[int]:
    """Each sequence's last token in the step: the one whose logits the head computes."""
    ends, off = [], 0
    for n, _ in p.prefills:
        off += n
        ends.append(off - 1)
    return ends + list(range(off, off + p.decode[0]))


# -- attention --------------------------------------------------------------------------------


def _sdpa_paths(torch) -> list[tuple[str, Callable]]:
    """Ways to run a prefill chunk's attention, best first; each raises if its kernels
    cannot run the shape (sdpa is held to flash and cuDNN, never the memory-hungry math)."""
    from torch.nn.attention.bias import causal_lower_right
    F = torch.nn.functional

    def gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              enable_gqa=True)

    def expanded(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))

    return [("gqa", gqa), ("expanded-kv", expanded)]


def _backends(torch, device: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device == "cpu":  # the CPU's flash kernel, for the smoke test
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def _kernel(torch, st: "LayerStack", p: Point) -> str:
    """The kernel torch's causal attention takes for the step's first chunk, by the checks
    ``CausalBias`` makes (flash, else memory-efficient, else a materialised mask)."""
    if not p.prefills or st.device == "cpu":
        return "flash" if not p.prefills else "cpu"
    n, c = p.prefills[0]
    if c == 0:
        return "flash (is_causal)"
    try:
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
        q = torch.empty(1, st.hq, n, st.dh, device=st.device, dtype=torch.bfloat16)
        k = torch.empty(1, st.hkv, c + n, st.dh, device=st.device, dtype=torch.bfloat16)
        params = SDPAParams(q, k, k, None, 0.0, False, True)
        return ("flash" if can_use_flash_attention(params) else
                "efficient" if can_use_efficient_attention(params) else "masked")
    except Exception as e:  # an older torch's SDPAParams: not known
        return f"unknown ({type(e).__name__})"


def make_attention(torch, prefill_path: Callable) -> Callable:
    """The step's attention: each prefill chunk, then the decode batch, in token order."""
    F = torch.nn.functional

    def attention(q, k, v, cache, p: Point):
        pre, dec = cache
        outs, off = [], 0
        hq, dh = q.shape[1], q.shape[2]
        for (n, c), (kc, vc) in zip(p.prefills, pre):
            kc[0, :, c:c + n].copy_(k[off:off + n].transpose(0, 1))
            vc[0, :, c:c + n].copy_(v[off:off + n].transpose(0, 1))
            qi = q[off:off + n].transpose(0, 1).unsqueeze(0)
            outs.append(prefill_path(qi, kc, vc)[0].transpose(0, 1).reshape(n, hq * dh))
            off += n
        b = p.decode[0]
        if b:
            kc, vc = dec
            hkv = kc.shape[1]
            kc[:, :, -1].copy_(k[off:off + b])  # the new token's KV into its slot
            vc[:, :, -1].copy_(v[off:off + b])
            qd = q[off:off + b].view(b, hkv, hq // hkv, dh)  # a KV head's query heads as rows
            outs.append(F.scaled_dot_product_attention(qd, kc, vc).reshape(b, hq * dh))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return attention


# -- timing -----------------------------------------------------------------------------------


def _time(torch, fn: Callable[[], Any], device: str, warmup: int, repeats: int) -> tuple[list[float], bool]:
    """Milliseconds of ``repeats`` runs of ``fn`` after ``warmup``: replayed from a CUDA graph
    between CUDA events on a GPU (eagerly if capture fails), wall clock on a CPU."""
    if device == "cpu":
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out, False
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture stream, as torch's docs ask
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run, used = graph.replay, True
    except Exception:  # a shape the graph cannot capture: timed eagerly, and said so
        graph, run, used = None, fn, False
    for _ in range(warmup):
        run()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    del graph
    return out, used


def measure(m: ModelShape, tp: int, points: Sequence[Point], device: str = "cuda", depth: int = 4,
            warmup: int = 3, repeats: int = 15, deadline: float = math.inf,
            say: Callable[[str], None] = print, kernels: Sequence[str] = ("eager",)) -> list[Measurement]:
    """Time each point's step of ``m`` at ``tp`` with each of ``kernels`` in turn (a point's
    kernels timed one after the other, so that they compare on the same machine state);
    stop before ``deadline`` (time.monotonic)."""
    torch = _torch()
    if "compiled" in kernels:
        # Each stack compiles its own shapes: none of an earlier stack's graphs kept, and no
        # recompilation limit reached (past it torch would run the ops eagerly, unsaid).
        torch._dynamo.reset()
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, limit, max(getattr(cfg, limit), 64))
    st = LayerStack(m, tp, depth, device)
    paths = _sdpa_paths(torch)
    out = []
    for p in points:
        if time.monotonic() > deadline:
            say(f"  {m.name} tp={tp}: time budget spent, {len(points) - len(out) // len(kernels)} shapes not timed")
            break
        inp = st.inputs(p)
        chosen, err = None, None
        with torch.no_grad(), _backends(torch, device):
            for name, path in paths if p.prefills else paths[:1]:
                attention = make_attention(torch, path)
                try:
                    st.stack(inp, attention)
                    if device != "cpu":
                        torch.cuda.synchronize()
                    chosen = name
                    break
                except Exception as e:  # this path's kernels cannot run the shape: the next
                    err = e
            if chosen is None:
                say(f"  {m.name} tp={tp} {p}: no attention path ran ({type(err).__name__}: {err}); skipped")
                continue
            head_ms, _ = _time(torch, lambda: st.head(inp), device, warmup, repeats)
            kernel = _kernel(torch, st, p)
            for kind in kernels:
                stack_ms, graphed = _time(torch, lambda: st.stack(inp, attention, kind), device, warmup, repeats)
                out.append(_record(m, tp, p, depth, stack_ms, head_ms, chosen, graphed, repeats, kind, kernel,
                                   device, say))
        del inp
        if device != "cpu":
            torch.cuda.empty_cache()
    del st
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def _record(m: ModelShape, tp: int, p: Point, depth: int, stack_ms: list[float], head_ms: list[float], chosen: str,
            graphed: bool, repeats: int, kernels: str, kernel: str, device: str,
            say: Callable[[str], None]) -> Measurement:
    med, head = statistics.median(stack_ms), statistics.median(head_ms)
    r = Measurement(m.name, tp, [list(x) for x in p.prefills], list(p.decode), depth, round(med, 5),
                    [round(min(stack_ms), 5), round(max(stack_ms), 5)], round(head, 5),
                    round(head + m.layers / depth * med, 4), ("sdpa-" + chosen) if p.prefills else "sdpa-grouped",
                    graphed, repeats, p.kind, p.tokens, p.seqs, {"kernel": kernel}, kernels)
    say(f"  {m.name:10} tp={tp} {kernels:8} {p.kind:7} pre={r.prefills!s:16} dec={r.decode!s:12} step "
        f"{r.step_ms:9.3f} ms (stack {med:.3f} [{min(stack_ms):.3f}-{max(stack_ms):.3f}], head {head:.3f}; "
        f"{r.attention} {kernel}{'' if graphed or device == 'cpu' else ', eager'})")
    return r


def machine(device: str) -> dict[str, Any]:
    torch = _torch()
    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
            "device": device}
    if device != "cpu":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_bytes=props.total_memory,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return info


def run(models: Iterable[tuple[ModelShape, int]], out_path: Optional[str], device: str, depth: int, budget_s: float,
        smoke: bool, command: str, write: Callable[[str, str], None],
        kernels: Sequence[str] = ("eager",)) -> dict[str, Any]:
    """Measure every (model, tp) in turn, rewriting ``out_path`` after each so that a run cut
    short still leaves what it measured; return the document."""
    deadline = time.monotonic() + budget_s
    doc: dict[str, Any] = {"commands": [command], "machine": machine(device), "measurements": []}
    print(f"kvsim: calibrate gpu on {doc['machine'].get('gpu', device)}, torch {doc['machine']['torch']}", file=sys.stderr)
    for m, tp in models:
        res = measure(m, tp, grid(smoke), device, depth, deadline=deadline,
                      say=lambda s: print(s, file=sys.stderr, flush=True), kernels=kernels)
        doc["measurements"] += [vars(r) for r in res]
        if out_path:
            write(out_path, json.dumps(doc, indent=1) + "\n")
    return doc


# -- the fit ----------------------------------------------------------------------------------

# Where the fit starts, and what it keeps when no measurement constrains it (no decode
# step: the weight and KV read rates, the knee and a decode thread block's rate): a
# device copy on this workplace's H200 moved 4.3 TB/s (library/device/KINDS.md,
# 2026-10-28 and 11-04), a block's share of it over the H200's 132 SMs; the knee [est].
START = dict(weight_gb_s=4300.0, gemm_tflops=700.0, attn_tflops=450.0, kv_gb_s=4300.0, token_layer_ns=1.0,
             layer_us=10.0, knee=4.0, kv_head_gb_s=4300.0 / 132)
DECODE_SIDE = ("weight_gb_s", "kv_gb_s", "knee", "kv_head_gb_s")


def _shape(rec: dict[str, Any]) -> tuple[ModelShape, int, int, int, float, float, int]:
    m = get_model(rec["model"])
    attn = sum(m.attention_flops(n, c) for n, c in rec["prefills"])
    b, ctx = rec["decode"]
    tokens = sum(n for n, _ in rec["prefills"]) + b
    return m, rec["tp"], tokens, len(rec["prefills"]) + b, attn, b * ctx * m.kv_bytes_per_token, b


def predicted_ms(gpu: GpuProfile, rec: dict[str, Any]) -> float:
    """The profile's time for a measured step, as ``calibrate gpu`` timed it (no all-reduce)."""
    return gpu.measured_part_s(*_shape(rec)) * 1e3


def fit_kernels(records: Sequence[dict[str, Any]]) -> str:
    """The kernels a profile is fitted to: the compiled layers, what vLLM runs, when any
    were timed; else the eager ones (an older run's measurements)."""
    return "compiled" if any(r.get("kernels") == "compiled" for r in records) else "eager"


def fitted(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a fit uses: those of ``fit_kernels``, but for those marked ``excluded``
    (with the reason); a step timed with the other kernels stays beside it, for the ratio."""
    kind = fit_kernels(records)
    return [r for r in records if not r.get("excluded") and r.get("kernels", "eager") == kind]


def fit_step(records: Sequence[dict[str, Any]], iterations: int = 300) -> StepFit:
    """The StepFit whose step times are closest to ``records``' in relative terms
    (least squares of log ratios, Levenberg-Marquardt over the logs of the parameters).
    Without a decode step among them, the decode side keeps ``START``'s values."""
    import numpy as np

    recs = fitted(records)
    fixed = {} if any(r["decode"][0] for r in recs) else {n: START[n] for n in DECODE_SIDE}
    names = [n for n in START if n not in fixed]
    shapes = [_shape(r) for r in recs]
    measured = np.log([r["step_ms"] * 1e-3 for r in recs])

    def params(theta: Any) -> StepFit:
        v = dict(zip(names, (float(x) for x in np.exp(np.clip(theta, -30, 30)))))
        if "knee" in v:
            v["knee"] = 1.0 + min(v["knee"], 32.0)  # a soft maximum between a sum (1) and the max
        return StepFit(**fixed, **v)

    def residuals(theta: Any) -> Any:
        prof = _profile(params(theta))
        return np.log([prof.measured_part_s(*s) for s in shapes]) - measured

    theta = np.log([START[n] if n != "knee" else START[n] - 1 for n in names])
    r = residuals(theta)
    lam = 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(theta)))
        for i in range(len(theta)):
            step = np.zeros_like(theta)
            step[i] = 1e-6
            jac[:, i] = (residuals(theta + step) - r) / 1e-6
        a, g = jac.T @ jac, jac.T @ r
        while lam < 1e12:
            delta = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
            trial = residuals(theta + delta)
            if trial @ trial < r @ r:
                theta, r, lam = theta + delta, trial, max(lam / 3, 1e-9)
                break
            lam *= 4
        if lam >= 1e12 or np.max(np.abs(delta)) < 1e-8:  # no step improves it: converged
            break
    return params(theta)


def _profile(fit: StepFit) -> GpuProfile:
    return GpuProfile("fit", "", 0.0, fit, 0.0, 0.0, 1.0)


def table(gpu: GpuProfile, records: Sequence[dict[str, Any]], tolerance: float) -> str:
    """Measured against fitted step times, one row a step, ``!`` past ``tolerance``."""
    lines = [f"{'model':10} {'tp':>2} {'kernels':8} {'kind':7} {'prefill (new, cached)':22} {'decode (seqs, ctx)':18} "
             f"{'measured ms':>11} {'profile ms':>10} {'error':>7}"]
    fit_kind = fit_kernels(records)
    for r in records:
        p = predicted_ms(gpu, r)
        err = p / r["step_ms"] - 1
        kind = r.get("kernels", "eager")
        mark = (" (not fitted)" if r.get("excluded") or kind != fit_kind else
                " !" if abs(err) > tolerance else "")
        lines.append(f"{r['model']:10} {r['tp']:>2} {kind:8} {r.get('kind', ''):7} {str(r['prefills']):22} "
                     f"{str(r['decode']):18} {r['step_ms']:11.3f} {p:10.3f} {100 * err:+6.1f}%{mark}")
    return "\n".join(lines)


def errors_line(gpu: GpuProfile, records: Sequence[dict[str, Any]], tolerance: float) -> str:
    """How far ``gpu``'s step times are from the fitted kinds of ``records``, in one line."""
    errors = [predicted_ms(gpu, r) / r["step_ms"] - 1 for r in fitted(records)]
    worst = max(errors, key=abs)
    return (f"worst error {100 * abs(worst):.1f}% ({100 * min(errors):+.1f}% to {100 * max(errors):+.1f}%), "
            f"{sum(abs(e) > tolerance for e in errors)} of {len(errors)} steps beyond {100 * tolerance:g}%")


def check(gpu: GpuProfile, doc: dict[str, Any], tolerance: float = 0.10) -> str:
    """The table of ``gpu``'s step times against ``doc``'s measurements, fitting nothing:
    how well a profile (one derived by published ratios, say) predicts another machine."""
    mach = doc["machine"]
    return (table(gpu, doc["measurements"], tolerance) + f"\nprofile {gpu.name} ({gpu.source}) against "
            f"{len(fitted(doc['measurements']))} steps timed on {mach.get('gpu', mach.get('device', '?'))}: "
            + errors_line(gpu, doc["measurements"], tolerance))


# -- the command's two halves -----------------------------------------------------------------

# Not measured here: the engine's host work per step (notes §4.4, 3-5 ms [est]).
STEP_FIXED_MS = 4.0
# What vLLM runs on Hopper instead of the stack's torch kernels (gpu.py, EngineKernels):
# FlashAttention 3, whose paper (Shah et al. 2024, arXiv:2407.08608, abstract) reports it
# 1.5-2.0x faster than FlashAttention 2 on the H100 in FP16/BF16; torch's flash SDPA, the
# kernel timed, is FlashAttention 2. The middle of that range, 1.75, is taken [from the
# paper, not measured here]. FA3 also splits a decoding context over thread blocks when
# the sequences and KV heads alone do not fill the SMs (hopper/heuristics.h,
# num_splits_heuristic), so its decode reads KV at the HBM's rate.
ENGINE_KERNELS = EngineKernels(
    attn_speedup=1.75, kv_split=True,
    why="vLLM on Hopper runs FlashAttention 3, the stack timed torch's FlashAttention 2: prefill attention at "
        "1.75x the rate timed (FA3 paper, arXiv:2407.08608: 1.5-2.0x FA2 on the H100 in FP16/BF16; the middle "
        "taken, not measured), decode attention split over blocks (FA3's num_splits_heuristic) so its KV is read "
        "at kv_gb_s however few sequences decode")
# NVLink 4's all-reduce where none was timed across GPUs (kvsim/allreduce.py times it):
# H100 and H200 SXM move 900 GB/s both ways, 450 each; NCCL's bus bandwidth taken as 80%
# of that, 360 GB/s, and vLLM's custom all-reduce for small messages as about 10 us [est].
ALLREDUCE_US, ALLREDUCE_GB_S = 10.0, 360.0
# The H200's memory by its datasheet, 141 GB: what vLLM's 0.9 share is taken of.
H200_HBM_BYTES = 141e9


def require_torch(device: str) -> None:
    """Refuse, in one line, a machine that cannot time on ``device``."""
    try:
        import torch
    except ImportError:
        raise ValueError("calibrate gpu needs torch") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("calibrate gpu needs a CUDA GPU (torch.cuda.is_available() is False here); "
                         "--device cpu --smoke checks the code path on the CPU")


def read_measurements(path: str) -> dict[str, Any]:
    """A ``calibrate gpu`` output or a GPU profile: its commands, machine, checked step
    measurements and all-reduces (``calibrate gpu --allreduce``)."""
    doc = read_json(path)
    require(isinstance(doc, dict) and isinstance(doc.get("measurements", []), list)
            and ("measurements" in doc or "allreduce" in doc), path, doc, "measurements",
            "expected an object with a list of measurements (a `calibrate gpu` output or a GPU profile)")
    # Each figure in its range (kvsim/limits.py): the fit's GEMM tile counts are int64.
    for i, r in enumerate(doc.get("measurements", [])):
        require(isinstance(r, dict), path, doc["measurements"], i, "a measurement is an object")
        m = r.get("model")
        require(m in MODELS and MODELS[m].buildable, path, r, "model", f"unknown model {m!r}")
        require(integer_in(r.get("tp"), 1, MAX_TP), path, r, "tp", f"tp must be {integer_range(1, MAX_TP)}")
        ok = isinstance(r.get("prefills"), list) and all(
            isinstance(x, list) and len(x) == 2 and integer_in(x[0], 1, MAX_TOKENS) and integer_in(x[1], 0, MAX_TOKENS)
            for x in r["prefills"])
        require(ok, path, r, "prefills", f"prefills must be a list of [new tokens in [1, {MAX_TOKENS}], cached "
                                         f"tokens in [0, {MAX_TOKENS}]]")
        d = r.get("decode")
        require(isinstance(d, list) and len(d) == 2 and integer_in(d[0], 0, MAX_COUNT)
                and integer_in(d[1], 0, MAX_TOKENS), path, r, "decode",
                f"decode must be [sequences in [0, {MAX_COUNT}], context in [0, {MAX_TOKENS}]]")
        require(sum(n for n, _ in r["prefills"]) + d[0] <= MAX_TOKENS, path, r, "prefills",
                f"a step's new tokens (its prefills' and one per decoding sequence) must be at most {MAX_TOKENS}")
        require(number_in(r.get("step_ms"), MIN_MS, MAX_MS), path, r, "step_ms",
                f"step_ms must be {number_range(MIN_MS, MAX_MS)}")
        require(r.get("kernels", "eager") in ("eager", "compiled"), path, r, "kernels",
                "kernels must be \"eager\" or \"compiled\"")
    if doc.get("measurements"):
        require(len(fitted(doc["measurements"])) > 0, path, doc, "measurements", "no measurements to fit")
    mach = doc.get("machine")
    if isinstance(mach, dict) and mach.get("memory_bytes") is not None:  # the profile's hbm_bytes, unless an H200
        require(number_in(mach["memory_bytes"], 1, MAX_BYTES), path, mach, "memory_bytes",
                f"machine.memory_bytes must be {number_range(1, MAX_BYTES)}")
    return {"commands": [c for c in doc.get("commands", []) if isinstance(c, str)],
            "machine": doc.get("machine") if isinstance(doc.get("machine"), dict) else {},
            "measurements": doc.get("measurements", []),
            "allreduce": allreduce.check(doc.get("allreduce", []), path, doc)}


def merge(paths: Sequence[str]) -> dict[str, Any]:
    """The measurements of several files as one document to fit: the steps of one run (a
    profile, or a ``calibrate gpu`` output) and the all-reduces of another; the machine is
    the steps'."""
    seen: set[Path] = set()
    for p in paths:
        if Path(p).resolve() in seen:
            raise ValueError(f"--measurements {p}: given twice; its measurements would count twice")
        seen.add(Path(p).resolve())
    docs = [read_measurements(p) for p in paths]
    steps = [(p, d) for p, d in zip(paths, docs) if d["measurements"]]
    if not steps:
        raise ValueError(f"{', '.join(paths)}: no step measurements to fit (an --allreduce output holds only "
                         f"all-reduces: give it beside a profile or a `calibrate gpu` output)")
    if len(steps) > 1:
        raise ValueError(f"--measurements {steps[0][0]} and {steps[1][0]}: each holds steps; a profile is fitted "
                         f"to one run's steps (and another's all-reduces, if any), on one machine")
    return {"commands": [c for d in docs for c in d["commands"]], "machine": steps[0][1]["machine"],
            "measurements": [r for d in docs for r in d["measurements"]],
            "allreduce": [r for d in docs for r in d["allreduce"]]}


def profile_of(doc: dict[str, Any], name: str, refit: Optional[str] = None,
               tolerance: float = 0.10) -> tuple[GpuProfile, str]:
    """The GPU profile fitted to ``doc``'s measurements, and the table of how close it is."""
    recs = doc["measurements"]
    fit = fit_step(recs)
    mach = doc["machine"]
    gpu = str(mach.get("gpu", mach.get("device", "?")))
    hbm = H200_HBM_BYTES if "H200" in gpu else float(mach.get("memory_bytes") or H200_HBM_BYTES)
    how = mach.get("method") or ("layer stacks of random bf16 weights replayed from CUDA graphs, median of the "
                                 "replays, scaled to the full depth (kvsim/gpucal.py)")
    used = fitted(recs)
    ar = doc.get("allreduce", [])
    ar_us, ar_gb_s, allreduce_note = _allreduce_terms(ar)
    kind = fit_kernels(recs)
    other = sum(r.get("kernels", "eager") != kind for r in recs)
    excluded = len(recs) - len(used) - other
    layers = ("the layers' ops fused by torch.compile (inductor, token count symbolic), as vLLM compiles them"
              if kind == "compiled" else "each of the layers' torch ops its own kernel (eager)")
    notes = [
        f"fit: {len(used)} steps of {', '.join(sorted({'%s tp=%d' % (r['model'], r['tp']) for r in used}))} timed on "
        f"{gpu} (torch {mach.get('torch', '?')}, CUDA {mach.get('cuda', '-')}): {how}; {layers}"
        + (f"; {other} steps timed with the other kernels beside them, not fitted (their ratio)" if other else "")
        + (f"; {excluded} more not fitted, each saying why" if excluded else ""),
        f"linear layers: each GEMM (the layer's QKV, output, gate-up and down, the LM head) as waves of "
        f"tiles of {'/'.join(map(str, sorted({tm for tm, _ in TILES})))} tokens by "
        f"{'/'.join(map(str, sorted({tn for _, tn in TILES})))} outputs over {SMS} SMs, split-K "
        f"{'/'.join(map(str, SPLITS))}, its fastest "
        f"tiling; a wave at gemm_tflops {fit.gemm_tflops:.0f} ({fit.gemm_tflops / SMS:.2f} per SM), weights at "
        f"weight_gb_s {fit.weight_gb_s:.0f}, soft maximum knee {fit.knee:.2f}",
        f"engine kernels: {ENGINE_KERNELS.why}",
        f"step_fixed_ms {STEP_FIXED_MS}: the engine's host work per step, not measured (notes §4.4: 3-5 ms [est]); "
        f"vLLM's async scheduling (on by default since v0.14) overlaps it with the GPU's step (kvsim/engine.py)",
        allreduce_note,
        f"hbm_bytes {hbm:.4g}: {'the H200 datasheet' if 'H200' in gpu else 'the device total'}",
    ]
    if not any(r["decode"][0] for r in used):
        notes.append("no decode step measured: " + ", ".join(f"{n} {START[n]:g}" for n in DECODE_SIDE)
                     + " kept (a device copy moved 4.3 TB/s on this workplace's H200, a thread block's share of it "
                       "over 132 SMs; the knee [est])")
    else:
        notes.append(
            f"decode attention: {fit.kv_head_gb_s:.1f} GB/s per thread block (one sequence's one KV head), up to "
            f"kv_gb_s {fit.kv_gb_s:.0f} from {fit.kv_gb_s / fit.kv_head_gb_s:.0f} blocks on: the kernel timed (torch "
            f"SDPA) streams a context in one block; FlashAttention 3, vLLM's on Hopper, splits a context over several "
            f"blocks when too few fill the SMs (its num_splits_heuristic): the limit is the kernel timed's; the "
            f"engine's step reads at kv_gb_s (engine kernels)")
    if "source" in mach:
        notes.append(f"measurements: {mach['source']}")
    commands = list(doc["commands"]) + ([refit] if refit else [])
    prof = GpuProfile(name, f"measured on {gpu}", hbm, fit, STEP_FIXED_MS, ar_us, ar_gb_s, notes,
                      recs, commands, mach, ENGINE_KERNELS, ar)
    text = (table(prof, recs, tolerance) + "\nfit: " + ", ".join(f"{k} {v:.4g}" for k, v in vars(fit).items())
            + "; " + errors_line(prof, recs, tolerance))
    if any(r["vllm"] for r in ar):
        text += "\n" + allreduce.table(ar, ar_us, ar_gb_s)
    return prof, text


def _allreduce_terms(records: Sequence[dict[str, Any]]) -> tuple[float, float, str]:
    """``allreduce_us``, ``allreduce_gb_s`` and the note saying where they come from: fitted
    to the all-reduces timed with vLLM's path, else the estimates."""
    used = [r for r in records if r["vllm"]]
    if not used:
        return ALLREDUCE_US, ALLREDUCE_GB_S, (
            f"allreduce {ALLREDUCE_US} us + bytes at {ALLREDUCE_GB_S} GB/s: NVLink 4 (450 GB/s each way) at 80% "
            f"[est]; not measured (no all-reduce timed across GPUs: calibrate gpu --allreduce)")
    us, gb_s = allreduce.fit(records)
    errors = [allreduce.predicted_us(us, gb_s, r["bytes"]) / r["us"] - 1 for r in used]
    tps = ", ".join(str(t) for t in sorted({r["tp"] for r in used}))
    return us, gb_s, (
        f"allreduce {us:.2f} us + bytes at {gb_s:.0f} GB/s: fitted to {len(used)} all-reduces of the hidden state "
        f"timed across {tps} GPUs (calibrate gpu --allreduce, kvsim/allreduce.py), each size by the path vLLM runs "
        f"on Hopper (its custom all-reduce, for which torch's symmetric-memory one- and two-shot stand in, below 8 "
        f"MiB; two-shot to 64 MiB; NCCL above), replayed from CUDA graphs; errors {100 * min(errors):+.0f}% to "
        f"{100 * max(errors):+.0f}%; applied at every tp")
