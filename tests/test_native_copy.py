"""Device copies launched inside the native core's unit calls, on CPU.

On CUDA (``CudaDevice.native_copy``) a store's copy into staging is launched and
waited for inside its unit's call, and a load's copy out of staging is launched by
the next unit's call, so an IO thread gives the GIL up once per unit. ``CpuDevice``
prepares the same copies for the core to make with memcpy; here a CPU device offers
them as CUDA-kind copies instead, with cffi callbacks (of the header's own function
types) in place of the driver's ``cuMemcpyBatchAsync``/``cuEventRecord``/
``cuEventSynchronize``, so the lanes' logic around them (deferral, shutdown, a failed
launch) runs and is counted in CI; ``pytest -m cuda`` runs the driver's own.
"""

from __future__ import annotations

import ctypes
import errno
import threading
import time

import numpy as np
import pytest
import torch

from faults import Fault, FaultyOsCalls, sweep
from faults._sweep import BACKGROUND, SITES
from kvoffload import BackendFatalError, LeakedFdWarning, native_io
from kvoffload.device import CpuDevice, piece_descriptors
from tests.conftest import make_caches, snapshot
from tests.test_disk_backend import run_job, start


@pytest.fixture(autouse=True)
def _core(native_core):
    return native_core


class Recorded:
    """A copy's event: recorded once the copy ran (callbacks copy synchronously)."""

    def __init__(self) -> None:
        self.recorded = 0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CallbackCopy:
    """``NativeCopy``'s shape: ``c`` for the core, and ``event``."""

    def __init__(self, dev: "CallbackCopyDevice", arrays, event: Recorded, wait: bool) -> None:
        core = native_io.core()
        ffi = core.ffi
        self.dev, self.arrays, self.event = dev, arrays, event
        token = dev.register(event)
        self.c = ffi.new("kvo_copy *")
        self.c.kind, self.c.count = core.lib.KVO_COPY_CUDA, len(arrays[2])
        self.c.batch, self.c.record = dev.batch_fn, dev.record_fn
        self.c.sync, self.c.wait = dev.wait_fn, int(wait)
        self.c.dsts, self.c.srcs, self.c.sizes = (ffi.cast("uint64_t *", a.ctypes.data) for a in arrays)
        self.c.event = ffi.cast("void *", token)


class CallbackCopyDevice(CpuDevice):
    """CpuDevice whose ``native_copy`` the core launches as a driver copy: C calls back here."""

    def __init__(self) -> None:
        ffi = native_io.core().ffi
        self.lock = threading.Lock()
        self.events: dict[int, Recorded] = {}
        self.c_launches = self.waits = 0
        self.fail_batch = 0  # a CUresult to fail the next launches with
        self.batch_fn = ffi.callback("kvo_batch_fn", self._batch)
        self.record_fn = ffi.callback("kvo_record_fn", self._record)
        self.wait_fn = ffi.callback("kvo_wait_fn", self._wait)

    def register(self, event: Recorded) -> int:
        with self.lock:
            token = len(self.events) + 1
            self.events[token] = event
        return token

    def new_event(self) -> Recorded:
        return Recorded()

    def native_copy(self, stream, layout, block_ids, host, rows, to_host, wait_event=None, event=None):
        if to_host and wait_event is not None:
            wait_event.synchronize()
        return CallbackCopy(self, piece_descriptors(layout, block_ids, host, rows, to_host),
                            event if event is not None else Recorded(), wait=to_host)

    @staticmethod
    def move(dsts, srcs, sizes) -> None:
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream) -> int:
        if self.fail_batch:
            return self.fail_batch
        ffi = native_io.core().ffi
        arr = [np.frombuffer(ffi.buffer(ffi.cast("uint64_t *", p), 8 * count), np.uint64) for p in (dsts, srcs, sizes)]
        self.move(*arr)
        with self.lock:
            self.c_launches += 1
        return 0

    def _record(self, event, stream) -> int:
        self.events[int(native_io.core().ffi.cast("uintptr_t", event))].recorded += 1
        return 0

    def _wait(self, event) -> int:
        with self.lock:
            self.waits += 1
        return 0 if self.events[int(native_io.core().ffi.cast("uintptr_t", event))].recorded else 999


def test_copies_run_inside_the_units_calls_and_move_exact_bytes(tmp_path):
    # Goal: with one IO thread per lane and 8 units per job, every store's copy is
    # made and waited for inside its own call, and every load's copy but the last is
    # launched by the next unit's call; the bytes come back exact.
    caches = make_caches("cpu", 16, [4096, 8192])
    dev = CallbackCopyDevice()
    b = start(caches, "cpu", tmp_path, num_slots=32, io_threads=1, io_unit_bytes=2 * 12288, device_impl=dev,
              native_io=True)
    try:
        want, ev = snapshot(caches), []
        assert run_job(b, list(range(16)), list(range(16, 32)), True, ev).ok
        assert (dev.c_launches, dev.waits) == (8, 8)
        for t in caches.values():
            t.fill_(7)
        assert run_job(b, list(range(16, 32)), list(range(16)), False, ev, 1).ok
        # Each unit's copy launched by the next one's call; the last by settle() (kvo_copy_gated):
        # every one from C.
        assert dev.c_launches - 8 == 8
        for k in caches:
            assert torch.equal(caches[k], want[k]), k
    finally:
        b.shutdown()


