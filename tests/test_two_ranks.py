"""scripts/two_ranks.py on CPU for about 3 s: two spawned ranks, EIO injected into one.

Checks the result object only (no timing): both ranks ran, every loaded byte matched,
the faulty rank's errors stayed in that rank, and the shared directory is empty.
"""

from __future__ import annotations

import os

from kvoffload.bench import ranks as bench_ranks

SMALL = ["--device", "cpu", "--tensors", "4", "--tensor-kib", "16", "--blocks", "64", "--slots", "128",
         "--job-blocks", "8", "--raw-mib", "16", "--raw-seconds", "0.05"]


def test_faults_in_one_rank_never_reach_the_other(tmp_path):
    res = bench_ranks.run(["--seconds", "3", "--dir", str(tmp_path), "--fault-rank", "1", *SMALL])
    assert res["checks"] == {
        "both_ranks_reported": True,
        "clean_exit": True,
        "no_files_left": True,
        "healthy_rank_saw_no_errors": True,
        "faults_fired_in_faulty_rank": True,
        "every_loaded_byte_matches": True,
    }, res
    assert res["ok"] and res["devices"] == ["cpu", "cpu"] and os.listdir(tmp_path) == []
    healthy, faulty = res["ranks"]
    assert not healthy["faulty"] and faulty["faulty"]
    assert healthy["faults_fired"] == 0 and healthy["warnings_logged"] == 0
    assert faulty["faults_fired"] > 0 and faulty["load_errors"] + faulty["failed_stores"] > 0
    for r in res["ranks"]:
        assert r["mismatches"] == 0 and r["blocks_verified"] > 0
        assert r["store_gib_s"] > 0 and r["load_gib_s"] > 0 and r["store_ratio"] > 0
    assert res["raw_ceiling"]["write_gib_s"] > 0 and res["raw_ceiling"]["read_gib_s"] > 0
    agg = res["aggregate"]
    assert agg["store_gib_s"] > 0 and agg["load_gib_s"] > 0
    assert "checks: both_ranks_reported ok" in bench_ranks.table(res)
