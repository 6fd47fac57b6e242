"""kvsim: a server restart between the fill and the reload (``python -m kvsim.restart``)."""

from __future__ import annotations

import json

from kvsim.restart import CASES, main


def test_a_persistent_disk_tier_keeps_the_reload_as_fast_as_without_a_restart(capsys):
    # Goal: after a restart, the reload with a persistent disk tier is as fast as if the
    # server had kept running (its blocks are disk hits), and without persistence it is
    # recomputed: many times slower, no offload hit.
    assert main(["--tier", "disk:200GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cases = doc["tiers"]["disk:200GiB"]
    assert list(cases) == list(CASES)
    p50 = {c: s["phases"]["reload"]["ttft_ms"]["p50"] for c, s in cases.items()}
    hits = {c: s["reload_offload_hit_rate"] for c, s in cases.items()}
    assert p50["restart, persist"] <= 1.1 * p50["no restart"]
    # "Many times": the restart recomputes every reload at 1/s, each 6,144 tokens after the
    # shared prompt taking 0.93 s of the GPU (compiled layers; 0.97 s eager), so its queue
    # sits near saturation and sets the ratio, while the persistent reload is disk-bound.
    # 13x with the eager GPU profile, 9.4x with the compiled one (docs/kvsim.md): the
    # bound leaves room for a faster GPU, not for a reload that recomputes.
    assert p50["restart"] > 5 * p50["restart, persist"]
    assert hits["restart"] == 0 and hits["restart, persist"] >= hits["no restart"] > 0
    assert cases["restart, persist"]["restored_units"] > 0 and cases["restart"]["restored_units"] == 0


def test_the_table_and_a_usage_error(capsys):
    assert main(["--tier", "disk:100GiB", "--contexts", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("scenario dram-limited-nvme, 8 contexts") and len(out) == 2 + len(CASES)
    assert main(["--tier", "disk:1XB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m kvsim.restart: error:")
