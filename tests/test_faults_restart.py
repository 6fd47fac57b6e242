"""A persistent pool under faults: the exhaustive single-fault sweep over a store-then-restart
cycle (``faults/_restart.py``), and kill -9 at every write of a store (a child process killed,
then a restart): after the restart only completed stores are served, each exactly.

CI runs these on both IO paths (the native core in the test command, the Python path in
the ``KVOFFLOAD_NATIVE_IO=off`` stage; the killed children inherit it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faults import Fault, FaultyOsCalls
from faults._restart import BOTH_IO, EXPECTED, RESTART_SITES, restart_workload, startup_workload, sweep_restart, \
    sweep_startup

pytestmark = pytest.mark.faults

CASES = [pytest.param(call, fault, id=f"{call}-{fault!r}".replace(" ", ""))
         for call, faults in RESTART_SITES.items() for fault in faults]


@pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("call,fault", CASES)
def test_restart_sweep(tmp_path, call, fault, persistent, use_page_cache):
    if use_page_cache and call not in BOTH_IO:
        pytest.skip("this call does not depend on the page cache")
    points = sweep_restart(tmp_path, call, fault, persistent, use_page_cache)
    if call in ("pwritev", "preadv", "fdatasync"):
        assert points >= 5, "the cycle should make many of these calls"


def test_the_fault_free_cycle_restores_everything_and_reaches_every_site(tmp_path):
    # Goal: the sweep is not vacuous: without a fault every stored block comes back, and the
    # cycle makes the calls the sweep fails.
    osc = FaultyOsCalls()
    d = tmp_path / "cycle"
    d.mkdir(mode=0o700)
    assert restart_workload(d, osc) == {"restored": len(EXPECTED), "served": len(EXPECTED)}
    missing = [c for c in RESTART_SITES if c != "unlink" and not osc.calls[c]]
    assert missing == [], missing
    assert osc.calls["unlink"] == 0  # only a failed creation removes what it made


@pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("call,fault", CASES + [pytest.param("preadv", Fault.short(0.0), id="preadv-Fault.short(0.0)")])
def test_startup_sweep(tmp_path, call, fault, persistent, use_page_cache):
    # Goal: every call a start of a healthy pool makes, failed with every fault kind, once or
    # from then on: the pool is served as before, or the start is refused in one line with
    # the files byte-identical; the next fault-free start serves every block (0 pools lost).
    if use_page_cache and call not in BOTH_IO:
        pytest.skip("this call does not depend on the page cache")
    outcomes = sweep_startup(tmp_path, call, fault, persistent, use_page_cache)
    if call in ("open", "lstat", "flock", "fstat", "preadv"):
        assert sum(outcomes.values()) >= 1, "a start-up makes this call: the sweep must reach it"
    if call == "pwritev":
        assert outcomes == {"served": 0, "refused": 0}, "a start of an existing pool writes nothing"


def test_the_fault_free_start_up_serves_the_pool(tmp_path):
    # Goal: the start-up sweep is not vacuous: without a fault the start serves every block.
    d = tmp_path / "start"
    d.mkdir(mode=0o700)
    osc = FaultyOsCalls()
    assert startup_workload(d, osc) == "served"
    assert osc.calls["preadv"] >= 2 and osc.calls["pwritev"] == 0


# -- kill -9 at every write of a store ---------------------------------------------------------

# One process imports torch once and forks a child per kill point (a fresh interpreter per
# point would take seconds each): the child runs a persistent backend that kills itself
# (SIGKILL) right before or right after its N-th pwritev, telling the parent which stores
# completed; N = 0 never kills.
_ZYGOTE = r"""
import hashlib, json, os, signal, sys
import torch
from faults import Fault, FaultyOsCalls
from kvoffload import DiskBackend
from kvoffload.persist import Persist

def child(cfg, out):
    osc = FaultyOsCalls()
    calls = {"n": 0}

    def kill(info):
        calls["n"] += 1
        if calls["n"] == cfg["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)

    (osc.before if cfg["when"] == "before" else osc.after)("pwritev", kill)
    caches = {"t": torch.zeros(4, 4096, dtype=torch.int8)}
    b = DiskBackend()
    b.init(caches, "cpu", None, None, cfg["path"], 8, 4096, io_threads=1, io_unit_bytes=8192,
           report_load_errors=True, os_calls=osc, use_page_cache=cfg["page_cache"],
           persist=Persist(bytes(range(32)), {"m": "kill"}))
    for job, (slots, keys) in enumerate(cfg["stores"]):
        for i, k in enumerate(keys):
            data = bytearray(hashlib.shake_256(k.encode()).digest(4096))
            caches["t"][i] = torch.frombuffer(data, dtype=torch.int8)
        ev = []
        b.launch_copy(list(range(len(slots))), slots, True, 0, ev, keys=[k.encode() for k in keys])
        ev[0][1].synchronize()
        if ev[0][1].ok:
            out.write(json.dumps({"done": job}) + "\n")
            out.flush()
    b.shutdown()
    out.write(json.dumps({"writes": calls["n"]}) + "\n")

for cfg in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        with os.fdopen(w, "w") as out:
            child(cfg, out)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as inp:
        lines = [json.loads(x) for x in inp.read().splitlines()]
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps({"path": cfg["path"], "lines": lines, "killed": killed,
                      "ok": killed or os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0}), flush=True)
