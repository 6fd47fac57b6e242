"""The GPU's step time, from a profile fitted to measured layer stacks (``calibrate gpu``).

One engine step on one GPU of a replica (tensor parallelism ``tp``) runs ``T`` new
tokens of ``S`` sequences: prefill chunks and ``D`` decode tokens together. Its time is

    linear    L * sum of the layer's four GEMMs + the LM head's GEMM    (below)
  + attention F_attn / attn_rate                               prefill FLOPs
            + KV / min(kv_rate, D * H_kv * kv_head_rate)       decode's reads of the cached KV
  + per token T * L * token_layer, per layer L * layer          norms, RoPE, small kernels
  + all-reduce 2 L (allreduce + T * hidden * 2 / allreduce_rate) when tp > 1   (kvsim/allreduce.py)
  step = max(host step_fixed, the GPU's sum above)           scheduling, sampling [est],
                                                               overlapped (vLLM's async scheduling)

A GEMM of ``M`` tokens by a weight of ``K`` inputs and ``N`` outputs (per GPU: the
layer's QKV, output, gate-and-up and down projections with heads and MLP width divided
by ``tp``, and the vocabulary-parallel LM head on one token per sequence) runs as tiles
of ``tm x tn`` outputs, each on one of the GPU's ``SMS`` (132) SMs, optionally split
``s`` ways along ``K`` (split-K, its fp32 partial sums written and reduced). The tiles
run in ``ceil(tiles * s / SMS)`` waves, each as long as one tile's FLOPs at the SM's
share of ``gemm_rate``; the weights stream from HBM at ``weight_rate``; the two overlap
as a soft maximum ``softmax(a, b) = (a^k + b^k)^(1/k)``. The GEMM's time is that of its
fastest tiling among ``TILES`` x ``SPLITS`` (cuBLAS picks a kernel per shape). Wave
quantization is what makes 128 and 256 tokens cost unlike any smooth curve: a shape
whose tiles just exceed a wave pays for a second one. Decode attention runs one thread
block per sequence and KV head (``H_kv`` on each GPU) in the kernel timed (torch's
SDPA), each streaming its context's KV: a block keeps only so many bytes in flight, so
the read rate grows with the ``D * H_kv`` blocks until the HBM's rate caps it. The rates
and the per-token and per-layer costs are fitted to step times measured on the H200, the
layers compiled by torch.compile as vLLM compiles them (kvsim/profiles/gpu_h200.json holds
the measurements, eager and compiled, the fit and the command); another
GPU is derived from the H200 by published ratios only (``derive``).

What the engine runs is vLLM's kernels, not the stack timed: on Hopper vLLM's attention
is FlashAttention 3, where the stack timed torch's FlashAttention 2. Two stated
differences (``EngineKernels``), not measured here and not fitted: prefill attention at
``attn_speedup`` times the FLOP rate timed, and decode attention splitting a context over
thread blocks (FA3's split-KV) so that its KV is read at the HBM's rate however few
sequences decode. ``kernels="timed"`` gives the stack as timed (what ``calibrate gpu``
fits); the engine uses ``kernels="engine"``. The all-reduce is timed apart, across GPUs
(``calibrate gpu --allreduce``); the host's cost per step is not measured: each profile
says where they come from.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.cli_args import finite_number, read_json, where
from kvsim.models import ModelShape

PROFILE_DIR = Path(__file__).parent / "profiles"
MEASURED = {"h200": "gpu_h200.json"}
DEFAULT_GPU = "h200"


@dataclass(frozen=True)
class StepFit:
    """The fitted part of the step time (module docstring)."""

    weight_gb_s: float  # weights a GEMM streams from HBM (its bound when few tokens run)
    gemm_tflops: float  # a GEMM's tiles at the GPU's whole tensor rate: SMS SMs, one tile each
    attn_tflops: float  # prefill attention, FLOPs as ModelShape.attention_flops counts them
    kv_gb_s: float  # decode attention's reads of the cached KV, at full parallelism (the HBM's cap)
    token_layer_ns: float  # per token per layer: norms, RoPE, activation, residuals
    layer_us: float  # per layer per step: the small kernels' floor
    knee: float  # k of the soft maximum of a GEMM's weight streaming and its waves of tiles
    # Decode attention's read rate per thread block (one sequence's one KV head): what
    # a block alone streams, so that D * H_kv blocks read at most D * H_kv times it.
    kv_head_gb_s: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            positive = f.name not in ("token_layer_ns", "layer_us")
            if not finite_number(v) or (v <= 0 if positive else v < 0):
                raise ValueError(f"step fit: {f.name} must be a number {'>' if positive else '>='} 0, got {v!r}")


@dataclass(frozen=True)
class EngineKernels:
    """How vLLM's kernels differ from the stack timed (module docstring); stated, not fitted."""

    attn_speedup: float = 1.0  # prefill attention's FLOP rate over the timed kernel's
    kv_split: bool = False  # decode attention splits a context over blocks: KV read at the HBM's rate
    why: str = ""


