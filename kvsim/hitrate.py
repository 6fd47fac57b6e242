"""The untimed oracle: token hit rate of an LRU of units replayed in request order.

No time, no concurrency: each request first looks up its prefix, then all its units
become most recent, tail first so the shared prefix stays hottest; capacity counts
vLLM blocks, as the timed caches do (units, request.py). A timed replay at equal
capacity differs by LRU order only, either way (it frees blocks when a request
finishes, holds those in use and reserved, and shares a block as soon as its step
is scheduled, as vLLM does): within a point on the test trace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvsim.request import prompt_units
from kvsim.trace import TraceRequest


def lru_hit_rate(requests: Sequence[TraceRequest], capacity_blocks: int, block_size: int = 16) -> float:
    lru: OrderedDict[int, int] = OrderedDict()  # unit -> blocks
    used = hit = total = 0
    for req in requests:
        u = prompt_units(req, block_size)
        keys = u.keys
        cap = u.within((req.input_length - 1) // block_size)  # as the engine: last token computed
        n = 0
        for k in keys[:cap]:
            if k not in lru:
                break
            n += 1
        hit += u.blocks(n) * block_size
        total += req.input_length
        for i in range(len(keys) - 1, -1, -1):
            k = keys[i]
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = u.weight(i)
                used += lru[k]
        # Evict after the request, as its own blocks are held while it runs.
        while used > capacity_blocks:
            used -= lru.popitem(last=False)[1]
    return hit / total if total else 0.0
