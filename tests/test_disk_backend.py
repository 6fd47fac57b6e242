"""DiskBackend on real files: round trips, the completion contract, errors, lifecycle.

Every test runs on CPU tensors (CI) and on CUDA tensors where a GPU exists
(``pytest -m cuda`` on the H200). tmp_path is on ext4 here, so O_DIRECT is real.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time

import pytest
import torch

from faults import Fault, FaultyOsCalls, kvoffload_threads
from kvoffload import BackendFatalError, DiskBackend, LeakedFdWarning
from kvoffload.device import CpuDevice, HostDevice
from kvoffload.slot_file import SlotFileError, slot_bytes_for
from tests.conftest import block_bytes, make_caches, open_fds, snapshot

LAYOUTS = {
    "aligned": [4096] * 4,
    "mla": [576 * 2] * 3,  # DeepSeek-style 576-value bf16 rows: not a multiple of 512
    "hybrid": [3098112],  # the hybrid stride that made vLLM 0.33 unbootable (#55424)
    "many": [256] * 120,
}


def start(caches, device, tmp_path, num_slots=64, **kw) -> DiskBackend:
    b = DiskBackend()
    kw.setdefault("io_threads", 3)
    kw.setdefault("report_load_errors", True)
    # The budget of padded slots: these tests are about data, not sizing.
    kw.setdefault("capacity_bytes", num_slots * slot_bytes_for(block_bytes(caches), 4096, False))
    b.init(caches, device, None, None, str(tmp_path / "kv.bin"), num_slots, block_bytes(caches), **kw)
    return b


def run_job(b, src, dst, is_store, events, idx=0, wait_event=None):
    b.launch_copy(src, dst, is_store, idx, events, wait_event)
    ev = events[-1][1]
    ev.synchronize()
    return ev


def poll_like_vllm(events: list, hwm: int) -> int:
    """vLLM's worker: pop finished events from the front, stop at the first unfinished."""
    while events and events[0][1].query():
        idx, _ = events.pop(0)
        assert idx > hwm, "events must come out in submission order"
        hwm = idx
    return hwm


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
@pytest.mark.parametrize("named_file", [False, True], ids=["anonymous", "named"])
def test_round_trip_random_data(device, tmp_path, layout, use_page_cache, named_file):
    nblocks = 3 if layout == "hybrid" else 16
    caches = make_caches(device, nblocks, LAYOUTS[layout])
    b = start(caches, device, tmp_path, num_slots=2 * nblocks, use_page_cache=use_page_cache, named_file=named_file)
    try:
        f = b.files[0]
        assert f.named is named_file and f.direct is (not use_page_cache)
        if not use_page_cache:
            assert f.slot_bytes % 4096 == 0 and f.slot_bytes >= block_bytes(caches)
        want = snapshot(caches)
        ev = []
        # Scattered, non-contiguous slots, stored in reverse.
        slots = [2 * i + 1 for i in range(nblocks)][::-1]
        assert run_job(b, list(range(nblocks)), slots, True, ev).ok
        for t in caches.values():
            t.zero_()
        assert run_job(b, slots, list(range(nblocks)), False, ev, 1).ok
        assert b.get_block_ids_with_load_errors() == set()
        for k in caches:
            assert torch.equal(caches[k].cpu(), want[k]), k
        assert os.listdir(tmp_path) == []  # the data never sits under a name
    finally:
        b.shutdown()
    assert os.listdir(tmp_path) == []


def test_slot_padding_rule():
    assert slot_bytes_for(4224, 4096, False) == 8192
    assert slot_bytes_for(4224, 512, False) == 4608
    assert slot_bytes_for(4224, 4096, True) == 4224
    assert slot_bytes_for(3098112, 4096, False) == 3100672
    with pytest.raises(ValueError, match="total_block_bytes must be > 0"):
        slot_bytes_for(0, 4096, False)


