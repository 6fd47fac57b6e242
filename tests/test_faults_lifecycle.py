"""A backend's life outside the happy path: fork() after init, dropped without shutdown(),
and a hang at shutdown that ends later (classes 5 and 9 of issue 13)."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from faults import Fault, FaultyOsCalls, FdWatch, PinWatch, assert_dir_clean, block_data, make_caches, wait_threads_gone
from kvoffload import DiskBackend, LeakedFdWarning

pytestmark = pytest.mark.faults

NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
BLOCK = 64 << 10


def start(d, named, caches, slots=8, **kw) -> DiskBackend:
    b = DiskBackend()
    kw.setdefault("io_threads", 2)
    b.init(caches, "cpu", None, None, str(d / "kv.bin"), slots, BLOCK, named_file=named, report_load_errors=True, **kw)
    return b


def round_trip(b: DiskBackend, caches, slot: int, idx: int = 0) -> None:
    want = block_data(caches, 0)
    ev: list = []
    b.launch_copy([0], [slot], True, idx, ev)
    assert ev[0][1].wait(10) and ev[0][1].ok
    for t in caches.values():
        t[1].zero_()
    b.launch_copy([slot], [1], False, idx + 1, ev)
    assert ev[1][1].wait(10) and ev[1][1].ok
    assert block_data(caches, 1) == want


def in_child(fn) -> int:
    """Run ``fn`` in a fork()ed child; its return value (0..255) is the exit code.
    A child that hangs is killed after 20 s (exit code 124)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            killer = threading.Timer(20, lambda: os._exit(124))
            killer.daemon = True
            killer.start()
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@NAMED
def test_fork_child_cannot_launch_and_parent_keeps_working(fd_guard, cache_dir, named):
    caches = make_caches("cpu", 4, [BLOCK], seed=1)
    b = start(cache_dir, named, caches)
    try:
        round_trip(b, caches, slot=2)
        stored = block_data(caches, 0)

        def child() -> int:
            events: list = []
            try:
                b.launch_copy([0], [3], True, 0, events)
            except RuntimeError as e:
                if "fork()ed child" not in str(e) or events:
                    return 2
            else:
                return 1  # an event whose IO threads live in the parent would never complete
            b.shutdown()  # drops its copy without touching the parent's file or threads
            return 0

        assert in_child(child) == 0
        # The parent's threads, file and data are untouched by the child and its shutdown.
        for t in caches.values():
            t[3].zero_()
        ev: list = []
        b.launch_copy([2], [3], False, 0, ev)
        assert ev[0][1].wait(10) and ev[0][1].ok and block_data(caches, 3) == stored
        round_trip(b, caches, slot=5, idx=1)
    finally:
        b.shutdown()
    wait_threads_gone()
    assert_dir_clean(cache_dir)


@NAMED
def test_dropped_backend_frees_threads_fd_file_and_staging(cache_dir, named):
    fds = FdWatch()
    dev = PinWatch()
    caches = make_caches("cpu", 4, [BLOCK], seed=2)
    b = start(cache_dir, named, caches, device_impl=dev)
    round_trip(b, caches, slot=1)
    ev: list = []
    b.launch_copy([0, 1], [4, 5], True, 9, ev)  # still running when the backend goes
    del b
    gc.collect()
    wait_threads_gone()
    assert ev[0][1].wait(10), "a job of the dropped backend never completed"
    fds.check(near=cache_dir)
    dev.assert_unpinned()
    assert_dir_clean(cache_dir)


def test_hang_that_ends_after_shutdown_frees_the_file_space(small_fs):
    """Class 5: the fd and the whole preallocated file were kept until the process exited,
    after the hung thread had finished, so a new init on a small file system failed with
    ENOSPC forever. The thread that ends last now closes the file."""
    path, what = small_fs
    if path is None:
        pytest.skip(f"needs a real small file system: {what}")
    caches = make_caches("cpu", 4, [BLOCK], seed=3)
    slots = 40  # 2.5 MiB of a 4 MiB tmpfs: a second file does not fit while the first is held
    release = threading.Event()
    osc = FaultyOsCalls().fail_nth("pwritev", 1, Fault.hang(release, timeout=30))
    b = start(path, False, caches, slots=slots, io_threads=1, os_calls=osc, join_timeout=0.2, use_page_cache=True)
    try:
        ev: list = []
        b.launch_copy([0], [0], True, 0, ev)
        assert osc.hang_entered.wait(10)
        with pytest.warns(LeakedFdWarning):
            b.shutdown()
        assert ev[0][1].done and not ev[0][1].ok
        with pytest.raises(OSError, match="not enough space"):
            start(path, False, caches, slots=slots, use_page_cache=True)  # the hung run still holds its file
    finally:
        release.set()
    wait_threads_gone()
    deadline = time.monotonic() + 10
    while os.statvfs(path).f_bfree * os.statvfs(path).f_frsize < slots * BLOCK:
        assert time.monotonic() < deadline, "the file's space was not freed after its last thread ended"
        time.sleep(0.01)
    b2 = start(path, False, caches, slots=slots, use_page_cache=True)  # fits again
    round_trip(b2, caches, slot=7)
    b2.shutdown()
    assert_dir_clean(path)
