"""The load path: ``preadv`` from the slot file -> opened (decrypted or verified) -> device blocks.

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
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvoffload import native_io
from kvoffload.run import Lane, StageClock, Unit, units_of
from kvoffload.slot_seal import zero


@dataclass
class _Pending:
    """A unit read and opened, whose device copy is running (``event``), or prepared and
    not launched yet (``copy``: the next unit's native call launches it), or that has none."""

    unit: Unit
    failed: set[int]
    good: list[int] = field(default_factory=list)  # the rows its copy moves
    event: Any = None
    copy: Any = None


class LoadLane(Lane):
    direction = "load"
    buffers_per_thread = 2

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        run = self.run
        buffers = views or [(None, None, None)]  # a direct lane reads into the blocks: no staging
        turn = 0
        pending: Optional[_Pending] = None
        left: Optional[Unit] = None  # taken by gather() but not in its batch
        stop = False  # gather() took this thread's stop sentinel
        while True:
            if left is not None:
                unit, left = left, None
            elif stop:
                unit = None
            elif pending is None:
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
            unit, left, stop = self.gather(unit)
            if self.refuse_if_closing(unit):
                continue
            rows, mv, event = buffers[turn]
            turn = (turn + 1) % len(buffers)
            try:
                loaded = self.load(stream, unit, rows, mv, event, clock, pending)
            except BaseException as e:  # a device failure: fatal for the whole backend
                run.fail_fatal(e, self, unit)
                pending = self.settle(pending, clock)
                continue
            # The previous unit's copy had all of this unit's file IO to finish in;
            # its buffer is the one the next unit reads into, so wait for it now.
            self.settle(pending, clock)
            pending = loaded

    def settle(self, p: Optional[_Pending], clock: StageClock) -> None:
        """Launch a load's device copy if that is still to do, wait for it, then finish its unit."""
        if p is None:
            return None
        try:
            if p.copy is not None:  # no native call came to launch it
                copy = self.take_copy(p)
                if copy is not None:
                    self.launch_prepared(p, copy)
            if p.event is not None:
                try:
                    # Mostly done by now (it had this thread's next unit of file IO to run
                    # in); query() keeps the GIL, synchronize() gives it up and waits for it.
                    if not p.event.query():
                        p.event.synchronize()
                finally:
                    self.end_copy()
                    clock.lap("device")
        except BaseException as e:
            self.run.fail_fatal(e, self, p.unit)
            return None
        self.finish(p.unit, p.failed)
        return None

    def take_copy(self, p: Optional[_Pending]) -> Any:
        """``p``'s prepared copy, counted in as running (``p.event`` set), to launch now; None
        where there is none, or shutdown began (its rows then fail: the blocks are not ours)."""
        if p is None or p.copy is None:
            return None
        copy, p.copy = p.copy, None
        if not self.begin_copy(p):
            return None
        p.event = copy.event
        return copy

    def launch_prepared(self, p: _Pending, copy: Any) -> None:
        """Make ``p``'s prepared copy (counted in as running) and wait for it, in one native
        call inside shutdown's gate: the thread gives the GIL up once for both."""
        rc = self.run.native.lib.kvo_copy_gated(copy.c, self.run.gate.ptr)
        if rc == -1:  # shutdown ended its job meanwhile
            self.run.metrics.failed(False, "closing", len(p.good))
            self.copy_not_made(p)
        elif rc != 0:
            self.copy_not_made(p)
            raise native_io.DeviceCopyError(f"kvoffload: a load's device copy failed: CUresult {rc}")

    def launch_copy(self, p: _Pending, launch: Any) -> None:
        """Launch ``p``'s device copy from Python (counted in as running), unless shutdown
        ended its job meanwhile (the gate); ``p.event`` becomes what ``launch()`` returns."""
        if not self.run.gate.enter():
            self.run.metrics.failed(False, "closing", len(p.good))
            self.copy_not_made(p)
            return
        try:
            p.event = launch()
        except BaseException:
            self.copy_not_made(p)
            raise
        finally:
            self.run.gate.leave()

    def copy_not_made(self, p: _Pending) -> None:
        """A counted-in copy failed to launch: nothing runs, and its rows fail."""
        p.event = None
        p.failed = set(range(len(p.unit.slots)))
        self.end_copy()

    def begin_copy(self, p: _Pending) -> bool:
        """``enter_copy`` for ``p``'s copy; where shutdown began, all its rows fail."""
        if self.enter_copy(len(p.good)):
            return True
        p.failed = set(range(len(p.unit.slots)))
        return False

    def enter_copy(self, rows: int) -> bool:
        """Count a write of ``rows`` blocks as running (shutdown waits for it), unless shutdown
        began (those rows then count as failed by it): a job it ended as failed must not get
        its blocks written afterwards."""
        run = self.run
        with run.copy_cond:
            if run.closing:  # released from a hang after shutdown: the blocks are not ours
                run.metrics.failed(False, "closing", rows)
                return False
            run.copies += 1
            return True

    def file_call(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return self.run.osc.preadv(fd, buffers, offset)

    def load(self, stream: Any, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], event: Any,
             clock: StageClock, prev: Optional[_Pending] = None) -> _Pending:
        """Read and open a unit, then start (or prepare) its copy to the device. ``prev``'s
        prepared copy is launched by this unit's native call, before its IO."""
        run, n = self.run, len(unit.slots)
        # Taken before the IO: a store that rewrote a slot meanwhile fails its check.
        records = [run.records[s] for s in unit.slots]
        # Slots never stored, or whose store failed, are errors without any IO.
        skip = {j for j, r in enumerate(records) if r is None}
        run.metrics.failed(False, "not_stored", len(skip))
        if run.host_blocks is not None:
            # Host blocks: reading and opening into them is this unit's copy, so it is
            # checked against shutdown first and waited for by it.
            if len(skip) == n:
                return _Pending(unit, skip)
            if not self.enter_copy(n - len(skip)):
                return _Pending(unit, set(range(n)))
            try:
                return _Pending(unit, self.read_and_open(unit, records, skip, rows, mv, None, clock))
            finally:
                self.end_copy()
        # Device blocks: read and open in staging, then one copy of the good rows.
        first = self.take_copy(prev) if run.native is not None else None
        try:
            failed = self.read_and_open(unit, records, skip, rows, mv, first, clock)
        except native_io.DeviceCopyError:
            if first is not None:
                self.copy_not_made(prev)
            raise
        if first is not None and self.unit_call().unit.copy_refused:  # shutdown ended its job
            run.metrics.failed(False, "closing", len(prev.good))
            self.copy_not_made(prev)
        good = [j for j in range(n) if j not in failed]
        p = _Pending(unit, failed, good)
        if not good:
            return p
        ids = [unit.block_ids[j] for j in good]
        if run.native is not None:
            # Launched by the next unit's native call (or settle(), if none comes first),
            # so this thread gives the GIL up once per unit.
            p.copy = run.dev.native_copy(stream, run.layout, ids, rows, good, False, None, event)
            if p.copy is not None:
                return p
        if self.begin_copy(p):
            # Not waited for here: loop() settles it before these staging rows are read
            # into again (vLLM's trailing-drain fix, one unit later).
            self.launch_copy(p, lambda: run.dev.copy_to_device(stream, run.layout, rows, good, ids, event))
            clock.lap("device")
        return p

    def read_and_open(self, unit: Unit, records: list[Any], skip: set[int], rows: Optional[torch.Tensor],
                      mv: Optional[memoryview], copy: Any, clock: StageClock) -> set[int]:
        """Read each run of the unit's slots (leaving out ``skip``) and open each slot where
        its payload goes: in place in staging (device blocks), from staging into its host
        block, or, on a direct lane, in its host block, where it was read. Returns the rows
        that failed (``skip`` included). ``copy`` (the previous unit's) is launched first.

        Once shutdown began, nothing more is read or written into the caller's memory: the
        rows not delivered yet count as failed by it."""
        run = self.run
        if run.native is not None:
            failed, read, bad = self.read_and_open_native(unit, records, skip, rows, mv, copy, clock)
        else:
            failed, read, bad = self.read_and_open_python(unit, records, skip, mv, clock)
        with run.lock:
            run.bytes_read += read * self.file.slot_bytes
        run.forget(self, unit, bad, records)
        return failed

    def read_and_open_native(self, unit: Unit, records: list[Any], skip: set[int], rows: Optional[torch.Tensor],
                             mv: Optional[memoryview], copy: Any, clock: StageClock) -> tuple[set[int], int, set[int]]:
        """The unit in one GIL-free call (``native/load_unit.c``); (failed rows, rows read whole,
        rows that failed their check)."""
        run, n = self.run, len(unit.slots)
        lib = run.native.lib
        call = self.unit_call()
        blocks = None if run.host_blocks is None else self.block_addrs(unit)
        bufs = blocks if self.direct else self.staging_addrs(rows, n)
        idents = None
        if run.pool is not None:  # a persistent pool's seal: each slot's identity in its record
            idents = [r[2] if r is not None else bytes(run.seal.ident_bytes) for r in records]
        self.fill(call, unit, bufs, bufs if blocks is None else blocks, idents)
        call.status[list(skip)] = lib.KVO_SKIP
        if run.gcm_key:
            live = [j for j in range(n) if j not in skip]
            call.nonce[live] = run.seal.nonce_array([records[j][0] for j in live])
            call.tag[live] = np.frombuffer(b"".join(records[j][1] for j in live), np.uint8).reshape(-1, 16)
        self.call_native(call, unit, None if copy is None else copy.c, self.span(unit, mv), clock)
        status = call.status[:n]
        read = int(((status == lib.KVO_OK) | (status == lib.KVO_INTEGRITY)).sum())
        return skip | self.native_failures(call, unit), read, set(np.flatnonzero(status == lib.KVO_INTEGRITY).tolist())

    def read_and_open_python(self, unit: Unit, records: list[Any], skip: set[int], mv: Optional[memoryview],
                             clock: StageClock) -> tuple[set[int], int, set[int]]:
        """``read_and_open_native``'s calls and outcomes, slot by slot in Python."""
        run, n = self.run, len(unit.slots)
        blocks = None if run.host_blocks is None else self.blocks(unit)
        span = self.span(unit, mv)
        failed, read, checks = set(skip), 0, set()
        gate = run.gate
        for j0, j1 in units_of(unit.local, skip=skip):
            if gate.closing:  # shutdown began: no new file call
                return self.cancel_rows(range(j0, n), failed), read, checks
            bad = self.transfer(span, unit, j0, j1)
            clock.lap("io")
            if not gate.enter():  # back from a hang after shutdown ended the job: nothing written
                return self.cancel_rows(range(j0, n), failed | bad), read, checks
            try:
                if self.direct:
                    for j in bad:  # a failed or short read may have written part of the block
                        zero(blocks[j])
                failed |= bad
                read += j1 - j0 - len(bad)
                # Opened right after its read, while the rows are still hot in the cache.
                opened = self.open_rows(unit, range(j0, j1), bad, records, None if self.direct else mv, blocks)
                failed |= opened
                checks |= opened
            finally:
                gate.leave()
            clock.lap("seal")
        return failed, read, checks

    def cancel_rows(self, rows: Iterable[int], failed: set[int]) -> set[int]:
        """Rows not delivered because shutdown began (``failed`` ones aside): they fail, as "closing"."""
        cancelled = {j for j in rows if j not in failed}
        self.run.metrics.failed(False, "closing", len(cancelled))
        return failed | cancelled

    def open_rows(self, unit: Unit, rows: Iterable[int], skip: set[int], records: list[Any],
                  mv: Optional[memoryview], blocks: Optional[list[memoryview]]) -> set[int]:
        """Open the slots of ``rows``: read into staging ``mv`` (opened in place, or into
        ``blocks`` where given), or, with no staging, read straight into ``blocks``.
        Returns the rows that failed their check."""
        run, f = self.run, self.file
        payload = run.layout.block_bytes
        failed = set()
        for j in rows:
            if j in skip:
                continue
            if mv is None:
                ok = run.seal.open_block(unit.slots[j], blocks[j], records[j])
            else:
                ok = run.seal.open(unit.slots[j], mv[j * f.slot_bytes :], payload, records[j],
                                   None if blocks is None else blocks[j])
            if not ok:
                failed.add(j)
        run.metrics.failed(False, "integrity", len(failed))
        if failed:
            self.log_integrity([unit.slots[j] for j in sorted(failed)])
        return failed

    def end_copy(self) -> None:
        """A load's device copy is over (done or failed): shutdown may be waiting for it."""
        run = self.run
        with run.copy_cond:
            run.copies -= 1
            run.copy_cond.notify_all()
