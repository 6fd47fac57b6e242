"""What the drive really did: loads served from the page cache and reads the block device made
are counted apart (``vllm:kvoffload_device_bytes_total`` beside ``vllm:kvoffload_bytes_total``).

A "disk" result served from RAM with no physical read at all is what operators of other disk
tiers found by accident (ROCm/rocm-aic #74). Here an O_DIRECT load shows its bytes read by the
device under the path; a load of a file the page cache holds shows the bytes kvoffload moved
and (nearly) none read by the device. Run where the test's directory is on a block device.
"""

from __future__ import annotations

import logging
import os

import pytest

from kvoffload import DiskBackend
from kvoffload.block_device import of_device
from tests.conftest import block_bytes, make_caches

BLOCKS = 32
TENSORS = [1 << 20, 1 << 20]  # 2 MiB a block: 64 MiB a pass


def counters(b: DiskBackend) -> tuple[dict, dict]:
    data = b.take_metrics()["data"]
    return data.get("vllm:kvoffload_bytes_total", {}), data.get("vllm:kvoffload_device_bytes_total", {})


@pytest.fixture
def disk(tmp_path):
    if of_device(os.stat(tmp_path).st_dev) is None:
        pytest.skip(f"{tmp_path} is on no block device: nothing to count")
    return tmp_path


@pytest.mark.parametrize("page_cache", [False, True], ids=["odirect", "pagecache"])
def test_loads_from_the_page_cache_and_reads_of_the_drive_are_counted_apart(disk, page_cache, caplog):
    caches = make_caches("cpu", BLOCKS, TENSORS)
    b = DiskBackend()
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        b.init(caches, "cpu", None, None, str(disk / "kv.bin"), BLOCKS, block_bytes(caches), use_page_cache=page_cache,
               report_load_errors=True)
    try:
        dev = of_device(os.stat(disk).st_dev)
        assert f"({dev.name})" in caplog.text  # the start-up line names the drive under the path
        ids = list(range(BLOCKS))
        ev: list = []
        b.launch_copy(ids, ids, True, 0, ev)
        assert ev[-1][1].wait(30) and ev[-1][1].ok
        counters(b)
        loaded = 0
        for _ in range(2):  # under the page cache the second load is surely warm
            b.launch_copy(ids, ids, False, 0, ev)
            assert ev[-1][1].wait(30) and ev[-1][1].ok
            moved, device = counters(b)
            loaded = moved[("load", "0")]
        assert loaded == BLOCKS * b.files[0].slot_bytes
        read = device.get(("read", "0"), 0)
        if page_cache:
            assert read < loaded // 4, f"a warm page-cache load read {read} of {loaded} bytes from the drive"
        else:
            assert read >= loaded * 9 // 10, f"an O_DIRECT load read only {read} of {loaded} bytes from the drive"
    finally:
        b.shutdown()


def test_a_path_on_no_block_device_says_so(tmp_path, caplog):
    # /dev/shm is tmpfs: a "disk" there is RAM, and the start-up line says reads never reach a drive.
    shm = "/dev/shm"
    if not os.path.isdir(shm) or of_device(os.stat(shm).st_dev) is not None:
        pytest.skip("no tmpfs at /dev/shm")
    caches = make_caches("cpu", 4, [4096])
    b = DiskBackend()
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        b.init(caches, "cpu", None, None, os.path.join(shm, "kvoffload-test-kv.bin"), 4, 4096, use_page_cache=True,
               report_load_errors=True)
    try:
        assert "no block device" in caplog.text
        ev: list = []
        b.launch_copy([0, 1], [0, 1], True, 0, ev)
        assert ev[-1][1].wait(10)
        assert "vllm:kvoffload_device_bytes_total" not in b.take_metrics()["data"]
    finally:
        b.shutdown()
    assert not [n for n in os.listdir(shm) if n.startswith("kvoffload-test")]
