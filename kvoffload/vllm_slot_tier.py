"""``SlotTier``: chunks of vLLM's CPU primary tier on kvoffload's slot files; ``TierConfig``: its tier entry.

Data moves between the CPU primary's memory and kvoffload's slot files through
``DiskBackend`` on ``HostDevice``: the primary's rows are the blocks (one chunk per
row), sealed straight from them into staging and opened straight back into them (no
copy between primary and staging), so the tier keeps the backend's guarantees (preallocated file,
AES-GCM per slot, integrity on every load, per-slot failures, bounded shutdown, the
``OsCalls`` seam for faults). Which slot holds which chunk is kvsim's ``SlotPool``,
the same LRU the simulator models.

Nothing here imports vLLM: tests and benchmarks run ``SlotTier`` as it is, and
``KvoffloadTier`` (``vllm_tier_manager``) puts it behind vLLM's interface.
"""

from __future__ import annotations

import collections
import difflib
import functools
import hashlib
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvoffload import metrics
from kvoffload.budget import POOL_SLOT_BYTES, slot_state_bytes
from kvoffload.budget import check as budget_check
from kvoffload.config import DISK_SETTING_KEYS, DiskSettings, _bool, num_slots
from kvoffload.device import HostDevice
from kvoffload.disk_backend import DiskBackend
from kvoffload.jobs import JobEvent
from kvoffload.os_calls import OsCalls
from kvoffload.persist import Persist
from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, slot_bytes_for
from kvoffload.slot_pool import SlotPool

logger = logging.getLogger(__name__)

TIER_TYPE = "KvoffloadTier"
LOCALITIES = ("LOCAL", "REMOTE")
# Keys of a secondary_tiers entry that vLLM's factory consumes itself.
_FACTORY_KEYS = ("type", "module_path", "backpressure")
_KEYS = ("disk_path", "disk_paths", "locality", "direct_io", *DISK_SETTING_KEYS)


@dataclass(frozen=True)
class TierConfig(DiskSettings):
    """One ``secondary_tiers`` entry: its paths and placement, and the ``DiskSettings`` the
    connector's ``kv_connector_extra_config`` takes too, checked the same way."""

    disk_paths: tuple[str, ...] = ()  # required: one slot file per path
    locality: Optional[str] = None
    # File IO straight between the slot file and the primary's rows where O_DIRECT allows. Off:
    # AES-GCM loads measured faster read into staging and opened into the row than read into the
    # row and opened in place (2-core dev VM, scripts/probe_tier_direct.py, 2 MiB chunks: tmpfs
    # O_DIRECT 5.14 against 4.27 GiB/s, a loop RAM drive 4.88 against 4.30, the virtio disk 1.34
    # against 1.18; docs/vllm_tiering.md). xxh3 loads measured a tie.
    direct_io: bool = False

    def __post_init__(self) -> None:
        # Checked here, not only in from_tier_config, so a TierConfig built directly is
        # refused before the tier makes anything, each error naming its key.
        if not isinstance(self.disk_paths, tuple) or not self.disk_paths or not all(
                isinstance(p, str) and p for p in self.disk_paths):
            raise ValueError(f"{TIER_TYPE}: disk_paths={self.disk_paths!r}: expected a non-empty tuple of file paths")
        if len(set(self.disk_paths)) != len(self.disk_paths):
            raise ValueError(f"{TIER_TYPE}: disk_paths={list(self.disk_paths)!r} names a path twice")
        super().__post_init__()
        _bool("direct_io", self.direct_io)
        if self.locality is not None and self.locality not in LOCALITIES:
            raise ValueError(f"locality={self.locality!r}: expected one of {LOCALITIES}")

    @classmethod
    def from_tier_config(cls, tier: dict[str, Any]) -> "TierConfig":
        """Parse a tier entry (with or without the keys vLLM's factory pops); a bad key or
        value is a ``ValueError`` naming it."""
        given = {k: v for k, v in tier.items() if k not in _FACTORY_KEYS}
        unknown = sorted(k for k in given if k not in _KEYS)
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, _KEYS, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"{TIER_TYPE}: unknown key(s) {', '.join(hints)}; known keys: {', '.join(_KEYS)}")
        if ("disk_path" in given) == ("disk_paths" in given):
            raise ValueError(f"{TIER_TYPE}: set exactly one of disk_path (a file path on the offload disk) "
                             "or disk_paths (a list of them, one file per disk)")
        paths = [given.pop("disk_path")] if "disk_path" in given else given.pop("disk_paths")
        if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) and p for p in paths):
            key = "disk_path" if "disk_path" in tier else "disk_paths"
            raise ValueError(f"{TIER_TYPE}: {key}={tier[key]!r}: expected a non-empty file path"
                             + (" or a non-empty list of them" if key == "disk_paths" else ""))
        own = {k: given[k] for k in ("locality", "direct_io") if k in given}
        return cls(disk_paths=tuple(paths), **own, **DiskSettings.parse(given))

    def slot_bytes(self, block_bytes: int) -> int:
        """Bytes one chunk takes in the file (padded to the direct-IO alignment)."""
        return slot_bytes_for(block_bytes, MIN_DIRECT_ALIGNMENT, self.use_page_cache)


