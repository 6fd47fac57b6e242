"""Tier specs and the disk pipelines they name.

``KIND:SIZE[:OPTION]...`` or ``none``. Kinds: ``cpu`` (vLLM's pinned DRAM tier),
``disk`` (kvoffload's DiskBackend) and ``vllm-disk`` (vLLM 0.33's own disk backend).
Disk options: ``pagecache`` (buffered IO through the OS page cache instead of
O_DIRECT), ``threads=N`` (IO threads per slot file and direction: kvoffload's
``io_threads``), ``ios-per-thread=N`` (IOs in flight per IO thread: the queue depth of
one thread); ``disk`` only: ``unit=SIZE``
(a job is split into units of this size over the threads), ``seal=aes-gcm|xxh3|off``,
``paths=N`` (slot files, one per drive). Sizes by kvoffload's rules (``8GiB``,
``100GB``); on the command line a size needs its unit (``disk:200`` is refused, ``200B``
is 200 bytes). Two levels, as vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec``
runs them: ``cpu:SIZE+disk:SIZE[:OPTION]...`` (a CPU primary, kvoffload's slot files as
the secondary tier; tiering.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

from kvoffload.config import parse_size
from kvsim.profile import SEALS

MiB = 1 << 20
# kvoffload's DiskBackend defaults (kvoffload/disk_backend.py; a test keeps them equal):
# IO threads per lane, and units of at most 8 MiB within 256 MiB of staging per rank (the
# tier's the same).
KVOFFLOAD_IO_THREADS = 8
KVOFFLOAD_STAGING_BYTES = 256 * MiB
KVOFFLOAD_MAX_UNIT_BYTES = 8 * MiB
KVOFFLOAD_BUFFER_SLOTS = 2  # vLLM's disk_buffer_slots default, which the connector passes
KINDS = ("cpu", "disk", "vllm-disk")
MAX_OPTION = 1024  # threads=, ios-per-thread=, paths=
# Options each kind accepts; a flag that would do nothing is refused.
_OPTIONS = {"cpu": (), "vllm-disk": ("pagecache", "threads", "ios-per-thread"),
            "disk": ("pagecache", "threads", "ios-per-thread", "unit", "seal", "paths")}


@dataclass(frozen=True)
class Pipeline:
    """How a disk backend moves blocks between the GPU and its slot files."""

    threads: Optional[int]  # IO threads per slot file and direction; None: kvoffload_threads
    ios_per_thread: int  # IOs one thread keeps in flight (its queue depth)
    # Jobs are split into units of this many bytes over the threads; a thread copies
    # a unit to or from the GPU in one batched copy; a load thread reads its next
    # unit while the previous one's copy runs (two staging buffers), a store thread
    # copies, seals and writes one unit at a time. 0 (vLLM 0.33): a whole job on one
    # thread, block by block, its DMA and file IO overlapped through two staging slots.
    # None: kvoffload's default for the paths and threads (kvoffload_unit_bytes).
    unit_bytes: Optional[int]
    seal: str  # per slot: aes-gcm, xxh3 or off
    paths: Optional[int]  # slot files, one per drive; None: one per drive of the profile
    page_cache: bool


KVOFFLOAD = Pipeline(None, 1, None, "aes-gcm", None, False)
# vLLM 0.33's simple_kv_offload DiskBackend: one store and one load thread, one IO
# at a time, whole jobs, no checksum, one file.
VLLM_033 = Pipeline(1, 1, 0, "off", 1, False)


def kvoffload_threads(cpus: int, paths: int) -> int:
    """kvoffload's IO threads per lane (``default_io_threads``): up to 8, fewer when
    several slot files share the host's cores."""
    return max(KVOFFLOAD_BUFFER_SLOTS, 2, min(KVOFFLOAD_IO_THREADS, cpus // paths))


def kvoffload_unit_bytes(paths: int, threads: int) -> int:
    """kvoffload's default IO unit (``default_io_unit_bytes``): the largest, up to 8 MiB and
    at least 1 MiB, whose staging (three units per thread and path) fits 256 MiB."""
    return max(MiB, min(KVOFFLOAD_MAX_UNIT_BYTES, KVOFFLOAD_STAGING_BYTES // (3 * threads * paths)))


UNITS = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
# A number alone: kvoffload's config reads it as bytes, which a typed size almost never is
# (``disk:200`` for 200 GiB would be a 200-byte tier).
_NO_UNIT = re.compile(r"^\s*[0-9]*\.?[0-9]*\s*$", re.ASCII)


def has_no_unit(text: str) -> bool:
    return bool(_NO_UNIT.match(text)) and any(c.isdigit() for c in text)


def parse_bytes(what: str, text: str, need_unit: bool = False, example: str = "") -> int:
    """A size > 0 such as ``8GiB`` or ``100GB``, by the rules of kvoffload's config keys;
    with ``need_unit``, a number without its unit is refused (``example``: what the
    message shows instead, ``{n}`` the number given)."""
    n = parse_size(what, text)
    if n <= 0:
        raise ValueError(f"{what}={text!r}: must be > 0")
    if need_unit and has_no_unit(text):
        number = text.strip()
        shown = (example or "{n}GiB").format(n=number)
        raise ValueError(f"{what}={text!r} has no unit: write it with one, e.g. {shown} ({UNITS}; {number}B for "
                         f"bytes)")
    return n


@dataclass(frozen=True)
class TierSpec:
    kind: str  # "none" | "cpu" | "disk" | "vllm-disk"
    capacity_bytes: int = 0
    pipeline: Optional[Pipeline] = None  # disk kinds only
    text: str = "none"
    secondary: Optional["TierSpec"] = None  # cpu only: the disk level under it

    @property
    def page_cache(self) -> bool:
        if self.secondary is not None:
            return self.secondary.page_cache
        return self.pipeline is not None and self.pipeline.page_cache


def _int_option(text: str, name: str, value: str) -> int:
    # Threads, IOs per thread and paths are each simulated one by one: a mistyped
    # 10**21 must be refused, not started.
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        raise ValueError(f"bad tier {text!r}: {name}={value!r} must be an integer >= 1")
    if int(value) > MAX_OPTION:
        raise ValueError(f"bad tier {text!r}: {name}={value!r} must be at most {MAX_OPTION}")
    return int(value)


def parse_tier(text: str, need_unit: bool = False) -> TierSpec:
    """``text`` as a tier; ``need_unit`` (the command line): every size with its unit."""
    spec = text.strip()
    if "+" not in spec:
        return _parse_level(text, spec, need_unit=need_unit)
    levels = spec.split("+")
    if len(levels) != 2:
        raise ValueError(f"bad tier {text!r}: a two-level tier has two levels, cpu:SIZE+disk:SIZE")
    first, second = (lv.strip() for lv in levels)
    if first.split(":")[0].lower() != "cpu":
        raise ValueError(f"bad tier {text!r}: the first level must be the CPU primary, cpu:SIZE "
                         f"(got {first!r}); e.g. cpu:8GiB+disk:1TB")
    kind = second.split(":")[0].lower()
    if kind == "vllm-disk":
        raise ValueError(f"bad tier {text!r}: vllm-disk is vLLM's simple-offload disk backend, not a "
                         f"secondary tier (vLLM's own fs tier is not modelled); use disk:SIZE")
    if kind != "disk":
        raise ValueError(f"bad tier {text!r}: the second level must be kvoffload's disk tier, "
                         f"disk:SIZE[:OPTION...] (got {second!r})")
    primary = _parse_level(text, first, need_unit=need_unit)
    return replace(primary, text=f"{primary.text}+{second}",
                   secondary=_parse_level(text, second, KVOFFLOAD, need_unit))


def _parse_level(text: str, spec: str, disk: Pipeline = KVOFFLOAD, need_unit: bool = False) -> TierSpec:
    """One level (``spec``) of the tier ``text``; ``disk`` is what a ``disk`` level starts from."""
    parts = spec.split(":")
    kind = parts[0].lower()
    if kind == "none" and len(parts) == 1:
        return TierSpec("none", text="none")
    if kind not in KINDS:
        raise ValueError(f"bad tier {text!r}: use none, cpu:SIZE, disk:SIZE[:OPTION...] or "
                         f"vllm-disk:SIZE[:OPTION...]")
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"bad tier {text!r}: {kind} needs a size, e.g. {kind}:100GiB")
    try:
        size = parse_bytes("size", parts[1], need_unit, f"{kind}:{{n}}GiB")
    except ValueError as e:
        raise ValueError(f"bad tier {text!r}: {e}") from None
    if kind == "cpu":
        if len(parts) > 2:
            raise ValueError(f"bad tier {text!r}: cpu takes no options")
        return TierSpec("cpu", size, text=spec)
    pipe = disk if kind == "disk" else VLLM_033
    seen: set[str] = set()
    for opt in parts[2:]:
        name, _, value = opt.partition("=")
        name = name.lower()
        if name not in _OPTIONS[kind]:
            raise ValueError(f"bad tier {text!r}: unknown option {opt!r}; {kind} takes "
                             f"{', '.join(_OPTIONS[kind])}")
        if name in seen:
            raise ValueError(f"bad tier {text!r}: option {name} given twice")
        seen.add(name)
        if (name == "pagecache") != (not value):
            raise ValueError(f"bad tier {text!r}: " + ("pagecache takes no value" if name == "pagecache"
                                                       else f"{name} needs a value, e.g. {name}=4"))
        if name == "pagecache":
            pipe = replace(pipe, page_cache=True)
        elif name == "threads":
            pipe = replace(pipe, threads=_int_option(text, name, value))
        elif name == "ios-per-thread":
            pipe = replace(pipe, ios_per_thread=_int_option(text, name, value))
        elif name == "paths":
            pipe = replace(pipe, paths=_int_option(text, name, value))
        elif name == "unit":
            try:
                pipe = replace(pipe, unit_bytes=parse_bytes("unit", value, need_unit, "unit=8MiB"))
            except ValueError as e:
                raise ValueError(f"bad tier {text!r}: {e}") from None
        else:  # seal
            if value not in SEALS:
                raise ValueError(f"bad tier {text!r}: seal={value!r}: use one of {', '.join(SEALS)}")
            pipe = replace(pipe, seal=value)
    return TierSpec(kind, size, pipe, spec)


def _meaning(spec: TierSpec) -> TierSpec:
    """``spec`` without the text it was written as: ``disk:200GB`` and ``disk:0.2TB``, or
    options in another order, are one tier."""
    return replace(spec, text="", secondary=_meaning(spec.secondary) if spec.secondary is not None else None)


def refuse_repeats(tiers: "list[TierSpec]") -> None:
    """A tier given twice would be replayed twice under one name: refused, naming it."""
    seen: dict[TierSpec, TierSpec] = {}
    for t in tiers:
        first = seen.setdefault(_meaning(t), t)
        if first is not t:
            same = "given twice" if first.text == t.text else f"is the same tier as --tier {first.text}"
            raise ValueError(f"--tier {t.text} {same}: each tier is replayed once, give it once")
