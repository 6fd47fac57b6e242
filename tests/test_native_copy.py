"""Device copies made by the native engine's own workers, on CPU.

On CUDA (``CudaDevice.copy_plan``) a native worker launches a store's copy into staging
and waits for it, and launches a load's copy out of staging once its slots are opened,
waiting for it once its next unit is read: all in C, with no GIL. Here a CPU device
offers the same plan as a CUDA one whose driver functions (``cuMemcpyBatchAsync``,
``cuEventRecord``, ``cuEventSynchronize``, ``cuStreamWaitEvent``) are cffi callbacks of
the header's own function types, so the engine's logic around them (the order of launch
and wait, shutdown, a failed launch, a store's wait event) runs and is counted in CI;
``pytest -m cuda`` runs the driver's own.
"""

from __future__ import annotations

import ctypes
import errno
import threading

import numpy as np
import pytest
import torch

from faults import Fault, FaultyOsCalls, sweep, wait_threads_gone
from faults._sweep import BACKGROUND, SITES
from kvoffload import BackendFatalError, LeakedFdWarning
from kvoffload.device import CopyPlan, CpuDevice
from kvoffload.engine_choice import from_environment
from tests.conftest import make_caches, snapshot
from tests.test_disk_backend import run_job, start


@pytest.fixture(autouse=True)
def _core(native_core):
    return native_core


class Recorded:
    """An event the callbacks record (copies are synchronous here)."""

    def __init__(self, token: int) -> None:
        self.token, self.recorded = token, 0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CallbackCopyDevice(CpuDevice):
    """A CPU device whose plan is a CUDA one with callbacks for the driver's functions."""

    def __init__(self) -> None:
        from kvoffload import native_engine

        self.ffi = ffi = native_engine.core().ffi
        self.lock = threading.Lock()
        self.events: dict[int, Recorded] = {}
        self.launches = self.syncs = 0
        self.stream_waits: list[int] = []
        self.python_copies = 0
        self.fail_batch = 0  # a CUresult to fail the next launches with
        self.fns = {"batch": ffi.callback("kvo_batch_fn", self._batch),
                    "record": ffi.callback("kvo_record_fn", self._record),
                    "sync": ffi.callback("kvo_wait_fn", self._sync),
                    "stream_wait": ffi.callback("kvo_stream_wait_fn", self._stream_wait)}

    def new_event(self) -> Recorded:
        with self.lock:
            ev = Recorded(len(self.events) + 1)
            self.events[ev.token] = ev
        return ev

    def copy_plan(self, stream, layout, to_host, events):
        addr = {k: int(self.ffi.cast("uintptr_t", f)) for k, f in self.fns.items()}
        return CopyPlan("cuda", *layout.pointer_arrays, functions=addr, events=tuple(e.token for e in events),
                        keep=(self.fns,))

    def event_handle(self, event):
        return event.token if isinstance(event, Recorded) else None

    def copy_to_host(self, *a, **kw):
        self.python_copies += 1
        return super().copy_to_host(*a, **kw)

    def copy_to_device(self, *a, **kw):
        self.python_copies += 1
        return super().copy_to_device(*a, **kw)

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream) -> int:
        if self.fail_batch:
            return self.fail_batch
        ffi = self.ffi
        arr = [np.frombuffer(ffi.buffer(ffi.cast("uint64_t *", p), 8 * count), np.uint64) for p in (dsts, srcs, sizes)]
        for d, s, n in zip(*(a.tolist() for a in arr)):
            ctypes.memmove(d, s, n)
        with self.lock:
            self.launches += 1
        return 0

    def _record(self, event, stream) -> int:
        self.events[int(self.ffi.cast("uintptr_t", event))].recorded += 1
        return 0

    def _sync(self, event) -> int:
        with self.lock:
            self.syncs += 1
        return 0 if self.events[int(self.ffi.cast("uintptr_t", event))].recorded else 999

    def _stream_wait(self, stream, event, flags) -> int:
        with self.lock:
            self.stream_waits.append(int(self.ffi.cast("uintptr_t", event)))
        return 0


def test_copies_are_made_by_the_workers_and_move_exact_bytes(tmp_path):
    # Goal: with one worker per lane and 8 units per job, every store's copy is launched
    # and waited for by its worker, every load's launched and waited for: all from C, none
    # through Python; a store's wait event is waited for on the worker's stream; the bytes
    # come back exact.
    caches = make_caches("cpu", 16, [4096, 8192])
    dev = CallbackCopyDevice()
    b = start(caches, "cpu", tmp_path, num_slots=32, io_threads=1, io_unit_bytes=2 * 12288, device_impl=dev,
              native_io=True)
    try:
        want, ev = snapshot(caches), []
        gate = dev.new_event()
        assert run_job(b, list(range(16)), list(range(16, 32)), True, ev, wait_event=gate).ok
        assert (dev.launches, dev.syncs) == (8, 8) and dev.stream_waits == [gate.token] * 8
        for t in caches.values():
            t.fill_(7)
        assert run_job(b, list(range(16, 32)), list(range(16)), False, ev, 1).ok
        assert (dev.launches, dev.syncs) == (16, 16) and dev.python_copies == 0
        for k in caches:
            assert torch.equal(caches[k], want[k]), k
    finally:
        b.shutdown()


def test_a_load_copy_that_fails_to_launch_fails_its_job(tmp_path):
    # Goal: the launch fails (a device error): the backend turns fatal, and the job is
    # reported failed, not complete with blocks that were never written.
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
    # Goal: a unit's copy is launched once its own slots are opened, so an EIO in the next
    # unit's reads fails only the next unit's rows: the job reports exactly them.
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


def test_a_copy_not_launched_when_shutdown_ends_its_job_never_writes_the_blocks(tmp_path):
    # Goal: the unit's read hangs; shutdown ends the job as failed and gives up on the
    # worker. Released later, the worker must not launch that unit's copy: the device
    # blocks may belong to someone else by then.
    caches = make_caches("cpu", 8, [4096])
    dev = CallbackCopyDevice()
    release = threading.Event()
    osc = FaultyOsCalls()
    b = start(caches, "cpu", tmp_path, num_slots=16, io_threads=1, io_unit_bytes=4 * 4096, device_impl=dev,
              native_io=True, os_calls=osc, join_timeout=0.3)
    ev = []
    assert run_job(b, list(range(4)), list(range(4)), True, ev).ok
    caches["layer0"].fill_(7)
    launches = dev.launches
    osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.hang(release, timeout=30))
    b.launch_copy(list(range(4)), list(range(4)), False, 1, ev)
    assert osc.hang_entered.wait(10)
    with pytest.warns(LeakedFdWarning):
        b.shutdown()
    assert ev[-1][1].query() and not ev[-1][1].ok
    release.set()
    wait_threads_gone()
    assert dev.launches == launches  # the copy was never made
    assert bool((caches["layer0"] == 7).all())


@pytest.mark.faults
@pytest.mark.skipif(from_environment() is False, reason="the native engine is turned off")
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("call,fault", [(c, f) for c, fs in SITES.items() if c in ("pwritev", "preadv") for f in fs],
                         ids=lambda x: repr(x).replace(" ", ""))
def test_the_data_call_sweep_holds_with_copies_in_the_native_workers(cache_dir, ledger, call, fault, persistent):
    # Goal: every single fault of every data call, at every occurrence, against the
    # model, with every copy made by the native workers as CUDA's are.
    dev = CallbackCopyDevice()
    outs = sweep(cache_dir, False, call, fault, persistent, BACKGROUND.get(call, ()), device=dev)
    assert len(outs) >= 8 and dev.launches > 0
