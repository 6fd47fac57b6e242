"""KvoffloadConnector with ``"persist": true`` across a restart, under vLLM 0.33's real Scheduler.

Run one serves a request and stops (its scheduler and worker shut down, as a server
does); run two is a new Scheduler and worker on the same disk path and key: its
scheduler side seeds vLLM's offload pool from the ranks' indexes, so a request sharing
the prefix loads it from disk (the toy model checks every row it reads) instead of
computing it.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvoffload.persist import INDEX_SUFFIX, PersistError  # noqa: E402
from tests.test_vllm_scheduler import MAX_TOKENS, SHARED, assert_sound  # noqa: E402
from tests.vllm_harness import CpuEngine, EngineSpec, engine_configs, prompt, slot_bytes  # noqa: E402

FILE_MODES = [pytest.param(False, id="o_direct"), pytest.param(True, id="page_cache")]


@pytest.fixture
def key_file(tmp_path):
    f = tmp_path / "kvoffload.key"
    f.write_bytes(os.urandom(32))
    f.chmod(0o600)
    return f


def persistent(key_file, **extra) -> dict:
    return {"persist": True, "persist_key_file": str(key_file), **extra}


def run_one(tmp_path, monkeypatch, use_page_cache: bool, extra: dict) -> list[int]:
    """A first server: request "a" (the shared prefix and a tail), its stores drained, stopped."""
    eng = CpuEngine(tmp_path, monkeypatch, EngineSpec(use_page_cache=use_page_cache, extra=extra))
    try:
        tokens = SHARED + prompt(2, 10)
        eng.add("a", tokens, MAX_TOKENS)
        eng.run()
        eng.drain_stores()
        assert_sound(eng, "a", tokens, computed=len(tokens) + MAX_TOKENS - 1, loads=0)
    finally:
        eng.shutdown()
    return tokens


def serve_b(eng: CpuEngine, loads: int, recomputed: bool) -> None:
    """Run two's request "b": the shared prefix and another tail; with ``recomputed`` every
    prompt token is computed, else only the 20-token tail."""
    tokens = SHARED + prompt(3, 20)
    eng.add("b", tokens, MAX_TOKENS)
    eng.run()
    assert_sound(eng, "b", tokens, computed=(len(tokens) if recomputed else 20) + MAX_TOKENS - 1, loads=loads)


def restored_metrics(eng: CpuEngine) -> dict:
    eng.step()  # the first step's stats carry what start-up restored
    data = {}
    for stats in eng.scheduler_stats:
        payload = (stats.kv_connector_stats or {}).get("data", {})
        for name in ("vllm:kvoffload_restored_blocks_total", "vllm:kvoffload_refused_blocks_total"):
            for labels, v in payload.get(name, {}).items():
                data[(name, tuple(labels))] = data.get((name, tuple(labels)), 0) + v
    return data


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
def test_a_restarted_server_loads_prefixes_stored_before_it(tmp_path, monkeypatch, key_file, use_page_cache):
    # Goal: prefixes stored by run one are disk hits in run two: the restored blocks are in
    # vLLM's offload pool (LRU order carried over: oldest first in the free queue, behind
    # the empty slots), run two's request computes only its tail, and the metrics say what
    # start-up restored.
    extra = persistent(key_file)
    run_one(tmp_path, monkeypatch, use_page_cache, extra)
    assert {"kv.dp0.rank0", "kv.dp0.rank0" + INDEX_SUFFIX} <= set(os.listdir(tmp_path))
    eng = CpuEngine(tmp_path, monkeypatch, EngineSpec(use_page_cache=use_page_cache, extra=extra, log_stats=True))
    try:
        pool = eng.scheduler.connector.scheduler_manager.cpu_block_pool
        cached = [b.block_id for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
        assert len(cached) == len(pool.cached_block_hash_to_block) == 5  # a's 5 full shared-prefix blocks
        queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert queue[-5:] == cached, "restored blocks must queue behind the empty slots"
        serve_b(eng, loads=1, recomputed=False)
        assert restored_metrics(eng)[("vllm:kvoffload_restored_blocks_total", ())] == 5
    finally:
        eng.shutdown()


def test_a_changed_block_on_disk_is_recomputed_after_the_restart(tmp_path, monkeypatch, key_file):
    # Goal: a block whose bytes changed while the server was down fails its tag: vLLM
    # recomputes from it once, and the outputs stay right.
    extra = persistent(key_file)
    run_one(tmp_path, monkeypatch, False, extra)
    data = tmp_path / "kv.dp0.rank0"
    blob = bytearray(data.read_bytes())
    for s in range(len(blob) // slot_bytes(False)):
        blob[s * slot_bytes(False) + 10] ^= 0x40
    data.write_bytes(blob)
    eng = CpuEngine(tmp_path, monkeypatch, EngineSpec(extra=extra))
    try:
        serve_b(eng, loads=1, recomputed=True)
    finally:
        eng.shutdown()


def test_a_wrong_key_is_refused_in_one_line_and_the_files_stay(tmp_path, monkeypatch, key_file):
    # Goal: run two with another key does not start (one line naming the file and what to
    # do), and nothing of run one's files changed.
    run_one(tmp_path, monkeypatch, False, persistent(key_file))
    before = {p: (tmp_path / p).read_bytes() for p in ("kv.dp0.rank0", "kv.dp0.rank0" + INDEX_SUFFIX)}
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    with pytest.raises(PersistError, match=r"kv.dp0.rank0.index does not verify under this key") as e:
        CpuEngine(tmp_path, monkeypatch, EngineSpec(extra=persistent(other)))
    assert "\n" not in str(e.value)
    assert {p: (tmp_path / p).read_bytes() for p in before} == before


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_a_hash_that_changes_across_restarts_is_refused(tmp_path, monkeypatch, key_file, algo):
    # Goal: with a prefix-caching hash vLLM seeds at random per process, nothing stored
    # could be found after a restart: refused, naming the vLLM setting; PYTHONHASHSEED
    # fixes it.
    from kvoffload.vllm import check_stable_hashes

    vllm_config, _ = engine_configs(tmp_path, EngineSpec(extra=persistent(key_file)))
    vllm_config.cache_config.prefix_caching_hash_algo = algo
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match=r"--prefix-caching-hash-algo sha256 .* PYTHONHASHSEED") as e:
        check_stable_hashes(vllm_config)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_stable_hashes(vllm_config)
    vllm_config.cache_config.prefix_caching_hash_algo = "sha256"
    monkeypatch.delenv("PYTHONHASHSEED")
    check_stable_hashes(vllm_config)


def test_without_persist_a_restart_starts_empty(tmp_path, monkeypatch):
    # Goal: the default is unchanged: nothing named on disk, and run two computes everything.
    run_one(tmp_path, monkeypatch, False, {})
    assert [n for n in os.listdir(tmp_path) if n.startswith("kv")] == []
    eng = CpuEngine(tmp_path, monkeypatch, EngineSpec())
    try:
        serve_b(eng, loads=0, recomputed=True)
    finally:
        eng.shutdown()
