"""``kvoffload.bench.fs_core``: vLLM's fs tier IO loaded from a wheel's files, without vLLM.

vLLM's files are not in this repo, so these tests build a wheel of stand-ins that import
exactly what vLLM's ``io.py`` and ``thread_pool.py`` import from the rest of vLLM; the
real files run under ``-m vllm`` (``tests/test_vllm_tier_bench.py``).
"""

from __future__ import annotations

import sys
import types
import zipfile

import pytest

from kvoffload.bench import fs_core

# What vLLM 0.33's io.py does with the extension: use it if it imports, else fall back.
IO_STANDIN = b'''
try:
    from vllm.fs_io_C import batch_load_block as batch_load_block_C
    _HAS_FSIO_C = True
except ImportError as e:
    _HAS_FSIO_C = False
    why = str(e)

def batch_load_block(paths, view, offsets, block_size, use_o_direct=True):
    return batch_load_block_C(paths, view, use_o_direct) if _HAS_FSIO_C else "python"
'''
POOL_STANDIN = b'''
from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.base import JobId
logger = init_logger(__name__)
'''


def wheel(path, ext: bytes = b"not an ELF file") -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(fs_core.IO_PY, IO_STANDIN)
        z.writestr(fs_core.POOL_PY, POOL_STANDIN)
        z.writestr(fs_core.EXT_SO, ext)
    return str(path)


def test_a_wheel_whose_extension_does_not_load_runs_the_python_fallback(tmp_path) -> None:
    before = set(sys.modules)
    core = fs_core.load(wheel=wheel(tmp_path / "vllm.whl"))
    assert (core.compiled, core.path_name) == (False, "Python")
    assert core.ext_error.startswith("ImportError: ") and core.io.why == core.ext_error  # io.py saw why
    assert core.io.batch_load_block([], None, [], 0) == "python"
    assert core.pool.JobId is int and core.pool.logger.name == "kvoffload_fs_thread_pool"
    assert not [m for m in set(sys.modules) - before if m.startswith("vllm")]  # nothing of vLLM registered
    assert core.source == f"wheel {tmp_path / 'vllm.whl'}"


def test_an_extension_that_loads_is_the_path_io_takes() -> None:
    calls = []
    ext = types.ModuleType(fs_core.EXT_NAME)
    ext.batch_load_block = lambda paths, views, o_direct: calls.append((paths, o_direct)) or "C"
    core = fs_core.build(IO_STANDIN, POOL_STANDIN, ext, "", "test")
    assert (core.compiled, core.path_name, core.ext_error) == (True, "C", None)
    assert core.io.batch_load_block(["a"], None, [0], 8, False) == "C" and calls == [(["a"], False)]


def test_unpacked_files_missing_one_say_how_to_unpack(tmp_path) -> None:
    (tmp_path / fs_core.IO_PY).parent.mkdir(parents=True)
    (tmp_path / fs_core.IO_PY).write_bytes(IO_STANDIN)
    with pytest.raises(SystemExit, match=rf"--fs-files {tmp_path}: no {fs_core.POOL_PY} there .*unzip -d {tmp_path} "
                                         rf"WHEEL {fs_core.EXT_SO}"):
        fs_core.load(files=str(tmp_path))


def test_not_a_wheel_is_one_clear_line(tmp_path) -> None:
    bad = tmp_path / "x.whl"
    bad.write_bytes(b"no zip")
    with pytest.raises(SystemExit, match=r"--fs-wheel .*x\.whl: cannot read vLLM's fs tier from it"):
        fs_core.load(wheel=str(bad))


def test_paths_spread_over_hash_named_directories() -> None:
    paths = [fs_core.chunk_path("/r/m_0123456789ab", i) for i in range(64)]
    assert len({p.split("/")[-3] for p in paths}) > 32  # <hhh>: the keys' hashes, not their numbers
    h = fs_core.block_hash(5).hex()
    assert fs_core.chunk_path("/r/m", 5) == f"/r/m_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"
