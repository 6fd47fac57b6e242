"""Model shapes and the step-time model (simulation notes §4.1, §4.2, §7).

A step costs ``step_fixed + max(compute, memory)``: compute is the batch's FLOPs at
``peak * mfu``; memory is the weights plus the KV that decode reads, at
``hbm * decode_bw_eff``. Prefill FLOPs: ``2 P n + 4 L (Hq dh) n (ctx + n/2)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    q_heads: int
    head_dim: int  # of the attention score product (MLA: 192 = 128 nope + 64 rope)
    params_nonembed: float  # active parameters per token, embeddings excluded
    weight_bytes: float  # read once per step (bf16 unless noted)
    kv_bytes_per_token: int

    def prefill_flops(self, n_new: int, n_ctx: int) -> float:
        attn = 4.0 * self.layers * self.q_heads * self.head_dim * n_new * (n_ctx + n_new / 2)
        return 2.0 * self.params_nonembed * n_new + attn

    def decode_flops(self, n_seqs: int, ctx_tokens: int) -> float:
        return 2.0 * self.params_nonembed * n_seqs + 4.0 * self.layers * self.q_heads * self.head_dim * ctx_tokens


# KV bytes per token = 2 x layers x kv_heads x head_dim x 2 (bf16), notes §4.2.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 32, 32, 128, 6.98e9, 16.1e9, 131_072),
        ModelShape("llama3-70b", 80, 64, 128, 68.5e9, 141e9, 327_680),
        ModelShape("qwen3-8b", 36, 32, 128, 6.95e9, 16.4e9, 147_456),
        ModelShape("qwen3-32b", 64, 64, 128, 31.2e9, 65.5e9, 262_144),
        # MLA: 61 x 576 latent values; 37B active of 671B (fp8 weights do not fit one
        # GPU: the numbers are TP1 compute, as the notes' 70B rows are).
        ModelShape("deepseek-v3", 61, 128, 192, 36.5e9, 671e9, 70_272),
    )
}
DEFAULT_MODEL = "llama3-8b"


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}") from None
