"""Disk backend: moves KV blocks between device memory and preallocated slot files.

A drop-in for vLLM's ``simple_kv_offload`` ``DiskBackend`` (``init``,
``launch_copy``, ``shutdown``) plus the two error getters vLLM's worker lacks. Each
disk path gets a store lane and a load lane, each a queue served by ``io_threads``
workers of the IO engine (``engine.py``: native C workers, or the Python engine), so
loads never wait behind stores and several IOs are in flight per direction (vLLM 0.33
keeps one). What one ``init`` creates lives in a ``run.Run``; this class is only the
contract.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from kvoffload import block_device
from kvoffload.budget import file_slots, slot_state_bytes
from kvoffload.budget import check as budget_check
from kvoffload.device import BlockLayout, Device, make_device, resolve_device
from kvoffload.config import parse_choice
from kvoffload.engine_choice import choose as choose_engine
from kvoffload.engine_choice import from_environment
from kvoffload.jobs import check_event_idx, check_job
from kvoffload.metrics import IoMetrics
from kvoffload.os_calls import OsCalls
from kvoffload.persist import Persist, PoolKeeper, Restored
from kvoffload.run import Run, unit_rows
from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, SlotFile, slot_bytes_for
from kvoffload.slot_seal import make_seal

logger = logging.getLogger("kvoffload")

# IO threads per lane: 8 keep one fast drive busy (queue depth 8 per direction), but
# every disk path has its own lanes, and more threads than cores starve each other of
# the CPU they seal with. H200 (16 cores), 4 RAM-backed drives, 16 MiB units: 4 threads
# per lane loaded at 13.2 GiB/s, 8 at 12.4 (scripts/probe_fast_storage.py).
DEFAULT_IO_THREADS = 8
# A unit is what one worker reads or writes before its one device copy; its staging is
# three units per worker (one per store worker, two per load worker) on every disk path.
# The operators this backend is for chose disk because host DRAM is scarce: by default a
# backend (one rank) takes at most DEFAULT_STAGING_BYTES of pinned staging, in units of at
# most MAX_DEFAULT_IO_UNIT_BYTES. Small units cost the native engine one driver call and
# one event wait each, and no GIL; the Python engine pays a wait for the GIL per unit
# beside a busy engine thread as well (docs/performance.md has both, measured).
DEFAULT_STAGING_BYTES = 256 << 20
MAX_DEFAULT_IO_UNIT_BYTES = 8 << 20


def default_io_unit_bytes(num_paths: int, threads: int) -> int:
    """The default ``io_unit_bytes``: the largest unit, up to ``MAX_DEFAULT_IO_UNIT_BYTES``
    (and at least 1 MiB), whose staging over ``num_paths`` paths of ``threads`` workers per
    lane fits ``DEFAULT_STAGING_BYTES``."""
    return max(1 << 20, min(MAX_DEFAULT_IO_UNIT_BYTES, DEFAULT_STAGING_BYTES // (3 * threads * num_paths)))


def default_io_threads(num_paths: int, num_buffer_slots: int = 1, cores: Optional[int] = None) -> int:
    """IO threads per lane: up to 8, fewer when several disk paths share the ``cores``
    (default: the cores this process may run on)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 8)
    return max(num_buffer_slots, 2, min(DEFAULT_IO_THREADS, cores // num_paths))


DEFAULT_JOIN_TIMEOUT_S = 10.0
# How long init waits for its IO threads to bind the device (make a stream, maybe a
# staging buffer): a bounded wait, so a wedged driver fails init instead of hanging it.
DEFAULT_START_TIMEOUT_S = 60.0


# What the backend calls on a device (device.Device); a device_impl lacking one is refused at init.
_DEVICE_METHODS = ("bind_thread", "new_event", "pin", "unpin", "copy_to_host", "copy_to_device", "host_view",
                   "copy_plan", "event_handle")


class LeakedFdWarning(RuntimeWarning):
    """An IO thread outlived shutdown, so its file descriptor was kept open on purpose."""


class DiskBackend:
    """GPU <-> slot-file copy backend with vLLM's ``init``/``launch_copy``/``shutdown`` contract."""

    def __init__(self) -> None:
        self._run: Optional[Run] = None
        self._finalizer: Optional[weakref.finalize] = None
        self._join_timeout = DEFAULT_JOIN_TIMEOUT_S
        # The monotonic time source, an attribute so timeout tests can replace it.
        self.clock = time.monotonic

    # -- vLLM's contract -------------------------------------------------------

    def init(
        self,
        gpu_caches: dict[str, torch.Tensor],
        device: torch.device,
        load_stream: Any,
        store_stream: Any,
        disk_path: str,
        num_disk_slots: int,
        total_block_bytes: int,
        num_buffer_slots: int = 2,
        use_page_cache: bool = False,
        *,
        disk_paths: Optional[Sequence[str]] = None,
        capacity_bytes: Optional[int] = None,
        encrypt: bool = True,
        checksums: bool = True,
        report_load_errors: bool = False,
        io_threads: Optional[int] = None,
        io_unit_bytes: Optional[int] = None,
        named_file: bool = False,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        os_calls: Optional[OsCalls] = None,
        device_impl: Optional[Device] = None,
        native_io: Optional[bool | str] = None,
        prefill: bool = False,
        persist: Optional[Persist] = None,
    ) -> None:
        """Create the slot file(s), staging buffers and IO threads.

        - ``disk_paths`` stripes slots over several files (slot s lives in file
          ``s % n``), each with its own threads, so a failed disk costs only its slots.
        - ``capacity_bytes``: the disk budget; the files never exceed it. Default
          ``num_disk_slots * total_block_bytes``, what vLLM's own worker allots, so
          O_DIRECT padding that would overrun it is refused at init.
        - ``encrypt`` (AES-GCM, the default) keeps every slot unreadable outside this
          process; otherwise ``checksums`` (xxh3) only check integrity.
        - ``report_load_errors``: the caller collects ``get_block_ids_with_load_errors()``
          (``KvoffloadConnector`` does). Without it a failed load raises from its event
          (``UnreportedLoadError``) rather than end quietly on stale device blocks.
        - ``io_threads``: IO threads (and staging buffers) per lane; by default up to 8,
          fewer with several disk paths (``default_io_threads``), at least ``num_buffer_slots``.
        - ``native_io``: the IO engine (``engine.py``): the native engine (C workers that
          never take the GIL for a unit, built with the package) or the Python engine;
          None or ``"auto"`` (default): ``$KVOFFLOAD_NATIVE_IO``
          if set (``on``, ``off``, ``auto``), else the native engine where it was built and
          the seal is AES-GCM or none, else the Python engine; True or ``"on"``: the native
          engine, required (init fails saying why not); False or ``"off"``: the Python
          engine. Decided here, once.
        - ``prefill``: write each slot file once with zeros before ``init`` returns, so a
          fresh file's first stores run at the rewrite rate (start-up pays one full write
          of the files; docs/config.md).
        - ``persist``: keep the blocks across restarts (``persist/``): named files at each
          disk path (``P`` and ``P.index``), sealed under a key derived from the operator's,
          opened and checked here (a wrong key, another model or layout, a newer format:
          ``PersistError``, nothing changed on disk); stores then need ``launch_copy``'s
          ``keys``, and ``restored()`` says what came back. Needs ``encrypt``.
        """
        if self._run is not None:
            raise RuntimeError("DiskBackend.init called twice without shutdown")
        plan = _Plan.check(gpu_caches, device, disk_path, disk_paths, num_disk_slots, total_block_bytes,
                           num_buffer_slots, use_page_cache, capacity_bytes, encrypt, checksums,
                           report_load_errors, io_threads, io_unit_bytes, named_file, join_timeout,
                           start_timeout, os_calls, device_impl, native_io, prefill, persist)
        make_engine, io_path = choose_engine(plan.seal.name, plan.native_io)  # the one choice
        dev = device_impl if device_impl is not None else make_device(plan.device)
        run = Run(plan.osc, dev, plan.layout, num_disk_slots, plan.seal, report_load_errors, plan.threads,
                  IoMetrics(len(plan.paths)), plan.io_unit_bytes)
        run.io_path_detail = io_path
        run.streams = {True: store_stream, False: load_stream}
        try:
            # Published first, so an exception at any later line (an interrupt too)
            # finds everything made so far through self._run and shutdown() frees it.
            self._run = run
            self._join_timeout = plan.join_timeout
            self._open_files(run, plan, persist)
            devices = [block_device.of_file(plan.osc, f.fd) for f in run.files]
            run.metrics.watch_devices(devices)
            run.start(make_engine(run), plan.start_timeout)
            run.metrics.info = {
                "capacity_bytes": plan.budget, "slots": num_disk_slots, "slot_bytes": run.files[0].slot_bytes,
                "staging_bytes": self._staging_bytes(run), "io_threads": plan.threads, "paths": len(plan.paths),
                "seal": run.seal.name, "io": "page_cache" if use_page_cache else "o_direct",
                "io_path": run.engine.name,
            }
            # Dropped without shutdown(): stop the threads and free the files anyway.
            self._finalizer = weakref.finalize(self, _retire, run)
            # Inside the try too: an init that raises, even from here, leaves nothing.
            self._log_topology(run, plan, devices, io_path)
        except BaseException:
            self.shutdown()
            raise

    def _open_files(self, run: Run, plan: "_Plan", persist: Optional[Persist]) -> None:
        """Each path's slot file: a persistent pool's, opened and checked (its records
        restored), or a new anonymous one. Each is in ``run.files`` as soon as it is open."""
        n, paths = run.num_slots, plan.paths
        if persist is not None:
            PoolKeeper.open(run, plan.osc, persist, paths, plan.layout.block_bytes, plan.use_page_cache,
                            _layout_fingerprint(plan.layout), plan.budget // n, plan.prefill)
        for i, p in enumerate(paths[len(run.files):], start=len(run.files)):
            # Slot s of the whole pool lives in file s % n at index s // n.
            run.files.append(SlotFile.create(plan.osc, p, file_slots(n, len(paths), i), plan.layout.block_bytes,
                                             plan.use_page_cache, plan.named_file, max_slot_bytes=plan.budget // n,
                                             prefill=plan.prefill))

    def _log_topology(self, run: Run, plan: "_Plan", devices: list, io_path: str) -> None:
        """The start-up line: the topology as realised, what an operator checks first when a
        figure looks wrong."""
        logger.info(
            "kvoffload DiskBackend: %d slots of %d B on %s; IO path %s, %d workers per lane, %d MiB units, "
            "%.0f MiB pinned staging, %s, %s, %s",
            run.num_slots, plan.layout.block_bytes,
            "; ".join(f"{p} ({block_device.describe(d)})" for p, d in zip(plan.paths, devices)),
            io_path, plan.threads, plan.io_unit_bytes >> 20, self._staging_bytes(run) / 2**20, run.seal.label,
            "page cache" if plan.use_page_cache else "O_DIRECT",
            run.keeper.describe(),
        )

    def launch_copy(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        is_store: bool,
        event_idx: int,
        events_list: list,
        wait_event: Any = None,
        keys: Optional[Sequence[bytes]] = None,
    ) -> None:
        """Queue one job; never blocks. Appends exactly one ``(event_idx, event)``.

        Stores: src = device block ids, dst = slots. Loads: src = slots, dst = device
        block ids. Everything is checked before anything is queued; the event is
        appended last and completes once the job is over, also when it failed.
        ``keys``: a persistent pool's store, the key of each block (the block hash it
        holds, at most ``persist.MAX_KEY_BYTES``); ignored otherwise.
        """
        run = self._require_run()
        check_event_idx(event_idx, events_list)
        blocks, slots = check_job(src_blocks, dst_blocks, is_store, run.layout.num_blocks, run.num_slots)
        keys = run.keeper.store_keys(keys, len(slots)) if is_store else None
        run.submit(blocks, slots, is_store, event_idx, events_list, wait_event, keys)

    def restored(self, reserved: Sequence[int] = ()) -> Restored:
        """A persistent pool's blocks found at init, least recently stored first (one slot per
        key), and the records not taken, by cause; ``reserved``: slots the caller never uses."""
        found = self._require_run().keeper.restored()
        if not reserved:
            return found
        keep = ~np.isin(found.slots, np.asarray(list(reserved), np.int64))
        refused = found.refused.copy()
        refused["reserved"] += int((~keep).sum())
        return Restored(found.slots[keep], [k for k, x in zip(found.keys, keep) if x], +refused)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (then cleared)."""
        run = self._run
        return run.take("load_errors") if run is not None else set()

    def get_failed_store_slots(self) -> set[int]:
        """Slots whose store failed since the last call (then cleared); they never load as valid."""
        run = self._run
        return run.take("failed_store_slots") if run is not None else set()

    def shutdown(self) -> None:
        """Finish or fail queued jobs, join the threads, discard and close the files.

        Idempotent, and safe to call again after it was interrupted: the run is
        dropped only once it is fully stopped.
        """
        run = self._run
        if run is None:
            return
        alive = run.stop(self.clock() + self._join_timeout, self.clock)
        if run.metrics.info is not None:  # an init that failed moved nothing to sum up
            logger.info("kvoffload run summary: %s", run.metrics.summary())
        if alive:
            # Closing the fd under a live pwritev would let the number be reused by
            # another file, which the late write would then corrupt. The run stays
            # open until its last thread ends, then closes itself.
            fds = [f.fd for f in run.files]
            msg = (
                f"{len(alive)} kvoffload IO worker(s) still running {self._join_timeout} s after "
                f"shutdown; keeping fd(s) {fds} of the (unlinked) slot file(s) until they end"
            )
            logger.warning(msg)
            warnings.warn(msg, LeakedFdWarning, stacklevel=2)
            run.abandon()
        else:
            run.close()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._run = None

    # -- introspection ---------------------------------------------------------

    @property
    def closing(self) -> bool:
        """True unless the backend is initialised and accepting jobs."""
        run = self._run
        return run is None or run.closing

    @property
    def collect_metrics(self) -> bool:
        """Whether the run counts for ``take_metrics`` and the shutdown summary (on by default).
        Switched off, nothing is counted until it is on again: the bench's comparison."""
        return self._require_run().metrics.enabled

    @collect_metrics.setter
    def collect_metrics(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"collect_metrics must be a bool, got {on!r}")
        self._require_run().metrics.enabled = on

    @property
    def files(self) -> list[SlotFile]:
        """The open slot files (one per disk path)."""
        return list(self._require_run().files)

    def stats(self) -> dict[str, Any]:
        """Bytes moved to and from the slot files since init, how slots are sealed, the host
        staging allocated (all IO threads), per direction whether every lane's file IO goes
        straight to and from the blocks (``direct_io``: host blocks only), and the IO threads'
        seconds per stage and direction (``wait``, ``device``, ``seal``, ``io``)."""
        run = self._require_run()
        with run.lock:
            moved = {"bytes_written": run.bytes_written, "bytes_read": run.bytes_read, "seal": run.seal.name,
                     "staging_bytes": self._staging_bytes(run),
                     "io_path": run.engine.name,
                     "io_path_detail": run.io_path_detail,
                     "direct_io": {lane: all(run.direct_lane(f, is_store) for f in run.files)
                                   for lane, is_store in (("store", True), ("load", False))}}
        return {**moved, "stage_seconds": run.engine.stage_seconds()}

    def take_metrics(self) -> Optional[dict[str, Any]]:
        """What changed since the last call, as vLLM's stats payload (``kvoffload.metrics``:
        blocks and bytes moved, failures by cause, latency histograms, queued units, busy
        IO seconds; the tier's facts once). None when nothing changed or collection is off."""
        run = self._run
        if run is None or not run.metrics.enabled:
            return None
        busy = {d: sum(sec for stage, sec in stages.items() if stage != "wait")
                for d, stages in run.engine.stage_seconds().items()}
        return run.metrics.take(run.engine.queued(), busy)

    @staticmethod
    def _staging_bytes(run: Run) -> int:
        return sum(b.numel() * b.element_size() for b in run.pinned)

    def _require_run(self) -> Run:
        run = self._run
        if run is None:
            raise RuntimeError("DiskBackend is not initialised (call init, or it was shut down)")
        return run


def _retire(run: Run) -> None:
    """Finalizer of a backend dropped without shutdown: stop without waiting; the last
    IO worker to end closes the files."""
    run.begin_close()
    run.abandon()


def _layout_fingerprint(layout: BlockLayout) -> dict[str, Any]:
    """What a persistent pool's slots depend on in the layout itself: how the caches' bytes
    are packed into a slot (the caller's fingerprint names the model, dtype and rank)."""
    packing = ",".join(f"{o}:{t.shape[1]}" for o, t in zip(layout.offsets, layout.caches))
    return {"tensors": len(layout.offsets), "packing": hashlib.sha256(packing.encode()).hexdigest()[:16]}


@dataclass(frozen=True)
class _Plan:
    """``init``'s arguments, every one checked (each error naming its keyword) and the
    defaults filled in, before anything is made; and the disk and host memory the pool
    will take checked against what there is."""

    paths: list[str]
    device: torch.device
    layout: BlockLayout
    threads: int
    io_unit_bytes: int
    budget: int
    use_page_cache: bool
    named_file: bool
    prefill: bool
    native_io: Optional[bool]
    join_timeout: float
    start_timeout: float
    osc: OsCalls
    seal: Any

    @classmethod
    def check(cls, gpu_caches: dict[str, torch.Tensor], device: Any, disk_path: Any, disk_paths: Any,
              num_disk_slots: Any, total_block_bytes: Any, num_buffer_slots: Any, use_page_cache: Any,
              capacity_bytes: Any, encrypt: Any, checksums: Any, report_load_errors: Any, io_threads: Any,
              io_unit_bytes: Any, named_file: Any, join_timeout: Any, start_timeout: Any, os_calls: Any,
              device_impl: Any, native_io: Any, prefill: Any, persist: Any) -> "_Plan":
        paths = _disk_paths(disk_path, disk_paths)
        _positive_int("num_buffer_slots", num_buffer_slots)
        threads = _positive_int("io_threads", io_threads if io_threads is not None
                                else default_io_threads(len(paths), num_buffer_slots))
        io_unit_bytes = _positive_int("io_unit_bytes", io_unit_bytes if io_unit_bytes is not None
                                      else default_io_unit_bytes(len(paths), threads))
        _positive_int("num_disk_slots", num_disk_slots)
        _positive_int("total_block_bytes", total_block_bytes)
        for name, flag in (("use_page_cache", use_page_cache), ("encrypt", encrypt), ("checksums", checksums),
                           ("report_load_errors", report_load_errors), ("named_file", named_file),
                           ("prefill", prefill)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if native_io is not None and not isinstance(native_io, (bool, str)):
            raise TypeError(f"native_io must be a bool, None or on/off/auto, got {native_io!r}")
        native_io = parse_choice(native_io, "native_io")
        if native_io is None:
            native_io = from_environment()
        # shutdown() computes a deadline from join_timeout: a string here would fail
        # only there, after the threads and files exist.
        join_timeout = _seconds("join_timeout", join_timeout, minimum=0.0)
        start_timeout = _seconds("start_timeout", start_timeout, minimum=None)
        if os_calls is not None and not isinstance(os_calls, OsCalls):
            raise TypeError(f"os_calls must be an OsCalls, got {type(os_calls).__name__}")
        if persist is not None and not isinstance(persist, Persist):
            raise TypeError(f"persist must be a kvoffload.persist.Persist, got {type(persist).__name__}")
        if persist is not None and not encrypt:
            raise ValueError("persist needs encrypt=True: a kept file must hold nothing but ciphertext")
        missing = [m for m in _DEVICE_METHODS if device_impl is not None and not callable(getattr(device_impl, m, None))]
        if missing:
            raise TypeError(f"device_impl {type(device_impl).__name__} lacks {', '.join(missing)} (see device.Device)")
        layout = BlockLayout.from_caches(gpu_caches)
        if layout.block_bytes != total_block_bytes:
            raise ValueError(
                f"total_block_bytes={total_block_bytes} but the caches hold "
                f"{layout.block_bytes} bytes per block (sum of stride(0) * element_size())"
            )
        if num_disk_slots < len(paths):
            raise ValueError(f"num_disk_slots={num_disk_slots} is fewer than the {len(paths)} disk paths")
        budget = capacity_bytes if capacity_bytes is not None else num_disk_slots * total_block_bytes
        _positive_int("capacity_bytes", budget)
        plan = cls(paths, resolve_device(device), layout, threads, io_unit_bytes, budget, use_page_cache,
                   named_file, prefill, native_io, join_timeout, start_timeout,
                   os_calls if os_calls is not None else OsCalls(), make_seal(encrypt, checksums))
        plan.check_budget(num_disk_slots, persist is not None)
        return plan

    def check_budget(self, num_slots: int, persist: bool) -> None:
        """Disk and host memory for what ``init`` makes, before any of it is made: per-slot
        records (all slots valid) and pinned staging (3 buffers a thread and path)."""
        slot = slot_bytes_for(self.layout.block_bytes, MIN_DIRECT_ALIGNMENT, self.use_page_cache)
        staging = sum(3 * self.threads * (unit_rows(self.io_unit_bytes, slot, file_slots(num_slots, len(self.paths), i),
                                                    self.layout.num_blocks) * slot + MIN_DIRECT_ALIGNMENT)
                      for i in range(len(self.paths)))
        budget_check(self.osc, f"num_disk_slots={num_slots}", self.paths, num_slots, self.layout.block_bytes,
                     self.use_page_cache, num_slots * slot_state_bytes(self.seal.name, persist) + staging,
                     persist=persist)


def _disk_paths(disk_path: Any, disk_paths: Any) -> list[str]:
    """The slot files' paths: ``disk_paths`` when given, else ``[disk_path]``."""
    if disk_paths is None:
        paths = [disk_path]
    elif isinstance(disk_paths, (str, bytes)) or not isinstance(disk_paths, Sequence) or not disk_paths:
        # A string is a sequence too: "/nvme/kv" would become 8 one-letter paths.
        raise TypeError(f"disk_paths must be a non-empty list of file paths, got {disk_paths!r}")
    else:
        paths = list(disk_paths)
    key = "disk_path" if disk_paths is None else "disk_paths"
    for p in paths:
        if not isinstance(p, str):
            raise TypeError(f"{key} must be a str file path, got {p!r}")
        if not p:
            raise ValueError(f"{key} must be a non-empty file path, got {p!r}")
    if len(set(paths)) != len(paths):
        raise ValueError(f"disk_paths={paths!r} names a path twice")
    return paths


def _seconds(name: str, value: Any, minimum: Optional[float]) -> float:
    """A finite number of seconds, > 0 (``minimum`` None) or >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (int or float), got {value!r}")
    if not math.isfinite(value) or (value <= 0 if minimum is None else value < minimum):
        raise ValueError(f"{name} must be a finite number of seconds "
                         f"{'> 0' if minimum is None else f'>= {minimum:g}'}, got {value!r}")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