def test_many_concurrent_jobs_polled_like_vllm(device, tmp_path):
    caches = make_caches(device, 64, [1024, 3072])
    b = start(caches, device, tmp_path, num_slots=256, io_unit_bytes=8192)
    try:
        want = snapshot(caches)
        store_ev, load_ev = [], []
        for j in range(32):  # 32 store jobs of 2 blocks each, all queued at once
            b.launch_copy([2 * j, 2 * j + 1], [100 + 2 * j, 100 + 2 * j + 1], True, j + 1, store_ev)
        assert [i for i, _ in store_ev] == list(range(1, 33))
        hwm, deadline = 0, time.monotonic() + 30
        while hwm < 32:
            hwm = poll_like_vllm(store_ev, hwm)
            assert time.monotonic() < deadline
        for t in caches.values():
            t.zero_()
        for j in range(32):
            b.launch_copy([100 + 2 * j, 100 + 2 * j + 1], [2 * j, 2 * j + 1], False, j + 1, load_ev)
        hwm = 0
        while hwm < 32:
            hwm = poll_like_vllm(load_ev, hwm)
            assert time.monotonic() < deadline
        assert b.get_block_ids_with_load_errors() == set()
        for k in caches:
            assert torch.equal(caches[k].cpu(), want[k])
    finally:
        b.shutdown()


def test_one_load_thread_reusing_its_buffers_and_events_delivers_every_byte(device, tmp_path):
    # One load thread alternates two staging buffers, each with the one event its
    # copies re-record: settling the wrong one would let a read overwrite rows a
    # device copy still reads. Large blocks, one per unit, so copies take a while.
    n = 48
    caches = make_caches(device, n, [128 << 10, 128 << 10])
    b = start(caches, device, tmp_path, num_slots=n, io_threads=1, io_unit_bytes=1, use_page_cache=True)
    try:
        want = snapshot(caches)
        ev = []
        slots = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
        assert run_job(b, list(range(n)), slots, True, ev).ok
        for t in caches.values():
            t.zero_()
        assert run_job(b, slots, list(range(n)), False, ev, 1).ok
        assert b.get_block_ids_with_load_errors() == set()
        for k in caches:
            assert torch.equal(caches[k].cpu(), want[k]), k
    finally:
        b.shutdown()


def test_empty_job_still_completes(device, tmp_path):
    caches = make_caches(device, 4, [4096])
    b = start(caches, device, tmp_path)
    try:
        ev = []
        b.launch_copy([], [], False, 7, ev)
        assert ev[0][0] == 7 and ev[0][1].query() and ev[0][1].ok
    finally:
        b.shutdown()


def test_io_errors_reported_without_losing_events(device, tmp_path):
    caches = make_caches(device, 8, [4096, 4096])
    osc = FaultyOsCalls().fail_nth("pwritev", 2).fail_nth("pwritev", 5)
    osc.fail_nth("preadv", 1, Fault.short(0.5))  # a real short read: half the slot
    # io_unit_bytes = one slot, io_threads 1: one pwritev per block, in order.
    b = start(caches, device, tmp_path, num_slots=16, io_threads=1, io_unit_bytes=1, os_calls=osc)
    try:
        want = snapshot(caches)
        ev = []
        for i in range(8):
            b.launch_copy([i], [i], True, i, ev)
        for _, e in ev:
            e.synchronize(timeout=30)
        assert [e.ok for _, e in ev] == [True, False, True, True, False, True, True, True]
        assert b.get_failed_store_slots() == {1, 4}
        assert b.get_failed_store_slots() == set()  # returned once, then cleared
        for t in caches.values():
            t.fill_(7)
        load_ev = []
        for i in range(8):
            b.launch_copy([i], [i], False, i, load_ev)
        for _, e in load_ev:
            e.synchronize(timeout=30)
        # Read 1 came back short; slots 1 and 4 hold failed stores: never served.
        errors = b.get_block_ids_with_load_errors()
        assert errors == {0, 1, 4}
        assert [e.ok for _, e in load_ev] == [i not in errors for i in range(8)]
        for k in caches:
            for i in range(8):
                if i not in errors:
                    assert torch.equal(caches[k][i].cpu(), want[k][i])
                else:  # a failed load leaves the device block untouched
                    assert bool((caches[k][i] == 7).all())
    finally:
        b.shutdown()


@pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
def test_corruption_on_disk_is_a_load_error(device, tmp_path, use_page_cache):
    caches = make_caches(device, 4, [8192])
    b = start(caches, device, tmp_path, num_slots=4, use_page_cache=use_page_cache)
    try:
        ev = []
        run_job(b, [0, 1, 2, 3], [0, 1, 2, 3], True, ev)
        f = b.files[0]
        # Flip one bit of slot 2 through the backend's own fd (aligned for O_DIRECT).
        import mmap

        page = mmap.mmap(-1, 4096)
        off = 2 * f.slot_bytes + 4096
        assert os.preadv(f.fd, [page], off) == 4096
        page[100] ^= 0x10
        assert os.pwritev(f.fd, [page], off) == 4096
        run_job(b, [0, 1, 2, 3], [0, 1, 2, 3], False, ev, 1)
        assert b.get_block_ids_with_load_errors() == {2}
    finally:
        b.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("layout,staged", [("many", True), ("mla", True), ("aligned", False)])
def test_copy_path_by_piece_size_serves_good_rows_and_skips_a_bad_one(tmp_path, layout, staged):
    # Small pieces go through device staging rows, large ones as one DMA descriptor
    # each; either way a load unit whose middle slot is corrupt delivers the others.
    from kvoffload.cuda_device import CudaDevice
    from kvoffload.device import BlockLayout, resolve_device

    caches = make_caches("cuda", 16, LAYOUTS[layout])
    dev, lay = CudaDevice(resolve_device("cuda")), BlockLayout.from_caches(caches)
    # 4 KiB pieces go through staging rows only with the fused gather kernel (Triton).
    assert dev.stages(lay) is (staged or dev.fused(lay) is not None)
    b = start(caches, "cuda", tmp_path, num_slots=16, use_page_cache=True, io_threads=1)
    try:
        want = snapshot(caches)
        ev = []
        slots = list(range(15, -1, -1))
        assert run_job(b, list(range(16)), slots, True, ev).ok
        f = b.files[0]
        os.pwrite(f.fd, b"\xff" * 8, slots[7] * f.slot_bytes)  # block 7's slot
        for t in caches.values():
            t.fill_(7)
        run_job(b, slots, list(range(16)), False, ev, 1)
        assert b.get_block_ids_with_load_errors() == {7}
        for k in caches:
            got = caches[k].cpu()
            for i in range(16):
                if i == 7:
                    assert bool((got[i] == 7).all())
                else:
                    assert torch.equal(got[i], want[k][i]), (k, i)
    finally:
        b.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("tensor_bytes", [[8192] * 32, [18432] * 7, [1152, 4096, 36, 18432]],
                         ids=["many", "mla", "mixed"])
def test_fused_gather_kernel_is_used_and_moves_exact_bytes(tmp_path, tensor_bytes):
    pytest.importorskip("triton")
    from kvoffload.cuda_device import CudaDevice
    from kvoffload.device import BlockLayout, resolve_device

    caches = make_caches("cuda", 24, tensor_bytes, seed=11)
    dev = CudaDevice(resolve_device("cuda"))
    lay = BlockLayout.from_caches(caches)
    assert dev.fused(lay) is not None, "Triton imports but the kernel is off"
    # Loads stage pieces under 32 KiB; stores only under 16 KiB (larger pieces go faster as descriptors).
    piece = lay.block_bytes / len(lay.caches)
    assert dev.stages(lay, to_host=False) and dev.stages(lay) and dev.stages(lay, to_host=True) is (piece < 16 << 10)
    b = start(caches, "cuda", tmp_path, num_slots=24, io_unit_bytes=3 * block_bytes(caches), device_impl=dev)
    try:
        want, ev = snapshot(caches), []
        slots = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist()
        assert run_job(b, list(range(24)), slots, True, ev).ok
        for t in caches.values():
            t.fill_(7)
        assert run_job(b, slots, list(range(24)), False, ev, 1).ok
        for k in caches:
            assert torch.equal(caches[k].cpu(), want[k]), k
    finally:
        b.shutdown()


@pytest.mark.parametrize("unit, rows", [(8192, 2), (2**40, 8)], ids=["unit", "1TiB-unit"])
def test_staging_is_bounded_by_the_unit_and_by_what_a_job_can_fill(tmp_path, unit, rows):
    # Per IO thread one store buffer and two load buffers of `rows` slots (+ the tag's
    # spare bytes); a unit never holds more than the device's 8 blocks, whatever io_unit_bytes says.
    from kvoffload.slot_seal import TAG_BYTES

    caches = make_caches("cpu", 8, [4096])
    b = start(caches, "cpu", tmp_path, num_slots=64, io_threads=2, io_unit_bytes=unit)
    try:
        assert b.stats()["staging_bytes"] == 2 * 3 * (rows * b.files[0].slot_bytes + TAG_BYTES)
        want, ev = snapshot(caches), []
        assert run_job(b, list(range(8)), list(range(40, 48)), True, ev).ok
        caches["layer0"].zero_()
        assert run_job(b, list(range(40, 48)), list(range(8)), False, ev, 1).ok
        assert torch.equal(caches["layer0"], want["layer0"])
    finally:
        b.shutdown()


