"""KvoffloadConnector's worker side on the real vLLM 0.33 classes, with CPU tensors.

Runs only where vLLM imports (``make test-vllm``). vLLM's config objects need a
detected device platform, so the VllmConfig is a namespace holding the fields the
connector and worker read; KVTransferConfig, KVCacheConfig, the connector, the
worker and the metadata are vLLM's own. For CPU caches the worker must never touch
CUDA streams or events (vLLM's CPU engine has only placeholders for them), so the
tests replace them with classes that fail when used.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata  # noqa: E402

import kvoffload.vllm as kvv  # noqa: E402

NUM_BLOCKS, BLOCK_BYTES = 8, 4096 + 128  # padded to 8192 per slot under O_DIRECT


class _NoCuda:
    """Stands in for ``torch.cuda.Stream`` and ``torch.Event``: any use fails the test."""

    @staticmethod
    def priority_range():
        raise AssertionError("the worker asked for CUDA stream priorities for CPU caches")

    def __init__(self, *a, **k) -> None:
        raise AssertionError("the worker made a CUDA stream or event for CPU caches")


class _Stream:
    """vLLM's own ``register_kv_caches`` makes streams first thing: a host stand-in."""

    @staticmethod
    def priority_range():
        return 0, 0

    def __init__(self, *a, **k) -> None:
        pass


def _config(tmp_path, **extra):
    ktc = KVTransferConfig(
        kv_connector="KvoffloadConnector", kv_connector_module_path="kvoffload.vllm", kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_offload_backend": "disk", "disk_path": str(tmp_path / "kv.bin"),
                                   "use_page_cache": True, **extra},
    )
    return types.SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=types.SimpleNamespace(enable_prefix_caching=True, simple_cpu_offload_num_blocks=None),
        parallel_config=types.SimpleNamespace(world_size=1, data_parallel_rank=1),
    )


def _worker(tmp_path, monkeypatch, **extra):
    monkeypatch.setattr(torch.cuda, "Stream", _NoCuda)
    monkeypatch.setattr(torch, "Event", _NoCuda)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=NUM_BLOCKS * BLOCK_BYTES, layers=["layer.0"],
                                        layer_stride=NUM_BLOCKS * BLOCK_BYTES, block_stride=BLOCK_BYTES)],
        kv_cache_groups=[],
    )
    conn = kvv.KvoffloadConnector(_config(tmp_path, **extra), KVConnectorRole.WORKER, kv_cache_config)
    cache = torch.arange(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int32).to(torch.int8).view(NUM_BLOCKS, BLOCK_BYTES)
    conn.register_kv_caches({"layer.0": cache})
    return conn, cache


def _run_step(conn, meta):
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    done = None
    for _ in range(2000):
        _, done = conn.get_finished(set())
        if done or meta.load_event < 0:
            break
        time.sleep(0.001)
    conn.clear_connector_metadata()
    return done


def test_worker_runs_kvoffload_backend_round_trip(tmp_path, monkeypatch) -> None:
    conn, cache = _worker(tmp_path, monkeypatch, disk_capacity_bytes="1MiB", checksums=True)
    try:
        w = conn.worker_handler
        assert type(w).__name__ == "KvoffloadWorker"
        assert type(w._backend).__module__ == "kvoffload.disk_backend"
        assert w.rank_path == str(tmp_path / "kv.bin") + ".dp1.rank0"
        assert w.num_cpu_blocks == (1 << 20) // BLOCK_BYTES  # page cache: raw block size
        want = cache[:3].clone()
        # Store blocks 0..2 into slots 5..7 through the worker's store path (no CUDA
        # event for CPU caches), then load them into blocks 4..6.
        conn.bind_connector_metadata(SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[0, 1, 2],
                                                              store_cpu_blocks=[5, 6, 7]))
        conn.wait_for_save()
        conn.clear_connector_metadata()
        for _ in range(2000):
            if w._store_events and w._store_events[0][1].query():
                break
            time.sleep(0.001)
        assert w._store_events and w._store_events[0][0] == 0
        meta = SimpleCPUOffloadMetadata(load_event=0, load_gpu_blocks=[4, 5, 6], load_cpu_blocks=[5, 6, 7],
                                        load_event_to_reqs={0: ["req-a"]})
        assert _run_step(conn, meta) == {"req-a"}
        assert torch.equal(cache[4:7], want)
        assert conn.get_block_ids_with_load_errors() == set()
    finally:
        conn.shutdown()


def test_load_of_never_stored_slot_is_a_load_error(tmp_path, monkeypatch) -> None:
    conn, _ = _worker(tmp_path, monkeypatch, disk_capacity_bytes="1MiB")
    try:
        meta = SimpleCPUOffloadMetadata(load_event=0, load_gpu_blocks=[3], load_cpu_blocks=[9],
                                        load_event_to_reqs={0: ["req-b"]})
        assert _run_step(conn, meta) == {"req-b"}
        # Reported in the same pass as the completion: vLLM then applies "recompute".
        assert conn.get_block_ids_with_load_errors() == {3}
        assert conn.get_block_ids_with_load_errors() == set()
    finally:
        conn.shutdown()


