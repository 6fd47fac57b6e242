"""KvoffloadConnector under vLLM 0.33's real Scheduler, on a disk tier, CPU only.

Each test runs requests through ``tests.vllm_harness.CpuEngine`` (vLLM's
Scheduler and the worker's model-runner connector code, a toy model that checks
every KV row it reads) in both file modes, with faults injected only through the
backend's OS seam. Every test asserts: the requests finish with the tokens a run
without any cache would give, the model never attends to a wrong KV row, the
tokens computed are exactly what the hits allow, and load attempts are bounded.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import kvoffload.vllm as kvv  # noqa: E402
from faults import Fault, FaultyOsCalls  # noqa: E402
from tests.vllm_harness import (BLOCK_SIZE, CpuEngine, EngineSpec, expected_output, prom_registry,  # noqa: E402
                                prom_samples, prompt, slot_bytes)

FILE_MODES = [pytest.param(False, id="o_direct"), pytest.param(True, id="page_cache")]
SHARED = prompt(1, 5 * BLOCK_SIZE)  # the shared prefix: 5 full blocks
MAX_TOKENS = 3


@pytest.fixture
def faulty(monkeypatch) -> FaultyOsCalls:
    """The OS seam every KvoffloadWorker's backend uses in this test."""
    osc = FaultyOsCalls()
    monkeypatch.setattr(kvv.KvoffloadWorker, "os_calls", osc)
    yield osc
    osc.release_hangs()


@pytest.fixture
def make_engine(tmp_path, monkeypatch):
    engines = []

    def make(use_page_cache: bool, **kw) -> CpuEngine:
        eng = CpuEngine(tmp_path, monkeypatch, EngineSpec(use_page_cache=use_page_cache, **kw))
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


def first_request_stored(eng: CpuEngine) -> list[int]:
    """Run request "a" (the shared prefix and a tail), wait for its stores, then
    empty the GPU prefix cache so the next request can only hit the disk."""
    tokens = SHARED + prompt(2, 10)
    eng.add("a", tokens, MAX_TOKENS)
    eng.run()
    eng.reset_gpu_prefix_cache()
    assert_sound(eng, "a", tokens, computed=len(tokens) + MAX_TOKENS - 1, loads=0)
    return tokens


def assert_sound(eng: CpuEngine, req_id: str, tokens: list[int], computed: int, loads: int) -> None:
    st = eng.stats[req_id]
    assert eng.finished(req_id)
    assert st.stale == [], f"the model attended to wrong KV: {st.stale}"
    assert eng.output(req_id) == expected_output(tokens, MAX_TOKENS)
    assert st.computed == computed
    assert st.loads == loads
    assert eng.bad_loads == [], "a slot whose load or store failed was loaded before being stored again"


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
def test_shared_prefix_hit_loads_exact_bytes(make_engine, faulty, use_page_cache) -> None:
    eng = make_engine(use_page_cache)
    first_request_stored(eng)
    tokens = SHARED + prompt(3, 20)
    eng.add("b", tokens, MAX_TOKENS)
    eng.run()
    # The 5 shared blocks come from disk (the model checked every row it read):
    # only the tail and the decode steps are computed.
    assert_sound(eng, "b", tokens, computed=20 + MAX_TOKENS - 1, loads=1)
    assert faulty.calls["preadv"] >= 1


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
def test_read_error_once_is_retried_by_the_backend(make_engine, faulty, use_page_cache) -> None:
    eng = make_engine(use_page_cache)
    first_request_stored(eng)
    faulty.fail_nth("preadv", faulty.calls["preadv"] + 1)
    tokens = SHARED + prompt(3, 20)
    eng.add("b", tokens, MAX_TOKENS)
    eng.run()
    # The failed multi-slot read is retried slot by slot, which succeeds: still a hit.
    assert faulty.fired["preadv"] == 1
    assert_sound(eng, "b", tokens, computed=20 + MAX_TOKENS - 1, loads=1)


