"""A request's run-time state, and its prompt as units of vLLM blocks.

kvsim caches per trace block (a *unit*): trace block ``h`` of ``T`` tokens is
``T / block_size`` vLLM blocks that are hit, stored, loaded and evicted together,
keyed ``h``. The trace cannot tell those blocks apart (an id stands for its whole
prefix, and sharing that diverges inside a trace block is invisible), and one
bookkeeping step per unit instead of per 16-token block is what makes a replay of
the Mooncake trace take seconds, not minutes. A unit's weight is its number of
full vLLM blocks: ``T / block_size``, fewer for a partial last trace block (whose
partial tail block vLLM never caches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvsim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class Units:
    keys: list[int]  # one per trace block holding at least one full vLLM block
    per_unit: int  # vLLM blocks in a full unit
    last: int  # full vLLM blocks in the last unit (<= per_unit)

    def blocks(self, n: int) -> int:
        """Full vLLM blocks in the first ``n`` units."""
        if n < len(self.keys):
            return n * self.per_unit
        return (len(self.keys) - 1) * self.per_unit + self.last if self.keys else 0

    def weight(self, i: int) -> int:
        return self.last if i == len(self.keys) - 1 else self.per_unit

    def within(self, num_blocks: int) -> int:
        """How many leading units lie wholly within the first ``num_blocks`` blocks."""
        if self.keys and num_blocks >= self.blocks(len(self.keys)):
            return len(self.keys)
        return min(num_blocks // self.per_unit, max(0, len(self.keys) - 1))


def block_size_error(block_tokens: int, block_size: int) -> str:
    return (f"--block-size {block_size}: trace blocks of {block_tokens} tokens are not a multiple of the block "
            f"size {block_size}")


def prompt_units(req: TraceRequest, block_size: int) -> Units:
    per_unit, rem = divmod(req.block_tokens, block_size)
    if rem or not per_unit:
        raise ValueError(block_size_error(req.block_tokens, block_size))
    tail = req.input_length - (len(req.hash_ids) - 1) * req.block_tokens
    last = min(tail, req.block_tokens) // block_size
    keys = list(req.hash_ids)
    if last == 0:  # the last trace block holds no full vLLM block: nothing to cache
        keys.pop()
        last = per_unit
    return Units(keys, per_unit, last)


@dataclass(slots=True, eq=False)
class Request:
    rid: int
    arrival_ns: int
    prompt: int
    output: int  # tokens to generate, the first one included (at least 1)
    trace: TraceRequest
    units: Optional[Units] = None  # built at admission, dropped at finish
    allocated: bool = False
    admitted_ns: Optional[int] = None  # GPU blocks allocated: the end of its queueing
    computed: int = 0  # prompt tokens whose KV is on the GPU
    generated: int = 0
    owned: list[Any] = field(default_factory=list)  # the GPU cache's copies it references (gpu_cache.py)
    num_anon: int = 0  # GPU blocks taken but not cached (not yet computed, duplicates, output)
    num_reserved: int = 0  # GPU blocks reserved at admission, not yet taken
    num_held: int = 0  # GPU blocks in its block table: hit and taken
    published: int = 0  # leading units published to the GPU cache
    offered: int = 0  # leading units offered to the offload tier
    gpu_hit_blocks: int = 0
    load_blocks: int = 0
    recomputed_tokens: int = 0
    load_eta_ns: Optional[int] = None  # when the engine expected to see the load complete
    resumed_ns: Optional[int] = None  # the step boundary that saw its load complete
    runnable_at: int = 0  # the engine's first step boundary whose batch may hold it (async scheduling)
    first_token_ns: Optional[int] = None
    finish_ns: Optional[int] = None
