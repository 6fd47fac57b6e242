"""The per-slot figures ``budget.check`` charges are at least what the state really takes.

``DiskBackend.init`` and ``SlotTier`` refuse a capacity whose per-slot state would not fit
host memory (tests/test_init_checks.py); these keep the figures honest: each is measured
with tracemalloc on a full pool and must cover it, without being far above it.
"""

from __future__ import annotations

import tracemalloc

import pytest

from kvoffload.budget import POOL_SLOT_BYTES, RECORD_BYTES, file_slots
from kvoffload.slot_pool import SlotPool
from kvoffload.slot_records import Records
from kvoffload.slot_seal import make_seal

ROW = 8192


@pytest.mark.parametrize("seal", list(RECORD_BYTES))
def test_record_bytes_cover_a_full_pool_of_records(seal):
    # The records are arrays made whole at init: what a full pool holds is what init allots,
    # whatever the seal's records are, and a record sealed fits its row.
    n = 200_000
    tracemalloc.start()
    try:
        records = Records.empty(n, seal)
        per_slot = tracemalloc.get_traced_memory()[0] / n
    finally:
        tracemalloc.stop()
    assert per_slot <= RECORD_BYTES[seal] + 1 and RECORD_BYTES[seal] <= per_slot * 1.25, per_slot
    s = make_seal(seal == "aes-gcm", seal == "xxh3")
    row = memoryview(bytearray(ROW + 16))
    rec = s.seal(7, row, ROW)
    records.set_record(7, rec)
    assert records.record(7) == rec


@pytest.mark.parametrize("n", [20_000, 175_000], ids=["dicts-after-growth", "dicts-before-growth"])
def test_pool_slot_bytes_cover_a_pool_with_every_slot_cached(n):
    keys = [i.to_bytes(32, "little") for i in range(n)]  # made before counting: the caller's objects
    tracemalloc.start()
    try:
        pool = SlotPool(n)
        for k in range(0, n, 100):
            placed = pool.prepare_store(keys[k:k + 100])
            pool.complete_store([key for key, _ in placed], True)
        per_slot = tracemalloc.get_traced_memory()[0] / n
    finally:
        tracemalloc.stop()
    assert pool.num_cached() == n
    assert per_slot <= POOL_SLOT_BYTES <= per_slot * 2, per_slot


@pytest.mark.parametrize("num_slots,num_files", [(1, 1), (7, 3), (8, 4), (9, 2), (10**30, 3)])
def test_file_slots_is_the_striping_rule(num_slots, num_files):
    counts = [file_slots(num_slots, num_files, i) for i in range(num_files)]
    assert sum(counts) == num_slots
    if num_slots < 100:
        assert counts == [len(range(i, num_slots, num_files)) for i in range(num_files)]
