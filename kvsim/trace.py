"""Trace readers: Mooncake FAST'25 jsonl and kvsim's own jsonl (docs/kvsim.md).

Mooncake: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` with one
id per 512-token block, the partial last block included. kvsim: ``{"arrival_us",
"input_length", "output_length", "hash_ids", "block_tokens"?, "phase"?}`` (block_tokens
defaults to 512; phase, a name such as ``fill``, groups requests in the report). The
format is told by the first record's keys.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Optional

import xxhash

from kvoffload.cli_args import InputError, read_lines
from kvsim.limits import MAX_ARRIVAL_NS, MAX_TOKENS, integer_in, integer_range, shown

MOONCAKE_BLOCK_TOKENS = 512
_MOONCAKE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids"}
_KVSIM_KEYS = {"arrival_us", "input_length", "output_length", "hash_ids"}


class TraceError(InputError):
    """A bad trace record; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ns: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    phase: Optional[str] = None


def _int_field(rec: dict, key: str, where: str, minimum: int, maximum: int = MAX_TOKENS, unit: str = "") -> int:
    """``rec[key]``, an integer in [minimum, maximum] (kvsim/limits.py: token counts by
    default; ``unit`` says what else it counts)."""
    v = rec.get(key)
    if not integer_in(v, minimum, maximum):
        raise TraceError(f"{where}: {key!r} must be {integer_range(minimum, maximum)}{unit}, got {shown(v)}")
    return v


def _parse(rec: object, fmt: Optional[str], where: str) -> tuple[str, TraceRequest]:
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    keys = set(rec)
    if fmt is None:
        fmt = "mooncake" if "timestamp" in keys else "kvsim" if "arrival_us" in keys else None
        if fmt is None:
            raise TraceError(f"{where}: neither a Mooncake record (timestamp) nor a kvsim record (arrival_us)")
    need = _MOONCAKE_KEYS if fmt == "mooncake" else _KVSIM_KEYS
    if missing := need - keys:
        raise TraceError(f"{where}: {fmt} record lacks {', '.join(sorted(missing))}")
    n_in = _int_field(rec, "input_length", where, 1)
    n_out = _int_field(rec, "output_length", where, 0)
    phase = None
    # Arrival times become int64 nanoseconds (kvsim/limits.py).
    if fmt == "mooncake":
        arrival_ns = _int_field(rec, "timestamp", where, 0, MAX_ARRIVAL_NS // 1_000_000, " (ms)") * 1_000_000
        block = MOONCAKE_BLOCK_TOKENS
    else:
        arrival_ns = _int_field(rec, "arrival_us", where, 0, MAX_ARRIVAL_NS // 1_000, " (us)") * 1_000
        block = _int_field(rec, "block_tokens", where, 1) if "block_tokens" in rec else MOONCAKE_BLOCK_TOKENS
        phase = rec.get("phase")
        if phase is not None and not (isinstance(phase, str) and phase):
            raise TraceError(f"{where}: 'phase' must be a non-empty string, got {phase!r}")
    ids = rec["hash_ids"]
    # Ids are 64-bit (sampling hashes them as 8 bytes).
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64
                                            for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers in [0, 2**64)")
    blocks = -(-n_in // block)  # integer ceil: a float would overflow on a huge input_length
    if len(ids) != blocks:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{block}) = "
            f"{blocks} (one per {block}-token block, the partial last one included)"
        )
    return fmt, TraceRequest(arrival_ns, n_in, n_out, tuple(ids), block, phase)


def parse_lines(lines: Iterable[str], name: str = "<trace>") -> Iterator[TraceRequest]:
    fmt: Optional[str] = None
    last_ns = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON: {e.msg} at column {e.colno}") from None
        except RecursionError:
            raise TraceError(f"{where}: not a trace record: nested too deeply") from None
        except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            raise TraceError(f"{where}: not a trace record: an integer of more than "
                             f"{sys.get_int_max_str_digits()} digits") from None
        fmt, req = _parse(rec, fmt, where)
        if req.arrival_ns < last_ns:
            raise TraceError(f"{where}: arrival goes backwards ({req.arrival_ns} ns after {last_ns} ns)")
        last_ns = req.arrival_ns
        yield req


def _keep(req: TraceRequest, fraction: float, seed: int) -> bool:
    # Sample whole conversations: Mooncake ids are prefix-chained and every request
    # starts with the shared block 0, so the second id names the conversation root.
    root = req.hash_ids[1] if len(req.hash_ids) > 1 else req.hash_ids[0]
    return xxhash.xxh64_intdigest(root.to_bytes(8, "little"), seed) < fraction * 2.0**64


def read_trace(
    path: str,
    time_scale: float = 1.0,
    sample: float = 1.0,
    seed: int = 0,
    limit: Optional[int] = None,
) -> list[TraceRequest]:
    """Read, sample conversations, stretch arrivals by ``time_scale`` (2 = half the rate)."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if not 0 < sample <= 1:
        raise ValueError(f"sample must be in (0, 1], got {sample}")
    out: list[TraceRequest] = []
    # Decoded line by line, so a byte that is not UTF-8 is named with its line.
    for req in parse_lines((text for _, text in read_lines(path, TraceError)), path):
        if sample < 1 and not _keep(req, sample, seed):
            continue
        if time_scale != 1:
            req = dataclasses.replace(req, arrival_ns=round(req.arrival_ns * time_scale))
        out.append(req)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(f"{path}: no requests (empty file, or --sample kept none)")
    return out


def write_kvsim(requests: Iterable[TraceRequest], f: IO[str]) -> None:
    for r in requests:
        rec = {"arrival_us": r.arrival_ns // 1_000, "input_length": r.input_length,
               "output_length": r.output_length, "block_tokens": r.block_tokens, "hash_ids": list(r.hash_ids)}
        if r.phase is not None:
            rec["phase"] = r.phase
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
