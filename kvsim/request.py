"""A request's run-time state, and its vLLM block keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvsim.trace import TraceRequest


def block_keys(req: TraceRequest, block_size: int) -> list[int]:
    """Keys of the prompt's full ``block_size``-token blocks; partial tails have none.

    Trace block ``h`` of ``T`` tokens is ``T / block_size`` vLLM blocks keyed
    ``h * (T / block_size) + k``; an id stands for its whole prefix, so the keys
    do too, and sharing that diverges inside a trace block is invisible.
    """
    sub, rem = divmod(req.block_tokens, block_size)
    if rem:
        raise ValueError(f"trace blocks of {req.block_tokens} tokens are not a multiple of "
                         f"the block size {block_size}")
    keys: list[int] = []
    left = req.input_length
    for h in req.hash_ids:
        full = min(req.block_tokens, left) // block_size
        base = h * sub
        keys.extend(range(base, base + full))
        left -= req.block_tokens
    return keys


@dataclass(slots=True, eq=False)
class Request:
    rid: int
    arrival_ns: int
    prompt: int
    output: int  # tokens to generate, the first one included (at least 1)
    trace: TraceRequest
    keys: list[int] = field(default_factory=list)  # built at admission, dropped at finish
    allocated: bool = False
    computed: int = 0  # prompt tokens whose KV is on the GPU
    generated: int = 0
    owned: list[int] = field(default_factory=list)  # GPU cache keys referenced
    num_anon: int = 0
    published: int = 0  # leading keys published to the GPU cache
    gpu_hit_blocks: int = 0
    load_blocks: int = 0
    recomputed_tokens: int = 0
    resumed_ns: Optional[int] = None  # the step boundary that saw its load complete
    first_token_ns: Optional[int] = None
    finish_ns: Optional[int] = None
