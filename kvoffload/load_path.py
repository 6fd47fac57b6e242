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

import torch

from kvoffload import unit_io
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
                    try:
                        copy.launch()
                    except BaseException:
                        self.copy_not_made(p)
                        raise
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

    def load(self, stream: Any, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], event: Any,
             clock: StageClock, prev: Optional[_Pending] = None) -> _Pending:
        """Read and open a unit, then start (or prepare) its copy to the device. ``prev``'s
        prepared copy is launched by this unit's native call, before its IO."""
        run, f = self.run, self.file
        # Taken before the IO: a store that rewrote a slot meanwhile fails its check.
        records = [run.records[s] for s in unit.slots]
        # Slots never stored, or whose store failed, are errors without any IO.
        failed = {j for j, r in enumerate(records) if r is None}
        run.metrics.failed(False, "not_stored", len(failed))
        if self.direct and self.native is not None:
            return _Pending(unit, self.load_native_into_blocks(unit, records, failed, None, clock))
        if self.direct:
            return _Pending(unit, self.load_into_blocks(unit, records, failed, clock))
        host = run.host_blocks
        if self.native is not None and host is not None:
            # One call reads, opens and writes the host blocks: it is this unit's copy.
            return _Pending(unit, self.load_native_into_blocks(unit, records, failed, rows, clock))
        read = 0
        if self.native is not None:  # staging, opened in place, then the device copy
            js = [j for j in range(len(unit.slots)) if j not in failed]
            addrs = self.staging_addrs(rows, js)
            first = self.take_copy(prev)
            try:
                bad, read = self.native.load(unit, js, records, addrs, addrs, first)
            except unit_io.DeviceCopyError:
                if first is not None:
                    self.copy_not_made(prev)
                raise
            failed |= bad
            clock.lap("io")
        else:
            span = self.span(mv, None)
            for j0, j1 in units_of(unit.local, skip=failed):
                bad = self.transfer(span, unit, j0, j1)
                clock.lap("io")
                failed |= bad
                read += j1 - j0 - len(bad)
                if host is None:
                    # Opened right after its read, while the rows are still hot in the cache.
                    failed |= self.open_rows(unit, range(j0, j1), bad, records, mv, None)
                    clock.lap("seal")
        with run.lock:
            run.bytes_read += read * f.slot_bytes
        good = [j for j in range(len(unit.slots)) if j not in failed]
        p = _Pending(unit, failed, good)
        if not good:
            return p
        if host is None:
            ids = [unit.block_ids[j] for j in good]
            if self.native is not None and hasattr(run.dev, "native_copy"):
                # Launched by the next unit's native call (or settle(), if none comes
                # first), so this thread takes the GIL once per unit.
                p.copy = run.dev.native_copy(stream, run.layout, ids, rows, good, False, None, event)
                if p.copy is not None:
                    return p
            if self.begin_copy(p):
                try:
                    # Not waited for here: loop() settles it before these staging rows are
                    # read into again (vLLM's trailing-drain fix, one unit later).
                    p.event = run.dev.copy_to_device(stream, run.layout, rows, good, ids, event)
                except BaseException:
                    self.copy_not_made(p)
                    raise
                clock.lap("device")
            return p
        # Host blocks: opening each slot into its block is this unit's copy.
        if not self.begin_copy(p):
            return p
        try:
            p.failed |= self.open_rows(unit, good, set(), records, mv, self.blocks(unit))
            clock.lap("seal")
        finally:
            self.end_copy()
        return p

    def load_native_into_blocks(self, unit: Unit, records: list[Any], failed: set[int],
                                rows: Optional[torch.Tensor], clock: StageClock) -> set[int]:
        """Host blocks through ``unit_io``: read into staging ``rows`` and open into the
        blocks, or, on a direct lane (no ``rows``), read into the blocks and open them
        there; one GIL-free call. Returns the rows that failed; their blocks end zeroed.

        The call writes the blocks, so it counts as the unit's device copy: checked
        against ``closing`` first, waited for by shutdown.
        """
        run = self.run
        js = [j for j in range(len(unit.slots)) if j not in failed]
        if not js:
            return failed
        if not self.enter_copy(len(js)):
            return set(range(len(unit.slots)))
        try:
            blocks = self.block_addrs(unit, js)
            bad, read = self.native.load(unit, js, records, blocks if rows is None else self.staging_addrs(rows, js),
                                         blocks)
            clock.lap("io")
            if run.closing:
                # Released from a hang once shutdown had begun (maybe after it ended the
                # job as failed): what the late call wrote is not kept.
                for b in self.blocks(unit):
                    zero(b)
                return set(range(len(unit.slots)))
        finally:
            self.end_copy()
        with run.lock:
            run.bytes_read += read * self.file.slot_bytes
        return failed | bad

    def load_into_blocks(self, unit: Unit, records: list[Any], failed: set[int], clock: StageClock) -> set[int]:
        """A direct lane's unit: read each run of valid slots straight into their blocks and
        open them there; returns the rows that failed.

        The reads write the blocks, so they count as the unit's device copy: checked
        against ``closing`` first, waited for by shutdown. Every block read into ends
        verified or zeroed.
        """
        run = self.run
        blocks = self.blocks(unit)
        span = self.span(None, blocks)
        if not self.enter_copy(len(unit.slots) - len(failed)):
            return set(range(len(unit.slots)))
        read = 0
        try:
            for j0, j1 in units_of(unit.local, skip=failed):
                bad = self.transfer(span, unit, j0, j1)
                clock.lap("io")
                if run.closing:
                    # Released from a hang once shutdown had begun (maybe after it ended the
                    # job as failed): no check runs on what the late read wrote.
                    for j in range(j0, j1):
                        zero(blocks[j])
                    return set(range(len(unit.slots)))
                for j in bad:  # a failed or short read may have written part of the block
                    zero(blocks[j])
                failed |= bad
                read += j1 - j0 - len(bad)
                # Opened right after its read, while the block is still hot in the cache.
                failed |= self.open_rows(unit, range(j0, j1), bad, records, None, blocks)
                clock.lap("seal")
        finally:
            self.end_copy()
        with run.lock:
            run.bytes_read += read * self.file.slot_bytes
        return failed

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
                run.log.warning("integrity", "kvoffload: slot %d of %s failed its %s check",
                                unit.slots[j], f.path, run.seal.name)
                failed.add(j)
        run.metrics.failed(False, "integrity", len(failed))
        return failed

    def end_copy(self) -> None:
        """A load's device copy is over (done or failed): shutdown may be waiting for it."""
        run = self.run
        with run.copy_cond:
            run.copies -= 1
            run.copy_cond.notify_all()
