"""The untimed oracle: token hit rate of a block LRU replayed in request order.

No time, no concurrency: each request first looks up its prefix, then all its blocks
become most recent, tail first so the shared prefix stays hottest. A timed replay
can only do worse at equal capacity (blocks in use cannot be shared before they are
computed, nor evicted), and matches it as arrivals are spread out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvsim.request import block_keys
from kvsim.trace import TraceRequest


def lru_hit_rate(requests: Sequence[TraceRequest], capacity_blocks: int, block_size: int = 16) -> float:
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for req in requests:
        keys = block_keys(req, block_size)
        cap = min(len(keys), (req.input_length - 1) // block_size)  # as the engine: last token computed
        n = 0
        for k in keys[:cap]:
            if k not in lru:
                break
            n += 1
        hit += n * block_size
        total += req.input_length
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        # Evict after the request, as its own blocks are held while it runs.
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0
