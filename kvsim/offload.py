"""The offload tier: kvoffload's own ``SlotPool`` policy plus the timed store/load paths.

One job per request per direction and step, as vLLM's offloading worker launches
them. The worker polls each direction front-first once per engine step and stops at
the first unfinished job (a high-water mark), so a finished job waits behind an
earlier unfinished one before its blocks become visible or its request resumes.

Paths: ``cpu`` = one batched PCIe copy per job on a FIFO copy stream. ``disk`` =
IO threads, each moving a unit of a job (the whole job when ``io_unit_bytes`` is 0,
as in vLLM 0.33) block by block through staging buffers: with two or more buffers
the DMA of one block overlaps the file IO of the next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from kvoffload.config import num_slots
from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, slot_bytes_for
from kvsim.events import Event, Kind
from kvsim.hardware import Hardware
from kvsim.io import IoStation, PageCache, WriteBack
from kvsim.slot_pool import SlotPool
from kvsim.tiers import TierSpec


@dataclass(slots=True)
class Job:
    done_ns: int
    keys: list[Hashable]
    payload: Any = None  # loads: the parked request


class OffloadTier:
    def __init__(self, spec: TierSpec, hw: Hardware, block_bytes: int) -> None:
        assert spec.kind in ("cpu", "disk")
        disk = spec.kind == "disk"
        # kvoffload's sizing rule: an O_DIRECT slot is the block padded to 4096 bytes.
        slot_bytes = slot_bytes_for(block_bytes, MIN_DIRECT_ALIGNMENT, spec.page_cache) if disk else block_bytes
        if spec.capacity_bytes < slot_bytes:
            raise ValueError(f"tier {spec.text}: smaller than one {slot_bytes}-byte slot")
        self.spec, self.hw, self.block_bytes = spec, hw, block_bytes
        self.pool = SlotPool(num_slots(spec.capacity_bytes, slot_bytes))
        self._load_station = IoStation(hw.load_threads if disk else 1)
        self._store_station = IoStation(hw.store_threads if disk else 1)
        self._loads: deque[Job] = deque()
        self._stores: deque[Job] = deque()
        self.page_cache: Optional[PageCache] = None
        self._writeback: Optional[WriteBack] = None
        if spec.page_cache:
            self.page_cache = PageCache(hw.host_free_bytes // block_bytes)
            self._writeback = WriteBack(hw.disk_write_gbps, hw.dirty_ratio * hw.host_free_bytes)
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.disk_bytes_read = 0

    # -- timing ---------------------------------------------------------------

    def _block_ns(self, busy: int, write: bool) -> tuple[float, float, float]:
        """(file IO, page-cache copy, DMA) ns per block for one of ``busy`` busy threads.

        A thread keeps io_depth IOs in flight, so it is latency-bound at low depth
        (the QD1 rate); the busy threads share the device, host memory and PCIe.
        """
        hw, b = self.hw, self.block_bytes
        disk_gbps = hw.disk_write_gbps if write else hw.disk_read_gbps
        disk = max((hw.disk_base_us * 1e3 + b / hw.disk_qd1_gbps) / hw.io_depth, b * busy / disk_gbps)
        memcpy = max(b / hw.page_cache_gbps, b * busy / hw.page_cache_max_gbps)
        dma = hw.per_copy_us * 1e3 + b * busy / (hw.d2h_gbps if write else hw.h2d_gbps)
        return disk, memcpy, dma

    def _pipeline(self, io_ns: Sequence[tuple[int, float]], dma_ns: float) -> int:
        """Time for a unit whose blocks take ``io_ns`` (count, ns each) of file IO."""
        n = sum(c for c, _ in io_ns)
        if self.hw.buffer_slots == 1:
            return round(sum(c * t for c, t in io_ns) + n * dma_ns)
        # Pipelined: the slower stage sets the pace, the faster one is paid once.
        fill = min(min(t for c, t in io_ns if c), dma_ns)
        return round(fill + sum(c * max(t, dma_ns) for c, t in io_ns))

    def _disk_job(self, station: IoStation, now: int, slots: Sequence[int], write: bool) -> int:
        """Queue a disk job unit by unit on ``station``; return when its last unit is done.

        Units go to whichever thread frees first, as kvoffload's lanes hand them out,
        so one job spreads over the threads and a later short job can finish first.
        """
        unit = max(1, self.hw.io_unit_bytes // self.block_bytes if self.hw.io_unit_bytes else len(slots))
        done = now
        for i in range(0, len(slots), unit):
            chunk = slots[i : i + unit]
            disk, memcpy, dma = self._block_ns(station.busy_at_start(now), write)
            if write:  # a page-cache store is a copy into the cache; write-back comes later
                parts = [(len(chunk), memcpy if self.page_cache is not None else disk)]
            else:
                hits = self.page_cache.num_resident(chunk) if self.page_cache is not None else 0
                parts = [(hits, memcpy), (len(chunk) - hits, disk)]
            done = max(done, station.submit(now, self._pipeline(parts, dma)))
        return done

    def _load_done(self, station: IoStation, now: int, slots: Sequence[int]) -> int:
        if self.spec.kind == "cpu":
            hw = self.hw
            return station.submit(now, round(hw.per_copy_us * 1e3 + len(slots) * self.block_bytes / hw.h2d_gbps))
        return self._disk_job(station, now, slots, write=False)

    def load_eta_ns(self, now: int, slots: Sequence[int]) -> int:
        """Duration from now until a load of ``slots`` submitted now would finish."""
        return self._load_done(self._load_station.copy(), now, slots) - now

    # -- the engine's calls ---------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
        return self.pool.lookup(keys)

    def load(self, now: int, keys: list[Hashable], slots: list[int], req: Any) -> Event:
        """Start loading ``keys`` (pinned by ``pool.prepare_load``) for ``req``."""
        done = self._load_done(self._load_station, now, slots)
        if self.page_cache is not None:
            self.disk_bytes_read += (len(slots) - self.page_cache.num_resident(slots)) * self.block_bytes
            self.page_cache.touch(slots)
        elif self.spec.kind == "disk":
            self.disk_bytes_read += len(slots) * self.block_bytes
        self._loads.append(Job(done, keys, req))
        self.bytes_loaded += len(keys) * self.block_bytes
        return Event(done, Kind.IO_DONE)

    def store(self, now: int, keys: Sequence[Hashable]) -> None:
        """Offer freshly computed blocks; store those the pool gives slots to.

        No wake-up event: a store's completion matters only to a later lookup, and
        every lookup happens at a step boundary, which polls first.
        """
        granted = self.pool.prepare_store(keys)
        if not granted:
            return
        hashes = [h for h, _ in granted]
        slots = [s for _, s in granted]
        n, b = len(slots), self.block_bytes
        if self.spec.kind == "cpu":
            service = round(self.hw.per_copy_us * 1e3 + n * b / self.hw.d2h_gbps)
            done = self._store_station.submit(now, service)
        else:
            done = self._disk_job(self._store_station, now, slots, write=True)
        if self.page_cache is not None:
            self.page_cache.touch(slots)
            # Buffered writes return once copied unless the dirty backlog is over the limit.
            done = max(done, self._writeback.dirty(now, n * b))
        self._stores.append(Job(done, hashes))
        self.bytes_stored += n * b

    def poll(self, now: int) -> list[Any]:
        """Complete finished jobs front-first per direction; return the resumed requests."""
        while self._stores and self._stores[0].done_ns <= now:
            self.pool.complete_store(self._stores.popleft().keys, ok=True)
        resumed = []
        while self._loads and self._loads[0].done_ns <= now:
            job = self._loads.popleft()
            self.pool.complete_load(job.keys, ok=True)
            resumed.append(job.payload)
        return resumed

    def disk_bytes_written(self) -> int:
        if self.spec.kind != "disk":
            return 0
        return self._writeback.bytes_written if self._writeback is not None else self.bytes_stored

    def num_pending(self) -> int:
        return len(self._loads) + len(self._stores)