def test_a_load_copy_that_fails_to_launch_fails_its_job(tmp_path):
    # Goal: the deferred launch inside the next unit's call fails (a device error): the
    # backend turns fatal, and the job is reported failed, not complete with blocks
    # that were never written.
    caches = make_caches("cpu", 8, [4096])
    dev = CallbackCopyDevice()
    b = start(caches, "cpu", tmp_path, num_slots=16, io_threads=1, io_unit_bytes=2 * 4096, device_impl=dev,
              native_io=True)
    try:
        ev = []
        assert run_job(b, list(range(8)), list(range(8)), True, ev).ok
        caches["layer0"].fill_(7)
        dev.fail_batch = 700
        b.launch_copy(list(range(8)), list(range(8)), False, 1, ev)
        with pytest.raises(BackendFatalError, match="700"):
            ev[-1][1].synchronize(timeout=10)
        assert bool((caches["layer0"] == 7).all())  # no block written
    finally:
        b.shutdown()


def test_a_store_copy_that_fails_writes_nothing(tmp_path):
    caches = make_caches("cpu", 4, [4096])
    dev, osc = CallbackCopyDevice(), FaultyOsCalls()
    b = start(caches, "cpu", tmp_path, num_slots=8, io_threads=1, device_impl=dev, native_io=True, os_calls=osc)
    try:
        dev.fail_batch = 700
        ev = []
        b.launch_copy([0, 1], [0, 1], True, 0, ev)
        with pytest.raises(BackendFatalError, match="700"):
            ev[-1][1].synchronize(timeout=10)
        assert osc.calls["pwritev"] == 0
    finally:
        b.shutdown()


def test_a_failed_read_of_the_next_unit_still_delivers_the_previous_one(tmp_path):
    # Goal: the previous unit's copy is launched before the next unit's reads, so an
    # EIO in those reads fails only the next unit's rows: the job reports exactly them.
    caches = make_caches("cpu", 8, [4096])
    dev = CallbackCopyDevice()
    osc = FaultyOsCalls()
    b = start(caches, "cpu", tmp_path, num_slots=16, io_threads=1, io_unit_bytes=4 * 4096, device_impl=dev,
              native_io=True, os_calls=osc)
    try:
        want, ev = snapshot(caches), []
        assert run_job(b, list(range(8)), list(range(8)), True, ev).ok
        caches["layer0"].fill_(7)
        osc.fail_from("preadv", osc.calls["preadv"] + 2, Fault.error(errno.EIO))  # the second unit's reads, retries too
        assert not run_job(b, list(range(8)), list(range(8)), False, ev, 1).ok
        assert b.get_block_ids_with_load_errors() == {4, 5, 6, 7}
        assert torch.equal(caches["layer0"][:4], want["layer0"][:4])
        assert bool((caches["layer0"][4:] == 7).all())
    finally:
        b.shutdown()


def test_a_copy_prepared_when_shutdown_begins_never_writes_the_blocks(tmp_path):
    # Goal: the first unit's read hangs; shutdown ends the job as failed and gives up on
    # the thread. Released later, the thread must not launch that unit's copy: the
    # device blocks may belong to someone else by then.
    caches = make_caches("cpu", 8, [4096])
    dev = CallbackCopyDevice()
    release = threading.Event()
    osc = FaultyOsCalls()
    b = start(caches, "cpu", tmp_path, num_slots=16, io_threads=1, io_unit_bytes=4 * 4096, device_impl=dev,
              native_io=True, os_calls=osc, join_timeout=0.3)
    ev = []
    assert run_job(b, list(range(4)), list(range(4)), True, ev).ok
    caches["layer0"].fill_(7)
    launches = dev.c_launches
    osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.hang(release, timeout=30))
    b.launch_copy(list(range(4)), list(range(4)), False, 1, ev)
    assert osc.hang_entered.wait(10)
    with pytest.warns(LeakedFdWarning):
        b.shutdown()
    assert ev[-1][1].query() and not ev[-1][1].ok
    release.set()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threading.enumerate() if t.name.startswith("kvoffload-load")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert dev.c_launches == launches  # the prepared copy was never made
    assert bool((caches["layer0"] == 7).all())


@pytest.mark.faults
@pytest.mark.skipif(native_io.from_environment() is False, reason="the native path is turned off")
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("call,fault", [(c, f) for c, fs in SITES.items() if c in ("pwritev", "preadv") for f in fs],
                         ids=lambda x: repr(x).replace(" ", ""))
def test_the_data_call_sweep_holds_with_copies_in_the_native_call(cache_dir, ledger, call, fault, persistent):
    # Goal: every single fault of every data call, at every occurrence, against the
    # model, with store copies made and load copies launched inside unit_io's calls.
    dev = CallbackCopyDevice()
    outs = sweep(cache_dir, False, call, fault, persistent, BACKGROUND.get(call, ()), device=dev)
    assert len(outs) >= 8 and dev.c_launches > 0
