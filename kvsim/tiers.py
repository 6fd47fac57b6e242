"""Tier specs: ``none``, ``cpu:<size>``, ``disk:<size>``, ``disk:<size>:pagecache``."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.config import parse_size

DEFAULT_TIERS = ("none", "cpu:8GiB", "disk:1TB", "disk:1TB:pagecache")


def parse_bytes(what: str, text: str) -> int:
    """A size > 0 such as ``8GiB`` or ``100GB``, by the rules of kvoffload's config keys."""
    n = parse_size(what, text)
    if n <= 0:
        raise ValueError(f"{what}={text!r}: must be > 0")
    return n


@dataclass(frozen=True)
class TierSpec:
    kind: str  # "none" | "cpu" | "disk"
    capacity_bytes: int = 0
    page_cache: bool = False  # disk only: buffered IO through the OS page cache
    text: str = "none"


def parse_tier(text: str) -> TierSpec:
    parts = text.strip().split(":")
    kind = parts[0].lower()
    if kind == "none" and len(parts) == 1:
        return TierSpec("none", text="none")
    if kind not in ("cpu", "disk"):
        raise ValueError(f"bad tier {text!r}: use none, cpu:<size>, disk:<size> or disk:<size>:pagecache")
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"bad tier {text!r}: {kind} needs a size, e.g. {kind}:8GiB")
    try:
        size = parse_bytes("size", parts[1])
    except ValueError as e:
        raise ValueError(f"bad tier {text!r}: {e}") from None
    opts = [p.lower() for p in parts[2:]]
    if kind == "cpu" and opts:
        raise ValueError(f"bad tier {text!r}: cpu takes no options")
    if any(o != "pagecache" for o in opts) or len(opts) > 1:
        raise ValueError(f"bad tier {text!r}: the only disk option is 'pagecache'")
    return TierSpec(kind, size, bool(opts), text=text.strip())
