"""Service times of one tier's transfers, from an IO profile and a disk pipeline.

All times are ns per block (or per unit) on one IO thread while ``k`` threads of the
same direction are busy. The threads share the drives (``k`` IOs of ``ios_per_thread``
each, spread over the drives the slot files sit on), host memory (every byte of file
IO crosses DRAM several times: ``host_io_gib_s`` for all threads together) and the
PCIe link (kvoffload's batched copies: ``seam_*``; vLLM's per-block copies and the
DRAM tier: one stream of pinned copies, ``pcie_*``) and, for kvoffload's threads, the
GIL (``slot_cpu_us`` per slot). An idle device is not split: one busy thread gets the
whole drive, up to what one thread's queue depth reaches. A store's first writes into
slots of a fresh file (``first_write``) hold the file, so its other threads wait.
A secondary tier under vLLM's CPU primary (``host_device``) has no GPU on its path and
no unit copy either: kvoffload's ``HostDevice`` seals straight from the primary's rows
into staging and opens straight back into them, so a unit is seal and file IO alone.
"""

from __future__ import annotations

from typing import Optional

from kvsim.profile import IoProfile, bytes_per_ns
from kvsim.tiers import Pipeline, kvoffload_threads, kvoffload_unit_bytes


class TransferModel:
    def __init__(self, profile: IoProfile, pipe: Optional[Pipeline], block_bytes: int, slot_bytes: int,
                 host_device: bool = False) -> None:
        p = profile
        self.profile, self.pipe = p, pipe
        self.block_bytes, self.slot_bytes = block_bytes, slot_bytes
        self._call = p.copy_call_us * 1e3
        self._row = {True: p.seam_h2d_row_us * 1e3, False: p.seam_d2h_row_us * 1e3}
        self._pcie = {True: bytes_per_ns(p.pcie_h2d_gib_s), False: bytes_per_ns(p.pcie_d2h_gib_s)}
        self._seam = {True: bytes_per_ns(p.seam_h2d_gib_s), False: bytes_per_ns(p.seam_d2h_gib_s)}
        self.host_device = host_device
        self._host = bytes_per_ns(p.host_io_gib_s)
        self._page_cache = {False: bytes_per_ns(p.page_cache_read_gib_s), True: bytes_per_ns(p.page_cache_write_gib_s)}
        if pipe is None:
            return
        self.paths = pipe.paths if pipe.paths is not None else p.drives
        self.drives = min(self.paths, p.drives)
        per_lane = pipe.threads if pipe.threads is not None else kvoffload_threads(p.cpus, self.paths)
        self.threads = per_lane * self.paths  # per direction: a lane of threads per slot file
        self._seal = block_bytes * p.seal_ns_per_byte(pipe.seal)
        unit = pipe.unit_bytes if pipe.unit_bytes is not None else kvoffload_unit_bytes(self.paths, per_lane)
        self.rows = max(1, unit // slot_bytes) if unit else 0
        # kvoffload's per-slot CPU was measured on its own code; vLLM's backend is not.
        self._cpu = p.slot_cpu_us * 1e3 if self.rows else 0.0
        first = p.first_write_page_cache if pipe.page_cache else p.first_write
        self._first = first.ns(slot_bytes)

    # -- per block, one of k busy threads -------------------------------------------

    def disk_ns(self, k: int, write: bool) -> float:
        """O_DIRECT IO of one slot, the drives alone (host memory bounds the whole unit: ``_host_ns``)."""
        d = self.profile.disk_write if write else self.profile.disk_read
        depth = k * self.pipe.ios_per_thread / self.drives
        return self.slot_bytes * k / (self.drives * d.rate(self.slot_bytes, depth))

    def _host_ns(self, rows: int, k: int) -> float:
        """The least time ``rows`` slots of file IO take on one of k threads: every
        pass through DRAM (IO, staging, seal, copy) of all threads shares host memory,
        so the bound is on the whole unit, not on one of its stages."""
        return rows * self.slot_bytes * k / self._host

    def _cpu_ns(self, rows: int, k: int) -> float:
        """The least time ``rows`` slots take on one of k threads that take turns on the GIL."""
        return rows * k * self._cpu

    def first_write_ns(self, fresh: int, k: int) -> float:
        """What ``fresh`` first writes into the slot file add to a unit on one of k threads:
        each holds its file, so a file's threads (k / paths) wait for each other's."""
        return fresh * self._first * max(1.0, k / self.paths) if fresh else 0.0

    def page_cache_ns(self, k: int, write: bool) -> float:
        """A buffered copy of one slot out of (into) the page cache, on one of k threads.

        Reads are per thread. A buffered write holds its file's inode lock (ext4 and xfs
        take ``i_rwsem`` exclusively for it), so the threads writing one slot file take
        turns: the write rate is the file's, shared by its threads (k / paths)."""
        sharers = max(1.0, k / self.paths) if write else 1.0
        return max(self.slot_bytes * sharers / self._page_cache[write], self.slot_bytes * k / self._host)

    def io_ns(self, k: int, write: bool) -> float:
        """A store's IO of one block: a copy into the page cache, or an O_DIRECT write."""
        return self.page_cache_ns(k, write) if self.pipe.page_cache and write else self.disk_ns(k, write)

    # -- copies -------------------------------------------------------------------

    def copy_ns(self, num_blocks: int, to_device: bool) -> float:
        """One call on one stream of pinned copies (the DRAM tier's job, vLLM's block)."""
        return self._call + num_blocks * self.block_bytes / self._pcie[to_device]

    def unit_copy_ns(self, rows: int, k: int, to_device: bool) -> float:
        """kvoffload's batched copy of a unit, its threads sharing the link (none on a host device)."""
        if self.host_device:
            return 0.0
        return self._call + rows * k * (self._row[to_device] + self.block_bytes / self._seam[to_device])

    # -- units --------------------------------------------------------------------

    def store_unit(self, rows: int, k: int, fresh: int = 0) -> tuple[int, int]:
        """(thread busy, done after start) of a store unit of ``rows`` blocks, ``fresh``
        of them first writes into their slots."""
        if self.rows:  # kvoffload: copy the unit, then seal and write each slot
            t = self.unit_copy_ns(rows, k, False) + rows * (self._cpu + self._seal + self.io_ns(k, True))
            t = max(t, self._host_ns(rows, k), self._cpu_ns(rows, k)) + self.first_write_ns(fresh, k)
            return round(t), round(t)
        busy, _ = self._pipelined(rows, 0, self.io_ns(k, True), 0.0, self.copy_ns(1, False), k)
        t = busy + round(self.first_write_ns(fresh, k))
        return t, t

    def load_unit(self, rows: int, hits: int, k: int) -> tuple[int, int]:
        """(thread busy, done after start) of a load unit; ``hits`` rows are in the page cache."""
        hit, miss = self.page_cache_ns(k, False), self.disk_ns(k, False)
        if self.pipe.page_cache:  # a buffered read that misses fills the page cache, then copies out of it
            miss += hit
        if self.rows:
            # Read and open the unit, then copy it to the GPU while the thread reads
            # its next unit: the thread is held for the longer of the two.
            read = hits * (hit + self._seal) + (rows - hits) * (miss + self._seal) + rows * self._cpu
            copy = self.unit_copy_ns(rows, k, True)
            read = max(read, self._host_ns(rows, k), self._cpu_ns(rows, k))
            return round(max(read, copy)), round(read + copy)
        return self._pipelined(rows, hits, miss, hit, self.copy_ns(1, True), k)

    def _pipelined(self, rows: int, hits: int, io: float, hit_io: float, dma: float, k: int) -> tuple[int, int]:
        """vLLM 0.33: block by block, each block's copy overlapping the next one's IO
        through two staging slots: the slower stage sets the pace, the other is paid once."""
        io = max(io, self._host_ns(1, k))
        io += self._seal
        hit_io += self._seal
        first = min(hit_io if hits else io, dma)
        t = first + hits * max(hit_io, dma) + (rows - hits) * max(io, dma)
        return round(t), round(t)
