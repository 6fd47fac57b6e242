"""kvoffload's own metrics: what the disk tier counts, and the payload that carries it to vLLM's /metrics.

The IO threads count with plain ints and preallocated histogram buckets, once per IO
unit and once per job: no object per block, nothing that grows while nobody reads.
``take()`` turns what changed since its last call into vLLM's self-describing stats
payload, ``{"types": {name: kind}, "data": {name: {label values: value}}}`` (the format
of vLLM's ``SimpleCPUOffloadStats`` and ``OffloadingConnectorStats``), so one payload
serves ``KvoffloadConnector`` (``vllm.py``) and the tier under vLLM's
``OffloadingConnector`` (``vllm_slot_tier.py``). Nothing here imports vLLM or prometheus_client.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

STORE, LOAD = "store", "load"
DIRECTIONS = (STORE, LOAD)  # index 0: stores, 1: loads
# Why a block failed: its pwritev/preadv raised, moved fewer bytes, its seal check failed,
# its slot held no completed store (loads only), its unit was dequeued after shutdown
# began, or the device copy failed (fatal for the backend).
CAUSES = ("io_error", "short", "integrity", "not_stored", "closing", "device")
_CAUSE_INDEX = {c: i for i, c in enumerate(CAUSES)}
INFO_LABELS = ("capacity_bytes", "slots", "slot_bytes", "staging_bytes", "io_threads", "paths", "seal", "io",
               "io_path")

# A job is one launch_copy: up to a scheduler step's blocks, queueing included.
JOB_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A unit's pwritev/preadv calls: up to io_unit_bytes (by default at most 8 MiB).
UNIT_IO_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                           1.0, 2.5)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str
    buckets: Optional[tuple[float, ...]] = None


_DEFS = (
    MetricDef("vllm:kvoffload_bytes_total", "counter", ("direction", "path"),
              "Bytes of the blocks kvoffload stored to or loaded from a slot file (whole slots, padding included), "
              "by direction and disk path index; failed blocks are not counted."),
    MetricDef("vllm:kvoffload_blocks_total", "counter", ("direction", "path"),
              "Blocks kvoffload stored to or loaded from a slot file whole and checked, by direction and disk path "
              "index."),
    MetricDef("vllm:kvoffload_failed_blocks_total", "counter", ("direction", "cause"),
              "Blocks whose store or load failed, by cause: io_error (the pwritev/preadv raised), short (it moved "
              "fewer bytes), integrity (AES-GCM tag or checksum), not_stored (the slot held no completed store), "
              "closing (dequeued after shutdown began), device (the device copy failed: fatal)."),
    MetricDef("vllm:kvoffload_device_bytes_total", "counter", ("op", "path"),
              "Bytes the block device under a disk path really read or wrote (op read or write) since the backend "
              "started, from the kernel's own counters of that device (all its users, not kvoffload alone): "
              "loads that read far fewer bytes here than vllm:kvoffload_bytes_total{direction=\"load\"} were "
              "served from memory (the page cache), not the drive. Absent for a path on no block device."),
    MetricDef("vllm:kvoffload_job_seconds", "histogram", ("direction",),
              "Seconds from launch_copy to the job's completion (queueing, file IO, seal and device copy).",
              JOB_SECONDS_BUCKETS),
    MetricDef("vllm:kvoffload_unit_io_seconds", "histogram", ("direction",),
              "Seconds one IO unit (up to io_unit_bytes) spent in its pwritev/preadv calls.",
              UNIT_IO_SECONDS_BUCKETS),
    MetricDef("vllm:kvoffload_queued_units", "gauge", ("direction", "path"),
              "IO units waiting in a lane's queue (the most of any rank) when the step's stats were taken."),
    MetricDef("vllm:kvoffload_io_busy_seconds_total", "counter", ("direction",),
              "Seconds the IO threads spent on work (device copy, seal, file IO), summed over threads and ranks: "
              "its rate is the number of IO threads busy."),
    MetricDef("vllm:kvoffload_slots_used", "gauge", (),
              "Slots holding a block a lookup can hit."),
    MetricDef("vllm:kvoffload_slots_free", "gauge", (),
              "Slots holding no loadable block (empty, being written, or dropped after a failure)."),
    MetricDef("vllm:kvoffload_hit_tokens_total", "counter", (),
              "Prompt tokens whose KV was loaded from disk and used; a hit whose load failed is not counted."),
    MetricDef("vllm:kvoffload_recomputed_tokens_total", "counter", (),
              "Prompt tokens offered as a disk hit whose load failed, so vLLM recomputed them."),
    MetricDef("vllm:kvoffload_restored_blocks_total", "counter", (),
              "Blocks a persistent disk tier found in its index at start-up and offers as hits again."),
    MetricDef("vllm:kvoffload_refused_blocks_total", "counter", ("cause",),
              "Index records a persistent disk tier found at start-up and did not restore, by cause: checksum (a "
              "torn or damaged record), duplicate (a newer slot holds the same block), rank_mismatch (the ranks' "
              "files disagree on the slot), reserved (vLLM's null block), capacity (beyond the pool's slots)."),
    MetricDef("vllm:kvoffload_info", "gauge", INFO_LABELS,
              "kvoffload's disk tier per rank; value 1. capacity_bytes: the slot files' budget; staging_bytes: the "
              "host staging its IO threads allocated; io: o_direct or page_cache; io_path: native (the IO core built "
              "with the package) or python."),
)
METRICS: dict[str, MetricDef] = {d.name: d for d in _DEFS}
DEVICE_BYTES = "vllm:kvoffload_device_bytes_total"
BYTES, BLOCKS, FAILED, JOB_SECONDS, UNIT_IO_SECONDS, QUEUED, BUSY, SLOTS_USED, SLOTS_FREE, HIT_TOKENS, \
    RECOMPUTED_TOKENS, RESTORED_BLOCKS, REFUSED_BLOCKS, INFO = (d.name for d in _DEFS if d.name != DEVICE_BYTES)


class Histogram:
    """Counts and sums per bucket, preallocated: ``observe`` allocates nothing."""

    __slots__ = ("bounds", "counts", "sums")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket: above every bound
        self.sums = [0.0] * (len(bounds) + 1)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # bucket i holds (bounds[i-1], bounds[i]]
        self.counts[i] += 1
        self.sums[i] += value

    def observe_many(self, values: Sequence[float]) -> None:
        """``observe`` each nonzero value (a 0 is a unit that made no file call)."""
        v = np.asarray(values, float)
        v = v[v != 0]
        if not len(v):
            return
        idx = np.searchsorted(self.bounds, v, side="left")  # observe's buckets
        counts = np.bincount(idx, minlength=len(self.counts))
        sums = np.bincount(idx, v, minlength=len(self.counts))
        for i in np.flatnonzero(counts).tolist():
            self.counts[i] += int(counts[i])
            self.sums[i] += float(sums[i])

    def replay(self, counts: Sequence[int], sums: Sequence[float]) -> list[float]:
        """Observations that give ``counts`` per bucket with ``sums`` per bucket: each bucket's
        mean (which lies inside the bucket), repeated. Prometheus then gets exact bucket
        counts and an exact sum, from a list as long as the count, not one per block."""
        out: list[float] = []
        for i, n in enumerate(counts):
            if n:
                lo = self.bounds[i - 1] if i else -math.inf
                hi = self.bounds[i] if i < len(self.bounds) else math.inf
                out += [min(max(sums[i] / n, math.nextafter(lo, math.inf)), hi)] * n
        return out


def new_payload() -> dict[str, Any]:
    return {"types": {}, "data": {}}


def put(payload: dict[str, Any], name: str, labels: tuple[str, ...], value: Any) -> None:
    """Add one observation: a counter increment, a gauge value or a list of histogram samples."""
    kind = METRICS[name].kind
    payload["types"][name] = kind
    values = payload["data"].setdefault(name, {})
    if kind == "counter":
        values[labels] = values.get(labels, 0) + value
    elif kind == "histogram":
        values.setdefault(labels, []).extend(value)
    else:
        values[labels] = value


def merge(dst: dict[str, Any], src: Mapping[str, Any]) -> dict[str, Any]:
    """``src`` into ``dst``, as vLLM aggregates stats over ranks and steps: counters add,
    histogram samples join, gauges take the newer value, kvoffload's own gauges the
    larger (ranks report their own lanes; the busiest one is what to see)."""
    for name, values in src.get("data", {}).items():
        kind = src["types"][name]
        dst["types"].setdefault(name, kind)
        cur = dst["data"].setdefault(name, {})
        for labels, v in values.items():
            if kind == "counter":
                cur[labels] = cur.get(labels, 0) + v
            elif kind == "histogram":
                cur.setdefault(labels, []).extend(v)
            elif kind == "gauge":
                cur[labels] = max(cur[labels], v) if name in METRICS and labels in cur else v
            else:
                raise ValueError(f"unknown metric type {kind!r} for {name}")
    return dst


def combine(parts: Iterable[Optional[Mapping[str, Any]]]) -> Optional[dict[str, Any]]:
    """One payload of ``parts`` merged (``None`` parts skipped); None when none holds data."""
    out = new_payload()
    for p in parts:
        if p:
            merge(out, p)
    return out if out["data"] else None


def reduce(payload: Mapping[str, Any]) -> dict[str, float]:
    """A flat summary for vLLM's periodic log line: counters and gauges as they are,
    histograms as count and sum; info gauges (constant facts) left out."""
    out: dict[str, float] = {}
    for name, values in payload.get("data", {}).items():
        if name == INFO or name.endswith("_info"):
            continue
        kind = payload["types"][name]
        for labels, v in values.items():
            key = f"{name}:{labels}" if labels else name
            if kind == "histogram":
                out[f"{key}_count"] = len(v)
                out[f"{key}_sum"] = sum(v)
            else:
                out[key] = v
    return out


class IoMetrics:
    """What one run (one ``DiskBackend.init``) counts, per direction, disk path and cause.

    Its own lock is taken once per IO unit, twice per job and on each failure; the
    counts are cumulative, and ``take`` reports what changed since its last call.
    With ``enabled`` False every method returns at once (the bench's comparison).
    """

    def __init__(self, num_paths: int) -> None:
        self.enabled = True
        self.num_paths = num_paths
        self.lock = threading.Lock()
        self.blocks = [[0] * num_paths for _ in DIRECTIONS]
        self.bytes = [[0] * num_paths for _ in DIRECTIONS]
        self.failed_blocks = [[0] * len(CAUSES) for _ in DIRECTIONS]
        self.job_seconds = [Histogram(JOB_SECONDS_BUCKETS) for _ in DIRECTIONS]
        self.unit_io_seconds = [Histogram(UNIT_IO_SECONDS_BUCKETS) for _ in DIRECTIONS]
        self.peak_queued = [[0] * num_paths for _ in DIRECTIONS]
        # Per disk path its block device (block_device.BlockDevice, or None) and its counters
        # when the backend started: what the drive did is the difference (``watch_devices``).
        self.devices: list[Any] = [None] * num_paths
        self.device_base: list[Optional[tuple[int, int]]] = [None] * num_paths
        self.info: Optional[dict[str, Any]] = None
        self._sent = self._state({d: 0.0 for d in DIRECTIONS}, {})
        self._info_sent = False

    # -- counting (IO threads and launch_copy's caller) -----------------------------

    def watch_devices(self, devices: Sequence[Any]) -> None:
        """Report what each path's block device reads and writes from now on (None: none)."""
        self.devices = list(devices)
        self.device_base = [d.bytes_moved() if d is not None else None for d in self.devices]

    def device_bytes(self) -> list[Optional[tuple[int, int]]]:
        """Per path, (bytes read, bytes written) by its block device since ``watch_devices``."""
        out: list[Optional[tuple[int, int]]] = []
        for dev, base in zip(self.devices, self.device_base):
            now = dev.bytes_moved() if dev is not None and base is not None else None
            out.append(None if now is None else (now[0] - base[0], now[1] - base[1]))
        return out

    def units_done(self, is_store: bool, moved: Sequence[int], slot_bytes: Sequence[int],
                   io_seconds: Sequence[float]) -> None:
        """Units ended: ``moved[path]`` blocks moved whole per disk path (of ``slot_bytes[path]``
        each), and each unit's seconds in its file IO (0: it made none)."""
        if not self.enabled:
            return
        d = 0 if is_store else 1
        with self.lock:
            for path, n in enumerate(moved):
                if n:
                    self.blocks[d][path] += int(n)
                    self.bytes[d][path] += int(n) * int(slot_bytes[path])
            self.unit_io_seconds[d].observe_many(io_seconds)

    def failed(self, is_store: bool, cause: str, n: int) -> None:
        if not self.enabled or not n:
            return
        with self.lock:
            self.failed_blocks[0 if is_store else 1][_CAUSE_INDEX[cause]] += n

    def job_done(self, is_store: bool, seconds: float) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.job_seconds[0 if is_store else 1].observe(seconds)

    def queued(self, is_store: bool, depths: Mapping[int, int]) -> None:
        """A job's units are about to join their lanes, which then hold ``depths[path]``
        units: keeps each lane's peak depth for the summary."""
        if not self.enabled:
            return
        peak = self.peak_queued[0 if is_store else 1]
        with self.lock:
            for path, n in depths.items():
                if n > peak[path]:
                    peak[path] = n

    # -- reporting --------------------------------------------------------------------

    def take(self, queued: Mapping[tuple[str, int], int], busy: Mapping[str, float]) -> Optional[dict[str, Any]]:
        """The payload of what changed since the last call (None: nothing did).

        ``queued``: units waiting per (direction, path index) now; ``busy``: the IO
        threads' working seconds so far per direction (``Run.stage_seconds``).
        """
        if not self.enabled:
            return None
        with self.lock:
            now = self._state(busy, queued)
        last, p = self._sent, new_payload()
        for d, direction in enumerate(DIRECTIONS):
            for path in range(self.num_paths):
                labels = (direction, str(path))
                for name, key in ((BLOCKS, "blocks"), (BYTES, "bytes")):
                    if delta := now[key][d][path] - last[key][d][path]:
                        put(p, name, labels, delta)
                if now["queued"].get(labels, 0) != last["queued"].get(labels, 0):
                    put(p, QUEUED, labels, now["queued"].get(labels, 0))
            for c, cause in enumerate(CAUSES):
                if delta := now["failed"][d][c] - last["failed"][d][c]:
                    put(p, FAILED, (direction, cause), delta)
            for name, key, hists in ((JOB_SECONDS, "job", self.job_seconds),
                                     (UNIT_IO_SECONDS, "unit", self.unit_io_seconds)):
                (counts, sums), (c0, s0) = now[key][d], last[key][d]
                if counts != c0:
                    put(p, name, (direction,), hists[d].replay([a - b for a, b in zip(counts, c0)],
                                                              [a - b for a, b in zip(sums, s0)]))
            if (delta := now["busy"][direction] - last["busy"][direction]) > 0:
                put(p, BUSY, (direction,), delta)
        for path, (dev_now, dev_last) in enumerate(zip(now["device"], last["device"])):
            for k, op in enumerate(("read", "write")):
                if dev_now is not None and (delta := dev_now[k] - (dev_last[k] if dev_last else 0)) > 0:
                    put(p, DEVICE_BYTES, (op, str(path)), delta)
        if self.info is not None and not self._info_sent:
            put(p, INFO, tuple(str(self.info[k]) for k in INFO_LABELS), 1)
            self._info_sent = True
        self._sent = now
        return p if p["data"] else None

    def _state(self, busy: Mapping[str, float], queued: Mapping[tuple[str, int], int]) -> dict[str, Any]:
        return {
            "blocks": [list(x) for x in self.blocks], "bytes": [list(x) for x in self.bytes],
            "failed": [list(x) for x in self.failed_blocks],
            "job": [(list(h.counts), list(h.sums)) for h in self.job_seconds],
            "unit": [(list(h.counts), list(h.sums)) for h in self.unit_io_seconds],
            "busy": dict(busy), "queued": {(direction, str(path)): n for (direction, path), n in queued.items()},
            "device": self.device_bytes(),
        }

    def summary(self) -> str:
        """One line for the log at shutdown: bytes and blocks each way, failures by cause, peak queue."""
        if not self.enabled:
            return "metrics collection off"
        with self.lock:
            parts = []
            for d, verb in enumerate(("stored", "loaded")):
                parts.append(f"{verb} {_size(sum(self.bytes[d]))} in {sum(self.blocks[d])} blocks")
            for d, verb in enumerate(("stores", "loads")):
                failed = [f"{cause} {n}" for cause, n in zip(CAUSES, self.failed_blocks[d]) if n]
                parts.append(f"failed {verb}: {', '.join(failed) or 'none'}")
            peak = max((n, DIRECTIONS[d], path) for d in range(2) for path, n in enumerate(self.peak_queued[d]))
        parts.append(f"peak queue {peak[0]} units ({peak[1]} lane, path {peak[2]})")
        drives = [f"{dev.name} read {_size(moved[0])} and wrote {_size(moved[1])}"
                  for dev, moved in zip(self.devices, self.device_bytes()) if dev is not None and moved is not None]
        if drives:
            parts.append("the drives (all their users): " + ", ".join(drives))
        return "; ".join(parts)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def split_load(slots: Sequence[int], failed: Container[int], tokens_per_slot: int) -> tuple[int, int]:
    """(tokens served, tokens recomputed) of one request's load of ``slots``, in order:
    vLLM recomputes from the first failed block on, so the blocks after it that loaded
    are not hits either."""
    for i, s in enumerate(slots):
        if s in failed:
            return i * tokens_per_slot, (len(slots) - i) * tokens_per_slot
    return len(slots) * tokens_per_slot, 0


class HitMetrics:
    """What the side that holds the slot index counts: the tokens loads served and the
    tokens failed loads made vLLM recompute (counted when the load ends, not at lookup,
    unlike vLLM's own hit counters), and the slots holding a block. Only the scheduler's
    thread calls it."""

    def __init__(self) -> None:
        self.hit_tokens = 0
        self.recomputed_tokens = 0
        self._sent: tuple[int, int, Optional[tuple[int, int]]] = (0, 0, None)
        self._restore: Optional[tuple[int, Mapping[str, int]]] = None  # reported once

    def load_ended(self, served: int, recomputed: int) -> None:
        self.hit_tokens += served
        self.recomputed_tokens += recomputed

    def restored(self, blocks: int, refused: Mapping[str, int]) -> None:
        """What a persistent tier's start-up restored and refused, by cause (sent with the next take)."""
        self._restore = (blocks, dict(refused))

    def take(self, slots_used: int, slots_capacity: int) -> Optional[dict[str, Any]]:
        """The payload of what changed since the last call (None: nothing did)."""
        hits, recomputed, slots = self._sent
        p = new_payload()
        if self.hit_tokens != hits:
            put(p, HIT_TOKENS, (), self.hit_tokens - hits)
        if self.recomputed_tokens != recomputed:
            put(p, RECOMPUTED_TOKENS, (), self.recomputed_tokens - recomputed)
        if (slots_used, slots_capacity) != slots:
            put(p, SLOTS_USED, (), slots_used)
            put(p, SLOTS_FREE, (), slots_capacity - slots_used)
        if self._restore is not None:
            blocks, refused = self._restore
            put(p, RESTORED_BLOCKS, (), blocks)
            for cause, n in sorted(refused.items()):
                put(p, REFUSED_BLOCKS, (cause,), n)
            self._restore = None
        self._sent = (self.hit_tokens, self.recomputed_tokens, (slots_used, slots_capacity))
        return p if p["data"] else None


class PromExporter:
    """kvoffload's metrics as prometheus_client metrics of the classes vLLM hands in
    (``build_prom_metrics``), with vLLM's per-engine labels first."""

    def __init__(self, metric_types: Mapping[str, Callable[..., Any]], labelnames: Sequence[str],
                 per_engine_labelvalues: Mapping[int, Sequence[object]]) -> None:
        """``metric_types``: ``{"counter": cls, "gauge": cls, "histogram": cls}``."""
        self.per_engine_labelvalues = per_engine_labelvalues
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        for d in _DEFS:
            kw: dict[str, Any] = {"name": d.name, "documentation": d.help,
                                  "labelnames": list(labelnames) + list(d.labels)}
            if d.kind == "gauge":
                # One frontend gets each step's stats: the newest value is the engine's.
                kw["multiprocess_mode"] = "mostrecent"
            elif d.kind == "histogram":
                kw["buckets"] = d.buckets
            self._metrics[d.name] = metric_types[d.kind](**kw)

    def observe(self, payload: Mapping[str, Any], engine_idx: int = 0) -> None:
        for name, values in payload.get("data", {}).items():
            d = METRICS[name]
            for labels, v in values.items():
                key = (engine_idx, name, labels)
                child = self._children.get(key)
                if child is None:
                    child = self._metrics[name].labels(*self.per_engine_labelvalues[engine_idx], *labels)
                    self._children[key] = child
                if d.kind == "counter":
                    child.inc(v)
                elif d.kind == "gauge":
                    child.set(v)
                else:
                    for sample in v:
                        child.observe(sample)


def definitions(counter: Callable[..., Any], gauge: Callable[..., Any], histogram: Callable[..., Any]) -> dict:
    """Every metric as vLLM's offloading metadata classes (a secondary tier's
    ``build_metric_definitions``)."""
    out = {}
    for d in _DEFS:
        if d.kind == "histogram":
            out[d.name] = histogram(documentation=d.help, labelnames=d.labels, buckets=d.buckets)
        else:
            out[d.name] = (counter if d.kind == "counter" else gauge)(documentation=d.help, labelnames=d.labels)
    return out
