"""Shared fixtures: every data-path test runs on CPU and, where a GPU exists, on CUDA.

The fault-injection fixtures come from ``faults.plugin``, loaded here (not by an
entry point of the wheel), so a plain checkout with ``PYTHONPATH=.`` has them and
other projects' pytest runs never see them.
"""

from __future__ import annotations

import pytest
import torch

from kvoffload.device import BlockLayout, random_caches

pytest_plugins = ("faults.plugin",)

HAS_CUDA = torch.cuda.is_available()
make_caches = random_caches


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """The ``-m engine`` tests' tiny random Llama, built offline once per session."""
    from tests.real_engine import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def baseline(tmp_path_factory, model):
    """The standard engine workload with no connector: what every run must equal."""
    from tests.real_engine import BASE, EngineSpec, disk_dir, run_engine

    d = disk_dir(tmp_path_factory.mktemp("baseline"))
    return run_engine(EngineSpec(model=model, disk_dir=str(d), connector="none", **BASE))


def block_bytes(caches) -> int:
    return BlockLayout.from_caches(caches).block_bytes


def snapshot(caches) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in caches.items()}


def open_fds() -> set[int]:
    """This process's fds on files and directories (the CUDA driver's lazily opened
    device nodes, eventfds and pipes are not the backend's)."""
    from faults._invariants import fd_table

    return set(fd_table())


@pytest.fixture(scope="session")
def native_core():
    """The native IO core built with the package; the test skips where it was not built,
    except where ``KVOFFLOAD_REQUIRE_NATIVE=1`` (CI builds it: a missing core fails there)."""
    import os

    from kvoffload import native_engine

    core = native_engine.core()
    if core is None:
        why = f"the native IO core is unavailable: {native_engine.why_unavailable()}"
        if os.environ.get("KVOFFLOAD_REQUIRE_NATIVE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return core
