"""A lane's units through ``unit_io``: one GIL-free call per unit, same outcomes as Python.

The lanes call this instead of their per-slot Python loop (``Lane.transfer`` and the
seal's ``seal``/``open``) where the run has the native library and a seal it knows
(AES-GCM or none). A slot's buffer is where its file bytes are (a staging row, or
its host block on a direct lane); its payload is where the plaintext is taken from
or put (the same buffer in place, or the host block). What fails is reported and
logged as on the Python path, and a slot's record is still published only by the
lane, once its write succeeded whole.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import numpy as np

from kvoffload import unit_io
from kvoffload.slot_seal import AesGcmSeal, SlotSeal, ValiditySeal

_STATUS_TEXT = {unit_io.STATUS_SHORT: "short", unit_io.STATUS_INTEGRITY: "integrity",
                unit_io.STATUS_CIPHER: "cipher"}


def native_seal(seal: SlotSeal) -> Optional[int]:
    """The library's seal kind for ``seal``, or None where it has none (xxh3)."""
    if isinstance(seal, AesGcmSeal):
        return unit_io.SEAL_AES_GCM
    if isinstance(seal, ValiditySeal):
        return unit_io.SEAL_OFF
    return None


class NativeUnits:
    """One lane's native executor; its per-slot arrays are per thread."""

    def __init__(self, lane: Any, lib: Any) -> None:
        self.lane, self.lib = lane, lib
        run = lane.run
        self.kind = native_seal(run.seal)
        self.key = run.seal.key if self.kind == unit_io.SEAL_AES_GCM else None
        self.fns = unit_io.io_functions(run.osc)
        self._local = threading.local()

    def _arrays(self) -> unit_io.UnitArrays:
        a = getattr(self._local, "arrays", None)
        if a is None:
            a = self._local.arrays = unit_io.UnitArrays.make(self.lane.rows)
        return a

    def _fill(self, unit: Any, js: list[int], bufs: np.ndarray, payloads: np.ndarray) -> unit_io.UnitArrays:
        a, k = self._arrays(), len(js)
        size = self.lane.file.slot_bytes
        a.file_off[:k] = np.asarray([unit.local[j] for j in js], np.int64) * size
        a.buf[:k] = bufs
        a.payload[:k] = payloads
        a.aad[:k] = [unit.slots[j] for j in js]
        a.cut[:k] = 0
        if unit.parts:  # a batch: no run of file IO spans two of its units
            part = np.repeat(np.arange(len(unit.parts)), [len(p.slots) for p in unit.parts])[js]
            a.cut[1:k] = part[1:] != part[:-1]
        return a

    def store(self, unit: Any, js: list[int], bufs: np.ndarray, payloads: np.ndarray,
              copy: Any = None) -> tuple[list[Any], set[int]]:
        """Seal and write slots ``js`` of ``unit``, after ``copy`` (a ``NativeCopy`` into
        staging, made and waited for first) where given; (their records, the rows that failed)."""
        a, k = self._fill(unit, js, bufs, payloads), len(js)
        if self.kind == unit_io.SEAL_AES_GCM:
            first = self.lane.run.seal.reserve_nonces(k)
            a.nonce[:k] = np.arange(first, first + k, dtype=np.uint64)
        self._run(unit, True, a, k, copy)
        if self.kind == unit_io.SEAL_AES_GCM:
            records = [(first + i, a.tag[i].tobytes()) for i in range(k)]
        else:
            records = [True] * k
        return records, self._failed(unit, js, a, k)

    def load(self, unit: Any, js: list[int], records: list[Any], bufs: np.ndarray,
             payloads: np.ndarray, copy: Any = None) -> tuple[set[int], int]:
        """Read and open slots ``js`` of ``unit`` (records of each), after launching
        ``copy`` (a ``NativeCopy``: the previous unit's) where given; (the rows that failed,
        how many slots were read whole). A failed row's payload is left zeroed."""
        a, k = self._fill(unit, js, bufs, payloads), len(js)
        if self.kind == unit_io.SEAL_AES_GCM:
            recs = [records[j] for j in js]
            a.nonce[:k] = [r[0] for r in recs]
            a.tag[:k] = np.frombuffer(b"".join(r[1] for r in recs), np.uint8).reshape(k, unit_io.TAG_BYTES)
        self._run(unit, False, a, k, copy)
        status = a.status[:k]
        read = int(((status != unit_io.STATUS_IO_ERROR) & (status != unit_io.STATUS_SHORT)).sum())
        return self._failed(unit, js, a, k), read

    def _run(self, unit: Any, is_store: bool, a: unit_io.UnitArrays, k: int, copy: Any) -> None:
        lane = self.lane
        t0 = time.perf_counter()
        try:
            unit_io.run_unit(self.lib, is_store, self.fns, lane.file.fd, k, a, lane.file.slot_bytes,
                             lane.run.layout.block_bytes, self.kind, self.key, None if copy is None else copy.c)
        finally:
            unit.io_seconds += time.perf_counter() - t0  # the seals' time is in it too

    def _failed(self, unit: Any, js: list[int], a: unit_io.UnitArrays, k: int) -> set[int]:
        bad = np.flatnonzero(a.status[:k])
        if not len(bad):
            return set()
        lane, f = self.lane, self.lane.file
        is_store = lane.direction == "store"
        integrity = [js[i] for i in bad if a.status[i] == unit_io.STATUS_INTEGRITY]
        io = [js[i] for i in bad if a.status[i] != unit_io.STATUS_INTEGRITY]
        short = int((a.status[:k] == unit_io.STATUS_SHORT).sum())
        lane.run.metrics.failed(is_store, "integrity", len(integrity))
        lane.run.metrics.failed(is_store, "short", short)
        lane.run.metrics.failed(is_store, "io_error", len(io) - short)
        if integrity:
            lane.run.log.warning("integrity", "kvoffload: slot(s) %s of %s failed the %s check",
                                 [unit.slots[j] for j in integrity], f.path, lane.run.seal.name)
        if io:
            first = next(i for i in bad if a.status[i] != unit_io.STATUS_INTEGRITY)
            code = int(a.err[first])
            why = (OSError(code, os.strerror(code)) if code else
                   f"{_STATUS_TEXT.get(int(a.status[first]), 'failed')} {lane.direction}")
            lane.run.log.warning(f"{lane.direction} error", "kvoffload: %s of slots %s of %s failed: %s",
                                 lane.direction, [unit.slots[j] for j in io], f.path, why)
        return {js[i] for i in bad}


ENV = "KVOFFLOAD_NATIVE_IO"
_ENV_VALUES = {"on": True, "off": False, "auto": None, "": None}


def from_environment() -> Optional[bool]:
    """``$KVOFFLOAD_NATIVE_IO``: on (required), off (the Python path), auto or unset.

    An operator's switch that needs no config change; the tests run the Python path
    through it too.
    """
    value = os.environ.get(ENV, "").strip().lower()
    if value not in _ENV_VALUES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected on, off or auto")
    return _ENV_VALUES[value]


def why_not(seal: SlotSeal, requested: Optional[bool]) -> Optional[str]:
    """Why a run will not use the native path (None: it will)."""
    if requested is False:
        return f"turned off (native_io=False or {ENV}=off)"
    if native_seal(seal) is None:
        return f"no native {seal.name} seal"
    reason = unit_io.why_unavailable()
    if reason is not None:
        return f"unit_io unavailable: {reason}"
    return None

