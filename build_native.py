"""Builds ``kvoffload.native_engine._core``, the native engine's C, when the package is built.

``pip install .``, ``pip install -e .`` and ``pip wheel .`` compile it (setup.py names
this file through cffi's ``cffi_modules``); nothing is compiled at run time. Where no C
compiler is found the build goes on without it (an optional extension) and the backend
runs its Python path, saying why at start-up.

Why cffi in API mode: the declarations Python uses are ``kvoffload/native_engine/unit_io.h``
itself, and the compiler checks every structure field and prototype cffi generates
from them against the C that implements them, so no structure is kept in step by
hand. cffi also releases the GIL around each call, and is already installed with
``cryptography``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cffi import FFI

NATIVE = Path("kvoffload") / "native_engine"
SOURCES = ["engine.c", "unit_runs.c", "store_unit.c", "load_unit.c", "aes_gcm.c"]
HEADERS = ["unit_io.h", "unit_runs.h", "aes_gcm.h"]


def source_digest(native_dir: Path) -> str:
    """What the extension is built from: a digest of every source and header, which the
    built module reports (``kvo_build_info``) and ``kvoffload.native_engine`` compares with
    the sources beside it, so a stale build in a source tree is never loaded."""
    h = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        h.update(name.encode() + b"\0" + (native_dir / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


# AES-GCM's functions for the tests and the bench (the IO units call them from C); the
# key's layout stays C's own ("...": cffi asks the compiler for its size).
_GCM_CDEF = """
typedef struct { ...; } kvo_gcm_key;
int kvo_gcm_supported(void);
const char *kvo_gcm_impl(void);
int kvo_gcm_force_impl(const char *name);
void kvo_gcm_init(kvo_gcm_key *k, const uint8_t key[16]);
void kvo_gcm_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                  const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]);
int kvo_gcm_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                 const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]);
"""

# The engine's callbacks into Python (native_engine/__init__.py defines them at import).
_CALLBACKS = """
extern "Python" int kvo_py_bind(void *, int);
extern "Python" int64_t kvo_py_io(void *, int, int64_t, int, int, int, int, int64_t);
extern "Python" int kvo_py_device(void *, int, int64_t, int, int, int, int);
"""

_here = Path(__file__).resolve().parent
ffibuilder = FFI()
ffibuilder.cdef((_here / NATIVE / "unit_io.h").read_text() + _GCM_CDEF + _CALLBACKS)
ffibuilder.set_source(
    "kvoffload.native_engine._core",
    "#include <stddef.h>\n#include <stdint.h>\n#include \"unit_runs.h\"\n",
    sources=[str(NATIVE / name) for name in SOURCES],
    include_dirs=[str(NATIVE)],
    define_macros=[("KVO_SOURCE_HASH", f'"{source_digest(_here / NATIVE)}"'), ("_GNU_SOURCE", "1")],
    extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],
    # A machine without a C compiler still installs the package: the Python path runs.
    optional=True,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