# (fault on every preadv, leading blocks of the 5 that still load)
READ_FAULTS = [
    pytest.param(Fault.error(), 0, id="eio"),
    # Half of the 5-slot read arrives: 2 whole slots; each later slot alone comes up short.
    pytest.param(Fault.short(0.5), 2, id="short_read"),
    # A flipped byte in the first slot of every read fails its AES-GCM tag.
    pytest.param(Fault.bitflip(byte=4100, bit=3), 0, id="corrupt"),
]


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
@pytest.mark.parametrize("fault, good_blocks", READ_FAULTS)
def test_every_read_failing_recomputes_exactly_once(make_engine, faulty, use_page_cache, fault,
                                                    good_blocks) -> None:
    eng = make_engine(use_page_cache)
    first_request_stored(eng)
    faulty.fail_from("preadv", 1, fault)
    tokens = SHARED + prompt(3, 20)
    eng.add("b", tokens, MAX_TOKENS)
    eng.run(max_steps=300)
    # One load attempt, then everything from the first failed block on, once: no
    # retry loop, no stale rows.
    recompute = len(tokens) - good_blocks * BLOCK_SIZE
    assert_sound(eng, "b", tokens, computed=recompute + MAX_TOKENS - 1, loads=1)
    failed = eng.failed_load_slots
    assert failed and failed <= set(eng.stats["b"].load_slots)
    # The disk heals; b's recompute stored the prefix again (vLLM reuses the freed
    # slots first). The next request hits it; no slot is loaded between its failure
    # and its next store (assert_sound checks every load of the run).
    faulty.clear()
    eng.reset_gpu_prefix_cache()
    tokens_c = SHARED + prompt(4, 7)
    eng.add("c", tokens_c, MAX_TOKENS)
    eng.run()
    assert_sound(eng, "c", tokens_c, computed=7 + MAX_TOKENS - 1, loads=1)


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
def test_failed_store_never_becomes_a_hit(make_engine, faulty, use_page_cache) -> None:
    eng = make_engine(use_page_cache)
    faulty.fail_from("pwritev", 1)
    first_request_stored(eng)
    assert faulty.fired["pwritev"] >= 1
    tokens = SHARED + prompt(3, 20)
    eng.add("b", tokens, MAX_TOKENS)
    eng.run()
    assert_sound(eng, "b", tokens, computed=len(tokens) + MAX_TOKENS - 1, loads=0)
    assert faulty.calls["preadv"] == 0


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
def test_preemption_with_stores_in_flight(make_engine, faulty, use_page_cache) -> None:
    # Slow writes keep stores in flight; 12 GPU blocks cannot hold three requests
    # decoding, so the scheduler preempts, frees blocks under in-flight stores and
    # hands them to another request, whose KV the toy model then writes.
    faulty.fail_from("pwritev", 1, Fault.delay(0.02))
    eng = make_engine(use_page_cache, num_gpu_blocks=12, extra={"io_threads": 1})
    prompts = {f"r{i}": SHARED[: 2 * BLOCK_SIZE] + prompt(10 + i, 20) for i in range(3)}
    max_tokens = 40
    for req_id, tokens in prompts.items():
        eng.add(req_id, tokens, max_tokens)
    eng.run(max_steps=3000)
    preempted = {r: eng.requests[r].num_preemptions for r in prompts}
    assert sum(preempted.values()) >= 1, "the scenario did not preempt"
    for req_id, tokens in prompts.items():
        st = eng.stats[req_id]
        assert st.stale == [], f"the model attended to wrong KV: {st.stale}"
        assert eng.output(req_id) == expected_output(tokens, max_tokens)
        # Each admission loads at most once, and recomputes at most everything.
        assert st.loads <= preempted[req_id]
        assert st.computed <= (1 + preempted[req_id]) * (len(tokens) + max_tokens)
    assert eng.bad_loads == []


@pytest.mark.parametrize("use_page_cache", FILE_MODES)
@pytest.mark.parametrize("num_cpu_blocks", [None, 20])
def test_scheduler_pool_is_the_ranks_slot_count(make_engine, use_page_cache, num_cpu_blocks) -> None:
    # Goal: vLLM's scheduler hands out exactly the slots each rank's file holds (the
    # padded-slot rule, or num_cpu_blocks), on 0.32 (no num_cpu_blocks key in vLLM)
    # and 0.33 alike: the connector gives vLLM the byte budget whose floor is the count.
    extra = {} if num_cpu_blocks is None else {"num_cpu_blocks": num_cpu_blocks}
    eng = make_engine(use_page_cache, disk_slots=32, extra=extra)
    want = 32 if num_cpu_blocks is None else num_cpu_blocks
    assert eng.worker.worker_handler.num_cpu_blocks == want
    assert eng.scheduler.connector.scheduler_manager.num_cpu_blocks == want


def test_num_cpu_blocks_beyond_the_budget_is_refused(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"num_cpu_blocks=33 exceeds the 32 disk slots that disk_capacity_bytes="):
        CpuEngine(tmp_path, monkeypatch, EngineSpec(disk_slots=32, extra={"num_cpu_blocks": 33}))


def scrape(eng: CpuEngine) -> dict[str, float]:
    """What /metrics would show: every step's SchedulerStats, as the frontend decoded them,
    into the connector's own Prometheus metrics (``build_prom_metrics``)."""
    types, registry = prom_registry()
    prom = kvv.KvoffloadConnector.build_prom_metrics(eng.vllm_config, types, ["engine"], {0: ["0"]})
    for st in eng.scheduler_stats:
        if st.kv_connector_stats:
            prom.observe(st.kv_connector_stats, 0)
    return prom_samples(registry)