def test_scheduler_count_larger_than_rank_is_refused(tmp_path, monkeypatch) -> None:
    conn, _ = _worker(tmp_path, monkeypatch, disk_capacity_bytes="1MiB")
    try:
        meta = SimpleCPUOffloadMetadata()
        meta.kvoffload_num_slots = conn.worker_handler.num_cpu_blocks + 1
        with pytest.raises(RuntimeError, match=r"scheduler uses \d+ disk slots but this rank's file"):
            conn.bind_connector_metadata(meta)
    finally:
        conn.shutdown()


def test_scheduler_pool_uses_the_padded_slot_rule(tmp_path) -> None:
    from kvoffload.config import OffloadConfig

    kv_cache_config = types.SimpleNamespace(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[types.SimpleNamespace(size=NUM_BLOCKS * BLOCK_BYTES)])
    cfg = OffloadConfig.from_extra_config({"kv_offload_backend": "disk", "disk_path": "/x",
                                           "disk_capacity_bytes": 10 * 8192})
    assert kvv.scheduler_num_slots(cfg, kv_cache_config) == 10  # 4224 B padded to 8192, not 19


LAYOUTS = {
    # One tensor per layer, layer outermost (vLLM's default on CUDA).
    "per-layer": [dict(layers=["a"], layer_stride=NUM_BLOCKS * 4096, block_stride=4096),
                  dict(layers=["b"], layer_stride=NUM_BLOCKS * 4096, block_stride=4096)],
    # Two layers in one allocation, layer outermost: a region per layer.
    "two-layers-outermost": [dict(layers=["a", "b"], layer_stride=NUM_BLOCKS * 4096, block_stride=4096)],
    # K and V outermost inside one layer's tensor: a region per half (name.0, name.1).
    "kv-outermost": [dict(layers=["a"], layer_stride=2 * NUM_BLOCKS * 2048, block_stride=2048)],
    # Block outermost over two layers: one region whose block holds both pages.
    "block-outermost": [dict(layers=["a", "b"], layer_stride=2048, block_stride=4096)],
    # Two groups overlaying one allocation: the storage is taken once.
    "aliased": [dict(layers=["a"], layer_stride=NUM_BLOCKS * 4096, block_stride=4096),
                dict(layers=["b"], layer_stride=NUM_BLOCKS * 4096, block_stride=4096)],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_regions_equal_what_vllms_worker_registers(layout, monkeypatch) -> None:
    # Goal: kvoffload registers the caches itself (vLLM's method makes CUDA streams),
    # so its regions must be vLLM's, name for name and byte for byte.
    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    placed = LAYOUTS[layout]
    size = NUM_BLOCKS * 4096 * (2 if layout in ("two-layers-outermost", "block-outermost") else 1)
    tensors = [KVCacheTensor(size=size, **p) for p in placed]
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=[])
    storage = [torch.zeros(size, dtype=torch.int8) for _ in tensors]
    if layout == "aliased":
        storage = [storage[0], storage[0]]
    kv_caches = {}
    for t, buf in zip(tensors, storage):
        for name in t.layers:
            kv_caches[name] = buf.view(torch.float16)

    class Registers(SimpleCPUOffloadWorker):
        def _init_disk_mode(self, *args) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    vllm_worker = Registers(None, kv_cache_config, 1 << 20, kv_offload_backend="disk", disk_path="/x",
                            disk_capacity_bytes=1 << 20)
    vllm_worker.register_kv_caches(kv_caches)
    ours = kvv.offload_regions(kv_cache_config, kv_caches)
    theirs = vllm_worker.gpu_kv_caches
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].data_ptr() == theirs[name].data_ptr()
        assert ours[name].shape == theirs[name].shape and ours[name].stride() == theirs[name].stride()
        assert ours[name].dtype == theirs[name].dtype == torch.int8


def test_interface_check_names_supported_version() -> None:
    class Worker:
        def __init__(self, vllm_config, kv_cache_config):
            pass

    with pytest.raises(ImportError, match=r"supports vLLM 0\.32\.x or 0\.33\.x; the installed vLLM 9\.9 .*"
                                          r"register_kv_caches is missing"):
        kvv._check_interface("9.9", object, Worker, Worker)


def test_worker_metadata_aggregates_over_ranks_and_pickles() -> None:
    import pickle

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    meta = kvv.KvoffloadWorkerMetadata
    rank0 = meta(completed_store_events={3: 1}, failed_store_events={3: [7]}, failed_load_slots=[1])
    rank1 = meta(completed_store_events={3: 1, 4: 1}, failed_store_events={3: [8], 4: [9]}, failed_load_slots=[1, 2])
    outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                              kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=pickle.loads(pickle.dumps(m))))
            for m in (rank0, rank1)]
    got = KVOutputAggregator(expected_finished_count=2).aggregate(outs).kv_connector_output.kv_connector_worker_meta
    # vLLM's rule for completions (summed per event), and a slot that failed on any rank fails.
    assert got == meta(completed_store_events={3: 2, 4: 1}, failed_store_events={3: [7, 8], 4: [9]},
                       failed_load_slots=[1, 2])
