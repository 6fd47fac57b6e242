"""vLLM 0.33's ``fs`` tier IO core, loaded from its wheel's files and driven as its manager does.

For hosts where vLLM cannot be installed (the GPU host: it pins another torch and pulls in
a server's worth of packages) but its compiled IO runs: ``io.py`` and ``thread_pool.py`` of
``vllm/v1/kv_offload/tiering/fs/`` and ``vllm/fs_io_C.abi3.so`` are read at run time from
the wheel (``--fs-wheel``), from a directory the wheel was unpacked into keeping its paths
(``--fs-files``), or from an installed vLLM; nothing of vLLM is copied into this repo.

The two Python files import only two names from the rest of vLLM (its logger and the
``JobId`` alias, an int); the loader gives them those, and ``io.py`` the extension it
loaded itself, through the modules' own ``__import__``, so ``sys.modules`` is left alone.
The extension links libtorch (``torch`` is imported first) and, in the 0.33.0 wheel, CUDA
libraries: over a CPU-only torch it does not load, and ``io.py`` runs its Python fallback,
as vLLM's own tier would there. ``FsCoreTier.compiled`` says which ran.

``FsCoreTier`` is ``FileSystemTierManager``'s data path: one task per job calling
``batch_store_block``/``batch_load_block`` over the whole job, on a ``DualQueueThreadPool``
(16 read and 16 write threads by default), O_DIRECT as ``probe_o_direct`` finds, a file per
chunk at ``<root>/<model>_<hash>_r0/<hhh>/<hh>_g0/<hash>.bin`` and its ``config.json``.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import types
import zipfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

IO_PY = "vllm/v1/kv_offload/tiering/fs/io.py"
POOL_PY = "vllm/v1/kv_offload/tiering/fs/thread_pool.py"
EXT_SO = "vllm/fs_io_C.abi3.so"
EXT_NAME = "vllm.fs_io_C"


@dataclass
class FsCore:
    """The loaded modules, where they came from, and whether the compiled IO loaded."""

    io: types.ModuleType
    pool: types.ModuleType
    source: str
    compiled: bool
    ext_error: Optional[str] = None  # why the extension did not load

    @property
    def path_name(self) -> str:
        return "C" if self.compiled else "Python"


def load(wheel: Optional[str] = None, files: Optional[str] = None) -> FsCore:
    """The fs IO core from ``wheel`` (a .whl), ``files`` (the wheel unpacked, its paths kept)
    or, with neither, the installed vLLM's package directory; ``SystemExit`` naming what is
    missing."""
    if wheel is not None:
        try:
            with zipfile.ZipFile(wheel) as z:
                texts = {name: z.read(name) for name in (IO_PY, POOL_PY, EXT_SO)}
        except (OSError, zipfile.BadZipFile, KeyError) as e:
            raise SystemExit(f"--fs-wheel {wheel}: cannot read vLLM's fs tier from it ({e}); "
                             "give the vLLM 0.33 wheel (.whl)") from e
        return _build(texts, f"wheel {os.path.abspath(wheel)}")
    if files is None:
        spec = importlib.util.find_spec("vllm")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("the fs-core tier needs vLLM's fs tier files: give --fs-wheel PATH (the vLLM 0.33 "
                             "wheel) or --fs-files DIR (the wheel unpacked), or install vLLM 0.33")
        files = os.path.dirname(list(spec.submodule_search_locations)[0])
    texts = {}
    for name in (IO_PY, POOL_PY, EXT_SO):
        try:
            with open(os.path.join(files, name), "rb") as fh:
                texts[name] = fh.read()
        except OSError as e:
            raise SystemExit(f"--fs-files {files}: no {name} there ({e.strerror}); unpack it from the vLLM 0.33 "
                             f"wheel with: unzip -d {files} WHEEL {EXT_SO} '{IO_PY}' '{POOL_PY}'") from e
    return _build(texts, f"files under {os.path.abspath(files)}")


def _build(texts: dict[str, bytes], source: str) -> FsCore:
    return build(texts[IO_PY], texts[POOL_PY], *_load_extension(texts[EXT_SO]), source)


def build(io_text: bytes, pool_text: bytes, ext: Optional[types.ModuleType], error: str, source: str) -> FsCore:
    """The core from the two modules' sources and the extension (None: it did not load, ``error`` why)."""
    logger_mod = types.ModuleType("vllm.logger")
    logger_mod.init_logger = logging.getLogger  # what vLLM's init_logger returns: a named logger
    base_mod = types.ModuleType("vllm.v1.kv_offload.tiering.base")
    base_mod.JobId = int  # vllm/v1/kv_offload/tiering/base.py: JobId = int
    pool = _exec("kvoffload_fs_thread_pool", pool_text, f"{source}: {POOL_PY}",
                 {"vllm.logger": logger_mod, "vllm.v1.kv_offload.tiering.base": base_mod})
    io = _exec("kvoffload_fs_io", io_text, f"{source}: {IO_PY}", {EXT_NAME: ext if ext is not None else error})
    compiled = bool(getattr(io, "_HAS_FSIO_C", False))
    return FsCore(io, pool, source, compiled, None if compiled else error)


