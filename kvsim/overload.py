"""A trace that offers more than the deployment serves: the rule that says so, and the
settings that serve it, each found by replaying the trace with it.

A trace comes from a cluster; kvsim replays it on what it is told (one replica unless
``--replicas``). When the backlog outlasts the arrivals, every TTFT is mostly a queue
and the line printed before the table says so. What it suggests is not a ratio of rates:
a trace whose arrivals come in bursts (the Mooncake trace sends up to a few tens of
requests at one instant) queues in each burst at any arrival rate, so a ``--time-scale``
worked out from the served rate left every tier warning that queueing was most of its
TTFT. Each value the line gives has been replayed, on every tier, and served it: no tier
overloaded, and queueing at most half of every tier's TTFT (no warning).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from kvsim.replay import QUEUE_WARNING, Workload

# A trace's replay is overloaded when its backlog at the last arrival takes longer to
# drain than a fiftieth of the trace and a few requests' own service: the queue grew all
# along (a burst drains in about one request's time).
OVERLOAD_DRAIN_SHARE, OVERLOAD_SERVICES = 0.02, 3
# The first value tried: the offered over the served rate with this much headroom; a value
# that does not serve is followed by one this much larger (a replica more at least), a
# few times, then by the largest allowed and, when that serves, a bisection between.
FIRST_HEADROOM = 1.25
GROWTH = 1.25
STEPS_UP = 3


def overloaded(s: dict) -> Optional[float]:
    """How many times more work the trace offered than the tier served in time, when its
    backlog outlasted the arrivals (else None): the span plus the drain over the span, or,
    for arrivals all at once, the drain over what a few requests' service allows."""
    span, drain, service = s["arrival_span_s"], s["drain_s"], OVERLOAD_SERVICES * s["service_p90_s"]
    if drain <= OVERLOAD_DRAIN_SHARE * span + service or not drain:
        return None
    return (span + drain) / span if span else drain / max(service, 1e-3)


def queue_bound(s: dict) -> bool:
    """Whether the tier warns that queueing for the GPU is most of its TTFT (replay.py)."""
    return any(QUEUE_WARNING in w for w in s["warnings"])


def serves(s: dict) -> bool:
    """The tier kept up: not overloaded, and no queueing warning."""
    return overloaded(s) is None and not queue_bound(s)


def worst_first(summaries: Sequence[dict]) -> list[int]:
    """The tiers' indices, the one likeliest to fail a setting first (most overloaded,
    then the largest share of queueing), so that a setting that does not serve costs
    one replay."""
    return sorted(range(len(summaries)), key=lambda i: (-(overloaded(summaries[i]) or 0.0),
                                                        -summaries[i]["queue_share_of_ttft"]))


def largest_burst(work: Workload) -> int:
    """The most requests of the trace that arrive at one instant."""
    counts = Counter(r.arrival_ns for s in work.stages for r in s)
    return max(counts.values(), default=0)


# A setting's check: replay the trace with it, tier by tier, and give the summary of the
# first tier it does not serve, or None when it serves every tier.
Check = Callable[[float], Optional[dict]]


@dataclass(frozen=True)
class Search:
    """Values tried in turn, the first that served, and the last that did not with the
    tier it failed (its summary)."""

    found: Optional[float]
    tried: tuple[float, ...]
    failed: Optional[dict]