def test_checksums_off_still_round_trips(device, tmp_path):
    caches = make_caches(device, 4, [4096])
    b = start(caches, device, tmp_path, checksums=False)
    try:
        want, ev = snapshot(caches), []
        run_job(b, [0, 1, 2, 3], [3, 2, 1, 0], True, ev)
        caches["layer0"].zero_()
        run_job(b, [3, 2, 1, 0], [0, 1, 2, 3], False, ev, 1)
        assert torch.equal(caches["layer0"].cpu(), want["layer0"])
        run_job(b, [9], [0], False, ev, 2)  # never stored: still an error without checksums
        assert b.get_block_ids_with_load_errors() == {0}
    finally:
        b.shutdown()


@pytest.mark.parametrize("named_file", [False, True], ids=["anonymous", "named"])
def test_file_mode_is_0600_whatever_the_umask(tmp_path, named_file):
    caches = make_caches("cpu", 2, [4096])
    old = os.umask(0o277)
    try:
        b = start(caches, "cpu", tmp_path, named_file=named_file)
    finally:
        os.umask(old)
    try:
        st = os.fstat(b.files[0].fd)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_nlink == 0  # no name: nobody else can open it
        assert st.st_size == 64 * 4096  # fully reserved up front
        assert st.st_blocks * 512 >= st.st_size  # fallocated, not sparse
    finally:
        b.shutdown()


def test_init_shutdown_init_in_one_process(device, tmp_path):
    caches = make_caches(device, 4, [4096])
    before = open_fds()
    b = DiskBackend()
    for round_ in range(3):
        b.init(caches, device, None, None, str(tmp_path / "kv.bin"), 8, 4096, io_threads=2, report_load_errors=True)
        ev = []
        run_job(b, [0], [round_], True, ev)
        run_job(b, [round_], [1], False, ev, 1)
        b.shutdown()
        b.shutdown()  # idempotent
        assert open_fds() == before
    b2 = DiskBackend()
    b2.init(caches, device, None, None, str(tmp_path / "kv.bin"), 8, 4096, io_threads=2, report_load_errors=True)
    b2.shutdown()
    assert open_fds() == before and os.listdir(tmp_path) == []


def test_calls_after_shutdown_fail_clearly(tmp_path):
    b = start(make_caches("cpu", 2, [4096]), "cpu", tmp_path)
    b.shutdown()
    with pytest.raises(RuntimeError, match="not initialised"):
        b.launch_copy([0], [0], True, 0, [])
    assert b.get_block_ids_with_load_errors() == set()


def test_bad_arguments_are_named(tmp_path):
    caches = make_caches("cpu", 4, [4096])
    b = DiskBackend()
    with pytest.raises(ValueError, match="total_block_bytes=4000 but the caches hold 4096"):
        b.init(caches, "cpu", None, None, str(tmp_path / "kv"), 8, 4000, report_load_errors=True)
    with pytest.raises(ValueError, match="num_buffer_slots must be >= 1"):
        b.init(caches, "cpu", None, None, str(tmp_path / "kv"), 8, 4096, num_buffer_slots=0, report_load_errors=True)
    with pytest.raises(ValueError, match="num_disk_slots must be >= 1"):
        b.init(caches, "cpu", None, None, str(tmp_path / "kv"), 0, 4096, report_load_errors=True)
    b = start(caches, "cpu", tmp_path, num_slots=8)
    try:
        with pytest.raises(ValueError, match=r"slot id 8 out of range \[0, 8\)"):
            b.launch_copy([0], [8], True, 0, [])
        with pytest.raises(ValueError, match=r"device block id 4 out of range"):
            b.launch_copy([0], [4], False, 0, [])
        with pytest.raises(ValueError, match="appears twice"):
            b.launch_copy([0, 1], [3, 3], True, 0, [])
        with pytest.raises(ValueError, match="src_blocks has 2 ids, dst_blocks has 1"):
            b.launch_copy([0, 1], [3], True, 0, [])
    finally:
        b.shutdown()
    assert os.listdir(tmp_path) == []


