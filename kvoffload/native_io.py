"""The native IO core's Python side: loading it, the one choice per run, and a unit's call.

``kvoffload._native`` is compiled when the package is built (``build_native.py``, cffi
API mode, from ``kvoffload/native/``); it is never built, cached or written at run time.
It does a whole IO unit (every run's file call, the single-slot retries, every slot's
AES-GCM seal or open, and the unit's device copy) in one call without the GIL:
``store_unit.c`` for the store path, ``load_unit.c`` for the load path. In vLLM's worker
that is what keeps the drives' bandwidth beside a busy engine thread.

Whether a run uses it is decided once, at ``init`` (``choose``), kept on the run
(``Run.native``), and named in the start-up line, ``python -m kvoffload --dir``, the
metrics' info and the bench's JSON. The Python path (``store_path``/``load_path``'s
``*_python`` methods) is its reference: ``tests/test_native_differential.py`` drives both
with the same jobs and fault schedules and requires the same outcomes.

File calls go through the run's ``OsCalls``: the kernel's ``preadv``/``pwritev`` straight
from C where the seam is the plain one, else the seam's own methods, called back with
the very buffers the Python path passes, so a fault injected on the Nth call hits the
same slots on both paths. That is checked at every unit, so a method patched onto the
instance after ``init`` is honoured too.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from kvoffload.config import NATIVE_IO_ENV as ENV
from kvoffload.config import parse_choice
from kvoffload.os_calls import OsCalls, moved
from kvoffload.slot_seal import SlotSeal

# Most slots one file call moves, on both paths: the kernel takes at most IOV_MAX
# buffers a call, and a direct lane passes one per block.
MAX_RUN_SLOTS = 1024


@dataclass(frozen=True)
class NativeCore:
    """The loaded extension: cffi's ``ffi`` and ``lib``, and what it was built as."""

    ffi: Any
    lib: Any
    build: str  # e.g. "unit_io 4f38..." (a digest of its sources)
    gcm: str  # the AES-GCM code path this CPU takes ("none": no AES-GCM here)

    def describe(self) -> str:
        return f"native ({self.build}, AES-GCM {self.gcm})"


_CORE: Optional[NativeCore] = None
_WHY_NOT: Optional[str] = None
_LOCK = threading.Lock()


def _import() -> NativeCore:
    try:
        _native = importlib.import_module("kvoffload._native")  # optional: not built without a compiler
    except ModuleNotFoundError as e:
        raise ImportError("the native IO core was not built with this install: pip builds it where it finds a "
                          "C compiler") from e
    except ImportError as e:  # a broken, foreign or empty file under its name
        raise ImportError(f"the native IO core cannot be loaded: {e}") from e
    ffi, lib = _native.ffi, _native.lib
    for name in ("kvo_store_unit", "kvo_load_unit", "kvo_build_info", "kvo_gcm_supported"):
        if not hasattr(lib, name):
            raise ImportError(f"{_native.__file__} lacks {name}: not kvoffload's native core")
    build = ffi.string(lib.kvo_build_info()).decode()
    sources = Path(__file__).with_name("native")
    builder = Path(__file__).resolve().parent.parent / "build_native.py"
    if sources.is_dir() and builder.is_file():
        # A source tree (an editable install): its sources must be what was built.
        want = _source_digest(builder, sources)
        if want is not None and not build.endswith(want):
            raise ImportError(f"{_native.__file__} was built from other sources ({build}, the tree's are {want}): "
                              "rebuild it with `pip install -e .`")
    ffi.def_extern(name="kvo_io_callback")(_io_callback)
    gcm = ffi.string(lib.kvo_gcm_impl()).decode() if lib.kvo_gcm_supported() else "none"
    return NativeCore(ffi, lib, build, gcm)


def _source_digest(builder: Path, sources: Path) -> Optional[str]:
    spec = importlib.util.spec_from_file_location("_kvoffload_build_native", builder)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        return mod.source_digest(sources)
    except Exception:  # noqa: BLE001 - an unreadable tree cannot prove the build stale
        return None


def core() -> Optional[NativeCore]:
    """The native core, or None (``why_unavailable()`` says why); loaded once per process."""
    global _CORE, _WHY_NOT
    if _CORE is not None or _WHY_NOT is not None:
        return _CORE
    with _LOCK:
        if _CORE is None and _WHY_NOT is None:
            try:
                _CORE = _import()
            except Exception as e:  # noqa: BLE001 - a broken or foreign file: the Python path, said why
                _WHY_NOT = str(e) or type(e).__name__
        return _CORE


def why_unavailable() -> Optional[str]:
    core()
    return _WHY_NOT


def from_environment() -> Optional[bool]:
    """``$KVOFFLOAD_NATIVE_IO``: on (required), off (the Python path), auto or unset."""
    return parse_choice(os.environ.get(ENV, ""), ENV)


# The seals the core implements; xxh3 checksums stay on the Python path.
NATIVE_SEALS = ("aes-gcm", "off")


def seal_code(core: NativeCore, seal: SlotSeal) -> int:
    """The core's ``KVO_SEAL_*`` (native/unit_io.h) for ``seal``, one of ``NATIVE_SEALS``."""
    return core.lib.KVO_SEAL_AES_GCM if seal.name == "aes-gcm" else core.lib.KVO_SEAL_OFF


def choose(seal: SlotSeal, requested: Optional[bool]) -> tuple[Optional[NativeCore], str]:
    """The one choice: (the core, or None for the Python path; what the start-up line says).

    ``requested`` True and no core raises ``ValueError`` naming why.
    """
    why = None
    if requested is False:
        why = f"turned off (native_io=off or {ENV}=off)"
    elif seal.name not in NATIVE_SEALS:
        why = f"no native {seal.name} seal"
    elif core() is None:
        why = why_unavailable()
    elif seal.name == "aes-gcm" and core().gcm == "none":
        why = "this CPU has no AES-NI and PCLMULQDQ for the native AES-GCM"
    if why is None:
        return core(), core().describe()
    if requested:
        raise ValueError(f"native_io=on: {why}")
    return None, f"Python ({why})"


