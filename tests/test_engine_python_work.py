"""The Python work an engine does on its own threads grows with jobs, not with units.

In vLLM's worker the engine thread holds the GIL most of a step: every Python call on an
IO thread waits for it. The native engine's units run in C, so its own Python threads (the
collector) do a constant amount of work per job however many units it has; the Python
engine's threads work per unit, which this count shows too (the measure is not blind).
Deterministic: Python function calls counted by ``threading.setprofile`` on kvoffload's
threads, not time. The GPU path runs on the CPU device (staged blocks), the tier's on host
blocks (``HostDevice``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from kvoffload import DiskBackend
from kvoffload.device import CpuDevice, HostDevice
from tests.conftest import block_bytes, make_caches

BLOCK = 4096
UNITS = 64


class CallCount:
    """Python and C function calls made on kvoffload's own threads while it is on."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.on = False

    def hook(self, frame, event, arg):
        if self.on and event in ("call", "c_call"):
            name = threading.current_thread().name
            if name.startswith("kvoffload-"):
                self.calls[name] += 1

    def __enter__(self) -> "CallCount":
        threading.setprofile(self.hook)  # for every thread started from now on
        return self

    def __exit__(self, *exc) -> None:
        threading.setprofile(None)


def backend(tmp_path, engine: str, host: bool) -> tuple[DiskBackend, dict]:
    caches = ({"blocks": torch.randint(-128, 128, (UNITS, BLOCK), dtype=torch.int8)} if host
              else make_caches("cpu", UNITS, [BLOCK // 2, BLOCK // 2]))
    b = DiskBackend()
    # One block a unit: a job of UNITS blocks is UNITS units.
    b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 2 * UNITS, block_bytes(caches), io_threads=2,
           io_unit_bytes=BLOCK, report_load_errors=True, native_io=engine == "native",
           device_impl=HostDevice() if host else CpuDevice())
    b.collect_metrics = True
    return b, caches


def python_calls(count: CallCount, b: DiskBackend, n: int, is_store: bool) -> int:
    """Calls on kvoffload's threads for one job of ``n`` blocks (each its own unit)."""
    ev: list = []
    ids = list(range(n))
    before = sum(count.calls.values())
    count.on = True
    try:
        b.launch_copy(ids, ids, is_store, 0, ev)
        assert ev[0][1].wait(30) and ev[0][1].ok
        # The job's event completes inside the last settle: let the thread finish it.
        while b._run.open_jobs:
            time.sleep(0.001)
    finally:
        count.on = False
    return sum(count.calls.values()) - before


@pytest.mark.parametrize("host", [False, True], ids=["gpu-path", "tier"])
def test_the_native_engines_python_work_grows_with_jobs_not_units(tmp_path, native_core, host):
    with CallCount() as count:
        b, _ = backend(tmp_path, "native", host)
        engine = b._run.engine
        called_back = Counter()
        for name in ("file_call", "copy"):  # Python reached from a worker: none here
            real = getattr(engine, name)
            setattr(engine, name, lambda *a, _r=real, _n=name: (called_back.update([_n]), _r(*a))[1])
        try:
            for is_store in (True, False):
                python_calls(count, b, 1, is_store)  # warm: first-use imports and caches
                one = python_calls(count, b, 1, is_store)
                many = python_calls(count, b, UNITS, is_store)
                # A constant per job: numpy's per-call work does not depend on the units;
                # 64 units of Python work would add thousands of calls.
                assert many <= one + 40, (is_store, one, many)
            assert not called_back, called_back
        finally:
            b.shutdown()


@pytest.mark.parametrize("host", [False, True], ids=["gpu-path", "tier"])
def test_the_python_engines_work_grows_with_units(tmp_path, host):
    # The measure is not blind: the Python engine's IO threads work per unit.
    with CallCount() as count:
        b, _ = backend(tmp_path, "python", host)
        try:
            for is_store in (True, False):
                python_calls(count, b, 1, is_store)
                one = python_calls(count, b, 1, is_store)
                many = python_calls(count, b, UNITS, is_store)
                assert many > 20 * one, (is_store, one, many)
        finally:
            b.shutdown()