"""
STORES = [([1, 2], ["a", "b"]), ([3], ["c"]), ([2, 4], ["d", "e"]), ([5], ["f"])]


def _run_children(points: list[dict]) -> dict[str, tuple[list[int], int, bool]]:
    """path -> (jobs that completed, the child's pwritev count when not killed, whether killed)."""
    cfgs = [{**p, "stores": STORES} for p in points]
    proc = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(cfgs)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        r = json.loads(line)
        assert r["ok"], f"a child ended badly: {r}"
        writes = [x["writes"] for x in r["lines"] if "writes" in x]
        out[r["path"]] = ([x["done"] for x in r["lines"] if "done" in x], writes[0] if writes else 0, r["killed"])
    assert len(out) == len(points), proc.stderr[-3000:]
    return out


def _check_restart(path: Path, completed: list[int], page_cache: bool) -> dict[int, str]:
    """Restart on ``path``: every block served is its key's, and every completed store whose
    slot no later store touched is served. Returns what was served."""
    import hashlib

    import torch

    from kvoffload import DiskBackend
    from kvoffload.persist import Persist

    caches = {"t": torch.zeros(8, 4096, dtype=torch.int8)}
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(path), 8, 4096, io_threads=1, report_load_errors=True,
           use_page_cache=page_cache, persist=Persist(bytes(range(32)), {"m": "kill"}))
    try:
        found = dict(b.restored().entries())
        slots = sorted(found)
        ev: list = []
        if slots:
            b.launch_copy(slots, list(range(len(slots))), False, 0, ev)
            assert ev[0][1].wait(10)
        bad = b.get_block_ids_with_load_errors()
        served = {}
        for i, s in enumerate(slots):
            if i not in bad:
                assert caches["t"][i].numpy().tobytes() == hashlib.shake_256(found[s]).digest(4096), \
                    f"slot {s} served bytes that are not {found[s]!r}'s"
                served[s] = found[s].decode()
        want: dict[int, str] = {}
        for job in completed:
            want.update(zip(*STORES[job]))
        for job in range(max(completed, default=-1) + 1, len(STORES)):  # cut short, or never reached
            for s in STORES[job][0]:
                want.pop(s, None)
        assert {s: served.get(s) for s in want} == want, (served, want)
        return served
    finally:
        b.shutdown()


@pytest.mark.parametrize("page_cache", [False, True], ids=["direct", "pagecache"])
def test_kill_9_at_any_write_serves_only_completed_stores(tmp_path, page_cache):
    # Goal: a server killed (SIGKILL) right before or right after any write of a store (the
    # headers at start-up, a slot's data, its index record) restarts serving exactly the
    # stores that completed before the kill, each as stored, and nothing else: a store cut
    # short anywhere costs at worst one failed load (its old record no longer fits its bytes).
    def dirs(names: list[str]) -> list[Path]:
        out = [tmp_path / n for n in names]
        for d in out:
            d.mkdir(mode=0o700)
        return out

    (base,) = dirs(["base"])
    done, writes, killed = _run_children([{"path": str(base / "kv"), "kill_at": 0, "when": "before",
                                           "page_cache": page_cache}])[str(base / "kv")]
    assert done == list(range(len(STORES))) and not killed and writes >= 2 * len(STORES)
    assert _check_restart(base / "kv", done, page_cache) == {1: "a", 3: "c", 2: "d", 4: "e", 5: "f"}
    points = [(n, when) for n in range(1, writes + 1) for when in ("before", "after")]
    paths = dirs([f"{when}{n}" for n, when in points])
    results = _run_children([{"path": str(d / "kv"), "kill_at": n, "when": when, "page_cache": page_cache}
                             for d, (n, when) in zip(paths, points)])
    outcomes = []
    for d in paths:
        done, _, killed = results[str(d / "kv")]
        assert killed
        if (d / "kv.index").exists() and (d / "kv").exists():  # else killed before the pool existed
            _check_restart(d / "kv", done, page_cache)
        outcomes.append(len(done))
    assert min(outcomes) == 0 and max(outcomes) == len(STORES) - 1, outcomes
