"""O_DIRECT padding carries no process memory to disk: freed heap memory full of a marker
is planted where the staging buffers will be allocated, then the padding of every
slot written is read back from the file and must be all zeros (class 2 of issue 13:
staging came from torch.empty, and the marker came back from the padding)."""

from __future__ import annotations

import pytest
import torch

from faults import Tamper, make_caches
from kvoffload import DiskBackend
from kvoffload.slot_seal import TAG_BYTES

pytestmark = pytest.mark.faults

TENSORS = [576 * 2, 3072]  # 4224 B a block: 3968 B of padding per 8192 B slot
SLOT = 8192
NBLOCKS = 6
MARKER = b"PLANTED-HEAP-KV!"


def plant_freed_memory(rows: int) -> None:
    """Free many buffers full of MARKER of the sizes the staging allocations ask for, so
    the allocator hands exactly that memory out again."""
    fill = torch.frombuffer(bytearray(MARKER * 4096), dtype=torch.uint8)
    planted = []
    for size in (rows * SLOT + 4096, rows * SLOT + TAG_BYTES + 4096):
        for _ in range(64):
            t = torch.empty(size, dtype=torch.uint8)
            t.copy_(fill[:size] if size <= fill.numel() else fill.repeat(size // fill.numel() + 1)[:size])
            planted.append(t)
    del planted


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("encrypt,checksums", [(True, True), (False, True), (False, False)],
                         ids=["aes-gcm", "xxh3", "off"])
def test_padding_on_disk_is_zeros(fd_guard, cache_dir, encrypt, checksums, rows):
    caches = make_caches("cpu", NBLOCKS, TENSORS, seed=9)
    payload = sum(TENSORS)
    plant_freed_memory(rows)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(cache_dir / "kv.bin"), NBLOCKS, payload, encrypt=encrypt,
           checksums=checksums, io_threads=1, io_unit_bytes=rows * SLOT, report_load_errors=True,
           capacity_bytes=NBLOCKS * SLOT)
    try:
        f = b.files[0]
        assert f.slot_bytes == SLOT
        ev: list = []
        b.launch_copy(list(range(NBLOCKS)), list(range(NBLOCKS)), True, 0, ev)
        assert ev[0][1].wait(10) and ev[0][1].ok
        raw = Tamper(f.fd).read(0, f.size)
        for s in range(NBLOCKS):
            pad = raw[s * SLOT + payload : (s + 1) * SLOT]
            assert MARKER not in pad, f"slot {s}: planted heap memory written to disk in the padding"
            assert pad == bytes(len(pad)), f"slot {s}: padding is not zeros"
    finally:
        b.shutdown()
