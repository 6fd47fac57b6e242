"""``vllm serve`` with KvoffloadConnector on 127.0.0.1, driven by the ``openai`` client.

A real HTTP server (API process, engine core, worker: vLLM's own processes) serves
the tiny model; text prompts go through its tokenizer, and the completions come
back with their token ids. They must equal the offline run without a connector,
the server's /metrics must show disk hits, and once the server has stopped no
process, file or fd of it is left and no prompt text is anywhere under the disk
directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.real_engine import (BASE, BLOCK_BYTES, BLOCK_SIZE, PROMPTS, ROUNDS, disk_dir, needs_vllm_cpu,
                               private_tmpdir)

pytestmark = [pytest.mark.engine, needs_vllm_cpu]

START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def processes_in_group(pgid: int) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_vllm_serve_over_http_equals_offline_and_leaves_nothing(tmp_path, model, baseline):
    # Goal: the deployment shape, for real: `vllm serve` with the kvoffload connector,
    # HTTP completions from the openai client, outputs equal to the run without a
    # connector, disk hits in /metrics, and nothing left once the server stops.
    from openai import OpenAI

    disk = disk_dir(tmp_path)
    port = free_port()
    ktc = {"kv_connector": "KvoffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"kv_offload_backend": "disk", "disk_path": f"{disk}/kv",
                                         "disk_capacity_bytes": "64MiB"}}
    log = tmp_path / "serve.log"
    # `vllm serve` is this module (vllm-cpu's `vllm` script looks up the metadata of a
    # distribution named "vllm" and fails before serving).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--seed", "0",
           "--kv-cache-memory-bytes", str(BASE["device_blocks"] * BLOCK_BYTES), "--max-model-len", "1024",
           "--max-num-seqs", str(BASE["max_num_seqs"]), "--max-num-batched-tokens", "1024",
           "--enable-prefix-caching", "--kv-transfer-config", json.dumps(ktc)]
    # vLLM's files (vllm_dist_*, ZMQ sockets) go in a TMPDIR of the server's own, removed after it.
    with private_tmpdir() as tmp:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=tmp,
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        texts = [" ".join(f"w{t}" for t in p) for p in PROMPTS]
        try:
            wait_healthy(url, proc, log)
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            outputs = []
            for _ in ROUNDS:
                got = []
                for text in texts:
                    r = client.completions.create(model=model, prompt=text, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True, "return_token_ids": True})
                    got.append(list(r.choices[0].model_extra["token_ids"]))
                outputs.append(got)
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                metrics = r.read().decode()
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise AssertionError(f"vllm serve did not stop within 60 s of SIGINT:\n{log.read_text()[-4000:]}")
    # One request at a time over HTTP: the same greedy tokens as the offline batches.
    assert outputs == baseline.outputs
    disk_hits = [line for line in metrics.splitlines()
                 if line.startswith("vllm:prompt_tokens_cached_by_source_total") and 'source="disk"' in line]
    assert disk_hits and float(disk_hits[0].split()[-1]) > 0, disk_hits
    # kvoffload's own metrics crossed vLLM's processes too (worker, engine core, API server).
    ours = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith(("vllm:kvoffload_hit_tokens_total", "vllm:kvoffload_blocks_total"))
            and ('direction="load"' in line or "hit_tokens" in line)}
    assert ours["vllm:kvoffload_hit_tokens_total"] == float(disk_hits[0].split()[-1]), ours
    assert ours["vllm:kvoffload_blocks_total"] * BLOCK_SIZE == ours["vllm:kvoffload_hit_tokens_total"], ours
    # The server is gone, and with it every trace of the tier.
    deadline = time.monotonic() + 30
    while processes_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_in_group(proc.pid) == [], "a server process outlived the server"
    assert os.listdir(disk) == []
    prompt_bytes = texts[0].encode()[:64]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path != log:
            assert prompt_bytes not in path.read_bytes(), f"prompt text found in {path}"
