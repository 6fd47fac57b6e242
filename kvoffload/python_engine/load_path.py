"""The Python engine's load: ``preadv`` from the slot file -> opened (decrypted or verified) -> device blocks.

A load thread takes one unit, fails at once (no IO) the slots that hold no completed
store, reads each run of consecutive valid slots with one ``preadv``, opens each slot
against its record, and starts one batched copy of the good rows to their device
blocks. It has two staging buffers: it reads its next unit into one while the copy
from the other still runs, and waits for that copy (then ends its unit) before the
buffer is read into again. Reusing a buffer before its copy finished was vLLM's
trailing-drain bug: the next ``preadv`` overwrote rows the GPU was still reading.
Blocks in host memory (``HostDevice``) have no copy: each slot is opened (decrypted
or verified) straight from staging into its block, which is then that unit's copy.
A direct lane (aligned host blocks under O_DIRECT, ``Lane.direct``) has no staging:
it reads each slot straight into its block and opens it there; a block whose read
fails or whose check fails is zeroed, so a block never keeps unverified bytes.
The native engine's load is ``native_engine/load_unit.c``.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvoffload.engine import CANCELLED, INTEGRITY, OK, SKIP
from kvoffload.python_engine.lanes import Lane, StageClock, Unit, outcome_arrays, units_of
from kvoffload.slot_seal import zero


@dataclass
class _Pending:
    """A unit read and opened, whose device copy is running (``event``), or that has none."""

    unit: Unit
    status: np.ndarray
    err: np.ndarray
    good: list[int] = field(default_factory=list)  # the rows its copy moves
    event: Any = None


class LoadLane(Lane):
    direction = "load"
    buffers_per_thread = 2

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        buffers = views or [(None, None, None)]  # a direct lane reads into the blocks: no staging
        turn = 0
        pending: Optional[_Pending] = None
        while True:
            if pending is None:
                unit = self.queue.get()
            else:
                try:
                    unit = self.queue.get_nowait()
                except queue.Empty:  # nothing to overlap with: finish the pending load now
                    pending = self.settle(pending, clock)
                    continue
            clock.lap("wait")
            if unit is None:
                self.settle(pending, clock)
                return
            if self.refuse_if_closing(unit):
                continue
            rows, mv, event = buffers[turn]
            turn = (turn + 1) % len(buffers)
            try:
                loaded = self.load(stream, unit, rows, mv, event, clock)
            except BaseException as e:  # a device failure: fatal for the whole backend
                self.fail_fatal(e, unit)
                pending = self.settle(pending, clock)
                continue
            # The previous unit's copy had all of this unit's file IO to finish in;
            # its buffer is the one the next unit reads into, so wait for it now.
            self.settle(pending, clock)
            pending = loaded

    def settle(self, p: Optional[_Pending], clock: StageClock) -> None:
        """Wait for a load's device copy, if it has one, then end its unit."""
        if p is None:
            return None
        if p.event is not None:
            try:
                # Mostly done by now (it had this thread's next unit of file IO to run in);
                # query() keeps the GIL, synchronize() gives it up and waits for it.
                if not p.event.query():
                    p.event.synchronize()
            except BaseException as e:
                self.end_copy()
                self.fail_fatal(e, p.unit)
                return None
            self.end_copy()
            clock.lap("device")
        self.finish(p.unit, p.status, p.err, None)
        return None

    def enter_copy(self, rows: int) -> bool:
        """Count a write of ``rows`` blocks as running (shutdown waits for it), unless shutdown
        began: a job it ended as failed must not get its blocks written afterwards."""
        engine = self.engine
        with engine.copy_cond:
            if self.run.closing:  # released from a hang after shutdown: the blocks are not ours
                return False
            engine.copies += 1
            return True

    def end_copy(self) -> None:
        """A load's device copy is over (done or failed): shutdown may be waiting for it."""
        engine = self.engine
        with engine.copy_cond:
            engine.copies -= 1
            engine.copy_cond.notify_all()

    def file_call(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return self.run.osc.preadv(fd, buffers, offset)

    def load(self, stream: Any, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], event: Any,
             clock: StageClock) -> _Pending:
        """Read and open a unit, then start its copy to the device."""
        run, n = self.run, len(unit.slots)
        status, err = outcome_arrays(n)
        # Slots never stored, or whose store failed, are errors without any IO.
        status[~unit.records.valid] = SKIP
        if run.host_blocks is not None:
            # Host blocks: reading and opening into them is this unit's copy, so it is
            # checked against shutdown first and waited for by it.
            if (status == SKIP).all():
                return _Pending(unit, status, err)
            if not self.enter_copy(n):
                status[status == OK] = CANCELLED
                return _Pending(unit, status, err)
            try:
                self.read_and_open(unit, status, err, mv, clock)
                return _Pending(unit, status, err)
            finally:
                self.end_copy()
        # Device blocks: read and open in staging, then one copy of the good rows.
        self.read_and_open(unit, status, err, mv, clock)
        good = np.flatnonzero(status == OK).tolist()
        p = _Pending(unit, status, err, good)
        if not good:
            return p
        if not self.enter_copy(len(good)):
            status[good] = CANCELLED
            return p
        ids = [unit.block_ids[j] for j in good]
        # Not waited for here: loop() settles it before these staging rows are read into
        # again (vLLM's trailing-drain fix, one unit later). Launched inside the gate:
        # not once shutdown ended the job.
        gate = self.engine.gate
        if not gate.enter():
            status[good] = CANCELLED
            self.end_copy()
            return p
        try:
            p.event = run.dev.copy_to_device(stream, run.layout, rows, good, ids, event)
        except BaseException:
            self.end_copy()
            raise
        finally:
            gate.leave()
        clock.lap("device")
        return p

    def read_and_open(self, unit: Unit, status: np.ndarray, err: np.ndarray, mv: Optional[memoryview],
                      clock: StageClock) -> None:
        """Read each run of the unit's slots (leaving out those already failed) and open each
        slot where its payload goes: in place in staging (device blocks), from staging into
        its host block, or, on a direct lane, in its host block, where it was read.

        Once shutdown began, nothing more is read or written into the caller's memory: the
        rows not delivered yet end as cancelled."""
        run = self.run
        blocks = None if run.host_blocks is None else self.blocks(unit)
        span = self.span(unit, mv)
        gate = self.engine.gate
        skip = set(np.flatnonzero(status != OK).tolist())
        for j0, j1 in units_of(unit.local, skip=skip):
            if gate.closing:  # shutdown began: no new file call
                self.cancel_from(status, j0)
                return
            bad = self.transfer(span, unit, j0, j1, status, err)
            clock.lap("io")
            if not gate.enter():  # back from a hang after shutdown ended the job: nothing written
                self.cancel_from(status, j0)
                return
            try:
                if self.direct:
                    for j in bad:  # a failed or short read may have written part of the block
                        zero(blocks[j])
                # Opened right after its read, while the rows are still hot in the cache.
                self.open_rows(unit, range(j0, j1), bad, status, None if self.direct else mv, blocks)
            finally:
                gate.leave()
            clock.lap("seal")

    @staticmethod
    def cancel_from(status: np.ndarray, j: int) -> None:
        """Rows from ``j`` not failed already: not delivered, shutdown began."""
        rest = status[j:]
        rest[rest == OK] = CANCELLED

    def open_rows(self, unit: Unit, rows: range, skip: set[int], status: np.ndarray, mv: Optional[memoryview],
                  blocks: Optional[list[memoryview]]) -> None:
        """Open the slots of ``rows``: read into staging ``mv`` (opened in place, or into
        ``blocks`` where given), or, with no staging, read straight into ``blocks``."""
        run, f = self.run, self.file
        payload = run.layout.block_bytes
        for j in rows:
            if j in skip:
                continue
            record = unit.records.record(j)
            if mv is None:
                ok = run.seal.open_block(unit.slots[j], blocks[j], record)
            else:
                ok = run.seal.open(unit.slots[j], mv[j * f.slot_bytes :], payload, record,
                                   None if blocks is None else blocks[j])
            if not ok:
                status[j] = INTEGRITY
