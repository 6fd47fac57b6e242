"""The CUDA driver calls kvoffload makes itself: ``cuMemcpyBatchAsync`` through ctypes.

Everything else CUDA goes through torch. This module only loads ``libcuda`` when a
CUDA device is built, so importing it needs no GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3


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


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` with the CUDA 12.8 ABI (the one with failIdx).

    Resolved through cuGetProcAddress at version 12080 so the signature is fixed
    whatever the driver's own version (CUDA 13 renamed the default to a _v2 ABI
    without failIdx). Called with numpy descriptor arrays: building one Python object
    per descriptor (cuda.bindings' list API) costs more than the copy for small blocks.
    vLLM 0.33 needs the same call, so a driver without it cannot run vLLM's offload either.
    """

    def __init__(self) -> None:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
            get_proc = libcuda.cuGetProcAddress_v2
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"kvoffload needs the CUDA driver's cuGetProcAddress: {e}") from e
        fn = ctypes.c_void_p()
        status = ctypes.c_int()
        get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                             ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        rc = get_proc(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(status))
        if rc != 0 or not fn.value:
            raise RuntimeError(
                f"the CUDA driver has no cuMemcpyBatchAsync (CUresult {rc}); kvoffload, like vLLM's "
                "offload, needs a driver for CUDA 12.8 or newer"
            )
        proto = ctypes.CFUNCTYPE(
            ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
        )
        self._fn = proto(fn.value)

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attr: MemcpyAttributes,
                 stream: Any) -> None:
        """Queue ``len(sizes)`` copies ``srcs[i] -> dsts[i]`` (uint64 arrays) on ``stream``."""
        fail_idx = ctypes.c_size_t(0)
        attr_idx = ctypes.c_size_t(0)
        rc = self._fn(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
            ctypes.byref(attr), ctypes.byref(attr_idx), 1, ctypes.byref(fail_idx),
            ctypes.c_void_p(stream.cuda_stream),
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail_idx.value}")
