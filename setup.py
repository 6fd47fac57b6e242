"""The native engine's C, built with the package (build_native.py); the rest is pyproject.toml."""

from setuptools import setup

setup(
    cffi_modules=["build_native.py:ffibuilder"],
    # The core uses CPython's stable ABI only (cffi, API mode): one wheel serves 3.10 and later.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
