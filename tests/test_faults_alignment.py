"""Alignment gating on a real ext4 file: under O_DIRECT no misaligned buffer, offset or
length reaches the kernel, whatever the block size; the page cache takes any size."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest

from faults import FaultyOsCalls, KvChecker, make_caches
from kvoffload import DiskBackend
from kvoffload.slot_file import slot_bytes_for

pytestmark = pytest.mark.faults
NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
LAYOUTS = {
    "mla": [576 * 2],
    "odd": [4224],
    "hybrid": [3098112],  # vLLM #55424
    "mixed": [576 * 2, 3072, 100],
}


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


class AlignmentAudit(FaultyOsCalls):
    """Records every pwritev/preadv whose buffer address, offset or length is not a
    multiple of the slot file's alignment (known after init: ``align``)."""

    def __init__(self):
        super().__init__()
        self.align = None
        self.seen = 0
        self.bad: list[str] = []

    def _audit(self, call, fd, buffers, offset):
        a = self.align
        if a is None:
            return
        self.seen += 1
        if offset % a:
            self.bad.append(f"{call} offset {offset} % {a}")
        for b in buffers:
            if len(b) % a:
                self.bad.append(f"{call} length {len(b)} % {a}")
            if address(b) % a:
                self.bad.append(f"{call} buffer address {address(b):#x} % {a}")

    def pwritev(self, fd, buffers, offset):
        self._audit("pwritev", fd, buffers, offset)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd, buffers, offset):
        self._audit("preadv", fd, buffers, offset)
        return super().preadv(fd, buffers, offset)


def round_trip(b, caches, nslots):
    nblocks = next(iter(caches.values())).shape[0]
    ck = KvChecker(b, caches, None, nslots)
    ck.attach()
    # Scattered and contiguous slots, reversed order: several run shapes per unit.
    ck.store(list(range(nblocks)), [nslots - 1 - 2 * i for i in range(nblocks)])
    ck.store(list(range(nblocks)), list(range(nblocks)))
    ck.verify_all()
    assert ck.stats["store_fail"] == 0
    return ck


@NAMED
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_direct_io_never_sends_misaligned_io(fd_guard, ext4_dir, device, named, layout):
    nblocks = 2 if layout == "hybrid" else 4
    caches = make_caches(device, nblocks, LAYOUTS[layout], seed=31)
    osc = AlignmentAudit()
    b = DiskBackend()
    bb = sum(LAYOUTS[layout])
    b.init(caches, device, None, None, str(ext4_dir / "kv.bin"), 2 * nblocks, bb, named_file=named,
           io_threads=2, io_unit_bytes=3 << 20, os_calls=osc, report_load_errors=True,
           capacity_bytes=2 * nblocks * slot_bytes_for(bb, 4096, False))
    try:
        f = b.files[0]
        assert f.direct and f.alignment % 512 == 0 and f.slot_bytes % f.alignment == 0
        osc.align = f.alignment
        round_trip(b, caches, 2 * nblocks)
        assert osc.seen > 0 and osc.bad == [], osc.bad[:5]
    finally:
        b.shutdown()


@NAMED
@pytest.mark.parametrize("block", [577, 1000, 4224, 576 * 2, 3098112 + 1])
def test_page_cache_accepts_any_block_size(fd_guard, ext4_dir, device, named, block):
    nblocks = 2 if block > 1 << 20 else 4
    caches = make_caches(device, nblocks, [block], seed=32)
    osc = AlignmentAudit()
    b = DiskBackend()
    b.init(caches, device, None, None, str(ext4_dir / "kv.bin"), 2 * nblocks, block, named_file=named,
           use_page_cache=True, io_threads=2, io_unit_bytes=1 << 20, os_calls=osc, report_load_errors=True)
    try:
        f = b.files[0]
        assert not f.direct and f.slot_bytes == block  # no padding
        osc.align = 512
        round_trip(b, caches, 2 * nblocks)
        if block % 512:
            assert osc.bad, "odd sizes should produce unaligned IO, which the page cache accepts"
    finally:
        b.shutdown()


def test_the_kernel_really_rejects_misaligned_direct_io(ext4_dir):
    """Proves the gate matters here: on this ext4, misaligned O_DIRECT IO fails EINVAL."""
    fd = os.open(ext4_dir / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 1 << 16)
        page = mmap.mmap(-1, 8192)
        assert os.pwritev(fd, [memoryview(page)[:4096]], 4096) == 4096  # aligned: fine
        cases = {
            "offset": lambda: os.pwritev(fd, [memoryview(page)[:4096]], 100),
            "length": lambda: os.pwritev(fd, [memoryview(page)[:100]], 0),
            "address": lambda: os.pwritev(fd, [memoryview(page)[8:4104]], 0),
        }
        for what, call in cases.items():
            with pytest.raises(OSError) as e:
                call()
            assert e.value.errno == errno.EINVAL, what
    finally:
        os.close(fd)
        os.unlink(ext4_dir / "probe")
