"""Tier specs: ``none``, ``cpu:<size>``, ``disk:<size>``, ``disk:<size>:pagecache``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

DEFAULT_TIERS = ("none", "cpu:8GiB", "disk:1TB", "disk:1TB:pagecache")


def parse_size(text: str) -> int:
    """``8GiB`` -> 8589934592, ``100GB`` -> 10**11; decimal and binary units."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}: use a number and a unit such as 8GiB, 100GB, 1TB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"bad size {text!r}: must be > 0")
    return n


@dataclass(frozen=True)
class TierSpec:
    kind: str  # "none" | "cpu" | "disk"
    capacity_bytes: int = 0
    page_cache: bool = False  # disk only: buffered IO through the OS page cache
    text: str = "none"

    @property
    def label(self) -> str:
        return self.text


def parse_tier(text: str) -> TierSpec:
    parts = text.strip().split(":")
    kind = parts[0].lower()
    if kind == "none" and len(parts) == 1:
        return TierSpec("none", text="none")
    if kind not in ("cpu", "disk"):
        raise ValueError(f"bad tier {text!r}: use none, cpu:<size>, disk:<size> or disk:<size>:pagecache")
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"bad tier {text!r}: {kind} needs a size, e.g. {kind}:8GiB")
    size = parse_size(parts[1])
    opts = [p.lower() for p in parts[2:]]
    if kind == "cpu" and opts:
        raise ValueError(f"bad tier {text!r}: cpu takes no options")
    if any(o != "pagecache" for o in opts) or len(opts) > 1:
        raise ValueError(f"bad tier {text!r}: the only disk option is 'pagecache'")
    return TierSpec(kind, size, bool(opts), text=text.strip())
