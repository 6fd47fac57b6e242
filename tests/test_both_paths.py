"""Properties that hold on both IO paths, the native core and the Python path alike.

Each test runs once per path (``io_path``): what an adversarial user found broken in one
of them must hold in both. The differential test (``test_native_differential.py``) holds
them to the same outcomes job by job.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from faults import Fault, FaultyOsCalls, wait_threads_gone
from kvoffload import DiskBackend, LeakedFdWarning
from kvoffload.device import CpuDevice, HostDevice
from kvoffload.os_calls import OsCalls
from tests.conftest import block_bytes, make_caches

BLOCK = 4096


@pytest.fixture(params=["native", "python"])
def io_path(request) -> str:
    if request.param == "native":
        request.getfixturevalue("native_core")
    return request.param


def backend(tmp_path: Path, io_path: str, host: bool = False, num_blocks: int = 8, **kw) -> tuple[DiskBackend, dict]:
    """A backend on CPU blocks (staged, as a GPU's) or host blocks (the CPU tier's)."""
    caches = ({"blocks": torch.randint(-128, 128, (num_blocks, BLOCK), dtype=torch.int8)} if host
              else make_caches("cpu", num_blocks, [BLOCK]))
    kw.setdefault("io_threads", 1)
    kw.setdefault("report_load_errors", True)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 16, block_bytes(caches),
           device_impl=HostDevice() if host else CpuDevice(), native_io=io_path == "native", **kw)
    assert b.stats()["io_path"] == io_path
    return b, caches


def job(b: DiskBackend, src, dst, is_store: bool, events: list, timeout: float = 10):
    b.launch_copy(src, dst, is_store, len(events), events)
    ev = events[-1][1]
    assert ev.wait(timeout), "job did not complete"
    return ev


def hold_store_lane(b: DiskBackend, osc: FaultyOsCalls, events: list) -> threading.Event:
    """Store block 7 to slot 15 and hang its write until the returned event is set: the
    store lane's only thread is then busy, and the jobs launched next queue behind it."""
    go = threading.Event()
    osc.fail_nth("pwritev", osc.calls["pwritev"] + 1, Fault.hang(go, timeout=30))
    b.launch_copy([7], [15], True, len(events), events)
    assert osc.hang_entered.wait(10)
    return go


@pytest.mark.parametrize("host", [False, True], ids=["staged", "host-blocks"])
def test_a_slot_whose_latest_store_failed_never_loads_an_older_copy(tmp_path, io_path, host):
    # Two stores to slot 3, queued back to back (on the native path with host blocks they
    # go in one batched call): the first writes, the second fails. The slot's latest
    # store failed, so loading it is an error, never the first store's bytes.
    osc = FaultyOsCalls()
    b, caches = backend(tmp_path, io_path, host=host, os_calls=osc)
    try:
        ev = []
        go = hold_store_lane(b, osc, ev)
        b.launch_copy([0], [3], True, len(ev), ev)
        b.launch_copy([1], [3], True, len(ev), ev)
        osc.fail_nth("pwritev", osc.calls["pwritev"] + 2, Fault.error(errno.EIO))  # the second store's write
        go.set()
        assert all(e.wait(10) for _, e in ev)
        assert [e.ok for _, e in ev] == [True, True, False]
        assert b.get_failed_store_slots() == {3}
        before = {k: v.clone() for k, v in caches.items()}
        load = job(b, [3], [5], False, ev)
        assert not load.ok and b.get_block_ids_with_load_errors() == {5}
        assert all(torch.equal(caches[k], before[k]) for k in caches)  # nothing of the older copy
    finally:
        b.shutdown()


def test_a_store_launched_after_another_decides_the_slot_whichever_ends_last(tmp_path, io_path):
    # The later store succeeds: the slot holds its bytes, whatever the earlier one did.
    osc = FaultyOsCalls()
    b, caches = backend(tmp_path, io_path, os_calls=osc)
    try:
        ev = []
        go = hold_store_lane(b, osc, ev)
        b.launch_copy([0], [3], True, len(ev), ev)
        b.launch_copy([1], [3], True, len(ev), ev)
        go.set()
        assert all(e.wait(10) and e.ok for _, e in ev)
        want = caches["layer0"][1].clone()
        assert job(b, [3], [5], False, ev).ok and torch.equal(caches["layer0"][5], want)
    finally:
        b.shutdown()


