"""Exhaustive single-fault sweep (SQLite sysfault.test): every call site x occurrence,
transient and persistent, on both file paths, each checked against the model."""

from __future__ import annotations

import errno
import os
import re

import pytest

from faults import Fault, FaultyOsCalls, is_injected, run_workload, sweep, wait_threads_gone
from faults._sweep import BACKGROUND, POINTS_RUN, SITES, start_backend
from kvoffload.slot_file import SlotFileError

pytestmark = pytest.mark.faults

CASES = [
    pytest.param(call, fault, id=f"{call}-{fault!r}".replace(" ", ""))
    for call, faults in SITES.items() for fault in faults
]


@pytest.mark.parametrize("use_page_cache", [False, True], ids=["direct", "pagecache"])
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
@pytest.mark.parametrize("call,fault", CASES)
def test_single_fault_sweep(cache_dir, ledger, call, fault, named, persistent, use_page_cache):
    outs = sweep(cache_dir, named, call, fault, persistent, BACKGROUND.get(call, ()), use_page_cache=use_page_cache)
    n_init = sum(o.init_failed for o in outs)
    print(f"{call} {fault!r} {'persistent' if persistent else 'transient'}: "
          f"{len(outs)} fault points, {n_init} failed init; total so far {POINTS_RUN['points']}")
    if call in ("pwritev", "preadv"):
        assert len(outs) >= 8, "the workload should make many data calls"
        assert not any(o.init_failed for o in outs)
    if call in ("unlink", "lstat") and not named:
        assert outs == [], "the anonymous file has no name to examine or unlink"
    if call == "dio_alignment" and use_page_cache:
        assert outs == [], "the page cache needs no alignment"


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_workload_reaches_every_site(cache_dir, ledger, named):
    """The fault-free workload makes the calls the sweep counts on (so it is not vacuous)."""
    osc = FaultyOsCalls()
    out = run_workload(cache_dir, named, osc)
    calls = dict(osc.calls)
    print(f"calls per site ({'named' if named else 'anonymous'}):", calls)
    for site in ("open", "fchmod", "fstat", "fstatvfs", "dio_alignment", "fallocate", "close"):
        assert calls.get(site, 0) >= 1, site
    assert calls.get("unlink", 0) == (2 if named else 0)
    assert calls.get("lstat", 0) == (1 if named else 0)  # the stale name: does it hold data?
    assert calls["pwritev"] >= 12 and calls["preadv"] >= 10
    assert out.stats["store_fail"] == 0 and out.stats["load_fail"] == 1  # the never-stored slot 3


SEEDED_RUNS = 24


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_seeded_random_faults(cache_dir, ledger, fault_seed, named):
    """BUGGIFY-style runs: each derived seed picks active call sites (p=0.25) that then
    fire with p=0.25; any failure names the seed (replay: --fault-seed)."""
    kinds = {
        "pwritev": [Fault.error(errno.EIO), Fault.short(0.5), Fault.lie()],
        "preadv": [Fault.error(errno.EIO), Fault.short(0.5), Fault.bitflip(5, 1)],
    }
    fired = 0
    for i in range(SEEDED_RUNS):
        seed = fault_seed * 1000 + i
        osc = FaultyOsCalls()
        active = osc.buggify(seed, faults=kinds)
        try:
            run_workload(cache_dir, named, osc, leftover_ok=True)
        except AssertionError as e:
            raise AssertionError(f"seed {seed} (active {active}, fired {osc.log}): {e}") from e
        fired += osc.fired_total()
    print(f"seeded runs from fault seed {fault_seed}: {fired} faults fired in {SEEDED_RUNS} runs")


# -- regressions for the backend fixes the sweep found (kvoffload/slot_file.py) -----------


@pytest.mark.parametrize(
    "call,n,named",
    [
        ("fchmod", 1, False),  # the anonymous file's fd leaked when fchmod failed
        ("close", 1, False),  # a failed close of the directory fd leaked the slot fd
        ("close", 1, True),
    ],
)
def test_init_fault_leaks_no_fd(fd_guard, cache_dir, call, n, named):
    osc = FaultyOsCalls()
    osc.fail_nth(call, n)
    try:
        start_backend(osc, cache_dir, named)[0].shutdown()
    except SlotFileError:
        pass
    wait_threads_gone()
    fd_guard.check(near=cache_dir)


@pytest.mark.parametrize("call,n", [("fchmod", 1), ("unlink", 2)])
def test_named_init_failure_leaves_no_file(fd_guard, cache_dir, call, n):
    """fchmod or the unlink right after the named create failed: the empty file stayed."""
    osc = FaultyOsCalls()
    osc.fail_nth(call, n)
    with pytest.raises(SlotFileError, match="cannot secure"):
        start_backend(osc, cache_dir, True)
    assert os.listdir(cache_dir) == []


@pytest.mark.parametrize("call", ["fstat", "dio_alignment", "fstatvfs"])
def test_init_errors_name_the_path(fd_guard, cache_dir, call):
    """These used to escape as a bare OSError that did not say which disk_path failed."""
    osc = FaultyOsCalls()
    osc.fail_nth(call, 1, Fault.error(errno.EIO))
    with pytest.raises(SlotFileError, match=re.escape(str(cache_dir))) as e:
        start_backend(osc, cache_dir, False)
    assert e.value.errno == errno.EIO and is_injected(e.value, chain=True)