def test_refuses_world_writable_directory_without_sticky_bit(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(SlotFileError, match="world-writable without the sticky bit"):
        start(make_caches("cpu", 2, [4096]), "cpu", d)
    d.chmod(0o1777)  # /tmp-style sticky directory is fine: only the owner can unlink
    start(make_caches("cpu", 2, [4096]), "cpu", d).shutdown()


def test_refuses_symlinked_parent(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SlotFileError, match="is a symlink; give its real path"):
        start(make_caches("cpu", 2, [4096]), "cpu", tmp_path / "link")
    assert os.listdir(real) == []


def test_too_little_space_fails_at_init(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    caches = make_caches("cpu", 2, [4096])
    with pytest.raises(SlotFileError, match=r"need \d+ bytes, \d+ free") as e:
        start(caches, "cpu", tmp_path, num_slots=free // 4096 + 1024)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_hung_write_at_shutdown_keeps_the_fd_until_the_thread_ends(tmp_path):
    caches = make_caches("cpu", 4, [4096])
    release = threading.Event()
    osc = FaultyOsCalls().fail_nth("pwritev", 1, Fault.hang(release, timeout=30))
    before = open_fds()
    b = start(caches, "cpu", tmp_path, io_threads=1, os_calls=osc, join_timeout=0.3)
    fd = b.files[0].fd
    ev = []
    b.launch_copy([0], [0], True, 0, ev)
    b.launch_copy([1], [1], True, 1, ev)  # queued behind the hung one
    assert osc.hang_entered.wait(10)
    t0 = time.monotonic()
    with pytest.warns(LeakedFdWarning, match=rf"keeping fd\(s\) \[{fd}\]"):
        b.shutdown()
    assert time.monotonic() - t0 < 2.0
    assert all(e.query() and not e.ok for _, e in ev)  # no poll waits forever
    assert open_fds() - before == {fd}  # exactly the slot file's fd is kept
    assert os.fstat(fd).st_nlink == 0 and os.listdir(tmp_path) == []
    release.set()  # the late write lands in the unlinked file, nowhere else
    deadline = time.monotonic() + 10
    while kvoffload_threads():  # the native engine's collector outlives its last worker
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The last thread out closed the run: the fd and the file's space are released,
    # so a re-init on a small file system does not fail with ENOSPC forever.
    assert open_fds() == before


class BrokenDevice(CpuDevice):
    def copy_to_host(self, *a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def copy_plan(self, *a, **kw):
        return None  # every copy, the native engine's too, goes through copy_to_host


class NoMemoryDevice(CpuDevice):
    """Fails to set up the third IO thread, as a device staging allocation out of memory would."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def bind_thread(self, stream, layout=None, rows=0, to_host=None):
        with self.lock:
            self.calls += 1
            if self.calls == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
        return stream


def test_io_thread_that_cannot_start_fails_init_and_leaves_nothing(tmp_path):
    caches = make_caches("cpu", 4, [4096])
    fds = open_fds()
    b = DiskBackend()
    with pytest.raises(RuntimeError, match="could not set up the device: OutOfMemoryError") as ei:
        b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 8, block_bytes(caches), io_threads=2,
               device_impl=NoMemoryDevice(), report_load_errors=True)
    assert isinstance(ei.value.__cause__, torch.OutOfMemoryError)
    assert open_fds() == fds and os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload-")]
    with pytest.raises(RuntimeError, match="not initialised"):
        b.launch_copy([0], [0], True, 0, [])


class WedgedBindDevice(CpuDevice):
    """bind_thread blocks until released, as a wedged driver would."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def bind_thread(self, stream, layout=None, rows=0, to_host=None):
        self.release.wait(30)
        return stream


def test_io_thread_that_never_starts_fails_init_instead_of_hanging(tmp_path):
    dev = WedgedBindDevice()
    caches = make_caches("cpu", 4, [4096])
    b = DiskBackend()
    t0 = time.monotonic()
    with pytest.warns(LeakedFdWarning), pytest.raises(RuntimeError, match="did not start within 0.3 s"):
        b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 8, block_bytes(caches), io_threads=1,
               join_timeout=0.2, start_timeout=0.3, device_impl=dev, report_load_errors=True)
    assert time.monotonic() - t0 < 10
    dev.release.set()  # the wedged threads then see shutdown's sentinel and end
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t.name.startswith("kvoffload-")]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_device_failure_is_fatal_not_swallowed(tmp_path):
    caches = make_caches("cpu", 4, [4096])
    b = start(caches, "cpu", tmp_path, device_impl=BrokenDevice())
    try:
        ev = []
        b.launch_copy([0], [0], True, 0, ev)
        with pytest.raises(BackendFatalError, match="illegal memory access"):
            ev[0][1].synchronize(timeout=10)
        with pytest.raises(BackendFatalError, match="failed earlier"):
            b.launch_copy([1], [1], True, 1, ev)
    finally:
        b.shutdown()


@pytest.mark.parametrize("dev", [CpuDevice, HostDevice])
def test_wait_event_orders_store_after_compute(tmp_path, dev):
    """A store must not read the cache before wait_event (vLLM #45704)."""
    caches = make_caches("cpu", 2, [4096])
    b = start(caches, "cpu", tmp_path, device_impl=dev())
    try:
        computed = threading.Event()

        class Compute:
            def query(self):
                return computed.is_set()

            def synchronize(self):
                computed.wait(10)

        ev = []
        b.launch_copy([0], [0], True, 0, ev, wait_event=Compute())
        time.sleep(0.1)
        caches["layer0"][0].fill_(42)  # the "compute" writes the block late
        computed.set()
        ev[0][1].synchronize(timeout=10)
        caches["layer0"].zero_()
        run_job(b, [0], [1], False, ev, 1)
        assert bool((caches["layer0"][1] == 42).all())
    finally:
        b.shutdown()


@pytest.mark.cuda
def test_cuda_store_waits_for_a_torch_event_of_compute(tmp_path):
    """On CUDA the wait is the driver's (no GIL release): a store still reads the block
    only after compute's event, and a torch event never recorded does not block it."""
    caches = make_caches("cuda", 4, [1 << 20])
    b = start(caches, "cuda", tmp_path)
    try:
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # the block is written well after the launch
            caches["layer0"][0].fill_(42)
            written = torch.cuda.Event()
            written.record(compute)
        ev = []
        b.launch_copy([0], [0], True, 0, ev, wait_event=written)
        b.launch_copy([1], [1], True, 1, ev, wait_event=torch.cuda.Event())
        for _, e in ev:
            e.synchronize(timeout=30)
        want = caches["layer0"][1].clone()
        caches["layer0"].zero_()
        assert run_job(b, [0, 1], [2, 3], False, ev, 2).ok
        assert bool((caches["layer0"][2] == 42).all()) and torch.equal(caches["layer0"][3], want)
    finally:
        b.shutdown()


# -- HostDevice: blocks in host memory, sealed from and opened into directly -------

@pytest.mark.parametrize("seal", ["aes-gcm", "xxh3", "off"])
@pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
@pytest.mark.parametrize("block", [8192, 3098112], ids=["aligned", "padded"])
def test_host_device_round_trip_leaves_the_stored_blocks_as_they_were(tmp_path, seal, use_page_cache, block):
    caches = make_caches("cpu", 6, [block])
    b = start(caches, "cpu", tmp_path, num_slots=8, use_page_cache=use_page_cache, device_impl=HostDevice(),
              encrypt=seal == "aes-gcm", checksums=seal == "xxh3")
    try:
        assert b.stats()["seal"] == seal
        want = snapshot(caches)
        ev = []
        assert run_job(b, [0, 1, 2], [5, 6, 2], True, ev).ok
        # Sealed out of place: the source blocks are not encrypted or otherwise touched.
        assert torch.equal(caches["layer0"], want["layer0"])
        assert run_job(b, [5, 6, 2], [3, 4, 5], False, ev, 1).ok
        assert torch.equal(caches["layer0"][3:], want["layer0"][:3])
        assert torch.equal(caches["layer0"][:3], want["layer0"][:3])
    finally:
        b.shutdown()


@pytest.mark.parametrize("encrypt", [True, False], ids=["aes-gcm", "xxh3"])
def test_host_device_failed_check_leaves_no_unverified_bytes_in_the_block(tmp_path, encrypt):
    """AES-GCM's decrypt_into writes the plaintext before it checks the tag: a block that
    fails its check is zeroed, neither left as it was nor holding the forged bytes."""
    caches = make_caches("cpu", 4, [8192])
    osc = FaultyOsCalls()
    b = start(caches, "cpu", tmp_path, num_slots=4, device_impl=HostDevice(), encrypt=encrypt, os_calls=osc)
    try:
        ev = []
        assert run_job(b, [0, 1], [0, 1], True, ev).ok
        osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.bitflip(100, 1))
        caches["layer0"][2:].fill_(0x55)
        assert not run_job(b, [0, 1], [2, 3], False, ev, 1).ok
        assert osc.fired["preadv"] == 1
        bad = b.get_block_ids_with_load_errors()
        assert bad and bad <= {2, 3}
        for blk in (2, 3):
            if blk in bad:
                assert not caches["layer0"][blk].any(), "a block that failed its check kept bytes"
            else:
                assert torch.equal(caches["layer0"][blk], caches["layer0"][blk - 2])
    finally:
        b.shutdown()


def test_host_device_needs_the_blocks_as_one_cpu_tensor(tmp_path):
    caches = make_caches("cpu", 4, [4096, 4096])
    with pytest.raises(ValueError, match="HostDevice needs the blocks as one CPU tensor, got 2 cache"):
        start(caches, "cpu", tmp_path, device_impl=HostDevice())
    assert os.listdir(tmp_path) == []


def test_striping_over_two_paths_isolates_a_failed_disk(device, tmp_path):
    a, c = tmp_path / "a", tmp_path / "c"
    a.mkdir(), c.mkdir()
    caches = make_caches(device, 8, [4096])
    osc = FaultyOsCalls()
    b = DiskBackend()
    b.init(caches, device, None, None, str(a / "kv"), 8, 4096, disk_paths=[str(a / "kv"), str(c / "kv")],
           io_threads=2, os_calls=osc, report_load_errors=True)
    try:
        assert len(b.files) == 2 and [f.num_slots for f in b.files] == [4, 4]
        bad_fd = b.files[1].fd  # disk c dies
        osc.fail_from("pwritev", 1, Fault.error(errno.EIO), where=lambda args: args[0] == bad_fd)
        want, ev = snapshot(caches), []
        run_job(b, list(range(8)), list(range(8)), True, ev)
        assert b.get_failed_store_slots() == {1, 3, 5, 7}  # odd slots live on disk c
        caches["layer0"].zero_()
        run_job(b, list(range(8)), list(range(8)), False, ev, 1)
        assert b.get_block_ids_with_load_errors() == {1, 3, 5, 7}
        for i in (0, 2, 4, 6):
            assert torch.equal(caches["layer0"][i].cpu(), want["layer0"][i])
    finally:
        b.shutdown()


def test_prefill_writes_each_file_once_through_the_seam_before_init_returns(tmp_path):
    # Issue 33: written once at start-up, a slot file takes every store as a rewrite (no
    # unwritten-extent conversion); the writes go through the OS seam, like every file call.
    caches = make_caches("cpu", 8, [4096])
    osc = FaultyOsCalls()
    b = start(caches, "cpu", tmp_path, num_slots=4096, os_calls=osc, prefill=True, io_unit_bytes=1 << 20)
    try:
        f = b.files[0]
        assert osc.calls["pwritev"] == -(-f.size // (16 << 20))
        with open(f"/proc/self/fd/{f.fd}", "rb") as fh:  # what the disk holds
            assert not any(fh.read())
        ev = []
        assert run_job(b, [0, 1], [0, 1], True, ev).ok and run_job(b, [0, 1], [2, 3], False, ev).ok
    finally:
        b.shutdown()


def test_a_failed_prefill_fails_init_and_leaves_nothing(tmp_path, fd_guard):
    caches = make_caches("cpu", 8, [4096])
    osc = FaultyOsCalls().fail_nth("pwritev", 2, Fault.error(errno.EIO))
    b = DiskBackend()
    with pytest.raises(SlotFileError, match=r"cannot prefill the slot file for .*kv\.bin' at byte 16777216"):
        b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 8192, block_bytes(caches), os_calls=osc,
               prefill=True, report_load_errors=True)
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="^prefill must be a bool"):
        b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 8, block_bytes(caches), prefill="yes")
