"""Hung and slow IO: shutdown returns on time, keeps exactly the one fd while the hung
thread lives, a late transfer lands only in that unlinked file, and the last thread
out closes it; errors are per job, not sticky."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from faults import Fault, KvChecker, block_data, kvoffload_threads, make_caches
from kvoffload import DiskBackend, LeakedFdWarning

pytestmark = pytest.mark.faults

JOIN_TIMEOUT = 0.3


def start(caches, d, osc, named, device="cpu", **kw):
    b = DiskBackend()
    kw.setdefault("io_threads", 1)
    kw.setdefault("join_timeout", JOIN_TIMEOUT)
    b.init(caches, device, None, None, str(d / "kv.bin"), 8, 4096, named_file=named, os_calls=osc,
           report_load_errors=True, **kw)
    return b


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_hung_write_at_shutdown(fd_guard, faulty_os, ledger, cache_dir, device, named):
    release = threading.Event()
    faulty_os.fail_nth("pwritev", 1, Fault.hang(release))
    writes = []
    faulty_os.after("pwritev", lambda info: writes.append((info.args[0], info.args[2], info.result)))
    caches = make_caches(device, 4, [4096], seed=1)
    b = start(caches, cache_dir, faulty_os, named, device)
    fd = b.files[0].fd
    old_threads = kvoffload_threads()
    hung_data = block_data(caches, 0)
    op0 = ledger.launch(b, [0], [0], True)
    op1 = ledger.launch(b, [1], [1], True)  # queued behind the hung write
    assert faulty_os.hang_entered.wait(10)

    t0 = time.monotonic()
    with pytest.warns(LeakedFdWarning, match=rf"keeping fd\(s\) \[{fd}\]"):
        b.shutdown()
    took = time.monotonic() - t0
    assert took < JOIN_TIMEOUT + 0.5, f"shutdown took {took:.2f} s"
    # The hung job is indeterminate (its bytes may still land); the queued one failed.
    counts = ledger.check(indeterminate={op0.idx})
    assert counts == {"ok": 0, "fail": 1, "info": 1} and op1.status == "fail"
    st = os.fstat(fd)
    assert st.st_nlink == 0, "the leaked file must already be unlinked"
    assert os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
    assert os.listdir(cache_dir) == []
    new_fds = set(fd_guard.new_fds())
    assert new_fds == {fd}, f"exactly one fd is kept, not {new_fds}"

    # A new run, and an unrelated file, open while the late write is pending: the
    # leaked fd number stays taken, so neither can receive the late write.
    b2 = start(caches, cache_dir, None, named, device)
    other = cache_dir.parent / "other.bin"
    other.write_bytes(b"x" * 8192)
    other_fd = os.open(other, os.O_RDONLY)
    try:
        assert b2.files[0].fd != fd and other_fd != fd
        ck = KvChecker(b2, caches, None, 8)
        ck.attach()
        ck.store([2], [0])  # same slot number the hung write targets
        ck.drain()

        release.set()
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in old_threads):
            assert time.monotonic() < deadline, "released IO thread did not finish"
            time.sleep(0.01)
        assert faulty_os.calls["pwritev"] == 1, "the queued store must not be written after shutdown"
        # The late write went to the kept, unlinked file (whole) ...
        assert writes == [(fd, 0, 4096)]
        # ... and the thread that made it, the run's last, closed that file on its way out.
        assert fd not in fd_guard.new_fds()
        # Nothing else was touched: the new run's slot 0 still holds its own bytes.
        ck.load([0], [3])
        ck.drain()
        assert block_data(caches, 3) == block_data(caches, 2) != hung_data
        assert other.read_bytes() == b"x" * 8192
        assert op0.event.ok is False  # ended once, at shutdown; the late finish did not flip it
    finally:
        os.close(other_fd)
        b2.shutdown()
    assert os.listdir(cache_dir) == []


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_hung_read_released_after_shutdown_does_not_touch_device(fd_guard, faulty_os, ledger, cache_dir, device, named):
    release = threading.Event()
    caches = make_caches(device, 4, [4096], seed=2)
    b = start(caches, cache_dir, faulty_os, named, device)
    fd = b.files[0].fd
    old_threads = kvoffload_threads()
    ck = KvChecker(b, caches, None, 8, ledger)
    ck.attach()
    ck.store([0], [0])
    ck.drain()
    faulty_os.fail_nth("preadv", faulty_os.calls["preadv"] + 1, Fault.hang(release))
    op = ledger.launch(b, [0], [3], False)
    assert faulty_os.hang_entered.wait(10)
    with pytest.warns(LeakedFdWarning):
        b.shutdown()
    assert fd in fd_guard.new_fds()  # kept while the hung thread lives
    ledger.check(indeterminate={op.idx})
    for t in caches.values():
        t[3].fill_(7)  # the block belongs to the engine again
    release.set()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in old_threads):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert all(bool((t[3] == 7).all()) for t in caches.values()), "a late load wrote device memory"
    assert fd not in fd_guard.new_fds()  # the last thread out closed it


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_slow_device_completes_everything(fd_guard, faulty_os, ledger, cache_dir, named):
    """Delays everywhere, several IO threads: every job still completes, in full."""
    faulty_os.fail_from("pwritev", 1, Fault.delay(0.01))
    faulty_os.fail_from("preadv", 1, Fault.delay(0.01))
    caches = make_caches("cpu", 8, [4096], seed=3)
    b = start(caches, cache_dir, faulty_os, named, io_threads=3, io_unit_bytes=4096, join_timeout=10.0)
    ck = KvChecker(b, caches, faulty_os, 8, ledger)
    ck.attach()
    ck.store(list(range(8)), list(range(8)))
    ck.load(list(range(8)), [7, 6, 5, 4, 3, 2, 1, 0])
    ck.drain()
    b.shutdown()
    assert ledger.check() == {"ok": 2, "fail": 0, "info": 0}
    assert os.listdir(cache_dir) == []


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_errors_are_per_job_not_sticky(fd_guard, faulty_os, ledger, cache_dir, named):
    """Policy (decided, RocksDB 'severities'): an IO error fails only its transfer. After a
    dead spell of the device ends, new stores and loads succeed (TigerBeetle liveness)."""
    caches = make_caches("cpu", 8, [4096], seed=4)
    b = start(caches, cache_dir, faulty_os, named, io_threads=2, io_unit_bytes=4096)
    ck = KvChecker(b, caches, faulty_os, 8, ledger)
    ck.attach()
    faulty_os.fail_from("pwritev", 1, Fault.error(errno.EIO))
    faulty_os.fail_from("preadv", 1, Fault.error(errno.EIO))
    ck.store([0, 1, 2, 3], [0, 1, 2, 3])
    ck.load([0, 1], [4, 5])
    ck.drain()
    assert ck.stats == {"store_ok": 0, "store_fail": 1, "load_ok": 0, "load_fail": 1}
    faulty_os.clear()  # the device heals
    t0 = time.monotonic()
    ck.store([4, 5, 6, 7], [0, 1, 2, 3])
    ck.load([0, 1, 2, 3], [0, 1, 2, 3])
    ck.drain(timeout=5)
    assert time.monotonic() - t0 < 5
    assert ck.stats["store_ok"] == 1 and ck.stats["load_ok"] == 1
    b.shutdown()
    ledger.check()
