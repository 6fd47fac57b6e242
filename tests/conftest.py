"""Shared fixtures: every data-path test runs on CPU and, where a GPU exists, on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from kvoffload.device import BlockLayout

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    return torch.device(request.param)


def make_caches(device, num_blocks: int, tensor_bytes: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random int8 caches, one tensor per entry of ``tensor_bytes`` (bytes per block)."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": torch.randint(-128, 128, (num_blocks, b), dtype=torch.int8, generator=g).to(device)
        for i, b in enumerate(tensor_bytes)
    }


def block_bytes(caches) -> int:
    return BlockLayout.from_caches(caches).block_bytes


def snapshot(caches) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in caches.items()}


def open_fds() -> set[int]:
    """This process's fds on files and directories (the CUDA driver's lazily opened
    device nodes, eventfds and pipes are not the backend's)."""
    from faults._invariants import fd_table

    return set(fd_table())