def search(first: float, limit: float, check: Check, integer: bool, limit_first: bool = False) -> Search:
    """The smallest value from ``first`` up to ``limit`` that ``check`` passes, near enough:
    ``first``, then up by ``GROWTH`` (``STEPS_UP`` values in all), then ``limit``, and when
    that serves, a bisection between the last value that did not and it (to one replica,
    or to ``GROWTH`` for a time scale, whose values are rounded up to a tenth as the line
    prints them). None found when ``limit`` does not serve either. ``limit_first``: try
    ``limit`` right after ``first`` (a time scale: a trace sent in bursts queues in each
    burst however far apart the bursts are, which one replay at the limit shows)."""
    tried: list[float] = []

    def attempt(v: float) -> Optional[dict]:
        tried.append(v)
        return check(v)

    def up(v: float) -> float:
        return min(limit, max(v + 1, math.ceil(v * GROWTH)) if integer else _tenth_up(v * GROWTH))

    lo = min(first, limit)
    failed = attempt(lo)
    if failed is None:
        return Search(lo, tuple(tried), None)
    if lo >= limit:
        return Search(None, tuple(tried), failed)
    limit_serves = False
    if limit_first:
        f = attempt(limit)
        if f is not None:
            return Search(None, tuple(tried), f)
        limit_serves = True
    for _ in range(STEPS_UP - 1):
        v = up(lo)
        if v >= limit:
            break
        f = attempt(v)
        if f is None:
            return Search(v, tuple(tried), None)
        lo, failed = v, f
    if not limit_serves:
        f = attempt(limit)
        if f is not None:
            return Search(None, tuple(tried), f)
    hi = limit
    while (hi - lo > 1) if integer else (up(lo) < hi):
        mid = (lo + hi) // 2 if integer else min(_tenth_up(math.sqrt(lo * hi)), hi)
        if mid in (lo, hi):
            break
        if attempt(mid) is None:
            hi = mid
        else:
            lo = mid
    return Search(hi, tuple(tried), None)


def _tenth_up(x: float) -> float:
    """``x`` rounded up to a tenth, as the line prints it (``{:g}``) and a rerun reads it."""
    return float(f"{math.ceil(x * 10) / 10:g}")


def first_time_scale(worst: float, time_scale: float) -> float:
    return _tenth_up(time_scale * worst * FIRST_HEADROOM)


def first_replicas(worst: float, replicas: int) -> int:
    return max(replicas + 1, math.ceil(replicas * worst * FIRST_HEADROOM))


def _said(s: Search, flag: str, bursts: str = "") -> str:
    """``--replicas 4 does``, or the values tried and why the largest did not serve."""
    if s.found is not None:
        return f"{flag} {s.found:g} does"
    values = [f"{v:g}" if v < 1e5 else f"{v:,.0f}" for v in sorted(s.tried)]
    listed = f"{values[0]} does not" if len(values) == 1 else f"{', '.join(values[:-1])} and {values[-1]} do not"
    f = s.failed
    why = "still overloaded" if overloaded(f) else f"still queues for {f['queue_share_of_ttft']:.0%} of its TTFT"
    return f"{flag} {listed} (at {values[-1]} {f['tier']} {why}{bursts})"


def overload_line(summaries: Sequence[dict], what: str, replicas: Search, time_scale: Optional[Search],
                  burst: int) -> str:
    """The line for a trace that offered more than the deployment served: the numbers, and
    what serves it, each value replayed (``time_scale`` None: arrivals all at once, nothing
    to stretch)."""
    over = {s["tier"]: overloaded(s) for s in summaries}
    s = summaries[0]
    span = s["arrival_span_s"]
    served = ", ".join(f"{t} {x['prompt_tokens'] / (x['arrival_span_s'] + x['drain_s']):,.0f}"
                       for t, x in zip(over, summaries) if over[t])
    if span:
        head = (f"overloaded: the trace offers {s['prompt_tokens'] / span:,.0f} prompt tokens/s over {span:,.0f} s "
                f"({s['requests']:,} requests)")
    else:
        head = (f"overloaded: the trace's {s['requests']:,} requests ({s['prompt_tokens']:,} prompt tokens) arrive at "
                f"once")
    bursts = f"; up to {burst:,} requests arrive at one instant" if burst > 1 else ""
    fixes = [_said(replicas, "--replicas")]
    if time_scale is not None:
        fixes.append(_said(time_scale, "--time-scale", bursts))
    return (f"{head}; {what} served {served} tokens/s, so its TTFTs are mostly queueing. Replayed to find what "
            f"serves it (every tier keeping up, queueing at most half its TTFT): {'; '.join(fixes)}")
