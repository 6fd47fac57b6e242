"""A router over several replicas: llm-d's endpoint picker as the tiered-prefix-cache guide configures it.

Each request is scored on every replica by the guide's scorers (llm-d/llm-d
``guides/tiered-prefix-cache/router/*.values.yaml``, Gateway API Inference
Extension's scorers) and sent to the best; ties go to a seeded random one, as the
max-score picker shuffles its candidates. The scores, each in [0, 1]:

- queue: ``(max - q) / (max - min)`` of the replicas' waiting requests, 1 for all
  when they are equal (the queue scorer);
- KV-cache utilisation: ``1 - used / total`` of the replica's GPU blocks (vLLM's
  ``kv_cache_usage_perc``: blocks held by running requests);
- a prefix-cache scorer per tier: the share of the request's hashed blocks that continue
  a prefix the replica is believed to hold. The belief is the approximate prefix
  producer's (``approx-prefix-cache-producer``): an LRU per replica of the blocks of every
  request routed there, not what the replica really holds. The producer hashes at most
  ``DefaultMaxPrefixBlocks`` = 256 blocks of a prompt, each ``blockSizeTokens`` = 16
  tokens (vLLM's block, which ``autoTune`` reads; 64 characters at the code's 4
  characters a token): the first 4,096 tokens, so two prompts alike over those are
  alike to the router, and a prompt fills 256 entries of the LRU however long it is.
  The LRU holds ``NumOfGPUBlocks`` entries: the GPU producer's the replica's GPU blocks
  (``autoTune``); a producer with ``autoTune`` off (the CPU tier's) gets the constant
  ``defaultLRUCapacityPerServer`` = 31,250, which its ``makeserver`` passes to the
  indexer whatever ``lruCapacityPerServer`` says (gateway-api-inference-extension and
  llm-d-inference-scheduler ``approximateprefix/plugin.go`` and ``indexer.go``);
- no-hit LRU: a request that no replica is believed to hold goes first to the replica
  that least recently got such a cold request (rank over the replicas, 1 to 0); a
  request with a hit scores 0 everywhere on it.

The total is the weighted sum (the guide's weights: all 1). Metrics are read at the
instant of the arrival (the endpoint picker scrapes them every few tens of ms).
kvsim's blocks are its units (request.py); a capacity in tokens is converted to units.
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

SCORERS = ("queue", "kv-cache-utilization", "gpu-prefix", "tier-prefix", "no-hit-lru")
# The approximate prefix producer's defaults: DefaultMaxPrefixBlocks blocks of
# DefaultBlockSizeTokens tokens are hashed; an LRU with autoTune off holds
# defaultLRUCapacityPerServer blocks.
MAX_PREFIX_TOKENS = 256 * 16
UNTUNED_LRU_TOKENS = 31_250 * 16


@dataclass(frozen=True)
class RouterSpec:
    """Which scorers with which weights (``untiered_weights``: those of the replicas
    without an offload tier, where they are not ``weights`` less the tier scorer); the
    tier prefix scorer's belief of a replica's tier, in tokens (None: the tier's real
    capacity); how many leading tokens of a prompt the prefix producer hashes (None: all)."""

    weights: tuple[tuple[str, float], ...] = tuple((s, 1.0) for s in SCORERS)
    tier_capacity_tokens: Optional[int] = None
    max_prefix_tokens: Optional[int] = MAX_PREFIX_TOKENS
    untiered_weights: Optional[tuple[tuple[str, float], ...]] = None
    seed: int = 0

    def without(self, scorer: str) -> "RouterSpec":
        return dataclasses.replace(self, weights=tuple(w for w in self.weights if w[0] != scorer))

    def untiered(self) -> "RouterSpec":
        """The router of replicas without an offload tier."""
        if self.untiered_weights is None:
            return self.without("tier-prefix")
        return dataclasses.replace(self, weights=self.untiered_weights)


class PrefixIndex:
    """The approximate prefix producer's belief about one replica: an LRU of unit keys."""

    def __init__(self, capacity_units: int) -> None:
        self.capacity = max(1, capacity_units)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def matched(self, keys: Sequence[int]) -> int:
        lru, n = self._lru, 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        return n

    def record(self, keys: Sequence[int]) -> None:
        lru = self._lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class Router:
    def __init__(self, spec: RouterSpec, engines: Sequence[Any], gpu_units: int, tier_units: int,
                 unit_tokens: int) -> None:
        """``gpu_units``, ``tier_units``: what each replica's GPU and tier are believed to
        hold; ``unit_tokens``: the tokens of one unit."""
        self.spec, self.engines = spec, list(engines)
        # The hashed prefix in whole units (the producer hashes whole blocks), at least the
        # first: a unit longer than the hashed prefix still decides where its prompt goes.
        self.hashed_units = None if spec.max_prefix_tokens is None else max(1, spec.max_prefix_tokens // unit_tokens)
        self.weights = dict(spec.weights)
        self.gpu = [PrefixIndex(gpu_units) for _ in engines]
        self.tier = [PrefixIndex(tier_units) for _ in engines] if "tier-prefix" in self.weights else None
        self._cold_order = list(range(len(engines)))  # least recently sent a cold request first
        self._rng = random.Random(spec.seed)
        self.routed = [0] * len(engines)

    def pick(self, keys: Sequence[int]) -> int:
        """The replica for a request of unit ``keys``; records the keys there."""
        n = len(self.engines)
        if n == 1:
            self.routed[0] += 1
            return 0
        keys = keys[:self.hashed_units]
        w = self.weights
        total = max(1, len(keys))
        scores = [0.0] * n
        gpu_hits = [ix.matched(keys) for ix in self.gpu]
        tier_hits = [ix.matched(keys) for ix in self.tier] if self.tier is not None else [0] * n
        if "queue" in w:
            q = [len(e.waiting) + e.num_parked for e in self.engines]
            lo, hi = min(q), max(q)
            for i in range(n):
                scores[i] += w["queue"] * (1.0 if hi == lo else (hi - q[i]) / (hi - lo))
        if "kv-cache-utilization" in w:
            for i, e in enumerate(self.engines):
                scores[i] += w["kv-cache-utilization"] * (1.0 - e.gpu.num_used / e.gpu.num_blocks)
        if "gpu-prefix" in w:
            for i in range(n):
                scores[i] += w["gpu-prefix"] * gpu_hits[i] / total
        if self.tier is not None:
            for i in range(n):
                scores[i] += w["tier-prefix"] * tier_hits[i] / total
        cold = not any(gpu_hits) and not any(tier_hits)
        if cold and "no-hit-lru" in w:
            for rank, i in enumerate(self._cold_order):
                scores[i] += w["no-hit-lru"] * (1.0 - rank / (n - 1))
        best = max(scores)
        choice = self._rng.choice([i for i in range(n) if scores[i] >= best - 1e-12])
        if cold:
            self._cold_order.remove(choice)
            self._cold_order.append(choice)
        self.gpu[choice].record(keys)
        if self.tier is not None:
            self.tier[choice].record(keys)
        self.routed[choice] += 1
        return choice
