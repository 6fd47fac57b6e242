"""The reload scenario: the classic disk-offload experiment as a kvsim trace.

Every request shares a long system prompt. A fill phase visits ``contexts`` distinct
user contexts, together larger than the GPU cache plus a DRAM tier; a reload phase
then returns to them in the same order, so an LRU GPU cache has evicted each one
before it comes back (the LRU worst case), and only a tier that holds the whole
working set can serve them. The question suffix of each request is new.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True)
class ReloadScenario:
    contexts: int = 128
    prefix_len: int = 12_288  # the #49644 shape's shared system prompt
    context_len: int = 8_192
    suffix_len: int = 256
    output_len: int = 64
    fill_rate: float = 2.0  # requests per second
    reload_rate: float = 3.5
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
        n_in = self.prefix_len + self.context_len + self.suffix_len
        out: list[TraceRequest] = []
        gap_fill = round(1e9 / self.fill_rate)
        gap_reload = round(1e9 / self.reload_rate)
        t = 0
        for phase_gap in (gap_fill, gap_reload):
            for ctx in contexts:
                suffix = list(range(next_id, next_id + suffix_blocks))
                next_id += suffix_blocks
                out.append(TraceRequest(t, n_in, self.output_len, tuple(prefix + ctx + suffix), b))
                t += phase_gap
        return out
