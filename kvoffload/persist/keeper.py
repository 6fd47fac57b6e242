"""A persistent pool's keeper (``slot_keeper.Keeper``): each slot's record in the run's table
and in the pool's index, with the generation and LRU sequence that make it a record
a restart can trust."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from kvoffload.os_calls import OsCalls
from kvoffload.persist.index_file import IDENT_BYTES
from kvoffload.persist.operator_key import Persist
from kvoffload.persist.pool import Pool, Restored, check_keys, restorable
from kvoffload.slot_records import Records, generations_of, idents_of, keys_of

if TYPE_CHECKING:
    from kvoffload.slot_keeper import RunState


class PoolKeeper:
    """The records of a run over a persistent ``Pool``: ``open`` reads and checks the pool's
    files and takes its records for the run's; from then on every store's record also
    goes to the index, and a block that fails its check leaves it."""

    def __init__(self, pool: Pool, num_slots: int) -> None:
        self.pool = pool
        # Per slot: the generation of its latest store (part of its identity) and the LRU
        # sequence of its record.
        self.generation = np.zeros(num_slots, np.uint64)
        self.seq = np.zeros(num_slots, np.uint64)
        self.found = Restored(np.zeros(0, np.int64), [])

    @classmethod
    def open(cls, run: "RunState", osc: OsCalls, persist: Persist, paths: Sequence[str], block_bytes: int,
             use_page_cache: bool, fingerprint: bytes, max_slot_bytes: int, prefill: bool) -> "PoolKeeper":
        """The pool's files opened into ``run.files`` (each as soon as it is open) and its
        records made the run's; ``run.keeper`` is set before anything can fail, so the
        run's close releases whatever was opened."""
        keeper = cls(Pool(osc, persist, paths, run.num_slots, block_bytes, use_page_cache, fingerprint),
                     run.num_slots)
        run.keeper = keeper
        keeper.pool.open(run.files, max_slot_bytes=max_slot_bytes, prefill=prefill)
        keeper._restore(run)
        return keeper

    def _restore(self, run: "RunState") -> None:
        """The records as start-up found them become the run's: the seal takes the pool's
        key, each valid record its slot's (nonce, tag, identity)."""
        pool = self.pool
        run.seal.persist(pool.keys.slot, pool.fingerprint, IDENT_BYTES)
        run.records = Records.empty(run.num_slots, run.seal.name, IDENT_BYTES)
        n = len(pool.records)
        for i, fr in enumerate(pool.records):
            local = np.flatnonzero(fr.valid)
            slots = local * n + i
            raw = fr.raw[local]
            self.generation[slots], self.seq[slots] = raw["gen"], raw["seq"]
            got = Records.empty(len(slots), run.seal.name, IDENT_BYTES)
            got.valid[:] = True
            got.nonce[:, :8] = np.ascontiguousarray(raw["nonce_lo"]).astype("<u8").view(np.uint8).reshape(-1, 8)
            got.nonce[:, 8:] = np.ascontiguousarray(raw["nonce_hi"]).astype("<u4").view(np.uint8).reshape(-1, 4)
            got.tag[:] = raw["tag"]
            got.ident[:, :8] = np.ascontiguousarray(raw["gen"]).astype("<u8").view(np.uint8).reshape(-1, 8)
            got.ident[:, 8] = raw["key_len"]
            got.ident[:, 9:] = raw["key"]
            run.records.put(slots, got)
        self.found = restorable(pool.records)
        pool.records = []  # the raw index: 128 B a slot, not needed once restored

    # -- the door ------------------------------------------------------------------

    def store_keys(self, keys: Any, n: int) -> list[bytes]:
        return check_keys(keys, n)

    def identities(self, run: "RunState", slots: np.ndarray, keys: Optional[list[bytes]]) -> Records:
        self.generation[slots] += 1  # one generation more per slot: its identity
        records = Records.empty(len(slots), "off", IDENT_BYTES)
        records.ident[:] = idents_of(self.generation[slots], keys, IDENT_BYTES - 9)
        return records

    def publish(self, run: "RunState", job_id: int, slots: np.ndarray, files: np.ndarray, ok: np.ndarray,
                records: Optional[Records]) -> None:
        if records is None:
            ok = np.zeros(len(slots), bool)
        with run.lock:  # the record and its LRU sequence together
            rows = np.flatnonzero(run.latest_store[slots] == job_id)
            good = ok[rows]
            if good.any():
                run.records.put(slots[rows[good]], records.take(rows[good]))
            run.records.clear(slots[rows[~good]])
            seqs = np.zeros(len(rows), np.uint64)
            seqs[good] = self.pool.next_seq + np.arange(int(good.sum()), dtype=np.uint64)
            self.pool.next_seq += int(good.sum())
            self.seq[slots[rows]] = seqs
        self._write_index(run, slots, files, rows, good, seqs)

    def failed_check(self, run: "RunState", slots: np.ndarray, files: np.ndarray, bad: np.ndarray,
                     checked: Records) -> None:
        """Out of the run and of the index (a restart would offer them again), unless a
        store has replaced them meanwhile."""
        if not bad.any():
            return
        rows = np.flatnonzero(bad)
        with run.lock:
            gone = rows[run.records.same(slots[rows], checked.take(rows))]
            run.records.clear(slots[gone])
        self._write_index(run, slots, files, gone, np.zeros(len(gone), bool), np.zeros(len(gone), np.uint64))

    def _write_index(self, run: "RunState", slots: np.ndarray, files: np.ndarray, rows: np.ndarray, good: np.ndarray,
                     seqs: np.ndarray) -> None:
        """The index records of ``rows`` of ``slots``: the slot's record where ``good``, an
        empty one otherwise (a failed store, or a block that failed its check). Outside
        the run's lock: an index write may be slow or hang like any other file call."""
        if not len(rows):
            return
        recs = run.records.take(slots[rows])
        recs.valid &= good  # a newer store may have cleared it meanwhile: then it is empty
        for i in np.unique(files[rows]).tolist():
            mine = files[rows] == i
            r = recs.take(mine)
            keys = keys_of(r.ident)
            gens = np.where(r.valid, generations_of(r.ident), 0)
            failed = self.pool.write(i, slots[rows[mine]] // len(run.files), gens, seqs[mine], r.nonce, r.tag,
                                     [k if v else b"" for k, v in zip(keys, r.valid.tolist())])
            if failed:
                run.log.warning("index", "kvoffload: writing the index records of slots %s of %s failed; those "
                                "blocks serve now but will not after a restart", failed, run.files[i].path)

    def restored(self) -> Restored:
        return self.found

    def describe(self) -> str:
        refused = sum(self.found.refused.values())
        return (f"persistent ({'new pool' if self.pool.new else 'restarted'}, {len(self.found.slots)} blocks found, "
                f"{refused} refused)")

    def close(self, sync: bool) -> None:
        self.pool.close(sync=sync)
