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


@dataclass(frozen=True)
class SharedPrefixStages:
    """inference-perf's ``shared_prefix`` data under its Poisson rate stages (the llm-d
    tiered-prefix-cache benchmark): ``groups`` system prompts of ``system_len`` tokens,
    ``prompts_per_group`` questions of ``question_len`` tokens behind each, ``output_len``
    tokens out. The prompts are shuffled once; every stage sends ``rate * stage_s``
    requests, the i-th with prompt i (modulo their number), each second a Poisson
    number of them spread over it; a stage starts ``interval_s`` after the one before
    has finished (kubernetes-sigs/inference-perf ``shared_prefix_datagen.py``,
    ``load_generator.py``, ``load_timer.py``)."""

    rates: tuple[float, ...] = (5, 10, 15, 20, 25, 30, 35, 40)
    stage_s: int = 60
    interval_s: int = 60
    groups: int = 250
    prompts_per_group: int = 5
    system_len: int = 16_000
    question_len: int = 256
    output_len: int = 256
    seed: int = 0
    block_tokens: int = 128  # divides the system prompt and the question: no partial unit

    def __post_init__(self) -> None:
        if self.system_len % self.block_tokens or self.question_len % self.block_tokens:
            raise ValueError(f"system_len and question_len must be multiples of block_tokens={self.block_tokens}")

    @staticmethod
    def phase(rate: float) -> str:
        return f"{rate:g} QPS"

    def _prompts(self, rng: random.Random) -> list[tuple[int, ...]]:
        """Every prompt's hash ids (its group's system prompt, then its question), shuffled once."""
        b = self.block_tokens
        sys_units, q_units = self.system_len // b, self.question_len // b
        prompts = []
        for g in range(self.groups):
            prefix = list(range(g * sys_units, (g + 1) * sys_units))
            for p in range(self.prompts_per_group):
                first = self.groups * sys_units + (g * self.prompts_per_group + p) * q_units
                prompts.append(tuple(prefix + list(range(first, first + q_units))))
        rng.shuffle(prompts)
        return prompts

    def closed_loop(self, requests: int) -> list[TraceRequest]:
        """``requests`` requests, the i-th with prompt i (modulo their number), all at 0: what
        inference-perf's ``concurrent`` load sends, in order, as earlier ones finish
        (replayed with ``--concurrency``)."""
        prompts = self._prompts(random.Random(self.seed))
        n_in = self.system_len + self.question_len
        return [TraceRequest(0, n_in, self.output_len, prompts[i % len(prompts)], self.block_tokens)
                for i in range(requests)]

    def stages(self) -> list[list[TraceRequest]]:
        """Each stage's requests, arrivals from its start."""
        b = self.block_tokens
        rng = random.Random(self.seed)
        prompts = self._prompts(rng)
        n_in = self.system_len + self.question_len
        out = []
        for rate in self.rates:
            times: list[float] = []
            second = 0
            want = int(rate * self.stage_s)
            while len(times) < want:  # Poisson requests each second, spread by normalised gaps
                k = _poisson(rng, rate)
                gaps = [rng.expovariate(1.0) for _ in range(k)]
                t = float(second)
                for g_ in gaps:
                    t += g_ / sum(gaps)
                    times.append(t)
                second += 1
            out.append([TraceRequest(round(t * 1e9), n_in, self.output_len, prompts[i % len(prompts)], b,
                                     self.phase(rate)) for i, t in enumerate(times[:want])])
        return out


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's product of uniforms; lam is a few tens at most)."""
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k
