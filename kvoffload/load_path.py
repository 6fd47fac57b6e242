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
from typing import Any, Optional

import torch

from kvoffload.run import Lane, StageClock, Unit, units_of
from kvoffload.slot_seal import zero

# A load whose device copy is running: (unit, failed rows, copy event or None).
_Pending = Optional[tuple[Unit, set[int], Any]]


class LoadLane(Lane):
    direction = "load"
    buffers_per_thread = 2

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        run = self.run
        buffers = views or [(None, None, None)]  # a direct lane reads into the blocks: no staging
        turn = 0
        pending: _Pending = None
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
                failed, ev = self.load(stream, unit, rows, mv, event, clock)
            except BaseException as e:  # a device failure: fatal for the whole backend
                run.fail_fatal(e, self, unit)
                pending = self.settle(pending, clock)
                continue
            # The previous unit's copy had all of this unit's file IO to finish in;
            # its buffer is the one the next unit reads into, so wait for it now.
            self.settle(pending, clock)
            pending = (unit, failed, ev)

    def settle(self, pending: _Pending, clock: StageClock) -> None:
        """Wait for a load's copy to the device, then finish its unit."""
        if pending is None:
            return None
        unit, failed, ev = pending
        if ev is not None:
            try:
                # Mostly done by now (it had this thread's next unit of file IO to run
                # in); query() keeps the GIL, synchronize() gives it up and waits for it.
                if not ev.query():
                    ev.synchronize()
            except BaseException as e:
                self.run.fail_fatal(e, self, unit)
                return None
            finally:
                self.end_copy()
                clock.lap("device")
        self.finish(unit, failed)
        return None

    def load(self, stream: Any, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], event: Any,
             clock: StageClock) -> tuple[set[int], Any]:
        """Read and open a unit, then start its copy to the device; returns (failed, copy event)."""
        run, f = self.run, self.file
        # Taken before the IO: a store that rewrote a slot meanwhile fails its check.
        records = [run.records[s] for s in unit.slots]
        # Slots never stored, or whose store failed, are errors without any IO.
        failed = {j for j, r in enumerate(records) if r is None}
        run.metrics.failed(False, "not_stored", len(failed))
        if self.direct and self.native is not None:
            return self.load_native_into_blocks(unit, records, failed, None, clock), None
        if self.direct:
            return self.load_into_blocks(unit, records, failed, clock), None
        host = run.host_blocks
        if self.native is not None and host is not None:
            # One call reads, opens and writes the host blocks: it is this unit's copy.
            return self.load_native_into_blocks(unit, records, failed, rows, clock), None
        read = 0
        if self.native is not None:  # staging, opened in place, then the device copy
            js = [j for j in range(len(unit.slots)) if j not in failed]
            addrs = self.staging_addrs(rows, js)
            bad, read = self.native.load(unit, js, records, addrs, addrs)
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
        if not good:
            return failed, None
        with run.copy_cond:
            if run.closing:  # released from a hang after shutdown: the blocks are not ours
                run.metrics.failed(False, "closing", len(good))
                return set(range(len(unit.slots))), None
            run.copies += 1
        try:
            if host is None:
                # Not waited for here: loop() settles it before these staging rows are
                # read into again (vLLM's trailing-drain fix, one unit later).
                ev = run.dev.copy_to_device(stream, run.layout, rows, good, [unit.block_ids[j] for j in good], event)
                clock.lap("device")
                return failed, ev
            # Host blocks: opening each slot into its block is this unit's copy.
            failed |= self.open_rows(unit, good, set(), records, mv, self.blocks(unit))
            clock.lap("seal")
        except BaseException:
            self.end_copy()
            raise
        self.end_copy()
        return failed, None

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
        with run.copy_cond:
            if run.closing:  # shutdown ended this job: its blocks are not ours to write
                run.metrics.failed(False, "closing", len(js))
                return set(range(len(unit.slots)))
            run.copies += 1
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
        with run.copy_cond:
            if run.closing:  # shutdown ended this job: its blocks are not ours to write
                return set(range(len(unit.slots)))
            run.copies += 1
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
