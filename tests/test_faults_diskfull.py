"""Disk full: too little space fails at init with a clear error; reserved space keeps
stores working when the file system fills up; a sparse file's real ENOSPC and real
short writes fail only those stores, never served.

Runs on a real 4 MiB tmpfs the test mounts (root); where mounting is not allowed,
the same checks run with injected ENOSPC, and the skip reason or output says which.
"""

from __future__ import annotations

import errno
import os

import pytest

from faults import Fault, FaultyOsCalls, KvChecker, assert_dir_clean, make_caches, wait_threads_gone
from kvoffload import DiskBackend
from kvoffload.slot_file import SlotFileError

pytestmark = pytest.mark.faults
NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
BLOCK = 64 << 10  # 64 KiB blocks: a 4 MiB file system holds ~60


class RoomyStatvfs(FaultyOsCalls):
    """Reports plenty of free space, so the real posix_fallocate meets the real ENOSPC."""

    def fstatvfs(self, fd):
        real = super().fstatvfs(fd)
        return os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, 1 << 40, 1 << 40) + tuple(real)[5:])


def start(d, named, slots, osc=None, nblocks=8):
    caches = make_caches("cpu", nblocks, [BLOCK], seed=11)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(d / "kv.bin"), slots, BLOCK, use_page_cache=True,
           named_file=named, io_threads=1, io_unit_bytes=BLOCK, os_calls=osc, report_load_errors=True)
    return b, caches


@pytest.fixture
def full_fs(small_fs):
    path, what = small_fs
    print(f"disk-full variant: {what}")
    if path is None:
        pytest.skip(f"no real small file system ({what}); the injected-ENOSPC tests cover this")
    return path


@NAMED
def test_too_little_space_fails_at_init(fd_guard, full_fs, named):
    with pytest.raises(SlotFileError, match=r"not enough space for the slot file of .*: need \d+ bytes, \d+ free") as e:
        start(full_fs, named, slots=100)  # 6.25 MiB on a 4 MiB file system
    assert e.value.errno == errno.ENOSPC
    wait_threads_gone()
    assert_dir_clean(full_fs)


@NAMED
def test_real_fallocate_enospc_fails_at_init(fd_guard, full_fs, named):
    """Past the free-space check (lied about), posix_fallocate itself hits ENOSPC: same clear error."""
    osc = RoomyStatvfs()
    with pytest.raises(SlotFileError, match="not enough space") as e:
        start(full_fs, named, slots=100, osc=osc)
    assert e.value.errno == errno.ENOSPC and osc.calls["fallocate"] == 1
    wait_threads_gone()
    assert_dir_clean(full_fs)
    assert os.statvfs(full_fs).f_bfree == os.statvfs(full_fs).f_blocks, "space of the failed file not freed"


@NAMED
def test_reserved_space_survives_a_full_file_system(fd_guard, full_fs, named):
    b, caches = start(full_fs, named, slots=16)  # 1 MiB reserved up front
    try:
        with open(full_fs / "filler", "wb") as f:  # fill the rest until the real ENOSPC
            with pytest.raises(OSError) as e:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            assert e.value.errno == errno.ENOSPC
        ck = KvChecker(b, caches, None, 16)
        ck.attach()
        ck.store(list(range(8)), list(range(8)))
        ck.store(list(range(8)), list(range(8, 16)))
        ck.verify_all()
        assert ck.stats["store_fail"] == 0, "a preallocated slot failed to store on a full disk"
    finally:
        b.shutdown()
        os.unlink(full_fs / "filler")
    assert_dir_clean(full_fs)


@NAMED
def test_sparse_file_real_enospc_fails_only_those_stores(fd_guard, full_fs, named):
    """fallocate unsupported (injected EOPNOTSUPP): the file is sparse, bigger than the
    file system, and the real ENOSPC or real short write shows up as failed stores."""
    osc = RoomyStatvfs()
    osc.fail_from("fallocate", 1, Fault.error(errno.EOPNOTSUPP))
    b, caches = start(full_fs, named, slots=96, osc=osc)  # 6 MiB sparse on 4 MiB
    try:
        assert osc.calls["ftruncate"] == 1
        ck = KvChecker(b, caches, osc, 96)
        ck.attach()
        ck.unjustified_ok = True  # the kernel's ENOSPC is not an injected fault
        results = []
        for s in range(0, 96, 8):
            op = ck.store(list(range(8)), list(range(s, s + 8)))
            ck.drain()
            results.append(op.event.ok)
        assert results[0] and not results[-1], f"expected early stores ok, late ones failed: {results}"
        ck.verify_all()  # failed (ENOSPC or short) slots are never served; the rest exact
    finally:
        b.shutdown()
    assert_dir_clean(full_fs)


# -- injected variant: runs everywhere ----------------------------------------------


class TinyStatvfs(FaultyOsCalls):
    def fstatvfs(self, fd):
        real = super().fstatvfs(fd)
        return os.statvfs_result((real.f_bsize, 4096, real.f_blocks, 10, 10) + tuple(real)[5:])


@NAMED
def test_injected_too_little_space_fails_at_init(fd_guard, cache_dir, named):
    with pytest.raises(SlotFileError, match=r"need \d+ bytes, 40960 free") as e:
        start(cache_dir, named, slots=8, osc=TinyStatvfs())
    assert e.value.errno == errno.ENOSPC
    assert_dir_clean(cache_dir)


@NAMED
def test_injected_fallocate_enospc_fails_at_init(fd_guard, cache_dir, named):
    osc = FaultyOsCalls()
    osc.fail_nth("fallocate", 1, Fault.error(errno.ENOSPC))
    with pytest.raises(SlotFileError, match="not enough space") as e:
        start(cache_dir, named, slots=8, osc=osc)
    assert e.value.errno == errno.ENOSPC
    wait_threads_gone()
    assert_dir_clean(cache_dir)


@NAMED
def test_injected_enospc_mid_run_fails_only_those_stores(fd_guard, cache_dir, named):
    osc = FaultyOsCalls()
    b, caches = start(cache_dir, named, slots=16, osc=osc)
    try:
        ck = KvChecker(b, caches, osc, 16)
        ck.attach()
        ck.store(list(range(8)), list(range(8)))
        ck.drain()
        osc.fail_from("pwritev", osc.calls["pwritev"] + 3, Fault.short(0.5))
        osc.fail_from("pwritev", osc.calls["pwritev"] + 5, Fault.error(errno.ENOSPC))
        ck.store(list(range(8)), list(range(8, 16)))
        ck.drain()
        assert b.get_failed_store_slots() == set()  # already taken by drain
        ck.verify_all()
        assert ck.stats["store_fail"] == 1
    finally:
        b.shutdown()
    assert_dir_clean(cache_dir)