def plain_call(osc: OsCalls, name: str) -> bool:
    """Whether ``osc.<name>`` is ``OsCalls``' own, so C may make the call itself: not
    overridden by a subclass, nor set on the instance (as ``mock.patch.object`` does)."""
    return getattr(type(osc), name, None) is getattr(OsCalls, name) and name not in getattr(osc, "__dict__", {})


class _SeamCall:
    """What ``kvo_io_callback`` calls: the seam's method on the Python path's buffers."""

    __slots__ = ("method", "fd", "span", "exc")

    def __init__(self) -> None:
        self.method: Any = None
        self.fd = -1
        self.span: Optional[Callable[[int, int], list[memoryview]]] = None
        self.exc: Optional[BaseException] = None


def _io_callback(handle: Any, j0: int, j1: int, offset: int) -> int:
    call = _CORE.ffi.from_handle(handle) if _CORE is not None else None
    if call is None or call.exc is not None:  # a seam that raised: no more calls this unit
        return -errno.EIO
    try:
        return moved(call.method(call.fd, call.span(j0, j1), offset), call.method)
    except OSError as e:
        return -(e.errno or errno.EIO)
    except BaseException as e:  # noqa: BLE001 - carried out of C, raised after the unit
        call.exc = e
        return -errno.EIO


class DeviceCopyError(RuntimeError):
    """A device copy launched by a unit's call failed (a device failure: fatal)."""


class UnitCall:
    """One IO thread's arrays for its units (``rows`` slots), reused by every call."""

    def __init__(self, core: NativeCore, rows: int, aad_bytes: int) -> None:
        ffi = core.ffi
        self.core, self.rows, self.aad_bytes = core, rows, aad_bytes
        self.file_off = np.zeros(rows, np.int64)
        self.buf = np.zeros(rows, np.uint64)
        self.payload = np.zeros(rows, np.uint64)
        self.nonce = np.zeros((rows, 12), np.uint8)
        self.aad = np.zeros((rows, max(1, aad_bytes)), np.uint8)
        self.tag = np.zeros((rows, 16), np.uint8)
        self.status = np.zeros(rows, np.int32)
        self.err = np.zeros(rows, np.int32)
        self.cut = np.zeros(rows, np.uint8)
        self.slots = ffi.new("kvo_slots *")
        for name, field in ffi.typeof("kvo_slots").fields:
            arr = getattr(self, name)  # each array's element must be the header's type
            if arr.itemsize != ffi.sizeof(field.type.item):
                raise TypeError(f"kvo_slots.{name}: {arr.dtype} does not fit {ffi.getctype(field.type)}")
            setattr(self.slots, name, ffi.cast(field.type, arr.ctypes.data))
        self.unit = ffi.new("kvo_unit *")
        self.seam = _SeamCall()
        self._handle = ffi.new_handle(self.seam)

    def run(self, is_store: bool, n: int, fd: int, slot_bytes: int, payload_bytes: int, seal: int, key: Any,
            osc: OsCalls, span: Callable[[int, int], list[memoryview]], gate: Any, copy: Any) -> None:
        """Store or load the first ``n`` slots described in the arrays; outcomes land in
        ``status``/``err`` (and stores' ``tag``). The GIL is released for the call.

        Raises what the seam raised (other than ``OSError``), or ``DeviceCopyError`` where
        the copy failed (then no slot was touched).
        """
        ffi, lib = self.core.ffi, self.core.lib
        u = self.unit
        u.fd, u.n, u.slot_bytes, u.payload_bytes = fd, n, slot_bytes, payload_bytes
        u.max_run, u.seal, u.aad_bytes, u.key = MAX_RUN_SLOTS, seal, self.aad_bytes, key
        u.gate = gate
        u.copy = ffi.NULL if copy is None else copy
        name = "pwritev" if is_store else "preadv"
        if plain_call(osc, name):
            u.io, u.io_handle = ffi.NULL, ffi.NULL
        else:
            self.seam.method, self.seam.fd, self.seam.span, self.seam.exc = getattr(osc, name), fd, span, None
            u.io, u.io_handle = lib.kvo_io_callback, self._handle
        try:
            rc = (lib.kvo_store_unit if is_store else lib.kvo_load_unit)(u, self.slots)
        finally:
            self.seam.span = self.seam.method = None  # the unit's buffers are not kept
        exc, self.seam.exc = self.seam.exc, None
        if exc is not None:
            raise exc
        if rc != 0:
            raise DeviceCopyError(f"kvoffload: the unit's device copy failed: CUresult {rc}")

    @property
    def seconds(self) -> tuple[float, float, float]:
        """(file calls, seal or open, device copy) of the last call."""
        u = self.unit
        return u.io_ns / 1e9, u.seal_ns / 1e9, u.copy_ns / 1e9


def gcm_key(core: NativeCore, key: bytes) -> Any:
    """The core's expanded AES-GCM key (``wipe`` it when the run ends)."""
    k = core.ffi.new("kvo_gcm_key *")
    core.lib.kvo_gcm_init(k, key)
    return k


def wipe(core: NativeCore, obj: Any) -> None:
    """Overwrite a cffi object's bytes (an expanded key) with zeros."""
    core.ffi.memmove(obj, b"\0" * core.ffi.sizeof(obj[0]), core.ffi.sizeof(obj[0]))
