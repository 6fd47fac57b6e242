"""A CPU engine loop: vLLM 0.33's real ``Scheduler`` and the worker's real connector code.

In the style of vLLM's connector unit-test utilities (a ``VllmConfig`` from small
parts, a ``Scheduler`` over a hand-made ``KVCacheConfig``, requests with real
block hashes) but written for kvoffload: the worker side runs through vLLM's
``KVConnectorModelRunnerMixin`` (bind metadata, start loads after the forward,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``), and the "model" is a toy that checks every KV
row it attends to and writes a row per token it computes, so a step that would
run on stale or foreign KV is caught in the bytes.

The scheduler and the worker are built as separate connector instances that share
no Python object, as in vLLM, where they live in separate processes: everything
between them travels in ``SchedulerOutput`` and ``ModelRunnerOutput``. CUDA
streams and events are replaced by host stand-ins (``cpu_streams``), since the
worker makes them even when the caches live on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's config objects need a platform

import torch  # noqa: E402
from vllm import ModelRegistry, SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from kvoffload.disk_backend import DiskBackend  # noqa: E402

BLOCK_SIZE = 16  # tokens per block
ROW_BYTES = 1152  # KV bytes per token: a block is 18,432 B, not a multiple of 4096 (O_DIRECT pads it)
BLOCK_BYTES = BLOCK_SIZE * ROW_BYTES
VOCAB = 256
TOY_ARCH = "KvoffloadToyForCausalLM"


class ToyForCausalLM(torch.nn.Module):
    """Registered so ``ModelConfig`` accepts a local config without importing a real model."""

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the harness runs ToyModel, never this module")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


_MODEL_CONFIG: Optional[ModelConfig] = None
_MODEL_DIR = tempfile.TemporaryDirectory(prefix="kvoffload-toy-model-")


def model_config() -> ModelConfig:
    """One ``ModelConfig`` per process for a tiny local HF config (no hub, no tokenizer)."""
    global _MODEL_CONFIG
    if _MODEL_CONFIG is None:
        ModelRegistry.register_model(TOY_ARCH, ToyForCausalLM)
        (Path(_MODEL_DIR.name) / "config.json").write_text(json.dumps({
            "architectures": [TOY_ARCH], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": VOCAB,
            "max_position_embeddings": 4096, "torch_dtype": "float32", "rms_norm_eps": 1e-5,
        }))
        _MODEL_CONFIG = ModelConfig(model=_MODEL_DIR.name, skip_tokenizer_init=True, dtype="float32", max_model_len=4096)
    return _MODEL_CONFIG


class HostEvent:
    """``torch.Event`` stand-in: host work is synchronous, so it is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostStream:
    """``torch.cuda.Stream`` stand-in (the worker makes load and store streams)."""

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def cpu_streams(monkeypatch: Any) -> None:
    """Let vLLM's worker make its streams and compute-done events on a CPU-only torch."""
    monkeypatch.setattr(torch.cuda, "Stream", HostStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(torch, "Event", HostEvent)


def row_digests(tokens: list[int], upto: int, memo: list[bytes]) -> list[bytes]:
    """Digest per position: a hash chain over the tokens, so a row names its whole prefix."""
    while len(memo) < upto:
        prev = memo[-1] if memo else b"kvoffload"
        memo.append(hashlib.blake2b(prev + tokens[len(memo)].to_bytes(4, "little"), digest_size=32).digest())
    return memo


def expected_output(prompt_tokens: list[int], n: int) -> list[int]:
    """The ``n`` tokens the toy model samples after ``prompt_tokens`` when no KV is wrong."""
    tokens, memo = list(prompt_tokens), []
    for _ in range(n):
        tokens.append(row_digests(tokens, len(tokens), memo)[-1][0] % VOCAB)
    return tokens[len(prompt_tokens):]


def row_bytes(digest: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(digest * (ROW_BYTES // len(digest))), dtype=torch.int8)


@dataclass
class ReqStats:
    computed: int = 0  # tokens the model computed for the request
    loads: int = 0  # load jobs the scheduler sent for it
    load_slots: list[int] = field(default_factory=list)  # disk slots those jobs read
    stale: list[str] = field(default_factory=list)  # rows it attended to that were wrong


class ToyModel:
    """Reads and writes the "GPU" KV cache of the worker like attention would.

    Before computing positions [start, start + n) of a request it checks the rows of
    positions [0, start) in the request's blocks (what attention reads); then it
    writes the rows of the new positions and samples a token from the last digest.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv.view(-1, BLOCK_SIZE, ROW_BYTES)
        self.digests: dict[str, list[bytes]] = {}

    def run(self, req: Request, block_ids: list[int], start: int, n: int, stats: ReqStats) -> Optional[int]:
        tokens = list(req.all_token_ids)
        memo = row_digests(tokens, start + n, self.digests.setdefault(req.request_id, []))
        for p in range(start):
            got = self.kv[block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE]
            if not torch.equal(got, row_bytes(memo[p])):
                stats.stale.append(f"{req.request_id} position {p} (block {block_ids[p // BLOCK_SIZE]})")
                break
        for p in range(start, start + n):
            self.kv[block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = row_bytes(memo[p])
        stats.computed += n
        if start + n < len(tokens):
            return None  # a chunk of the prompt: nothing sampled yet
        return memo[start + n - 1][0] % VOCAB


@dataclass
class EngineSpec:
    num_gpu_blocks: int = 64
    disk_slots: int = 32  # disk_capacity_bytes is sized to hold this many slots
    use_page_cache: bool = False
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config keys
    # "KvoffloadConnector", or vLLM's own "SimpleCPUOffloadConnector" (its stock worker)
    connector: str = "KvoffloadConnector"
    # The scheduler makes SchedulerStats each step (CpuEngine.scheduler_stats), as with
    # vLLM's stat loggers on.
    log_stats: bool = False


def slot_bytes(use_page_cache: bool) -> int:
    return BLOCK_BYTES if use_page_cache else -(-BLOCK_BYTES // 4096) * 4096


def engine_configs(root: Path, spec: EngineSpec) -> tuple[VllmConfig, KVCacheConfig]:
    """The engine's VllmConfig (disk tier under ``root``) and its GPU KVCacheConfig."""
    ktc = KVTransferConfig(
        kv_connector=spec.connector,
        kv_connector_module_path="kvoffload.vllm" if spec.connector == "KvoffloadConnector" else None,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "kv_offload_backend": "disk", "disk_path": str(root / "kv"),
            "disk_capacity_bytes": spec.disk_slots * slot_bytes(spec.use_page_cache),
            "use_page_cache": spec.use_page_cache, **spec.extra,
        },
    )
    vllm_config = VllmConfig(
        model_config=model_config(),
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = spec.num_gpu_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=spec.num_gpu_blocks,
        kv_cache_tensors=[KVCacheTensor(size=spec.num_gpu_blocks * BLOCK_BYTES, layers=["layer.0"],
                                        layer_stride=spec.num_gpu_blocks * BLOCK_BYTES,
                                        block_stride=BLOCK_BYTES)],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=ROW_BYTES // 8, dtype=torch.float32))],
    )
    return vllm_config, kv_cache_config


class CpuEngine:
    """vLLM's Scheduler plus one worker's connector over a CPU "GPU" cache."""

    def __init__(self, root: Path, monkeypatch: Any, spec: EngineSpec) -> None:
        cpu_streams(monkeypatch)
        self.spec = spec
        self.vllm_config, kv_cache_config = engine_configs(root, spec)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE, log_stats=spec.log_stats,
        )
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        # The worker's connector, as vLLM's ensure_kv_transfer_initialized makes it;
        # the model-runner code finds it in the same module global.
        self.worker = KVConnectorFactory.create_connector(
            config=self.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", self.worker)
        self.kv = torch.zeros(spec.num_gpu_blocks, BLOCK_BYTES, dtype=torch.int8)
        self.worker.register_kv_caches({"layer.0": self.kv})
        self.model = ToyModel(self.kv)
        self.stats: dict[str, ReqStats] = {}
        self.failed_load_slots: set[int] = set()  # as the workers reported them
        # Slots whose last load or store failed, until a store writes them again; a
        # load of one would read a block the workers said is not there.
        self.unloadable: set[int] = set()
        self.bad_loads: list[int] = []
        self.requests: dict[str, Request] = {}
        self.steps = 0
        # Every step's SchedulerStats, as the frontend gets them (through vLLM's msgpack).
        self.scheduler_stats: list[Any] = []

    # -- requests ---------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        req = Request(
            request_id=req_id, prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None, block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(req)
        self.requests[req_id] = req
        self.stats[req_id] = ReqStats()
        return req

    def output(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    def finished(self, req_id: str) -> bool:
        return self.requests[req_id].status == RequestStatus.FINISHED_LENGTH_CAPPED

    # -- the engine step --------------------------------------------------------

    def step(self) -> None:
        """One EngineCore step: schedule, execute (worker side), update from output."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if meta is not None and meta.store_cpu_blocks:
            self.unloadable -= set(meta.store_cpu_blocks)  # written anew
        if meta is not None and meta.load_event >= 0:
            self.bad_loads.extend(sorted(self.unloadable & set(meta.load_cpu_blocks)))
            # One job for all requests of the step: their slots, in request order.
            slots = iter(meta.load_cpu_blocks)
            for req_id in meta.load_event_to_reqs.get(meta.load_event, ()):
                st = self.stats[req_id]
                st.loads += 1
                n = len(self.scheduler.connector.scheduler_manager._reqs_to_load[req_id].transfer_meta.cpu_block_ids)
                st.load_slots.extend(next(slots) for _ in range(n))
        runner_out = self._execute(out)
        kv_out = runner_out.kv_connector_output
        worker_meta = kv_out.kv_connector_worker_meta if kv_out is not None else None
        # vLLM's own worker metadata (the stock worker) has no failure fields.
        failed_loads = getattr(worker_meta, "failed_load_slots", ())
        self.failed_load_slots.update(failed_loads)
        self.unloadable.update(failed_loads)
        for slots in getattr(worker_meta, "failed_store_events", {}).values():
            self.unloadable.update(slots)
        outputs = self.scheduler.update_from_output(out, runner_out)
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                self.scheduler_stats.append(over_ipc(eco).scheduler_stats)
        self.steps += 1

    def _execute(self, out: Any) -> ModelRunnerOutput:
        """What GPUModelRunner.execute_model does around the forward, with the toy model."""
        self.worker.handle_preemptions(out.kv_connector_metadata)
        if not out.total_num_scheduled_tokens:
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.vllm_config)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        with (set_forward_context(None, self.vllm_config),
              KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(out) as kv_out):
            for req_id in req_ids:
                req = self.requests[req_id]
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
                tok = self.model.run(req, blocks, starts[req_id], out.num_scheduled_tokens[req_id],
                                     self.stats[req_id])
                sampled.append([] if tok is None else [tok])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    def run(self, max_steps: int = 500, until: Optional[list[str]] = None) -> None:
        """Step until ``until`` (default: every request) finished; fail after ``max_steps``."""
        ids = until if until is not None else list(self.requests)
        for _ in range(max_steps):
            if all(self.finished(r) for r in ids):
                return
            self.step()
            if not self.scheduler.get_num_unfinished_requests() or self._idle():
                time.sleep(0.001)  # waiting on disk IO threads
        raise AssertionError(f"not finished after {max_steps} steps: "
                             f"{ {r: self.requests[r].status.name for r in ids} }")

    def _idle(self) -> bool:
        return not self.scheduler.running

    def drain_stores(self, max_steps: int = 500) -> None:
        """Step until no store is in flight, so stored blocks are loadable."""
        for _ in range(max_steps):
            if not self.scheduler.connector.has_pending_push_work():
                return
            self.step()
            time.sleep(0.001)
        raise AssertionError("stores still in flight")

    def report_all(self, timeout: float = 10.0) -> None:
        """Stores drained, every job of the worker's backend over (its latencies counted),
        then one more step, which carries the last counts into ``scheduler_stats``."""
        self.drain_stores()
        run = self.worker.worker_handler._backend._run
        deadline = time.monotonic() + timeout
        while run.open_jobs:
            assert time.monotonic() < deadline, "backend jobs still open"
            time.sleep(0.001)
        self.step()

    def reset_gpu_prefix_cache(self) -> None:
        """Wait for stores (they hold GPU blocks), then empty the GPU prefix cache, so
        the next request can hit only the disk."""
        self.drain_stores()
        assert self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.worker.shutdown()
        # vLLM's own connector never shuts its backend down (its IO threads are daemons);
        # do it here so no test leaves threads behind for the next one to count.
        backend = getattr(getattr(self.worker, "worker_handler", None), "_backend", None)
        if isinstance(backend, DiskBackend):
            backend.shutdown()


def over_ipc(eco: EngineCoreOutputs) -> EngineCoreOutputs:
    """What the frontend decodes of the engine core's output (vLLM's msgpack)."""
    return MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(eco))


def prom_registry() -> tuple[dict, Any]:
    """vLLM's ``metric_types`` for ``build_prom_metrics``, bound to a private registry
    (vLLM registers its classes in the process-wide one), and that registry."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    return {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}, registry


def prom_samples(registry: Any) -> dict[str, float]:
    """Every sample of ``registry`` as "name{label=value,...}" -> value (labels sorted, the
    engine label left out), as Prometheus would scrape it."""
    out = {}
    for metric in registry.collect():
        for s in metric.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "engine")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def load_attempts(stats: dict[str, ReqStats]) -> Counter:
    return Counter({r: s.loads for r, s in stats.items()})
