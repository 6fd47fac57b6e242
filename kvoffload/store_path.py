"""The store path: device blocks -> pinned staging -> sealed -> ``pwritev`` into the slot file.

A store thread takes one unit (a few blocks of one job), copies the blocks into its
staging rows in one batched device copy ordered after ``wait_event`` (compute must
have finished writing the KV, vLLM #45704), waits for it, seals each slot (encrypts
or checksums it) and writes each run of consecutive file slots with one ``pwritev``.
Blocks in host memory (``HostDevice``) skip the copy: each is sealed straight from
the block into its staging row. A direct lane (aligned host blocks under O_DIRECT,
and a seal whose disk form is the payload) writes straight from the blocks. A store
never changes a block (vLLM may be reading it), so AES-GCM always seals into
staging. A slot's record is published only once its write succeeded whole.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvoffload.run import Lane, Run, StageClock, Unit, units_of
from kvoffload.slot_file import SlotFile


class StoreLane(Lane):
    direction = "store"
    buffers_per_thread = 1

    def __init__(self, run: Run, file: SlotFile, stream: Any, rows: int) -> None:
        super().__init__(run, file, stream, rows)
        # Only a disk form that is the payload itself can be written from the block:
        # ciphertext is a copy, since the block must not change.
        self.direct = self.direct and run.seal.disk_form_is_payload

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        run = self.run
        rows, mv, event = (views or [(None, None, None)])[0]  # a direct lane has no staging
        left: Optional[Unit] = None  # taken by gather() but not in its batch
        stop = False  # gather() took this thread's stop sentinel
        while True:
            if left is not None:
                unit, left = left, None
            else:
                unit = None if stop else self.queue.get()
            clock.lap("wait")
            if unit is None:
                return
            unit, left, stop = self.gather(unit)
            if self.refuse_if_closing(unit):
                continue
            try:
                failed = self.store(stream, unit, rows, mv, event, clock)
            except BaseException as e:  # a device failure: fatal for the whole backend
                run.fail_fatal(e, self, unit)
                continue
            self.finish(unit, failed)

    def file_call(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return self.run.osc.pwritev(fd, buffers, offset)

    def store(self, stream: Any, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], event: Any,
              clock: StageClock) -> set[int]:
        run, f = self.run, self.file
        n = len(unit.block_ids)
        copy = None
        if run.host_blocks is None:
            # pwritev reads staging from the CPU side: the device copy must be done first.
            # With the native core the unit's call makes it and waits for it itself, so the
            # thread gives the GIL up once per unit (cuda_driver.py says why that matters).
            if run.native is not None:
                copy = run.dev.native_copy(stream, run.layout, unit.block_ids, rows, range(n), True,
                                           unit.wait_event, event)
            if copy is None:
                run.dev.copy_to_host(stream, run.layout, unit.block_ids, rows, range(n), unit.wait_event,
                                     event).synchronize()
        elif unit.wait_event is not None:
            unit.wait_event.synchronize()  # the seal reads the blocks: their writer must be done
        clock.lap("device")
        if run.native is not None:
            records, failed = self.store_native(unit, rows, mv, copy, clock)
        else:
            records, failed = self.store_python(unit, mv, clock)
        applied = run.publish(unit, records, failed)
        with run.lock:
            run.bytes_written += (n - len(failed)) * f.slot_bytes
        # After the data write returned: a crash in between leaves the old record, whose
        # check the new bytes fail (one recompute after a restart, never wrong KV).
        run.write_index(self, unit, applied)
        clock.lap("io")
        return failed

    def store_native(self, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], copy: Any,
                     clock: StageClock) -> tuple[list[Any], set[int]]:
        """Seal and write the whole unit in one GIL-free call (``native/store_unit.c``),
        which first makes ``copy`` (the device blocks into staging) where given."""
        run, n = self.run, len(unit.slots)
        call = self.unit_call()
        blocks = None if run.host_blocks is None else self.block_addrs(unit)
        bufs = blocks if self.direct else self.staging_addrs(rows, n)
        self.fill(call, unit, bufs, bufs if blocks is None else blocks, unit.idents)
        if run.gcm_key:
            first = run.seal.reserve_nonces(n)
            call.nonce[:n] = run.seal.nonce_array(range(first, first + n))
        self.call_native(call, unit, None if copy is None else copy.c, self.span(unit, mv), clock)
        if not run.gcm_key:
            records: list[Any] = [True] * n
        elif unit.idents is None:
            records = [(first + j, call.tag[j].tobytes()) for j in range(n)]
        else:
            records = [(first + j, call.tag[j].tobytes(), unit.idents[j]) for j in range(n)]
        return records, self.native_failures(call, unit)

    def store_python(self, unit: Unit, mv: Optional[memoryview], clock: StageClock) -> tuple[list[Any], set[int]]:
        """Seal each run of consecutive file slots, then write it, slot by slot in Python."""
        run, f = self.run, self.file
        n = len(unit.block_ids)
        payload = run.layout.block_bytes
        records: list[Any] = [None] * n
        failed: set[int] = set()
        blocks = None if run.host_blocks is None else self.blocks(unit)
        span = self.span(unit, mv)
        idents = unit.idents or [b""] * n
        for j0, j1 in units_of(unit.local):
            # Sealed right before its write, while the rows are still hot in the cache.
            for j in range(j0, j1):
                if self.direct:  # the disk form is the block itself: seal only reads it
                    records[j] = run.seal.seal(unit.slots[j], blocks[j], payload, ident=idents[j])
                else:
                    src = None if blocks is None else blocks[j]
                    records[j] = run.seal.seal(unit.slots[j], mv[j * f.slot_bytes :], payload, src, idents[j])
            clock.lap("seal")
            failed |= self.transfer(span, unit, j0, j1)
            clock.lap("io")
        return records, failed
