"""kvoffload's own metrics from a real DiskBackend on real files, without vLLM.

What the IO threads count (blocks and bytes per path, failures by cause, latency
histograms, queues, busy seconds), the payload vLLM carries (``take_metrics``: what
changed since the last call), the summary line at shutdown, and the switch that
turns collection off. Faults go in through the OS seam. vLLM's side (its stats
classes and Prometheus) is ``tests/test_vllm_metrics.py``.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from faults import Fault, FaultyOsCalls
from kvoffload import DiskBackend
from kvoffload import metrics as m
from tests.conftest import block_bytes, make_caches

SLOT = 4 * 4096  # four 4 KiB tensors a block: one O_DIRECT slot, no padding
UNIT = 4  # blocks per IO unit (io_unit_bytes below)


def start(tmp_path, paths: int = 1, osc=None, **kw) -> DiskBackend:
    caches = make_caches(torch.device("cpu"), 16, [4096] * 4)
    b = DiskBackend()
    files = [str(tmp_path / f"kv{i}") for i in range(paths)]
    b.init(caches, torch.device("cpu"), None, None, files[0], 32, block_bytes(caches), io_threads=2,
           report_load_errors=True, disk_paths=files, io_unit_bytes=UNIT * SLOT, capacity_bytes=32 * SLOT,
           os_calls=osc, **kw)
    return b


def job(b: DiskBackend, src, dst, is_store: bool) -> bool:
    events: list = []
    b.launch_copy(src, dst, is_store, 0, events)
    events[-1][1].synchronize()
    # Latencies are counted as a job leaves the open jobs, just after its event completes.
    deadline = time.monotonic() + 10
    while b._run.open_jobs and time.monotonic() < deadline:
        time.sleep(0.001)
    return events[-1][1].ok


def data(payload, name) -> dict:
    return payload["data"].get(name, {}) if payload else {}


def test_round_trip_counts_blocks_bytes_units_jobs_per_path(tmp_path):
    # Goal: 16 blocks stored and loaded over two paths (slot s in path s % 2): each
    # path moved 8 blocks each way, in two 4-block units, one job each way; the facts
    # come once, and a second take with nothing new is None.
    b = start(tmp_path, paths=2)
    try:
        assert job(b, range(16), range(16), True) and job(b, range(16), range(16), False)
        p = b.take_metrics()
        for d in m.DIRECTIONS:
            for path in ("0", "1"):
                assert data(p, m.BLOCKS)[(d, path)] == 8
                assert data(p, m.BYTES)[(d, path)] == 8 * SLOT
            assert len(data(p, m.JOB_SECONDS)[(d,)]) == 1
            assert len(data(p, m.UNIT_IO_SECONDS)[(d,)]) == 4  # 2 paths x 2 units of 4
            assert all(s > 0 for s in data(p, m.UNIT_IO_SECONDS)[(d,)])
            assert data(p, m.BUSY)[(d,)] > 0
        assert m.FAILED not in p["data"]
        (info,) = data(p, m.INFO)
        assert dict(zip(m.INFO_LABELS, info)) == {
            "capacity_bytes": str(32 * SLOT), "slots": "32", "slot_bytes": str(SLOT),
            "staging_bytes": str(b.stats()["staging_bytes"]), "io_threads": "2", "paths": "2", "seal": "aes-gcm",
            "io": "o_direct", "io_path": b.stats()["io_path"]}
        assert set(p["types"]) == set(p["data"]) and all(p["types"][k] == m.METRICS[k].kind for k in p["types"])
        assert b.take_metrics() is None
        # Only what is new comes next time.
        assert job(b, [0, 2], [4, 6], False)  # slots 0 and 2: both in path 0
        p = b.take_metrics()
        assert data(p, m.BLOCKS) == {("load", "0"): 2}
        assert m.INFO not in p["data"] and list(data(p, m.JOB_SECONDS)) == [("load",)]
    finally:
        b.shutdown()


# fault on every preadv -> (cause, blocks failed of the 4 loaded in one unit)
READ_FAULTS = [
    pytest.param(Fault.error(), "io_error", 4, id="eio"),
    # Half of the 4-slot read arrives: 2 slots load; each later slot alone comes up short.
    pytest.param(Fault.short(0.5), "short", 2, id="short"),
    # A flipped byte in the first slot read fails its AES-GCM tag.
    pytest.param(Fault.bitflip(byte=100, bit=1), "integrity", 1, id="bitflip"),
]


@pytest.mark.parametrize("fault, cause, failed", READ_FAULTS)
def test_failed_loads_are_counted_by_cause_and_not_as_loaded(tmp_path, fault, cause, failed):
    osc = FaultyOsCalls()
    b = start(tmp_path, osc=osc)
    try:
        assert job(b, range(4), range(4), True)
        b.take_metrics()
        osc.fail_from("preadv", osc.calls["preadv"] + 1, fault)
        assert not job(b, range(4), range(4), False)
        p = b.take_metrics()
        assert data(p, m.FAILED) == {("load", cause): failed}
        assert data(p, m.BLOCKS).get(("load", "0"), 0) == 4 - failed
        assert data(p, m.BYTES).get(("load", "0"), 0) == (4 - failed) * SLOT
        assert len(b.get_block_ids_with_load_errors()) == failed
    finally:
        osc.release_hangs()
        b.shutdown()


def test_store_failures_and_never_stored_slots_are_counted(tmp_path):
    osc = FaultyOsCalls()
    b = start(tmp_path, osc=osc)
    try:
        osc.fail_from("pwritev", 1, Fault.error())
        assert not job(b, range(4), range(4), True)
        osc.clear()
        assert not job(b, [9, 10], [0, 1], False)  # slots never stored: failed without IO
        p = b.take_metrics()
        assert data(p, m.FAILED) == {("store", "io_error"): 4, ("load", "not_stored"): 2}
        assert data(p, m.BLOCKS) == {}
        assert osc.calls["preadv"] == 0
    finally:
        b.shutdown()


def test_shutdown_line_sums_up_the_run_with_closing_refusals(tmp_path, caplog):
    # Goal: the summary at shutdown says bytes each way, failures by cause (here the
    # units still queued behind a hung write, refused once shutdown began) and the peak queue.
    osc = FaultyOsCalls()
    gate = threading.Event()
    b = start(tmp_path, osc=osc, join_timeout=5.0)
    try:
        assert job(b, range(16), range(16), True)
        assert job(b, range(8), range(8), False)
        # Both store threads hang in their first write; two units wait behind them.
        first = osc.calls["pwritev"] + 1
        osc.fail_from("pwritev", first, Fault.hang(gate, timeout=30), last=first + 1)
        events: list = []
        b.launch_copy(list(range(16)), list(range(16, 32)), True, 1, events)  # 4 units, 2 threads
        deadline = time.monotonic() + 10
        while osc.calls["pwritev"] < first + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        threading.Timer(0.5, gate.set).start()
        with caplog.at_level(logging.INFO, logger="kvoffload"):
            b.shutdown()
    finally:
        gate.set()
        osc.release_hangs()
    (line,) = [r.getMessage() for r in caplog.records if "run summary" in r.getMessage()]
    summary, _, drives = line.partition("; the drives (all their users): ")
    assert summary == ("kvoffload run summary: stored 0.4 MiB in 24 blocks; loaded 0.1 MiB in 8 blocks; "
                       "failed stores: closing 8; failed loads: none; peak queue 4 units (store lane, path 0)")
    assert not drives or " read " in drives and " wrote " in drives  # where the path is on a block device


def test_collection_off_counts_nothing_and_moves_the_same(tmp_path, caplog):
    # Goal: the bench's switch. Off, nothing is counted and nothing reported; on
    # again, counting resumes from there.
    b = start(tmp_path)
    try:
        assert b.collect_metrics is True
        b.collect_metrics = False
        assert job(b, range(16), range(16), True) and job(b, range(16), range(16), False)
        assert b.take_metrics() is None
        assert b.stats()["bytes_read"] == 16 * SLOT
        b.collect_metrics = True
        assert job(b, range(4), range(4), False)
        p = b.take_metrics()
        assert data(p, m.BLOCKS) == {("load", "0"): 4} and len(data(p, m.JOB_SECONDS)[("load",)]) == 1
        with pytest.raises(TypeError, match="collect_metrics must be a bool"):
            b.collect_metrics = 1
        b.collect_metrics = False
        with caplog.at_level(logging.INFO, logger="kvoffload"):
            b.shutdown()
    finally:
        b.shutdown()
    assert any(r.getMessage() == "kvoffload run summary: metrics collection off" for r in caplog.records)


def test_histogram_replay_keeps_every_bucket_count_and_the_sum():
    # Goal: the samples sent for a histogram (each bucket's mean, repeated) fall in the
    # bucket they stand for, so Prometheus gets exact counts per bucket and the sum.
    rng = random.Random(1)
    bounds = m.UNIT_IO_SECONDS_BUCKETS
    h = m.Histogram(bounds)
    values = [rng.choice(bounds) for _ in range(50)] + [rng.uniform(0, 5) for _ in range(500)] + [0.0, 99.0]
    for v in values:
        h.observe(v)
    replayed = h.replay(h.counts, h.sums)
    again = m.Histogram(bounds)
    for v in replayed:
        again.observe(v)
    assert again.counts == h.counts and len(replayed) == len(values)
    assert sum(replayed) == pytest.approx(sum(values), rel=1e-9)


def test_merge_sums_counters_joins_samples_and_takes_the_busiest_lane():
    a, b = m.new_payload(), m.new_payload()
    m.put(a, m.BLOCKS, ("load", "0"), 3)
    m.put(b, m.BLOCKS, ("load", "0"), 4)
    m.put(a, m.JOB_SECONDS, ("load",), [0.1])
    m.put(b, m.JOB_SECONDS, ("load",), [0.2, 0.3])
    m.put(a, m.QUEUED, ("load", "0"), 5)
    m.put(b, m.QUEUED, ("load", "0"), 2)
    # vLLM's own gauges (SimpleCPUOffloadStats) keep the newer value.
    a["types"]["vllm:simple_kv_offload_used_blocks"] = b["types"]["vllm:simple_kv_offload_used_blocks"] = "gauge"
    a["data"]["vllm:simple_kv_offload_used_blocks"] = {(): 9}
    b["data"]["vllm:simple_kv_offload_used_blocks"] = {(): 1}
    out = m.merge(a, b)
    assert out["data"][m.BLOCKS] == {("load", "0"): 7}
    assert out["data"][m.JOB_SECONDS] == {("load",): [0.1, 0.2, 0.3]}
    assert out["data"][m.QUEUED] == {("load", "0"): 5}
    assert out["data"]["vllm:simple_kv_offload_used_blocks"] == {(): 1}
    assert m.reduce(out)[f"{m.JOB_SECONDS}:('load',)_count"] == 3


def test_split_load_recomputes_from_the_first_failed_block():
    assert m.split_load([5, 6, 7, 8], set(), 32) == (128, 0)
    assert m.split_load([5, 6, 7, 8], {7}, 32) == (64, 64)
    assert m.split_load([5, 6, 7, 8], {5, 8}, 32) == (0, 128)


def test_hit_metrics_report_changes_only():
    h = m.HitMetrics()
    h.load_ended(64, 0)
    h.load_ended(0, 96)
    p = h.take(slots_used=3, slots_capacity=10)
    assert data(p, m.HIT_TOKENS) == {(): 64} and data(p, m.RECOMPUTED_TOKENS) == {(): 96}
    assert data(p, m.SLOTS_USED) == {(): 3} and data(p, m.SLOTS_FREE) == {(): 7}
    assert h.take(slots_used=3, slots_capacity=10) is None
    assert h.take(slots_used=4, slots_capacity=10)["data"] == {m.SLOTS_USED: {(): 4}, m.SLOTS_FREE: {(): 6}}


def test_docs_table_lists_every_metric_with_its_type_and_labels():
    # Goal: docs/vllm.md's metric table is the exported set: same names (as scraped),
    # types and labels, nothing missing, nothing extra.
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `vllm:kvoffload_"):
            name, kind, labels = (c.strip() for c in line.split("|")[1:4])
            rows[name.strip("`")] = (kind, tuple(x.strip(" `") for x in labels.split(",")) if labels != "-" else ())
    assert rows == {d.name: (d.kind, d.labels) for d in m.METRICS.values()}
