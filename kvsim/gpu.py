"""The GPU's step time, from a profile fitted to measured layer stacks (``calibrate gpu``).

One engine step on one GPU of a replica (tensor parallelism ``tp``) runs ``T`` new
tokens of ``S`` sequences: prefill chunks and ``D`` decode tokens together. Its time is

    linear    softmax(W / weight_rate, F_lin / gemm_rate)      the weight GEMMs
  + attention F_attn / attn_rate                               prefill FLOPs
            + KV / min(kv_rate, D * H_kv * kv_head_rate)       decode's reads of the cached KV
  + per token T * L * token_layer, per layer L * layer          norms, RoPE, small kernels
  + all-reduce 2 L (allreduce + T * hidden * 2 / allreduce_rate) when tp > 1
  + host      step_fixed                                       scheduling, sampling [est]

with W the weights a step reads and F_lin = 2 (params T + vocab hidden S), all per
GPU (divided by ``tp``). ``softmax(a, b) = (a^k + b^k)^(1/k)``: a GEMM is bound by its
weights at few tokens and by its FLOPs at many, and the knee between is soft. Decode
attention runs one thread block per sequence and KV head (``H_kv`` KV heads on each
GPU), each streaming its context's KV from HBM: a block keeps only so many bytes in
flight, so the read rate grows with the ``D * H_kv`` blocks until the HBM's rate caps
it (the H200 measured about 46 GB/s a block, saturating near 100 blocks; the kernel
timed does not split a context across blocks). The rates and the per-token and
per-layer costs are fitted to step times measured on the H200
(kvsim/profiles/gpu_h200.json holds the measurements, the fit and the command);
another GPU is derived from the H200 by published ratios only (``derive``). The
all-reduce and the host's cost per step are not measured: each profile says where
they come from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.cli_args import finite_number, read_json, where
from kvsim.models import ModelShape

PROFILE_DIR = Path(__file__).parent / "profiles"
MEASURED = {"h200": "gpu_h200.json"}
DEFAULT_GPU = "h200"


@dataclass(frozen=True)
class StepFit:
    """The fitted part of the step time (module docstring)."""

    weight_gb_s: float  # weights read by the linear layers when few tokens run
    gemm_tflops: float  # linear layers when many do
    attn_tflops: float  # prefill attention, FLOPs as ModelShape.attention_flops counts them
    kv_gb_s: float  # decode attention's reads of the cached KV, at full parallelism (the HBM's cap)
    token_layer_ns: float  # per token per layer: norms, RoPE, activation, residuals
    layer_us: float  # per layer per step: the small kernels' floor
    knee: float  # k of the soft maximum
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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- the step ------------------------------------------------------------------------

    def gpu_s(self, m: ModelShape, tp: int, tokens: int, seqs: int, attn_flops: float, kv_bytes: float,
              decodes: int) -> float:
        """Seconds of GPU work of one step (the host's ``step_fixed_ms`` excluded):
        ``tokens`` new tokens of ``seqs`` sequences, ``attn_flops`` of prefill attention
        and ``kv_bytes`` of cached KV that the step's ``decodes`` decoding sequences read,
        all for the whole model."""
        const, per_kv_byte = self.decode_parts(m, tp, tokens, seqs, decodes)
        return const + attn_flops / (tp * self.fit.attn_tflops * 1e12) + kv_bytes * per_kv_byte

    def decode_parts(self, m: ModelShape, tp: int, tokens: int, seqs: int, decodes: int) -> tuple[float, float]:
        """A step's seconds without its attention, and its seconds per byte of cached KV
        read: the two parts of a run of decode steps, only the KV growing."""
        return self.layers_s(m, tp, tokens, seqs) + self.allreduce_s(m, tp, tokens), self.kv_s_per_byte(m, tp, decodes)

    def kv_s_per_byte(self, m: ModelShape, tp: int, decodes: int) -> float:
        """Decode attention's seconds per byte of the model's cached KV: each GPU reads its
        ``1 / tp`` share at the HBM's rate, or slower when its ``decodes * H_kv`` thread
        blocks (one a sequence and KV head) cannot pull that much."""
        blocks = max(1, decodes) * kv_heads_per_gpu(m, tp)
        return 1.0 / (tp * min(self.fit.kv_gb_s, blocks * self.fit.kv_head_gb_s) * 1e9)

    def layers_s(self, m: ModelShape, tp: int, tokens: int, seqs: int) -> float:
        """The fitted part without attention: linear layers, per-token and per-layer work."""
        f = self.fit
        weights = m.step_weight_bytes / tp / (f.weight_gb_s * 1e9)
        flops = 2.0 * (m.params_nonembed * tokens + m.vocab * m.hidden * seqs) / tp / (f.gemm_tflops * 1e12)
        hi, lo = max(weights, flops), min(weights, flops)
        linear = hi * (1.0 + (lo / hi) ** f.knee) ** (1.0 / f.knee)  # the soft maximum, without underflow
        return linear + m.layers * (tokens * f.token_layer_ns * 1e-9 / tp + f.layer_us * 1e-6)

    def allreduce_s(self, m: ModelShape, tp: int, tokens: int) -> float:
        """Tensor parallelism's two all-reduces of the hidden state per layer (not measured)."""
        if tp == 1:
            return 0.0
        return 2 * m.layers * (self.allreduce_us * 1e-6 + tokens * m.hidden * 2 / (self.allreduce_gb_s * 1e9))

    def measured_part_s(self, m: ModelShape, tp: int, tokens: int, seqs: int, attn_flops: float,
                        kv_bytes: float, decodes: int) -> float:
        """What ``calibrate gpu`` times: one GPU's share of the step without the all-reduce."""
        return self.gpu_s(m, tp, tokens, seqs, attn_flops, kv_bytes, decodes) - self.allreduce_s(m, tp, tokens)

    def step_ns(self, m: ModelShape, tp: int, tokens: int, seqs: int, attn_flops: float, kv_bytes: float,
                decodes: int) -> int:
        """One engine step, host work included, in ns."""
        return round((self.step_fixed_ms * 1e-3 + self.gpu_s(m, tp, tokens, seqs, attn_flops, kv_bytes, decodes)) * 1e9)

    def prefill_s(self, m: ModelShape, tp: int, n_new: int, n_ctx: int) -> float:
        """GPU seconds of a lone prefill of ``n_new`` tokens after ``n_ctx`` cached ones."""
        return self.gpu_s(m, tp, n_new, 1, m.attention_flops(n_new, n_ctx), 0.0, 0)

    def token_s(self, m: ModelShape, tp: int) -> float:
        """GPU seconds per prompt token in a full batch, attention aside (the linear layers
        at their FLOP rate and the per-token work): what a queue of prefill tokens costs."""
        return 2.0 * m.params_nonembed / tp / (self.fit.gemm_tflops * 1e12) + m.layers * self.fit.token_layer_ns * 1e-9 / tp

    def derive(self, name: str, hbm_bytes: float, bandwidth_ratio: float, compute_ratio: float,
               why: str) -> "GpuProfile":
        """Another GPU from this one by published ratios only: memory-bound parts scale with
        HBM bandwidth, compute-bound parts with the tensor rate, the rest stays (the
        per-layer floor, and what one thread block streams: ``derive`` is for GPUs of the
        same SMs)."""
        f = self.fit
        fit = dataclasses.replace(f, weight_gb_s=f.weight_gb_s * bandwidth_ratio, kv_gb_s=f.kv_gb_s * bandwidth_ratio,
                                  token_layer_ns=f.token_layer_ns / bandwidth_ratio,
                                  gemm_tflops=f.gemm_tflops * compute_ratio, attn_tflops=f.attn_tflops * compute_ratio)
        return dataclasses.replace(self, name=name, source=f"derived from {self.name} ({self.source})",
                                   hbm_bytes=hbm_bytes, fit=fit, notes=[why, *self.notes], measurements=[])


# Other GPUs, from the measured H200 by published ratios (vendor datasheets): the H100
# SXM5 is the same GH100 chip at the same dense bf16 rate (989 TFLOP/s) with 80 GB of
# HBM3 at 3.35 TB/s against the H200's 141 GB of HBM3e at 4.8 TB/s.
DERIVED = {
    "h100": dict(base="h200", hbm_bytes=80 * (1 << 30), bandwidth_ratio=3.35 / 4.8, compute_ratio=1.0,
                 why="H100 SXM5 from the H200 by the datasheets: HBM 3.35 against 4.8 TB/s (x0.698 on weight and "
                     "KV reads and per-token work), the same 989 TFLOP/s dense bf16 (x1.0 on GEMMs and attention), "
                     "the same GH100 chip's 132 SMs (x1.0 on what one decode thread block streams: bound by the bytes "
                     "one SM keeps in flight, not by the HBM's total [est]), 80 GB"),
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
        return GpuProfile(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where(path, doc)}: {e}") from None
