"""The Python engine's store: device blocks -> pinned staging -> sealed -> ``pwritev`` into the slot file.

A store thread takes one unit (a few blocks of one job), copies the blocks into its
staging rows in one batched device copy ordered after ``wait_event`` (compute must
have finished writing the KV, vLLM #45704), waits for it, seals each slot (encrypts
or checksums it) and writes each run of consecutive file slots with one ``pwritev``.
Blocks in host memory (``HostDevice``) skip the copy: each is sealed straight from
the block into its staging row. A direct lane (aligned host blocks under O_DIRECT,
and a seal whose disk form is the payload) writes straight from the blocks. A store
never changes a block (vLLM may be reading it), so AES-GCM always seals into
staging. A slot's record is published (``Run.settle``) only once its write succeeded
whole. The native engine's store is ``native_engine/store_unit.c``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from kvoffload.python_engine.lanes import Lane, StageClock, Unit, outcome_arrays, units_of
from kvoffload.slot_records import Records


class StoreLane(Lane):
    direction = "store"
    buffers_per_thread = 1

    def loop(self, stream: Any, views: list, clock: StageClock) -> None:
        rows, mv, event = (views or [(None, None, None)])[0]  # a direct lane has no staging
        while True:
            unit = self.queue.get()
            clock.lap("wait")
            if unit is None:
                return
            if self.refuse_if_closing(unit):
                continue
            try:
                status, err, made = self.store(stream, unit, rows, mv, event, clock)
            except BaseException as e:  # a device failure: fatal for the whole backend
                self.fail_fatal(e, unit)
                continue
            self.finish(unit, status, err, made)

    def file_call(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return self.run.osc.pwritev(fd, buffers, offset)

    def store(self, stream: Any, unit: Unit, rows: Optional[torch.Tensor], mv: Optional[memoryview], event: Any,
              clock: StageClock) -> tuple[np.ndarray, np.ndarray, Records]:
        """Copy, seal and write the unit: (status and errno per row, the records sealed)."""
        run, f = self.run, self.file
        n = len(unit.block_ids)
        if run.host_blocks is None:
            # pwritev reads staging from the CPU side: the device copy must be done first.
            run.dev.copy_to_host(stream, run.layout, unit.block_ids, rows, range(n), unit.wait_event,
                                 event).synchronize()
        elif unit.wait_event is not None:
            unit.wait_event.synchronize()  # the seal reads the blocks: their writer must be done
        clock.lap("device")
        status, err = outcome_arrays(n)
        payload = run.layout.block_bytes
        ident = unit.records.ident if unit.records is not None else np.zeros((n, 0), np.uint8)
        made = Records.empty(n, run.seal.name, ident.shape[1])
        made.ident[:] = ident
        blocks = None if run.host_blocks is None else self.blocks(unit)
        span = self.span(unit, mv)
        for j0, j1 in units_of(unit.local):
            # Sealed right before its write, while the rows are still hot in the cache.
            for j in range(j0, j1):
                idj = ident[j].tobytes()
                if self.direct:  # the disk form is the block itself: seal only reads it
                    rec = run.seal.seal(unit.slots[j], blocks[j], payload, ident=idj)
                else:
                    src = None if blocks is None else blocks[j]
                    rec = run.seal.seal(unit.slots[j], mv[j * f.slot_bytes :], payload, src, idj)
                made.set_record(j, rec)
            clock.lap("seal")
            self.transfer(span, unit, j0, j1, status, err)
            clock.lap("io")
        return status, err, made