def disk_hits_by_vllm(eng: CpuEngine) -> int:
    """vLLM's own count behind vllm:prompt_tokens_cached_by_source{source="disk"}."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return sum(st.connector_prefix_cache_stats.hits_by_source.get(CacheHitSource.DISK, 0)
               for st in eng.scheduler_stats if st.connector_prefix_cache_stats is not None)


# (fault on every read of b's 5 shared blocks, blocks that serve b, cause of the others)
METRIC_FAULTS = [
    pytest.param(None, 5, None, id="no_fault"),
    pytest.param(Fault.error(), 0, "io_error", id="eio"),
    pytest.param(Fault.short(0.5), 2, "short", id="short_read"),
    # The first slot fails its tag; the 4 after it load, and vLLM recomputes them anyway.
    pytest.param(Fault.bitflip(byte=4100, bit=3), 0, "integrity", id="corrupt"),
]


@pytest.mark.parametrize("fault, serving, cause", METRIC_FAULTS)
def test_metrics_count_what_the_disk_did_and_only_hits_that_served(make_engine, faulty, fault, serving,
                                                                   cause) -> None:
    # Goal: through vLLM's stats path (worker stats merged with the scheduler's,
    # msgpack to the frontend, the connector's Prometheus metrics), kvoffload's metrics
    # equal what the test counts: blocks and bytes each way, failures by cause, one load
    # job, and hits only for blocks that served b; vLLM's own simple-offload metrics are
    # still there, and vLLM's disk-hit count (at lookup) includes the failed loads.
    eng = make_engine(False, log_stats=True)
    first_request_stored(eng)
    if fault is not None:
        faulty.fail_from("preadv", 1, fault)
    tokens = SHARED + prompt(3, 20)
    eng.add("b", tokens, MAX_TOKENS)
    eng.run(max_steps=300)
    faulty.clear()
    eng.report_all()
    got = scrape(eng)
    loaded, failed = eng.stats["b"].load_slots, eng.failed_load_slots
    assert len(loaded) == 5 and eng.stats["b"].loads == 1
    assert got.get("vllm:kvoffload_hit_tokens_total{}", 0) == serving * BLOCK_SIZE
    assert got.get("vllm:kvoffload_recomputed_tokens_total{}", 0) == (5 - serving) * BLOCK_SIZE
    assert disk_hits_by_vllm(eng) == 5 * BLOCK_SIZE
    failures = {k: v for k, v in got.items() if k.startswith("vllm:kvoffload_failed_blocks_total{")}
    assert failures == ({} if cause is None else
                        {f"vllm:kvoffload_failed_blocks_total{{cause={cause},direction=load}}": len(failed)})
    slot = slot_bytes(False)
    backend = eng.worker.worker_handler._backend
    for direction, blocks in (("load", len(loaded) - len(failed)),
                              ("store", backend.stats()["bytes_written"] // slot)):
        assert got.get(f"vllm:kvoffload_blocks_total{{direction={direction},path=0}}", 0) == blocks
        assert got.get(f"vllm:kvoffload_bytes_total{{direction={direction},path=0}}", 0) == blocks * slot
    assert got["vllm:kvoffload_job_seconds_count{direction=load}"] == 1
    assert got["vllm:kvoffload_unit_io_seconds_count{direction=load}"] == 1  # 5 blocks: one unit
    assert got["vllm:kvoffload_io_busy_seconds_total{direction=load}"] > 0
    pool = eng.scheduler.connector.scheduler_manager.cpu_block_pool
    assert got["vllm:kvoffload_slots_used{}"] == len(pool.cached_block_hash_to_block) > 0
    assert got["vllm:kvoffload_slots_used{}"] + got["vllm:kvoffload_slots_free{}"] == 32 - 1  # the null block
    (info,) = [k for k in got if k.startswith("vllm:kvoffload_info{")]
    assert "slots=32," in info and f"slot_bytes={slot}," in info and "io=o_direct" in info
    # vLLM's metrics, composed: it counts every completed load block, failed or not.
    assert got["vllm:simple_kv_offload_load_blocks_total{}"] == 5
    assert got["vllm:simple_kv_offload_info{backend=disk,capacity_blocks=32,lazy_offload=false,page_cache=false}"] == 1
    # And vLLM's periodic log line of the same payloads.
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(eng.vllm_config.kv_transfer_config)
    for st in eng.scheduler_stats:
        if st.kv_connector_stats:
            logging_.observe(st.kv_connector_stats)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    line = lines[0] + ","  # each item ends with a comma
    assert len(lines) == 1
    assert (f"vllm:kvoffload_hit_tokens_total={serving * BLOCK_SIZE}," in line) == (serving > 0)
    assert "vllm:kvoffload_job_seconds:('load',)_count=1," in line and "vllm:simple_kv_offload_load_blocks_total=5" in line
