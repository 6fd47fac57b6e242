"""The reload workload: the classic disk-offload experiment as a kvsim trace.

A shared system prompt (12,288 tokens, the #49644 shape) and ``contexts`` user
contexts behind it. A fill phase visits every context once; a reload phase then
returns to each in a shuffled order (seeded), so whether a context is still on the
GPU, or in a tier, depends on what came since, as it does in service. Every request
asks a new question (the suffix). Requests are labelled ``fill`` and ``reload``: the
report gives TTFT per phase. The named scenarios (scenarios.py) size it and put a
model, a GPU and tiers around it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvsim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

PHASES = ("fill", "reload")


@dataclass(frozen=True)
class ReloadScenario:
    contexts: int = 48
    prefix_len: int = 12_288  # the #49644 shape's shared system prompt
    context_len: int = 6_144
    suffix_len: int = 256
    output_len: int = 64
    fill_rate: float = 0.5  # requests per second
    reload_rate: float = 1.0
    seed: int = 0  # order of the reload phase
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        for name in ("prefix_len", "context_len"):
            if getattr(self, name) % self.block_tokens:
                raise ValueError(f"{name} must be a multiple of block_tokens={self.block_tokens}")
        if self.contexts < 1 or self.suffix_len < 1 or self.fill_rate <= 0 or self.reload_rate <= 0:
            raise ValueError("contexts, suffix_len, fill_rate and reload_rate must be > 0")

    def requests(self) -> list[TraceRequest]:
        b = self.block_tokens
        prefix = list(range(self.prefix_len // b))
        next_id = len(prefix)
        ctx_blocks = self.context_len // b
        suffix_blocks = math.ceil(self.suffix_len / b)
        contexts = []
        for _ in range(self.contexts):
            contexts.append(list(range(next_id, next_id + ctx_blocks)))
            next_id += ctx_blocks
        revisits = list(contexts)
        random.Random(self.seed).shuffle(revisits)
        n_in = self.prefix_len + self.context_len + self.suffix_len
        out: list[TraceRequest] = []
        t = 0
        for phase, order, rate in (("fill", contexts, self.fill_rate), ("reload", revisits, self.reload_rate)):
            gap = round(1e9 / rate)
            for ctx in order:
                suffix = list(range(next_id, next_id + suffix_blocks))
                next_id += suffix_blocks
                out.append(TraceRequest(t, n_in, self.output_len, tuple(prefix + ctx + suffix), b, phase))
                t += gap
        return out
