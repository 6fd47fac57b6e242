"""What the connector takes from vLLM without importing it: the interface it relies on, the rules it restates.

Every function here is handed vLLM's objects, so this module (and ``kvoffload.vllm``,
which re-exports its names) imports without vLLM, and tests apply the rules to vLLM's
real objects. The pool size, the block layout, the block keys and the offload index
must agree with vLLM's exactly: each rule names the vLLM code it follows.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch

from kvoffload.config import OffloadConfig
from kvoffload.vllm_version import SUPPORTED_TEXT


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _check_interface(version: str, base: Any, worker_cls: Any, scheduler_cls: Any) -> None:
    """Feature-detect what this adapter relies on; raise ImportError naming what differs."""
    problems = []
    for name in ("register_kv_caches", "start_load_kv", "wait_for_save", "bind_connector_metadata",
                 "build_connector_worker_meta", "get_finished"):
        if not callable(getattr(worker_cls, name, None)):
            problems.append(f"SimpleCPUOffloadWorker.{name} is missing")
    init = set(_params(worker_cls.__init__))
    for p in ("kv_offload_backend", "disk_path", "disk_capacity_bytes", "disk_buffer_slots", "use_page_cache"):
        if p not in init:
            problems.append(f"SimpleCPUOffloadWorker.__init__ has no {p!r} parameter")
    if "disk_capacity_bytes" not in _params(scheduler_cls.__init__):
        problems.append("SimpleCPUOffloadScheduler.__init__ has no 'disk_capacity_bytes' parameter")
    if not hasattr(base, "get_block_ids_with_load_errors"):
        problems.append("KVConnectorBase_V1.get_block_ids_with_load_errors is missing")
    if problems:
        raise ImportError(
            f"kvoffload.vllm supports vLLM {SUPPORTED_TEXT}; the installed vLLM {version} has a different "
            f"simple_kv_offload interface: {'; '.join(problems)}. Install a supported release or use "
            'kv_connector "SimpleCPUOffloadConnector" (vLLM\'s own disk backend).'
        )


def _gpu_total_bytes(kv_cache_config: Any) -> int:
    # vLLM's rule (0.33's sizing.gpu_total_bytes): every KVCacheTensor is placed in
    # one backing allocation, so the first one's size is the whole cache.
    return kv_cache_config.kv_cache_tensors[0].size


def scheduler_num_slots(cfg: OffloadConfig, kv_cache_config: Any) -> int:
    """The scheduler's pool size: the ranks' rule applied to the scheduler's KV layout.

    Bytes per block come from the allocation as vLLM's ``_derive_cpu_config`` sees
    them (rounded up), and the result never exceeds vLLM's own unpadded bound.
    """
    total = _gpu_total_bytes(kv_cache_config)
    nb = kv_cache_config.num_blocks
    unpadded = nb * cfg.disk_capacity_bytes // total
    return min(cfg.num_disk_slots(-(-total // nb)), unpadded)


def _scheduler_capacity(num_slots: int, kv_cache_config: Any) -> int:
    """The byte budget for which vLLM's scheduler pool is exactly ``num_slots``.

    vLLM (0.32 and 0.33 alike) sizes it ``num_blocks * capacity // total``; with
    ``capacity = ceil(num_slots * total / num_blocks)`` the floor is ``num_slots``
    because ``total >= num_blocks`` (a block is at least one byte).
    """
    total = _gpu_total_bytes(kv_cache_config)
    nb = kv_cache_config.num_blocks
    return -(-num_slots * total // nb)


def offload_regions(kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``[num_blocks, block_bytes]`` int8 regions vLLM's worker offloads, by name.

    vLLM's ``SimpleCPUOffloadWorker.register_kv_caches`` rule (the same in 0.32 and
    0.33; ``tests/test_vllm_connector.py`` holds the two equal): each
    ``KVCacheTensor`` is re-viewed from its storage; a layer-outermost placement
    gives one region per layer (or per KV head group), a block-outermost one a
    single region for all its layers; storage seen twice is taken once.
    """
    num_blocks = kv_cache_config.num_blocks
    regions: dict[str, torch.Tensor] = {}
    seen: set[tuple[torch.device, int]] = set()
    for placed in kv_cache_config.kv_cache_tensors:
        name = next((n for n in placed.layers if n in kv_caches), None)
        if name is None:
            continue
        blocks_span = num_blocks * placed.block_stride
        if placed.layer_stride >= blocks_span:  # layer outermost
            start, span, names = placed.offset, len(placed.layers) * placed.layer_stride, placed.layers
        else:
            start, span, names = 0, blocks_span, placed.layers[:1]
        cache = kv_caches[name]
        raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(cache.untyped_storage())
        if raw.numel() < start + span:
            raise ValueError(f"KV cache {name!r} storage has {raw.numel()} bytes, smaller than the "
                             f"{span} bytes it places at offset {start}")
        views = raw[start:start + span].view(-1, num_blocks, placed.block_stride)
        per_layer, rest = divmod(len(views), len(names))
        if rest:
            raise ValueError(f"KV cache {name!r} places {len(names)} layers in {len(views)} block-strided regions")
        for i, view in enumerate(views):
            key = (view.device, view.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            layer = names[i // per_layer]
            regions[layer if per_layer == 1 else f"{layer}.{i % per_layer}"] = view
    return regions


# vLLM's prefix-caching hashes whose first block is seeded at random in every process
# unless PYTHONHASHSEED is set (vllm/v1/core/kv_cache_utils.py, init_none_hash; 0.32 and 0.33).
_RANDOM_SEEDED_HASHES = ("xxhash", "xxhash_cbor")
# num_tokens of a block key that has none (vLLM's primary hash of a full block may carry None).
_NO_TOKENS = 2**32 - 1


def check_stable_hashes(vllm_config: Any) -> None:
    """Refuse persistence where vLLM's block hashes change on every start: nothing stored
    could ever be found again (and the tier would fill with unreachable blocks)."""
    algo = getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", "sha256")
    if algo in _RANDOM_SEEDED_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise ValueError(
            f"kvoffload: \"persist\": true needs block hashes that survive a restart, but prefix_caching_hash_algo="
            f"{algo!r} seeds them at random in every process unless PYTHONHASHSEED is set; use "
            "--prefix-caching-hash-algo sha256 (vLLM's default) or sha256_cbor, or set PYTHONHASHSEED to one fixed "
            "value for every vLLM process")


def fingerprint(vllm_config: Any, regions: dict[str, torch.Tensor], dp: int, rank: int) -> dict[str, Any]:
    """What a rank's stored KV depends on besides the tokens: a file written under another
    fingerprint is refused at start-up (and its blocks would fail their tags)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    shapes = ";".join(f"{n}:{tuple(t.shape)}:{t.stride(0)}:{t.dtype}" for n, t in regions.items())
    return {"model": str(mc.model), "revision": mc.revision, "dtype": str(mc.dtype),
            "quantization": mc.quantization, "kv_cache_dtype": str(cc.cache_dtype), "block_size": cc.block_size,
            "regions": len(regions), "region_shapes": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "dp_rank": dp, "rank": rank, "world_size": pc.world_size,
            "tensor_parallel_size": pc.tensor_parallel_size, "pipeline_parallel_size": pc.pipeline_parallel_size}


def block_key(block: Any) -> bytes:
    """What a persistent tier stores a block under: vLLM's block hash with its group id, and
    the tokens it covers (what ``BlockPool._insert_block_hash`` takes back at restart)."""
    n = block.block_hash_num_tokens
    return block.block_hash + (_NO_TOKENS if n is None else n).to_bytes(4, "big")


def seed_pool(pool: Any, entries: Sequence[tuple[int, bytes]]) -> None:
    """Put restored blocks into vLLM's offload ``BlockPool``: each slot cached under its hash,
    and the free queue as vLLM's own would be, empty slots first, then the cached ones least
    recently stored first (the next store evicts the oldest)."""
    blocks = []
    for slot, key in entries:
        n = int.from_bytes(key[-4:], "big")
        block = pool.blocks[slot]
        pool._insert_block_hash(key[:-4], block, None if n == _NO_TOKENS else n)
        blocks.append(block)
    for block in blocks:
        pool.free_block_queue.remove(block)
    pool.free_block_queue.append_n(blocks)


def _drop_slots(pool: Any, slots: Any) -> None:
    """Take ``slots`` out of vLLM's offload index (a ``BlockPool``).

    A slot still held (by its load) keeps its place until released, when vLLM
    puts it, hashless, at the front of the free queue. A free one (its store was
    just published) is moved there now, as vLLM's ``free_blocks`` would have put it
    without the hash: reused before any cached block is evicted.
    """
    slots = sorted(set(slots))
    pool.evict_blocks(set(slots))
    free = [pool.blocks[s] for s in slots if pool.blocks[s].ref_cnt == 0]
    for block in free:
        pool.free_block_queue.remove(block)
    pool.free_block_queue.prepend_n(free)
