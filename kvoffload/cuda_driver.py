"""The CUDA driver calls kvoffload makes itself, through ctypes.

Everything else CUDA goes through torch. This module only loads ``libcuda`` when a
CUDA device is built, so importing it needs no GPU.

Which calls keep the GIL, and why: in vLLM's worker the engine thread holds the GIL
most of a step, and a thread that gave it up waits up to Python's switch interval
(5 ms) to get it back. torch's ``Event.record``, ``Stream.wait_event`` and ctypes'
usual foreign calls all give it up, for calls that only enqueue work and return in
microseconds: those (event record, query, a stream's wait) are made with
``ctypes.PYFUNCTYPE`` and keep it. ``cuMemcpyBatchAsync`` of a 16 MiB unit (512
descriptors) takes 0.56-0.64 ms (median; H200, 8-16 threads,
``scripts/probe_batch_launch.py``), too long to hold the GIL for: from Python it
gives it up; the native engine's workers call it from C instead (``CudaDevice.copy_plan``
hands them these functions' addresses). So does ``DriverEvent.synchronize``, which really
blocks.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3
CUDA_ERROR_NOT_READY = 600
CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (CUDA 12.8)."""

    class _Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_PROTOS = {  # name -> (ABI version, result and argument types)
    # The CUDA 12.8 ABI (with failIdx): CUDA 13 renamed the default to a _v2 ABI without it.
    "cuMemcpyBatchAsync": (12080, (ctypes.c_int, _P, _P, _P, ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes),
                                   ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_size_t), _P)),
    "cuEventCreate": (12000, (ctypes.c_int, ctypes.POINTER(_P), ctypes.c_uint)),
    "cuEventDestroy": (12000, (ctypes.c_int, _P)),
    "cuEventRecord": (12000, (ctypes.c_int, _P, _P)),
    "cuEventQuery": (12000, (ctypes.c_int, _P)),
    "cuEventSynchronize": (12000, (ctypes.c_int, _P)),
    "cuStreamWaitEvent": (12000, (ctypes.c_int, _P, _P, ctypes.c_uint)),
}
_RELEASE_GIL = ("cuMemcpyBatchAsync", "cuEventSynchronize")


class Driver:
    """The driver functions above, resolved through cuGetProcAddress at fixed ABI
    versions, so their signatures hold whatever the driver's own version.

    Called with numpy descriptor arrays: building one Python object per descriptor
    (cuda.bindings' list API) costs more than the copy for small blocks. vLLM 0.33
    needs the same batched copy, so a driver without it cannot run vLLM's offload either.
    """

    def __init__(self) -> None:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
            get_proc = libcuda.cuGetProcAddress_v2
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"kvoffload needs the CUDA driver's cuGetProcAddress: {e}") from e
        get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(_P), ctypes.c_int, ctypes.c_uint64,
                             ctypes.POINTER(ctypes.c_int)]
        self.addresses: dict[str, int] = {}
        for name, (version, types) in _PROTOS.items():
            fn, status = _P(), ctypes.c_int()
            rc = get_proc(name.encode(), ctypes.byref(fn), version, 0, ctypes.byref(status))
            if rc != 0 or not fn.value:
                raise RuntimeError(
                    f"the CUDA driver has no {name} (CUresult {rc}); kvoffload, like vLLM's offload, "
                    "needs a driver for CUDA 12.8 or newer"
                )
            self.addresses[name] = fn.value
            # The GIL is kept for the calls that return at once, given up for the others.
            proto = ctypes.CFUNCTYPE if name in _RELEASE_GIL else ctypes.PYFUNCTYPE
            setattr(self, name, proto(*types)(fn.value))

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attr: MemcpyAttributes,
                     stream: Any) -> None:
        """Queue ``len(sizes)`` copies ``srcs[i] -> dsts[i]`` (uint64 arrays) on ``stream``."""
        fail_idx = ctypes.c_size_t(0)
        attr_idx = ctypes.c_size_t(0)
        rc = self.cuMemcpyBatchAsync(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
            ctypes.byref(attr), ctypes.byref(attr_idx), 1, ctypes.byref(fail_idx), stream.cuda_stream,
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail_idx.value}")

    def stream_wait(self, stream: Any, event: Any) -> None:
        """``stream`` waits for ``event`` (a ``DriverEvent`` or a ``torch.cuda.Event``)."""
        handle = event.handle if isinstance(event, DriverEvent) else getattr(event, "cuda_event", None)
        if handle is None:  # some other event type: its own wait (which may release the GIL)
            stream.wait_event(event)
        elif handle:  # 0: a torch event never recorded, which torch's wait skips too
            self.check(self.cuStreamWaitEvent(stream.cuda_stream, handle, 0), "cuStreamWaitEvent")


class DriverEvent:
    """A CUDA event made, recorded and queried through ``Driver`` (GIL held)."""

    __slots__ = ("driver", "handle", "__weakref__")

    def __init__(self, driver: Driver, blocking: bool) -> None:
        self.driver = driver
        handle = _P()
        # Blocking: a waiting thread sleeps instead of spinning (CudaDevice.blocking_events).
        flags = CU_EVENT_DISABLE_TIMING | (CU_EVENT_BLOCKING_SYNC if blocking else 0)
        driver.check(driver.cuEventCreate(ctypes.byref(handle), flags), "cuEventCreate")
        self.handle: int = handle.value
        # It belongs to the context, not to a thread: destroyed when collected.
        weakref.finalize(self, driver.cuEventDestroy, self.handle)

    def record(self, stream: Any) -> None:
        self.driver.check(self.driver.cuEventRecord(self.handle, stream.cuda_stream), "cuEventRecord")

    def query(self) -> bool:
        rc = self.driver.cuEventQuery(self.handle)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.driver.check(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        self.driver.check(self.driver.cuEventSynchronize(self.handle), "cuEventSynchronize")