@dataclass(frozen=True)
class GpuProfile:
    name: str
    source: str  # what it was measured on, or derived from
    hbm_bytes: float
    fit: StepFit
    step_fixed_ms: float  # the engine's host work per step [est], not measured here
    # Tensor parallelism: two all-reduces of the hidden state per layer (NVLink).
    allreduce_us: float
    allreduce_gb_s: float
    notes: list[str] = field(default_factory=list)
    # The measured steps and the commands (calibrate gpu): for the record, and for the
    # test that holds the fit to them.
    measurements: list[dict[str, Any]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    engine: EngineKernels = EngineKernels()
    # The all-reduces timed across GPUs (calibrate gpu --allreduce), when allreduce_us and
    # allreduce_gb_s are fitted to them: for the record and the test that holds the fit.
    allreduce: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- the step ------------------------------------------------------------------------

    def gpu_s(self, m: ModelShape, tp: int, tokens: int, seqs: int, attn_flops: float, kv_bytes: float,
              decodes: int, kernels: str = "engine") -> float:
        """Seconds of GPU work of one step (the host's ``step_fixed_ms`` excluded):
        ``tokens`` new tokens of ``seqs`` sequences, ``attn_flops`` of prefill attention
        and ``kv_bytes`` of cached KV that the step's ``decodes`` decoding sequences read,
        all for the whole model; with vLLM's kernels (``"engine"``) or the stack timed
        (``"timed"``)."""
        const, per_kv_byte = self.decode_parts(m, tp, tokens, seqs, decodes, kernels)
        rate = self.fit.attn_tflops * (self.engine.attn_speedup if kernels == "engine" else 1.0)
        return const + attn_flops / (tp * rate * 1e12) + kv_bytes * per_kv_byte

    def decode_parts(self, m: ModelShape, tp: int, tokens: int, seqs: int, decodes: int,
                     kernels: str = "engine") -> tuple[float, float]:
        """A step's seconds without its attention, and its seconds per byte of cached KV
        read: the two parts of a run of decode steps, only the KV growing."""
        return (self.layers_s(m, tp, tokens, seqs) + self.allreduce_s(m, tp, tokens),
                self.kv_s_per_byte(m, tp, decodes, kernels))

    def kv_s_per_byte(self, m: ModelShape, tp: int, decodes: int, kernels: str = "engine") -> float:
        """Decode attention's seconds per byte of the model's cached KV: each GPU reads its
        ``1 / tp`` share at the HBM's rate, or, in the kernel timed, slower when its
        ``decodes * H_kv`` thread blocks (one a sequence and KV head) cannot pull that much."""
        if kernels == "engine" and self.engine.kv_split:
            return 1.0 / (tp * self.fit.kv_gb_s * 1e9)
        blocks = max(1, decodes) * kv_heads_per_gpu(m, tp)
        return 1.0 / (tp * min(self.fit.kv_gb_s, blocks * self.fit.kv_head_gb_s) * 1e9)

    def layers_s(self, m: ModelShape, tp: int, tokens: int, seqs: int) -> float:
        """The fitted part without attention: linear layers, per-token and per-layer work."""
        f = self.fit
        return (linear_s(f, m, tp, tokens, seqs)
                + m.layers * (tokens * f.token_layer_ns * 1e-9 / tp + f.layer_us * 1e-6))

    def allreduce_s(self, m: ModelShape, tp: int, tokens: int) -> float:
        """Tensor parallelism's two all-reduces of the hidden state per layer."""
        if tp == 1:
            return 0.0
        return 2 * m.layers * (self.allreduce_us * 1e-6 + tokens * m.hidden * 2 / (self.allreduce_gb_s * 1e9))

    def measured_part_s(self, m: ModelShape, tp: int, tokens: int, seqs: int, attn_flops: float,
                        kv_bytes: float, decodes: int) -> float:
        """What ``calibrate gpu`` times: one GPU's share of the step, the stack's own
        kernels, without the all-reduce."""
        return (self.gpu_s(m, tp, tokens, seqs, attn_flops, kv_bytes, decodes, kernels="timed")
                - self.allreduce_s(m, tp, tokens))

    def step_ns(self, m: ModelShape, tp: int, tokens: int, seqs: int, attn_flops: float, kv_bytes: float,
                decodes: int) -> int:
        """One engine step, host work included, in ns."""
        return self.with_host_ns(self.gpu_s(m, tp, tokens, seqs, attn_flops, kv_bytes, decodes))

    def with_host_ns(self, gpu_s: float) -> int:
        """A step of ``gpu_s`` seconds of GPU work, in ns, the host's work overlapped: vLLM's
        async scheduling (on by default since v0.14, vLLM PR #27614; in the v0.19.1 and
        v0.23.0 of llm-d's manifests and the 0.33 kvoffload runs on) prepares step t+1
        while the GPU runs step t, so a step lasts the longer of the two."""
        return round(max(self.step_fixed_ms * 1e-3, gpu_s) * 1e9)

    def prefill_s(self, m: ModelShape, tp: int, n_new: int, n_ctx: int) -> float:
        """GPU seconds of a lone prefill of ``n_new`` tokens after ``n_ctx`` cached ones."""
        return self.gpu_s(m, tp, n_new, 1, m.attention_flops(n_new, n_ctx), 0.0, 0)

    def token_s(self, m: ModelShape, tp: int) -> float:
        """GPU seconds per prompt token in a full batch, attention aside (the linear layers
        at their FLOP rate, waves full, and the per-token work): what a queue of prefill
        tokens costs."""
        return 2.0 * m.params_nonembed / tp / (self.fit.gemm_tflops * 1e12) + m.layers * self.fit.token_layer_ns * 1e-9 / tp

    def derive(self, name: str, hbm_bytes: float, bandwidth_ratio: float, compute_ratio: float,
               why: str) -> "GpuProfile":
        """Another GPU from this one by published ratios only: memory-bound parts scale with
        HBM bandwidth, compute-bound parts with the tensor rate, the rest stays (the
        per-layer floor, what one thread block streams, and the all-reduce: ``derive`` is
        for GPUs of the same SMs and NVLink)."""
        f = self.fit
        fit = dataclasses.replace(f, weight_gb_s=f.weight_gb_s * bandwidth_ratio, kv_gb_s=f.kv_gb_s * bandwidth_ratio,
                                  token_layer_ns=f.token_layer_ns / bandwidth_ratio,
                                  gemm_tflops=f.gemm_tflops * compute_ratio, attn_tflops=f.attn_tflops * compute_ratio)
        return dataclasses.replace(self, name=name, source=f"derived from {self.name} ({self.source})",
                                   hbm_bytes=hbm_bytes, fit=fit, notes=[why, *self.notes], measurements=[],
                                   allreduce=[])


# -- the linear layers: GEMMs as waves of tiles -----------------------------------------------

SMS = 132  # the H100's and H200's SMs (GH100 SXM)
# Tilings a GEMM may take (tokens x outputs of one thread block) and split-K factors:
# tiles of 64 or 128 tokens by each output width the H200's cuBLAS was seen running for
# vLLM's layout (F.linear; scripts/h200_kernel_probe.py: its nvjet kernels' tiles), split
# K for shapes of few tiles; the model takes the fastest of them for each shape. Widths
# other than powers of two are what let a wide GEMM fill its last wave (Qwen3-32B's
# 25,600-wide gate-and-up at 256 tokens: 144-wide tiles, three waves where 128 take four).
TILES = tuple((tm, tn) for tm in (64, 128) for tn in (64, 72, 80, 96, 112, 128, 144, 168, 176, 192, 256, 320, 448, 512))
SPLITS = (1, 2, 3, 4, 6, 8)


def gemm_shapes(m: ModelShape, tp: int) -> tuple[tuple[int, int], ...]:
    """``(N, K)`` of a decoder layer's four GEMMs on one GPU of ``tp``: QKV, output,
    gate-and-up, down (heads and MLP width divided by ``tp``, as gpucal builds them)."""
    hq, hkv, dh = m.q_heads // tp, kv_heads_per_gpu(m, tp), m.head_dim
    inter, h = m.intermediate // tp, m.hidden
    return ((hq + 2 * hkv) * dh, h), (h, hq * dh), (2 * inter, h), (h, inter)


@functools.lru_cache(maxsize=4096)
def gemm_tilings(rows: int, n: int, k: int, tiles: tuple[tuple[int, int], ...] = TILES
                 ) -> tuple[tuple[float, float, float], ...]:
    """Each tiling of a ``rows x k`` by ``k x n`` GEMM as ``(FLOPs of its waves, weight
    bytes, split-K partial-sum bytes)``: the waves' FLOPs are what ``ceil(tiles * s / SMS)``
    full waves would do, each SM working one ``tm x tn x k / s`` tile. Only those that
    could be the fastest are kept: a tiling with no fewer wave FLOPs and no fewer partial-sum
    bytes than another never is (the weight bytes are the same for all)."""
    tm, tn, splits = _tiling_grid(tiles)
    count = -(-rows // tm) * -(-n // tn)
    waves = -(-count * splits // SMS)
    flops = waves * SMS * 2.0 * tm * tn * k / splits
    partial = (splits > 1) * 8.0 * splits * rows * n
    front, least = [], float("inf")
    for i in np.lexsort((partial, flops)):  # by wave FLOPs, then partial-sum bytes
        if partial[i] < least:
            front.append((float(flops[i]), 2.0 * n * k, float(partial[i])))
            least = partial[i]
    return tuple(front)


@functools.lru_cache(maxsize=8)
def _tiling_grid(tiles: tuple[tuple[int, int], ...]) -> tuple[Any, Any, Any]:
    """Each tile and split-K factor of ``tiles`` x ``SPLITS`` as three int64 arrays."""
    grid = np.array([(tm, tn, s) for tm, tn in tiles for s in SPLITS], dtype=np.int64)
    return grid[:, 0], grid[:, 1], grid[:, 2]


def soft_max(a: float, b: float, k: float) -> float:
    """``(a^k + b^k)^(1/k)`` without underflow."""
    hi, lo = max(a, b), min(a, b)
    return hi * (1.0 + (lo / hi) ** k) ** (1.0 / k) if hi > 0 else 0.0


def gemm_s(f: "StepFit", tilings: tuple[tuple[float, float, float], ...]) -> float:
    """A GEMM's seconds: its fastest tiling's waves and weight streaming, overlapped."""
    bw, rate = f.weight_gb_s * 1e9, f.gemm_tflops * 1e12
    return min(soft_max(w / rate, b / bw, f.knee) + r / bw for w, b, r in tilings)


@functools.lru_cache(maxsize=65536)
def linear_s(f: "StepFit", m: ModelShape, tp: int, tokens: int, seqs: int) -> float:
    """The model's linear layers in one step on one GPU: ``L`` layers' four GEMMs over
    ``tokens`` rows and the LM head over one row a sequence. A model kvsim cannot build
    (no layer dims: MLA) is one GEMM of its active parameters, weights or FLOPs."""
    if not m.buildable:
        weights = m.step_weight_bytes / tp
        flops = 2.0 * (m.params_nonembed * tokens + m.vocab * m.hidden * seqs) / tp
        return soft_max(weights / (f.weight_gb_s * 1e9), flops / (f.gemm_tflops * 1e12), f.knee)
    layer = sum(gemm_s(f, gemm_tilings(tokens, n, k)) for n, k in gemm_shapes(m, tp)) if tokens else 0.0
    head = gemm_s(f, gemm_tilings(seqs, m.vocab // tp, m.hidden)) if seqs else 0.0
    return m.layers * layer + head


# Other GPUs, from the measured H200 by published ratios (vendor datasheets): the H100
# SXM5 is the same GH100 chip at the same dense bf16 rate (989 TFLOP/s) with 80 GB of
# HBM3 at 3.35 TB/s against the H200's 141 GB of HBM3e at 4.8 TB/s.
DERIVED = {
    "h100": dict(base="h200", hbm_bytes=80 * (1 << 30), bandwidth_ratio=3.35 / 4.8, compute_ratio=1.0,
                 why="H100 SXM5 from the H200 by the datasheets: HBM 3.35 against 4.8 TB/s (x0.698 on weight and "
                     "KV reads and per-token work), the same 989 TFLOP/s dense bf16 (x1.0 on GEMMs and attention), "
                     "the same GH100 chip's 132 SMs (x1.0 on what one decode thread block streams: bound by the bytes "
                     "one SM keeps in flight, not by the HBM's total [est]), the same NVLink 4 at 900 GB/s both ways (x1.0 "
                     "on the all-reduce), 80 GB"),
}
GPUS = (*MEASURED, *DERIVED)


def kv_heads_per_gpu(m: ModelShape, tp: int) -> int:
    """KV heads one GPU of ``tp`` holds: a share, or one replicated head when ``tp``
    exceeds them (as gpucal's layer stacks build them); an MLA model's one latent."""
    return max(1, m.kv_heads // tp)


def load_gpu(name: str) -> GpuProfile:
    """A GPU profile by name: measured (``MEASURED``) or derived from one (``DERIVED``)."""
    if name in DERIVED:
        d = dict(DERIVED[name])
        return load_gpu(d.pop("base")).derive(name, **d)
    if name not in MEASURED:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}")
    path = PROFILE_DIR / MEASURED[name]
    return gpu_from_json(read_json(str(path)), str(path))


def gpu_from_json(doc: Any, path: str) -> GpuProfile:
    """The profile in ``doc``; an error names the file and the line of the bad field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where(path, doc)}: a GPU profile is a JSON object")
    names = {f.name for f in dataclasses.fields(GpuProfile)}
    if unknown := sorted(set(doc) - names):
        raise ValueError(f"{where(path, doc, unknown[0])}: unknown GPU profile key(s) {', '.join(unknown)}")
    fit = doc.get("fit")
    if not isinstance(fit, dict):
        raise ValueError(f"{where(path, doc, 'fit')}: fit must be an object")
    try:
        kw = dict(doc)
        kw["fit"] = StepFit(**fit)
        if "engine" in kw:
            if not isinstance(kw["engine"], dict):
                raise ValueError("engine must be an object")
            kw["engine"] = EngineKernels(**kw["engine"])
        return GpuProfile(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where(path, doc)}: {e}") from None