@pytest.mark.parametrize("host", [False, True], ids=["staged", "host-blocks"])
def test_nothing_is_written_for_a_job_shutdown_ended_when_its_hung_read_returns(tmp_path, io_path, host):
    osc = FaultyOsCalls()
    b, caches = backend(tmp_path, io_path, host=host, os_calls=osc, join_timeout=0.3)
    ev = []
    assert job(b, [0, 1], [0, 1], True, ev).ok
    for v in caches.values():
        v[4:6] = 7
    before = {k: v.clone() for k, v in caches.items()}
    gate = threading.Event()
    osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.hang(gate, timeout=30))
    b.launch_copy([0, 1], [4, 5], False, len(ev), ev)
    assert osc.hang_entered.wait(10)
    with pytest.warns(LeakedFdWarning):
        b.shutdown()
    assert ev[-1][1].done and not ev[-1][1].ok  # ended by shutdown
    gate.set()  # the read now completes, into staging of a job that already failed
    wait_threads_gone()
    assert all(torch.equal(caches[k], before[k]) for k in caches), "the caller's blocks were written after shutdown"


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, RuntimeError], ids=lambda e: e.__name__)
def test_nothing_a_done_callback_raises_kills_an_io_thread(tmp_path, io_path, raised):
    osc = FaultyOsCalls()
    b, _ = backend(tmp_path, io_path, os_calls=osc)
    try:
        ev = []
        go = hold_store_lane(b, osc, ev)
        b.launch_copy([0], [3], True, len(ev), ev)
        calls = []

        def bad():
            calls.append("bad")
            raise raised("from a done callback")

        ev[-1][1].add_done_callback(bad)
        ev[-1][1].add_done_callback(lambda: calls.append("after"))  # the next callback still runs
        go.set()
        assert all(e.wait(10) for _, e in ev)
        deadline = time.monotonic() + 10  # callbacks run right after the event is set
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert calls == ["bad", "after"]
        for i in range(3):  # the lane's only thread lives on
            assert job(b, [i], [i], True, ev).ok
    finally:
        b.shutdown()


class EioWrites(OsCalls):
    def pwritev(self, fd, buffers, offset):
        raise OSError(errno.EIO, "subclass")


@pytest.mark.parametrize("how", ["subclass", "instance", "instance-after-init", "faulty"])
def test_the_fault_seam_is_honoured_however_it_was_set(tmp_path, io_path, how):
    osc = {"subclass": EioWrites, "faulty": FaultyOsCalls}.get(how, OsCalls)()
    if how == "faulty":
        osc.fail_from("pwritev", 1, Fault.error(errno.EIO))
    patch = mock.patch.object(osc, "pwritev", side_effect=OSError(errno.EIO, "patched"))
    if how == "instance":
        patch.start()
    b, _ = backend(tmp_path, io_path, os_calls=osc)
    try:
        if how == "instance-after-init":
            patch.start()
        ev = []
        assert not job(b, [0, 1], [0, 1], True, ev).ok
        assert b.get_failed_store_slots() == {0, 1}
        if how.startswith("instance"):
            assert osc.pwritev.call_count >= 1
    finally:
        if how.startswith("instance"):
            patch.stop()
        b.shutdown()


def _run_isolated(script: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host", [False, True], ids=["staged", "host-blocks"])
def test_a_seam_that_keeps_its_buffers_cannot_crash_the_interpreter(tmp_path, io_path, host):
    # In a child, so a crash is seen as one: the seam keeps every buffer it was handed,
    # and reads and writes them after the backend is gone and collected.
    script = f"""
        import gc, torch
        from kvoffload.os_calls import OsCalls
        from tests.test_both_paths import backend, job
        from pathlib import Path

        class Keeper(OsCalls):
            kept = []
            def pwritev(self, fd, buffers, offset):
                self.kept.extend(buffers)
                return super().pwritev(fd, buffers, offset)
            def preadv(self, fd, buffers, offset):
                self.kept.extend(buffers)
                return super().preadv(fd, buffers, offset)

        osc = Keeper()
        b, caches = backend(Path("."), {io_path!r}, host={host}, os_calls=osc)
        ev = []
        assert job(b, [0, 1, 2], [0, 1, 2], True, ev).ok and job(b, [0, 1, 2], [3, 4, 5], False, ev).ok
        b.shutdown()
        del b, caches
        gc.collect()
        total = 0
        for buf in Keeper.kept:
            buf[:1] = b"x"
            total += sum(bytes(buf[:64]))
        print("kept", len(Keeper.kept), total)
    """
    r = _run_isolated(script, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("kept ")


@pytest.mark.parametrize("content", ["empty", "garbage", "foreign"])
def test_a_broken_or_foreign_core_is_never_loaded_and_never_stops_init(tmp_path, content):
    # A copy of the package whose compiled core is an empty file, random bytes, or another
    # library under its name: init runs on the Python path and says why.
    import shutil

    import kvoffload

    pkg = tmp_path / "site" / "kvoffload"
    shutil.copytree(Path(kvoffload.__file__).parent, pkg, ignore=shutil.ignore_patterns("_core*", "*.o"))
    lib = pkg / "native_engine" / "_core.abi3.so"
    if content == "empty":
        lib.write_bytes(b"")
    elif content == "garbage":
        lib.write_bytes(os.urandom(4096))
    else:
        import _ctypes

        shutil.copy(_ctypes.__file__, lib)
    script = """
        import logging, torch
        from kvoffload import DiskBackend, native_engine
        from kvoffload.device import random_caches
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        caches = random_caches("cpu", 4, [4096])
        b = DiskBackend()
        b.init(caches, "cpu", None, None, "kv.bin", 8, 4096, report_load_errors=True)
        ev = []
        b.launch_copy([0, 1], [0, 1], True, 0, ev)
        ev[-1][1].synchronize()
        print("io_path", b.stats()["io_path"], native_engine.why_unavailable() is not None)
        b.shutdown()
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "KVOFFLOAD_NATIVE_IO": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "io_path python True" in r.stdout
    assert "IO path Python (the native IO core" in r.stderr, r.stderr[-2000:]
