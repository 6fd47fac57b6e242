"""Where a slot's record goes once its store ends: the one door between the data path and persistence.

A run's keeper is chosen once, at start-up (``DiskBackend.init``): ``Ephemeral``, the
default, keeps each slot's record in the run's table only, and nothing of it outlives
the process; ``persist.PoolKeeper`` also writes it to the pool's index, so a restart
finds it. ``Run.submit`` asks the keeper for a store's identities, ``Run.settle`` hands
it a store's outcome and a load's failed checks, ``DiskBackend`` asks it for a store's
keys, what start-up found and the words of the start-up line. Nothing else on the
data path asks whether a pool persists.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

from kvoffload.slot_records import Records


@dataclass
class Restored:
    """What start-up found in a pool's indexes: per global slot its record (valid ones only),
    and how many records it did not take, by cause (``persist.restorable``)."""

    slots: np.ndarray  # global slot ids, least recently stored first
    keys: list[bytes]  # parallel: the block key each holds
    refused: Counter = field(default_factory=Counter)

    def entries(self) -> list[tuple[int, bytes]]:
        return list(zip(self.slots.tolist(), self.keys))


class RunState(Protocol):
    """What of a run (``run.Run``) a keeper reads and writes."""

    num_slots: int
    records: Records  # per slot: its latest completed store's
    latest_store: np.ndarray  # per slot: the job id of the latest store launched to it
    lock: threading.Lock
    files: list  # the run's SlotFiles: slot s is in file s % len(files)
    seal: Any  # the run's SlotSeal
    log: Any  # its RateLimitedLog


class Keeper(Protocol):
    def store_keys(self, keys: Any, n: int) -> Optional[list[bytes]]:
        """A store's block keys (``launch_copy``'s ``keys``), checked, where this keeper
        keeps them; None where it keeps none (then they are ignored)."""

    def identities(self, run: RunState, slots: np.ndarray, keys: Optional[list[bytes]]) -> Optional[Records]:
        """At submit, under ``run.lock``: a store's records before sealing, each slot's
        identity (what its seal authenticates besides the slot), or None."""

    def publish(self, run: RunState, job_id: int, slots: np.ndarray, files: np.ndarray, ok: np.ndarray,
                records: Optional[Records]) -> None:
        """Store ``job_id``'s outcome, slot by slot (``files``: each slot's file index): a
        slot's record is set only by the latest store launched to it, or cleared where that
        store failed. An earlier store ending later changes nothing (if its bytes landed
        last, they fail the record's check). ``records`` None: nothing was sealed (every
        slot failed)."""

    def failed_check(self, run: RunState, slots: np.ndarray, files: np.ndarray, bad: np.ndarray,
                     checked: Records) -> None:
        """A load's blocks that failed their check (``bad``) against ``checked``."""

    def restored(self) -> Restored:
        """What start-up found, least recently stored first."""

    def describe(self) -> str:
        """What the start-up line says of it."""

    def close(self, sync: bool) -> None:
        """At the run's close; ``sync``: flush what it wrote (not in a fork()ed child)."""


class Ephemeral:
    """The default keeper: records in the run's table only, nothing at rest."""

    def store_keys(self, keys: Any, n: int) -> None:
        return None

    def identities(self, run: RunState, slots: np.ndarray, keys: Optional[list[bytes]]) -> None:
        return None

    def publish(self, run: RunState, job_id: int, slots: np.ndarray, files: np.ndarray, ok: np.ndarray,
                records: Optional[Records]) -> None:
        latest, own = run.latest_store, run.records
        if records is None:
            ok = np.zeros(len(slots), bool)
        # No lock (a contended one is a GIL hand-over per part). A store launched to the
        # slot meanwhile sets latest_store first, then clears the record (submit): set,
        # then look again, and the newer store's clearing always comes last.
        mine = latest[slots] == job_id
        if ok.any():
            own.put(slots[mine & ok], records.take(mine & ok))
        own.clear(slots[mine & ~ok])
        own.clear(slots[mine & (latest[slots] != job_id)])

    def failed_check(self, run: RunState, slots: np.ndarray, files: np.ndarray, bad: np.ndarray,
                     checked: Records) -> None:
        # The block is reported (load_errors) and recomputed; its slot keeps its record,
        # so the scheduler's next store there replaces it as any store does.
        return None

    def restored(self) -> Restored:
        return Restored(np.zeros(0, np.int64), [])

    def describe(self) -> str:
        return "nothing kept at exit"

    def close(self, sync: bool) -> None:
        return None