def _load_extension(data: bytes) -> tuple[Optional[types.ModuleType], str]:
    """``fs_io_C`` from its bytes (a private temporary file, removed once loaded), or None and why not."""
    import torch  # noqa: F401 - the extension links libtorch: its symbols must be loaded first

    tmp = tempfile.mkdtemp(prefix="kvoffload-fs-io-")
    try:
        path = os.path.join(tmp, os.path.basename(EXT_SO))
        with open(path, "wb") as fh:
            fh.write(data)
        loader = importlib.machinery.ExtensionFileLoader(EXT_NAME, path)
        spec = importlib.util.spec_from_file_location(EXT_NAME, path, loader=loader)
        try:
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except ImportError as e:
            return None, f"ImportError: {e}"
        return module, ""
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # dlopen keeps the mapping; the file is not needed


def _exec(name: str, text: bytes, origin: str, provided: dict[str, Any]) -> types.ModuleType:
    """Run a module's source with ``provided`` answering its imports of those names (a str:
    that import fails with it as the message, as a missing module's would)."""
    real = builtins.__import__

    def imp(what, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and what in provided:
            got = provided[what]
            if isinstance(got, str):
                raise ImportError(got)
            return got
        return real(what, globals, locals, fromlist, level)

    module = types.ModuleType(name)
    module.__file__ = origin
    module.__builtins__ = {**vars(builtins), "__import__": imp}
    exec(compile(text, origin, "exec"), module.__dict__)
    return module


@dataclass(frozen=True)
class Finished:
    job_id: int
    success: bool


class FsCoreTier:
    """``FileSystemTierManager``'s submit and poll over ``primary`` ([chunks, bytes]), no vLLM."""

    MODEL = "kvoffload-tier-bench"

    def __init__(self, core: FsCore, primary: memoryview, root_dir: str, n_read_threads: int = 16,
                 n_write_threads: int = 16) -> None:
        self.core, self._primary = core, primary
        self._block_size = primary.strides[0]
        fields = {"model_name": self.MODEL, "blocks_per_file": 1, "dtype": "bfloat16"}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
        self._base = os.path.join(root_dir, f"{self.MODEL}_{digest}")
        # As the manager: its config file first, then O_DIRECT probed where the files go.
        os.makedirs(self._base, exist_ok=True)
        with open(os.path.join(self._base, "config.json"), "w") as fh:
            json.dump(fields, fh)
        self.o_direct = core.io.probe_o_direct(self._base)
        self._pool = core.pool.DualQueueThreadPool(n_read_threads, n_write_threads, thread_name_prefix="vllm_kv_py_fs")

    def _task(self, fn, keys: Sequence[Hashable], chunk_ids: Sequence[int]) -> Any:
        return functools.partial(fn, [chunk_path(self._base, k) for k in keys], self._primary,
                                 [int(c) * self._block_size for c in chunk_ids], self._block_size, self.o_direct)

    def submit_store(self, job_id: int, keys: Sequence[Hashable], chunk_ids: Sequence[int]) -> None:
        self._pool.enqueue_store(job_id, 1, [self._task(self.core.io.batch_store_block, keys, chunk_ids)])

    def submit_load(self, job_id: int, keys: Sequence[Hashable], chunk_ids: Sequence[int]) -> None:
        self._pool.enqueue_load(job_id, 1, [self._task(self.core.io.batch_load_block, keys, chunk_ids)])

    def poll(self) -> list[Finished]:
        return [Finished(job_id, success) for job_id, success, _ in self._pool.get_finished()]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def chunk_path(base: str, key: Hashable) -> str:
    """A chunk's file as vLLM's ``FileMapper`` names it (rank 0, group 0), by its block hash."""
    h = block_hash(key).hex()
    return f"{base}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"


def block_hash(key: Hashable) -> bytes:
    """A 32-byte block hash for a bench key: spread like vLLM's SHA-256 block hashes."""
    return hashlib.sha256(repr(key).encode()).digest()