@dataclass(frozen=True)
class FinishedJob:
    """A job the tier finished: what ``get_finished_jobs`` reports to vLLM."""

    job_id: int
    success: bool
    # Loads that failed in part: the keys that did load (None: all share ``success``).
    successful_keys: Optional[tuple[Hashable, ...]]
    transfer_bytes: int


@dataclass
class _Job:
    job_id: int
    is_store: bool
    event: JobEvent
    keys: list[Hashable]  # the keys with IO (stores: newly placed; loads: present)
    chunks: list[int]  # primary rows, parallel to keys
    slots: list[int]  # tier slots, parallel to keys
    missing: tuple[Hashable, ...] = ()  # loads: keys gone before the job was submitted


class SlotTier:
    """Chunks of the CPU primary on kvoffload slot files: lookup, store, load, poll.

    ``primary`` is the primary tier's memory, ``[num_chunks, bytes_per_chunk]`` (vLLM's
    ``primary_kv_view``). Keys are any hashables (vLLM's ``OffloadKey``), bytes of at most
    ``persist.MAX_KEY_BYTES`` when the tier persists. ``tokens_of`` gives the prompt tokens
    a key's chunk holds, for the hit metrics (None: not counted). ``fingerprint``: what a
    persistent tier's chunks depend on besides the tokens (``persist.Persist``).
    """

    def __init__(self, primary: memoryview, cfg: TierConfig, *, os_calls: Optional[OsCalls] = None,
                 join_timeout: Optional[float] = None,
                 tokens_of: Optional[Callable[[Hashable], int]] = None,
                 fingerprint: Optional[dict[str, Any]] = None) -> None:
        if not isinstance(primary, memoryview):
            raise TypeError(f"{TIER_TYPE}: primary must be a memoryview, got {type(primary).__name__}")
        if not isinstance(cfg, TierConfig):
            raise TypeError(f"{TIER_TYPE}: cfg must be a TierConfig, got {type(cfg).__name__}")
        if os_calls is not None and not isinstance(os_calls, OsCalls):
            raise TypeError(f"os_calls must be an OsCalls, got {type(os_calls).__name__}")
        if primary.ndim < 1 or primary.strides is None or not primary.c_contiguous:
            raise ValueError(f"{TIER_TYPE}: the primary view must be C-contiguous [num_chunks, bytes], "
                             f"got shape {primary.shape}, strides {primary.strides}")
        if primary.readonly:
            # Loads write chunks straight into it: a read-only mapping would fault the process.
            raise ValueError(f"{TIER_TYPE}: the primary view is read-only; loads write into it")
        self.block_bytes = primary.strides[0]
        slots = num_slots(cfg.disk_capacity_bytes, cfg.slot_bytes(self.block_bytes))
        osc = os_calls if os_calls is not None else OsCalls()
        # The disk and the per-slot state (the pool's LRU and the backend's records) are
        # checked before either is built: SlotPool(1.3e12) would die in a MemoryError.
        budget_check(osc, f"disk_capacity_bytes={cfg.disk_capacity_bytes}", cfg.disk_paths, slots, self.block_bytes,
                     cfg.use_page_cache, slots * (POOL_SLOT_BYTES + slot_state_bytes(cfg.seal, cfg.persist.enabled)),
                     persist=cfg.persist.enabled)
        kept = Persist(cfg.persist.operator_key(), fingerprint or {}) if cfg.persist.enabled else None
        # The backend checks join_timeout like its other keywords, before it makes anything.
        extra = {"join_timeout": join_timeout} if join_timeout is not None else {}
        self.cfg = cfg
        self.pool = SlotPool(slots)
        # A byte view cast from the primary's, so vLLM can release its own view at shutdown.
        self._flat = primary.cast("B")
        rows = torch.frombuffer(self._flat, dtype=torch.int8).view(-1, self.block_bytes)
        self.backend = DiskBackend()
        self.backend.init(
            {"primary": rows}, torch.device("cpu"), None, None, cfg.disk_paths[0], slots, self.block_bytes,
            use_page_cache=cfg.use_page_cache, disk_paths=cfg.disk_paths, report_load_errors=True, os_calls=osc,
            device_impl=HostDevice(cfg.direct_io), persist=kept, **cfg.backend_kwargs(), **extra,
        )
        self._jobs: dict[int, _Job] = {}
        self._done_ids: collections.deque[int] = collections.deque()  # appended by IO threads
        self._finished: list[FinishedJob] = []  # ended without IO, not yet reported
        # Failures the backend reported for jobs not yet seen done (kept until they are).
        self._load_errors: set[int] = set()
        self._failed_slots: set[int] = set()
        self._tokens_of = tokens_of
        self.hits = metrics.HitMetrics()
        if kept is not None:
            found = self.backend.restored()
            self.pool.restore(found.entries())
            self.hits.restored(len(found.slots), found.refused)
            logger.info("kvoffload tier restored %d chunk(s) from %s (refused: %s)", len(found.slots),
                        ", ".join(cfg.disk_paths),
                        ", ".join(f"{c} {n}" for c, n in sorted(found.refused.items())) or "none")

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def lookup(self, key: Hashable) -> bool:
        """Whether ``key`` is on disk and loadable; a hit becomes most recently used."""
        if self.pool.lookup((key,)) != 1:
            return False
        self.pool.touch((key,))
        return True

    def touch(self, keys: Sequence[Hashable]) -> None:
        self.pool.touch(keys)

    def submit_store(self, job_id: int, keys: Sequence[Hashable], chunk_ids: Sequence[int]) -> None:
        """Queue primary rows ``chunk_ids`` to disk as ``keys``; never blocks.

        Keys already on disk (or in flight) are skipped; without a free or evictable
        slot, only a prefix of the new keys is stored (``SlotPool.prepare_store``).
        """
        chunk_of = self._chunk_map(job_id, keys, chunk_ids)
        placed = self.pool.prepare_store(list(keys))
        new = [k for k, _ in placed]
        self._launch(_Job(job_id, True, JobEvent(), new, [chunk_of[k] for k in new], [s for _, s in placed]))

    def submit_load(self, job_id: int, keys: Sequence[Hashable], chunk_ids: Sequence[int]) -> None:
        """Queue ``keys`` from disk into primary rows ``chunk_ids``; never blocks.

        A key evicted since its lookup (a store in the same scheduler step took its
        slot) fails at once: vLLM then recomputes it.
        """
        chunk_of = self._chunk_map(job_id, keys, chunk_ids)
        hit = [self.pool.lookup((k,)) == 1 for k in keys]
        present = [k for k, h in zip(keys, hit) if h]
        missing = tuple(k for k, h in zip(keys, hit) if not h)
        slots = self.pool.prepare_load(present)
        self._launch(_Job(job_id, False, JobEvent(), present, [chunk_of[k] for k in present], slots, missing))

    def poll(self) -> list[FinishedJob]:
        """Jobs finished since the last call; never blocks."""
        # Ids the jobs' events pushed as they ended: a poll costs what finished, not what is open.
        done = [job for job in (self._jobs.pop(self._done_ids.popleft(), None) for _ in range(len(self._done_ids)))
                if job is not None]
        if done:
            # Read after the events: a job's failures are recorded before it completes.
            self._load_errors |= self.backend.get_block_ids_with_load_errors()
            self._failed_slots |= self.backend.get_failed_store_slots()
        out, self._finished = self._finished, []
        for job in done:
            out.append(self._resolve(job))
        return out

    @property
    def pending(self) -> bool:
        """Whether a job is in flight or finished but not yet polled."""
        return bool(self._jobs or self._finished)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every submitted job ended (results stay for ``poll``); whether all did."""
        return all(job.event.wait(timeout) for job in list(self._jobs.values()))

    def close(self) -> None:
        """Stop the IO (queued jobs end failed), free the files; idempotent."""
        self.backend.shutdown()
        try:
            self._flat.release()
        except BufferError:
            # An IO thread hung past shutdown keeps the run (and its view of the
            # primary) until it ends; it makes no copy into the primary after that.
            logger.warning("kvoffload tier: an IO thread outlived shutdown; its view of the primary stays")

    def take_metrics(self) -> Optional[dict[str, Any]]:
        """The backend's metrics and the tier's (hits, slots) since the last call, as vLLM's
        stats payload (``kvoffload.metrics``); None when nothing changed."""
        return metrics.combine((self.backend.take_metrics(), self.hits.take(self.pool.num_cached(), self.pool.num_slots)))

    def _chunk_map(self, job_id: int, keys: Sequence[Hashable], chunk_ids: Sequence[int]) -> dict[Hashable, int]:
        """Each key's primary row; a malformed job is refused before the pool is touched."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        chunks = chunk_ids.tolist() if hasattr(chunk_ids, "tolist") else list(chunk_ids)
        if len(chunks) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(chunks)} chunk ids")
        chunk_of = dict(zip(keys, chunks))
        if len(chunk_of) != len(chunks):
            raise ValueError("a key appears twice in one job")
        return chunk_of

    def _launch(self, job: _Job) -> None:
        events: list = []
        src, dst = (job.chunks, job.slots) if job.is_store else (job.slots, job.chunks)
        keys = job.keys if job.is_store else None  # the backend's keeper takes them where it keeps them
        try:
            self.backend.launch_copy(src, dst, job.is_store, job.job_id, events, keys=keys)
        except Exception:
            # A dead or closed backend: the job fails (its keys become misses); the
            # scheduler must not see an exception from a tier call.
            logger.exception("kvoffload tier: job %d could not be queued; failing it", job.job_id)
            job.event.complete(False)
            self._finished.append(self._resolve(job))
            return
        job.event = events[-1][1]
        job.event.add_done_callback(functools.partial(self._done_ids.append, job.job_id))
        self._jobs[job.job_id] = job

    def _resolve(self, job: _Job) -> FinishedJob:
        """Publish or drop the job's keys in the pool and say what vLLM should keep."""
        failed = self._failed_slots if job.is_store else self._load_errors
        ids = job.slots if job.is_store else job.chunks
        bad = {i for i in ids if i in failed}
        failed -= bad
        if not job.event.ok and not bad:
            bad = set(ids)  # ended without per-slot detail (shutdown, device failure): all failed
        good_keys = [k for k, i in zip(job.keys, ids) if i not in bad]
        bad_keys = [k for k, i in zip(job.keys, ids) if i in bad]
        complete = self.pool.complete_store if job.is_store else self.pool.complete_load
        complete(good_keys, True)
        complete(bad_keys, False)  # a failed load drops the key: the slot holds bad bytes
        if not job.is_store and self._tokens_of is not None:
            # Promoted chunks served; the others are misses to vLLM, which recomputes them.
            tokens = self._tokens_of
            self.hits.load_ended(sum(map(tokens, good_keys)), sum(map(tokens, bad_keys + list(job.missing))))
        success = not bad_keys and not job.missing
        if bad_keys:
            logger.warning("kvoffload tier: %s job %d: %d of %d chunk(s) failed", "store" if job.is_store else
                           "load", job.job_id, len(bad_keys), len(job.keys) + len(job.missing))
        partial = None if success or job.is_store or not good_keys else tuple(good_keys)
        return FinishedJob(job.job_id, success, partial, len(good_keys) * self.block_bytes)


def tier_fingerprint(config: Any) -> dict[str, Any]:
    """What a persistent tier's chunks depend on besides the tokens, from vLLM's
    ``OffloadingConfig``: the model, its KV layout by group, the chunking, the rank."""
    groups = ";".join(f"{g.group_id}:{g.tokens_per_block}:{','.join(g.layer_names)}" for g in config.groups)
    par = config.parallel
    return {"model": config.model.name, "dtype": str(config.model.dtype),
            "groups": hashlib.sha256(groups.encode()).hexdigest()[:16], "kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "tokens_per_hash": config.cache.tokens_per_hash, "blocks_per_chunk": config.cache.blocks_per_chunk,
            "kv_cache_layout": getattr(config, "kv_cache_layout", None), "rank": par.rank, "world_size": par.world_size,
            "data_parallel_index": par.data_parallel_index}
