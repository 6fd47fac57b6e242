"""What ``DiskBackend.init`` and ``SlotTier`` refuse before they make anything (issue 23).

Every keyword is checked for type and range first, and the error names it; a capacity is
checked against the disk's free space and against the host memory its per-slot state
would take before any of that state exists. A refused start leaves no thread, no fd
and no file.
"""

from __future__ import annotations

import mmap
import os
import re
import resource

import pytest

from faults import FaultyOsCalls, kvoffload_threads, wait_threads_gone
from kvoffload import DiskBackend
from kvoffload.slot_file import SlotFileError
from kvoffload.vllm_tier import SlotTier, TierConfig
from tests.conftest import make_caches, open_fds

ROW = 8192
NO_SPACE = r"not enough space for the slot file of '.*': need \d+ bytes, \d+ free"
NO_MEMORY = r"not enough memory for the state of \d+ slots: need \d+ bytes, \d+ available"


@pytest.fixture
def memory_ceiling():
    """Cap this process's address space for the test: code that regressed to building
    per-slot state for 1e12 slots then fails fast with MemoryError instead of taking the
    machine's memory (the soft limit is restored afterwards)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as fh:
        vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    cap = vm + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class HugeDisk(FaultyOsCalls):
    """A file system that reports 4 EiB free: only the memory check can refuse."""

    def fstatvfs(self, fd):
        real = super().fstatvfs(fd)
        return os.statvfs_result((real.f_bsize, 1, real.f_blocks, 1 << 62, 1 << 62) + tuple(real)[5:])


def assert_nothing_made(d, fds_before) -> None:
    wait_threads_gone()
    assert kvoffload_threads() == []
    assert os.listdir(d) == []
    assert open_fds() == fds_before


# -- DiskBackend.init keywords ---------------------------------------------------------

GOOD = dict(gpu_caches=None, device="cpu", load_stream=None, store_stream=None, disk_path=None, num_disk_slots=8,
            total_block_bytes=4096)
BAD_KEYWORDS = [
    ("join_timeout", "10", TypeError),
    ("join_timeout", -1.0, ValueError),
    ("join_timeout", float("inf"), ValueError),
    ("join_timeout", float("nan"), ValueError),
    ("join_timeout", True, TypeError),
    ("start_timeout", "60", TypeError),
    ("start_timeout", None, TypeError),
    ("start_timeout", 0, ValueError),
    ("start_timeout", float("nan"), ValueError),
    ("io_threads", 0, ValueError),
    ("io_threads", "4", TypeError),
    ("io_threads", 2.0, TypeError),
    ("io_unit_bytes", 0, ValueError),
    ("io_unit_bytes", 1.5, TypeError),
    ("num_buffer_slots", 0, ValueError),
    ("num_disk_slots", -1, ValueError),
    ("num_disk_slots", "8", TypeError),
    ("capacity_bytes", 0, ValueError),
    ("capacity_bytes", "1GiB", TypeError),
    ("encrypt", "false", TypeError),
    ("named_file", 1, TypeError),
    ("use_page_cache", None, TypeError),
    ("report_load_errors", "yes", TypeError),
    ("disk_paths", "/nvme/kv", TypeError),
    ("disk_paths", [], TypeError),
    ("disk_paths", ["a", 3], TypeError),
    ("os_calls", os, TypeError),
    ("device_impl", object(), TypeError),
]


@pytest.mark.parametrize("key,value,error", BAD_KEYWORDS,
                         ids=[f"{k}={v!r}" for k, v, _ in BAD_KEYWORDS])
def test_every_init_keyword_is_checked_before_anything_is_made(cache_dir, key, value, error):
    before = open_fds()
    kw = dict(GOOD, gpu_caches=make_caches("cpu", 4, [4096]), disk_path=str(cache_dir / "kv.bin"))
    kw[key] = value
    b = DiskBackend()
    with pytest.raises(error, match=rf"^{re.escape(key)}\b") as e:
        b.init(**kw)
    assert "\n" not in str(e.value)
    assert b.closing
    assert_nothing_made(cache_dir, before)


def test_shutdown_after_a_good_start_never_fails_on_its_timeout(cache_dir):
    """The defect behind the keyword checks: join_timeout="10" was accepted, and shutdown
    then raised TypeError with the IO threads and the fd still alive."""
    b = DiskBackend()
    b.init(make_caches("cpu", 4, [4096]), "cpu", None, None, str(cache_dir / "kv.bin"), 8, 4096, join_timeout=10)
    b.shutdown()
    wait_threads_gone()
    assert kvoffload_threads() == []


# -- capacity: disk space and host memory, before any per-slot state -------------------


@pytest.mark.parametrize("slots", [10**12, 10**30])
def test_backend_capacity_beyond_the_disk_is_refused_first(cache_dir, memory_ceiling, slots):
    before = open_fds()
    b = DiskBackend()
    with pytest.raises(SlotFileError, match=NO_SPACE):
        b.init(make_caches("cpu", 4, [4096]), "cpu", None, None, str(cache_dir / "kv.bin"), slots, 4096,
               disk_paths=[str(cache_dir / "a"), str(cache_dir / "b")])
    assert_nothing_made(cache_dir, before)


def test_backend_per_slot_state_beyond_memory_is_refused(cache_dir, memory_ceiling):
    before = open_fds()
    b = DiskBackend()
    with pytest.raises(ValueError, match=r"^num_disk_slots=1000000000000: " + NO_MEMORY):
        b.init(make_caches("cpu", 4, [4096]), "cpu", None, None, str(cache_dir / "kv.bin"), 10**12, 4096,
               os_calls=HugeDisk())
    assert_nothing_made(cache_dir, before)


@pytest.fixture
def primary():
    mm = mmap.mmap(-1, 16 * ROW)
    view = memoryview(mm).cast("B", (16, ROW))
    yield view
    view.release()
    mm.close()


def tier(d, capacity, **kw) -> TierConfig:
    return TierConfig.from_tier_config({"disk_path": str(d / "kv.bin"), "disk_capacity_bytes": capacity, **kw})


def test_tier_of_10000_tib_is_refused_by_the_disk_not_by_memory_error(cache_dir, primary, memory_ceiling):
    before = open_fds()
    with pytest.raises(SlotFileError, match=NO_SPACE):
        SlotTier(primary, tier(cache_dir, "10000TiB"))
    assert_nothing_made(cache_dir, before)


def test_tier_state_beyond_memory_is_refused_before_the_pool(cache_dir, primary, memory_ceiling):
    before = open_fds()
    with pytest.raises(ValueError, match=r"^disk_capacity_bytes=10995116277760000: " + NO_MEMORY):
        SlotTier(primary, tier(cache_dir, "10000TiB"), os_calls=HugeDisk())
    assert_nothing_made(cache_dir, before)


@pytest.mark.parametrize("field,value", [
    ("io_threads", "4"), ("io_threads", 0), ("io_unit_bytes", 0), ("io_unit_bytes", "4MiB"),
    ("disk_capacity_bytes", -1), ("disk_capacity_bytes", 2**70), ("encrypt", "false"), ("named_file", None),
    ("locality", "local"), ("disk_paths", ("a", "a")), ("disk_paths", "/nvme/kv"),
])
def test_a_tier_config_built_directly_is_checked_too(field, value):
    kw = {"disk_paths": ("/nvme/kv",), field: value}
    with pytest.raises(ValueError, match=rf"{field}"):
        TierConfig(**kw)


@pytest.mark.parametrize("kw,error,name", [
    ({"join_timeout": "10"}, TypeError, "join_timeout"),
    ({"os_calls": object()}, TypeError, "os_calls"),
])
def test_tier_keywords_are_checked_before_anything_is_made(cache_dir, primary, kw, error, name):
    before = open_fds()
    with pytest.raises(error, match=name):
        SlotTier(primary, tier(cache_dir, 8 * ROW), **kw)
    assert_nothing_made(cache_dir, before)
