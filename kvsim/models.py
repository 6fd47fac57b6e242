"""Model shapes (simulation notes §4.2, §7; each model's Hugging Face config).

A shape carries what the step-time model (gpu.py) reads, and for the dense models
what ``python -m kvsim calibrate gpu`` needs to build a stack of their layers:
hidden size, KV heads, MLP width, vocabulary, and whether queries and keys are
normalised per head (Qwen3). Prefill attention FLOPs are counted as
``4 L (Hq dh) n (ctx + n/2)``: the score and value products of n new tokens
against the ctx cached ones and, causally, each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    q_heads: int
    head_dim: int  # of the attention score product (MLA: 192 = 128 nope + 64 rope)
    params_nonembed: float  # active parameters per token, embeddings excluded (the decoder layers)
    weight_bytes: float  # all weights, bf16 unless noted (the input embedding table included)
    kv_bytes_per_token: int
    # Architecture, for a layer stack (0: not a dense transformer kvsim can build).
    hidden: int = 0
    kv_heads: int = 0
    intermediate: int = 0
    vocab: int = 0
    qk_norm: bool = False

    @property
    def buildable(self) -> bool:
        """A dense GQA transformer whose layers ``calibrate gpu`` can build."""
        return bool(self.hidden and self.kv_heads and self.intermediate and self.vocab)

    @property
    def step_weight_bytes(self) -> float:
        """Weights every step reads: all but the input embedding, of which a step gathers
        only its tokens' rows (untied embeddings, as in every dense model here)."""
        return self.weight_bytes - 2.0 * self.vocab * self.hidden

    def attention_flops(self, n_new: int, n_ctx: int) -> float:
        return 4.0 * self.layers * self.q_heads * self.head_dim * n_new * (n_ctx + n_new / 2)


# KV bytes per token = 2 x layers x kv_heads x head_dim x 2 (bf16), notes §4.2.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 32, 32, 128, 6.98e9, 16.1e9, 131_072, 4096, 8, 14336, 128256),
        ModelShape("llama3-70b", 80, 64, 128, 68.5e9, 141e9, 327_680, 8192, 8, 28672, 128256),
        ModelShape("qwen3-8b", 36, 32, 128, 6.95e9, 16.4e9, 147_456, 4096, 8, 12288, 151936, True),
        ModelShape("qwen3-32b", 64, 64, 128, 31.2e9, 65.5e9, 262_144, 5120, 8, 25600, 151936, True),
        # MLA: 61 x 576 latent values; 37B active of 671B (fp8 weights do not fit one
        # GPU: the numbers are TP1 compute, as the notes' 70B rows are). Not buildable:
        # its step time uses the dense formulas with its active parameters.
        ModelShape("deepseek-v3", 61, 128, 192, 36.5e9, 671e9, 70_272),
    )
}
DEFAULT_MODEL = "llama3-8b"


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}") from None
