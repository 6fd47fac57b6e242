"""The tier under vLLM 0.33's real Scheduler and OffloadingConnector, on CPU.

Runs only where vLLM imports (``-m vllm``). Scheduler side: vLLM's ``Scheduler``, its
``OffloadingConnector`` and ``TieringOffloadingManager`` with the real CPU primary and
``KvoffloadTier`` loaded by ``module_path``, as ``vllm serve`` would. Worker side:
the real connector worker; only the GPU<->CPU copy (vLLM's needs CUDA) is a CPU copy
into the same shared primary region (``CpuTieringSpec``). vLLM's configs are built on
its CPU device from a tiny local model config (no download). The "model" writes each
token's KV as a function of (position, token), so every block a request runs on can
be checked byte for byte, whichever tier it came from.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import uuid

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
)
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from faults import Fault, FaultyOsCalls, wait_threads_gone  # noqa: E402
from kvoffload.vllm_tier import KvoffloadTier  # noqa: E402
from tests.vllm_harness import over_ipc, prom_registry, prom_samples  # noqa: E402

BLOCK = 16  # tokens per block
HEADS, HEAD = 1, 32  # float32 K and V: 4096 bytes a block, one page
PAGE = 2 * BLOCK * HEADS * HEAD * 4
TOKEN_BYTES = PAGE // BLOCK
EOS = 0
# Faults for the next tier vLLM's factory builds: the tier is made from its config
# entry inside the Scheduler, so a test queues its FaultyOsCalls here first.
NEXT_OS_CALLS: list = []


class FaultyKvoffloadTier(KvoffloadTier):
    """``KvoffloadTier`` built with the ``FaultyOsCalls`` a test queued."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, os_calls=NEXT_OS_CALLS.pop() if NEXT_OS_CALLS else None, **kwargs)


class CpuCopyWorker(OffloadingWorker):
    """vLLM's CPU offloading worker, minus CUDA: synchronous copies between the
    layer's blocks and this rank's rows of the shared primary region."""

    def __init__(self, kv_caches, region: SharedOffloadRegion) -> None:
        (t,) = kv_caches.tensors
        self.gpu = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
        self.cpu = region.create_next_worker_view(t.page_size_bytes)
        self.region = region
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, dst: torch.Tensor, dst_ids, src: torch.Tensor, src_ids) -> bool:
        for d, s in zip(np.asarray(dst_ids).tolist(), np.asarray(src_ids).tolist()):
            dst[d].copy_(src[s])
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=len(src_ids) * PAGE))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, self.cpu, dst_spec.block_ids, self.gpu, src_spec.block_ids)

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        return self._copy(job_id, self.gpu, dst_spec.block_ids, self.cpu, src_spec.block_ids)

    def get_finished(self) -> list:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids) -> None:
        return None

    def shutdown(self) -> None:
        del self.cpu  # the region's mmap closes only once no view of it is left
        self.region.cleanup()


class CpuTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies on CPU (one rank, one chunk a block)."""

    def get_worker(self, kv_caches) -> CpuCopyWorker:
        if not self._worker:
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            self._worker = CpuCopyWorker(kv_caches, region)
        return self._worker


def token_kv(pos: int, token: int) -> np.ndarray:
    """The KV bytes the "model" computes for ``token`` at ``pos``."""
    return ((np.arange(TOKEN_BYTES, dtype=np.int64) * (2 * token + 1) + pos * 7919 + token) % 256 - 128).astype(np.int8)


class Engine:
    """A scheduler and a worker connector stepped like vLLM's engine core, one process."""

    def __init__(self, model_dir, disk_dir, *, gpu_blocks: int, cpu_chunks: int,
                 tier: tuple[str, str] = ("KvoffloadTier", "kvoffload.vllm_tier"), **tier_config) -> None:
        tier_entry = {"type": tier[0], "module_path": tier[1], "disk_path": str(disk_dir / "kv.bin"),
                      "disk_capacity_bytes": "1MiB", **tier_config}
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                                     max_model_len=2048),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                engine_id=f"kvoffload-test-{uuid.uuid4().hex[:12]}",
                kv_connector_extra_config={
                    "spec_name": "CpuTieringSpec", "spec_module_path": __name__,
                    "cpu_bytes_to_use": cpu_chunks * PAGE, "secondary_tiers": [tier_entry],
                }),
        )
        self.config.cache_config.num_gpu_blocks = gpu_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=gpu_blocks * PAGE, layers=["layer.0"], layer_stride=gpu_blocks * PAGE,
                                            block_stride=PAGE)],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32))],
        )
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK, log_stats=True)
        self.worker = OffloadingConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.kv = torch.zeros(gpu_blocks, 2, BLOCK, HEADS, HEAD, dtype=torch.float32)
        with set_current_vllm_config(self.config):
            self.worker.register_kv_caches({"layer.0": self.kv})
        self.kv_bytes = self.kv.view(torch.int8).view(gpu_blocks, BLOCK, TOKEN_BYTES).numpy()
        manager = self.scheduler.connector.connector_scheduler.manager
        (self.tier,) = manager.secondary_tiers
        self.tier_jobs: list = []  # every FinishedJob the tier reported to vLLM
        self.load_keys: dict[int, int] = {}  # load job id -> keys it asked the tier for
        self.scheduler_stats: list = []  # every step's SchedulerStats, as the frontend decodes them
        if isinstance(self.tier, KvoffloadTier):
            poll, submit_load = self.tier.slot_tier.poll, self.tier.slot_tier.submit_load
            self.tier.slot_tier.poll = lambda: self._record(poll())

            def record_load(job_id, keys, chunk_ids):
                self.load_keys[job_id] = len(keys)
                submit_load(job_id, keys, chunk_ids)

            self.tier.slot_tier.submit_load = record_load
        self.manager = manager
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._next_id = 0
        self.checked_tokens = 0
        self.reused: dict[str, int] = {}  # tokens a request had when first scheduled (cached or loaded)

    def _record(self, finished: list) -> list:
        self.tier_jobs += finished
        return finished

    def add(self, tokens: list[int], max_tokens: int = 2) -> str:
        req_id = f"r{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                                           pooling_params=None, block_hasher=self._hasher))
        return req_id

    def step(self) -> None:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self._ctx)
        self._check_and_compute(out.num_scheduled_tokens)
        if out.total_num_scheduled_tokens > 0:
            self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.scheduler.requests[rid]
            # A token is sampled once the whole prompt is computed; 1 keeps decoding.
            sampled.append([1] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        outputs = self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                                  kv_connector_worker_meta=worker_meta)))
        self.scheduler_stats += [over_ipc(eco).scheduler_stats for eco in outputs.values()
                                 if eco.scheduler_stats is not None]

    def _check_and_compute(self, scheduled: dict[str, int]) -> None:
        """Check that every token a scheduled request already has (computed before, or
        loaded from the CPU or disk tier) holds its exact KV, then "compute" the new ones."""
        for rid, n in scheduled.items():
            req = self.scheduler.requests[rid]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            start = req.num_computed_tokens - n  # schedule() already counted this step's tokens
            for pos in range(start):
                got = self.kv_bytes[blocks[pos // BLOCK], pos % BLOCK]
                assert np.array_equal(got, token_kv(pos, req.all_token_ids[pos])), \
                    f"{rid}: token {pos} holds wrong KV"
            self.checked_tokens += start
            self.reused.setdefault(rid, start)
            for pos in range(start, start + n):
                self.kv_bytes[blocks[pos // BLOCK], pos % BLOCK] = token_kv(pos, req.all_token_ids[pos])

    def run(self, tokens: list[int], max_steps: int = 200, settle: bool = True) -> Request:
        """Add a request and step until it finished (and, with ``settle``, until the tiers
        have no pending work); returns it."""
        rid = self.add(tokens)
        req = self.scheduler.requests[rid]
        for _ in range(max_steps):
            self.step()
            if req.status not in (RequestStatus.WAITING, RequestStatus.RUNNING,
                                  RequestStatus.WAITING_FOR_REMOTE_KVS) and not (
                                      settle and self.manager.has_pending_work()):
                return req
            time.sleep(0.001)
        raise AssertionError(f"{rid} did not finish in {max_steps} steps (status {req.status})")

    def settle(self, max_steps: int = 200) -> None:
        """Step with no request until the tiers have no pending work (stores on disk)."""
        for _ in range(max_steps):
            self.step()
            if not self.manager.has_pending_work():
                return
            time.sleep(0.001)
        raise AssertionError("the tiers still have pending work")

    def shutdown(self) -> None:
        if self.kv is None:
            return
        self.kv = self.kv_bytes = None
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama config (no weights: nothing is run), so ModelConfig needs no download."""
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD * 2,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": HEADS,
        "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float32"}))
    return d


@pytest.fixture
def engine_factory(model_dir, cache_dir):
    engines = []

    def make(**kw) -> Engine:
        e = Engine(model_dir, cache_dir, **kw)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.shutdown()


def prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens plus one (the last token is always computed)."""
    return np.random.default_rng(seed).integers(2, 1000, blocks * BLOCK + 1).tolist()


def stats(e: Engine) -> dict:
    return e.tier.slot_tier.backend.stats()


def to_disk_only(e: Engine) -> list[int]:
    """Run prompt a, then b and c, which push most of a's blocks out of the GPU (24 blocks)
    and the CPU tier (12 chunks): those are then only on disk. Returns a."""
    a = prompt(1, 10)
    assert e.reused[e.run(a).request_id] == 0
    e.settle()
    assert stats(e)["bytes_written"] == 10 * PAGE  # GPU -> CPU -> disk, all of a
    e.run(prompt(2, 10))
    e.run(prompt(3, 10))
    e.settle()
    assert stats(e)["bytes_written"] == 30 * PAGE and stats(e)["bytes_read"] == 0
    return a


def test_blocks_evicted_from_cpu_come_back_from_disk_exact(engine_factory) -> None:
    e = engine_factory(gpu_blocks=24, cpu_chunks=12)
    a = to_disk_only(e)
    checked = e.checked_tokens
    again = e.run(a)
    assert e.reused[again.request_id] == 10 * BLOCK  # all of a reused: none recomputed
    assert stats(e)["bytes_read"] >= 5 * PAGE  # most of it promoted from disk
    assert e.checked_tokens - checked >= 10 * BLOCK  # and every token compared byte for byte
    assert not e.tier.has_pending_work()


@pytest.mark.parametrize("fault", ["eio", "bitflip"])
def test_disk_errors_become_misses_and_recompute(engine_factory, fault) -> None:
    osc = FaultyOsCalls()
    NEXT_OS_CALLS.append(osc)
    e = engine_factory(gpu_blocks=24, cpu_chunks=12, tier=("FaultyKvoffloadTier", __name__))
    a = to_disk_only(e)
    written = stats(e)["bytes_written"]
    if fault == "eio":
        osc.fail_from("preadv", osc.calls["preadv"] + 1, Fault.error(errno.EIO))
    else:  # one bit of the first chunk read back: AES-GCM refuses that chunk only
        osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.bitflip(100, 1))
    checked = e.checked_tokens
    again = e.run(a)
    assert osc.fired["preadv"] >= 1
    reused = e.reused[again.request_id]
    assert reused < 10 * BLOCK  # the chunks that failed were recomputed, not served
    assert e.checked_tokens - checked >= reused  # what was reused is exact
    (failed,) = [j for j in e.tier_jobs if not j.success]  # the promotion, reported per chunk
    # A failed chunk is dropped from the tier; recomputed, it goes GPU -> CPU -> disk again.
    if fault == "bitflip":
        assert failed.successful_keys and failed.transfer_bytes == len(failed.successful_keys) * PAGE
        assert stats(e)["bytes_written"] - written == PAGE  # only the refused chunk
    else:
        assert failed.successful_keys is None and failed.transfer_bytes == 0
        assert stats(e)["bytes_written"] - written == 10 * PAGE - reused // BLOCK * PAGE  # all but the CPU's
    osc.clear()
    # The request recomputed and re-offered its blocks: a third run reuses everything.
    third = e.run(a)
    assert e.reused[third.request_id] == 10 * BLOCK
    assert not e.tier.has_pending_work()


def test_pending_work_drain_on_reset_and_shutdown(engine_factory) -> None:
    osc = FaultyOsCalls()
    NEXT_OS_CALLS.append(osc)
    e = engine_factory(gpu_blocks=24, cpu_chunks=12, tier=("FaultyKvoffloadTier", __name__))
    try:
        gate = threading.Event()
        osc.fail_nth("pwritev", 1, Fault.hang(gate, timeout=60))
        e.run(prompt(1, 4), settle=False)
        # The cascade to disk hangs; the engine keeps stepping and the tier says it has work.
        assert osc.hang_entered.wait(10)
        t0 = time.monotonic()
        for _ in range(5):
            e.step()
        assert time.monotonic() - t0 < 5
        assert e.tier.has_pending_work() and e.manager.has_pending_work()
        # reset_cache drains every tier before the primary is reset: it waits for the hung write.
        reset = threading.Thread(target=e.scheduler.reset_prefix_cache, kwargs={"reset_connector": True})
        reset.start()
        reset.join(0.5)
        assert reset.is_alive()
        gate.set()
        reset.join(30)
        assert not reset.is_alive()
        e.settle()
        assert not e.tier.has_pending_work()
        assert stats(e)["bytes_written"] == 4 * PAGE  # the store finished during the drain
        # Shutdown while a write hangs: shutdown waits for it (join_timeout), queued work
        # ends, the threads end and the primary's shared memory is released.
        gate2 = threading.Event()
        osc.hang_entered.clear()
        osc.fail_nth("pwritev", osc.calls["pwritev"] + 1, Fault.hang(gate2, timeout=60))
        e.run(prompt(2, 4), settle=False)
        assert osc.hang_entered.wait(10)
        threading.Timer(0.3, gate2.set).start()
        region = e.manager.primary_tier._mmap_region.mmap_path
        e.shutdown()
        wait_threads_gone()
        assert not os.path.exists(region)
    finally:
        osc.release_hangs()


def test_bad_tier_config_fails_engine_start_with_the_key(engine_factory) -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'disk_capacity' \(did you mean 'disk_capacity_bytes'\?\)"):
        engine_factory(gpu_blocks=24, cpu_chunks=12, disk_capacity="1MiB")


@pytest.mark.parametrize("fault", [None, "eio", "bitflip"])
def test_tier_metrics_reach_vllms_offloading_prometheus(engine_factory, fault) -> None:
    # Goal: the tier's metrics travel vLLM's own tiering path (the tier's get_stats,
    # polled every step and merged by TieringOffloadingManager, through vLLM's msgpack
    # into OffloadingConnector's Prometheus metrics, declared by the tier's
    # build_metric_definitions) and equal what the test counts: chunks and bytes each
    # way, failures by cause, and hits only for the chunks promoted whole.
    osc = FaultyOsCalls()
    NEXT_OS_CALLS.append(osc)
    e = engine_factory(gpu_blocks=24, cpu_chunks=12, tier=("FaultyKvoffloadTier", __name__))
    a = to_disk_only(e)
    if fault == "eio":
        osc.fail_from("preadv", osc.calls["preadv"] + 1, Fault.error(errno.EIO))
    elif fault == "bitflip":  # the first chunk read back fails its tag
        osc.fail_nth("preadv", osc.calls["preadv"] + 1, Fault.bitflip(100, 1))
    e.run(a)
    osc.clear()
    e.settle()
    # The last jobs' latencies are counted as they leave the open jobs; one more step reports them.
    while e.tier.slot_tier.backend._run.open_jobs:
        time.sleep(0.001)
    e.step()
    types, registry = prom_registry()
    prom = OffloadingConnector.build_prom_metrics(e.config, types, ["engine"], {0: ["0"]})
    for st in e.scheduler_stats:
        if st.kv_connector_stats:
            prom.observe(st.kv_connector_stats, 0)
    got = prom_samples(registry)
    finished = {j.job_id: j for j in e.tier_jobs}
    promoted = sum(n if finished[job].success else len(finished[job].successful_keys or ())
                   for job, n in e.load_keys.items())
    failed = sum(e.load_keys.values()) - promoted
    assert (promoted > 0) == (fault != "eio") and (failed > 0) == (fault is not None)
    assert got.get("vllm:kvoffload_hit_tokens_total{}", 0) == promoted * BLOCK
    assert got.get("vllm:kvoffload_recomputed_tokens_total{}", 0) == failed * BLOCK
    cause = {None: None, "eio": "io_error", "bitflip": "integrity"}[fault]
    failures = {k: v for k, v in got.items() if k.startswith("vllm:kvoffload_failed_blocks_total{")}
    assert failures == ({} if cause is None else
                        {f"vllm:kvoffload_failed_blocks_total{{cause={cause},direction=load}}": failed})
    assert got.get("vllm:kvoffload_blocks_total{direction=load,path=0}", 0) == promoted
    stored = stats(e)["bytes_written"] // PAGE
    assert got["vllm:kvoffload_blocks_total{direction=store,path=0}"] == stored
    assert got["vllm:kvoffload_bytes_total{direction=store,path=0}"] == stored * PAGE
    assert got["vllm:kvoffload_job_seconds_count{direction=load}"] == len(e.load_keys)
    pool = e.tier.slot_tier.pool
    assert got["vllm:kvoffload_slots_used{}"] == pool.num_cached() > 0
    assert got["vllm:kvoffload_slots_used{}"] + got["vllm:kvoffload_slots_free{}"] == pool.num_slots
    assert [k for k in got if k.startswith("vllm:kvoffload_info{")]
    # vLLM's own tier metrics are still there beside them.
    assert got.get("vllm:kv_offload_tiering_read_bytes_total{tier=1:FaultyKvoffloadTier}", 0) == promoted * PAGE
