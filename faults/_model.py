"""A model of the slot file, and the driver that checks the backend against it.

The model holds, per slot, the bytes of the last store that succeeded, or
ABSENT (never stored since init) or INVALID (the last store failed or came up
short: old, new or mixed bytes, fsyncgate). A store the device acknowledged
without writing (``Fault.lie``) is MAYBE: a load may fail or return the new
bytes, never anything else. A load that reports success must return exactly the
model's bytes; a load error must be justified by the model or by a fault fired
on that slot (LevelDB ``ModelDB``, Hypothesis ``DatabaseComparison``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from kvoffload.device import random_caches as make_caches  # noqa: F401 - re-exported by faults

from faults._invariants import Ledger, Op, expect
from faults._seam import FaultyOsCalls, Fired


class _Tag:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


ABSENT = _Tag("ABSENT")
INVALID = _Tag("INVALID")


@dataclass(frozen=True)
class Maybe:
    data: bytes


SlotState = Union[bytes, Maybe, _Tag]


def block_data(caches: dict[str, torch.Tensor], b: int) -> bytes:
    return b"".join(t[b].cpu().numpy().tobytes() for t in caches.values())


class KvChecker:
    """Drives one backend (store/load/drain) and checks every completion against the model.

    Jobs may overlap; a job that would race a pending one on a slot or a device
    block drains first, so the model stays exact. ``drain`` is the barrier where
    completions are judged.
    """

    def __init__(self, backend, caches, osc: Optional[FaultyOsCalls], num_slots: int, ledger: Optional[Ledger] = None,
                 seed: int = 0) -> None:
        self.b, self.caches, self.osc = backend, caches, osc
        self.ledger = ledger if ledger is not None else Ledger()
        self.num_slots = num_slots
        self.model: dict[int, SlotState] = {s: ABSENT for s in range(num_slots)}
        self.pending: list[tuple[Op, list[bytes]]] = []  # (op, device bytes of its blocks at launch)
        self.log_pos = len(osc.log) if osc is not None else 0
        self.gen = torch.Generator().manual_seed(seed)
        self.stats = {"store_ok": 0, "store_fail": 0, "load_ok": 0, "load_fail": 0}
        self._file = None
        # Failures need a fault fired on that slot, unless real faults are expected
        # (a real ENOSPC on a small file system is not in the seam's log).
        self.unjustified_ok = False

    def attach(self) -> None:
        """Call after (re)init: remembers the slot file's geometry for fault attribution."""
        files = self.b.files
        assert len(files) == 1, "KvChecker attributes faults by offset in a single slot file"
        self._file = files[0]
        self.model = {s: ABSENT for s in range(self.num_slots)}

    # -- actions ----------------------------------------------------------------

    def fill(self, blocks) -> None:
        """New random bytes in device blocks (what a store will copy)."""
        for t in self.caches.values():
            for b in blocks:
                t[b].copy_(torch.randint(-128, 128, t[b].shape, dtype=torch.int8, generator=self.gen).to(t.device))

    def store(self, blocks, slots, fresh: bool = True) -> Op:
        self._avoid_races(blocks, slots, is_store=True)
        if fresh:
            self.fill(blocks)
        return self._launch(blocks, slots, True)

    def load(self, slots, blocks) -> Op:
        self._avoid_races(blocks, slots, is_store=False)
        return self._launch(slots, blocks, False)

    def _launch(self, src, dst, is_store) -> Op:
        blocks = src if is_store else dst
        before = [block_data(self.caches, b) for b in blocks]
        op = self.ledger.launch(self.b, src, dst, is_store)
        self.pending.append((op, before))
        return op

    def _avoid_races(self, blocks, slots, is_store) -> None:
        for op, _ in self.pending:
            slot_clash = set(slots) & set(op.slots) and (is_store or op.is_store)
            # Any shared device block: a load writes it, and a store refills it first.
            block_clash = set(blocks) & set(op.blocks)
            if slot_clash or block_clash:
                self.drain()
                return

    # -- the barrier --------------------------------------------------------------

    def drain(self, timeout: float = 30.0) -> None:
        """Wait for every pending job and judge it against the model."""
        pending, self.pending = self.pending, []
        self.ledger.wait([op for op, _ in pending], timeout)
        failed_slots = self.b.get_failed_store_slots()
        load_errors = self.b.get_block_ids_with_load_errors()
        fired = self._fired_since()
        for op, before in pending:
            if op.is_store:
                self._judge_store(op, before, failed_slots, fired)
            else:
                self._judge_load(op, before, load_errors, fired)
        stores = {s for op, _ in pending if op.is_store for s in op.slots}
        loads = {b for op, _ in pending if not op.is_store for b in op.blocks}
        expect(failed_slots <= stores, "wrong_data", f"failed store slots {failed_slots - stores} belong to no job")
        expect(load_errors <= loads, "wrong_data", f"load errors on blocks {load_errors - loads} belong to no job")

    def _fired_since(self) -> list[Fired]:
        if self.osc is None:
            return []
        out, self.log_pos = self.osc.log_since(self.log_pos)
        return out

    def _span(self, slot: int) -> tuple[int, int]:
        f = self._file
        return slot * f.slot_bytes, slot * f.slot_bytes + f.slot_bytes

    def _hit(self, fired, call, slot, kinds) -> bool:
        start, end = self._span(slot)
        return any(x.call == call and x.fault.kind in kinds and x.covers(self._file.fd, start, end) for x in fired)

    def _judge_store(self, op: Op, before, failed_slots, fired) -> None:
        bad = [s for s in op.slots if s in failed_slots]
        expect(op.event.ok == (not bad), "wrong_data", f"store job {op.idx}: event ok={op.event.ok} but failed slots {bad}")
        self.stats["store_ok" if op.event.ok else "store_fail"] += 1
        for s, data in zip(op.slots, before):
            if s in failed_slots:
                expect(self.unjustified_ok or self._hit(fired, "pwritev", s, ("error", "short")) or self._closing(),
                       "wrong_data", f"store job {op.idx}: slot {s} failed with no fault fired on it")
                self.model[s] = INVALID
            else:
                # A slot inside a failed multi-slot write may still be reported stored: the
                # backend retries such writes slot by slot. Whether its bytes really are
                # there is what the next load, or verify_all, checks.
                self.model[s] = Maybe(data) if self._hit(fired, "pwritev", s, ("lie",)) else data

    def _judge_load(self, op: Op, before, load_errors, fired) -> None:
        bad = [b for b in op.blocks if b in load_errors]
        expect(op.event.ok == (not bad), "wrong_data", f"load job {op.idx}: event ok={op.event.ok} but errors on {bad}")
        self.stats["load_ok" if op.event.ok else "load_fail"] += 1
        for s, b, old in zip(op.slots, op.blocks, before):
            want = self.model[s]
            got = block_data(self.caches, b)
            if b in load_errors:
                expect(got == old, "wrong_data", f"load job {op.idx}: failed load of slot {s} changed device block {b}")
                justified = (
                    not isinstance(want, bytes)
                    or self.unjustified_ok
                    or self._hit(fired, "preadv", s, ("error", "short", "bitflip"))
                    or self._closing()
                )
                expect(justified, "wrong_data", f"load job {op.idx}: slot {s} holds acknowledged data but failed with no fault")
            else:
                expect(isinstance(want, (bytes, Maybe)), "wrong_data",
                       f"load job {op.idx}: slot {s} is {want!r} but was served as a hit")
                exp = want.data if isinstance(want, Maybe) else want
                expect(got == exp, "wrong_data", f"load job {op.idx}: slot {s} served wrong bytes into block {b}")

    def _closing(self) -> bool:
        return self.b.closing

    # -- integrity check with faults off -------------------------------------------

    def verify_all(self) -> None:
        """Load every slot with faults disabled and check it against the model (SQLite integrity_check)."""
        self.drain()
        enabled = self.osc.enabled if self.osc is not None else None
        if self.osc is not None:
            self.osc.enabled = False
        try:
            nblocks = next(iter(self.caches.values())).shape[0]
            for start in range(0, self.num_slots, nblocks):
                slots = list(range(start, min(start + nblocks, self.num_slots)))
                self.load(slots, list(range(len(slots))))
                self.drain()
        finally:
            if self.osc is not None:
                self.osc.enabled = enabled
