"""The exhaustive single-fault sweep (SQLite ``do_faultsim_test``).

For one call site and one fault, run the standard workload with the N-th call
failing, for N = 1, 2, ... until the workload no longer reaches N; once
transient (that call only) and once persistent (that call and every later one).
Each run is prep (a fresh backend), body (the workload) and test (the
acceptable outcomes: the workload completes with every completion matching the
model, or init fails with a clear, injected-caused SlotFileError), then a
fault-free integrity check, and always: no hang, no lost completion, no wrong
data, no file and no fd left.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from faults._invariants import (
    KINDS,
    FdWatch,
    Ledger,
    Violation,
    assert_dir_clean,
    assert_mode_0600,
    expect,
    wait_threads_gone,
)
from faults._model import KvChecker, make_caches
from faults._seam import Fault, FaultyOsCalls, is_injected

# The exhaustive single-fault catalogue: each call site and the faults tried there.
SITES: dict[str, list[Fault]] = {
    "open": [Fault.error(errno.EACCES), Fault.error(errno.EINVAL), Fault.error(errno.EOPNOTSUPP)],
    "fchmod": [Fault.error(errno.EPERM)],
    "fstat": [Fault.error(errno.EIO)],
    "fstatvfs": [Fault.error(errno.EIO)],
    "dio_alignment": [Fault.error(errno.EIO)],
    "fallocate": [Fault.error(errno.ENOSPC), Fault.error(errno.EOPNOTSUPP), Fault.error(errno.EIO)],
    "ftruncate": [Fault.error(errno.EIO)],
    "unlink": [Fault.error(errno.EACCES), Fault.error(errno.EBUSY)],
    "lstat": [Fault.error(errno.EIO)],
    "close": [Fault.error(errno.EIO)],
    "pwritev": [
        Fault.error(errno.EIO), Fault.error(errno.ENOSPC), Fault.error(errno.EINVAL),
        Fault.short(0.5), Fault.lie(), Fault.error(errno.EIO, after=True),
    ],
    "preadv": [
        Fault.error(errno.EIO), Fault.error(errno.EINVAL), Fault.short(0.5),
        Fault.bitflip(0, 3), Fault.error(errno.EIO, after=True),
    ],
}
# ftruncate is only called when fallocate is unsupported: make it so for that site.
BACKGROUND: dict[str, tuple] = {"ftruncate": (("fallocate", Fault.error(errno.EOPNOTSUPP)),)}

# The standard workload's geometry: 576*2 + 3072 = 4224 B a block (not a multiple
# of 512), so each slot is padded to 8192 under O_DIRECT; two slots per IO unit.
TENSOR_BYTES = [576 * 2, 3072]
NUM_BLOCKS = 6
NUM_SLOTS = 8
IO_UNIT_SLOTS = 2
SLOT_BYTES_DIRECT = 8192

# The workloads the sweep runs: the standard one, and a persistent pool's restart cycle (_restart.py).
WORKLOADS = ("standard", "restart")

# Total fault points run in this process (the plugin prints it at the end).
POINTS_RUN = {"points": 0, "runs": 0}


@dataclass
class Outcome:
    n: int
    fired: int
    reached: bool
    init_failed: bool
    error: Optional[BaseException] = None
    left_file: bool = False
    stats: dict = field(default_factory=dict)


def standard_workload(ck: KvChecker) -> None:
    """Stores, loads, overwrites, a never-stored slot, overlapping jobs."""
    ck.store([0, 1, 2], [0, 1, 2])
    ck.store([3], [5])
    ck.store([4, 5], [7, 6])  # non-contiguous file order: one pwritev per slot
    ck.load([0, 1, 2, 5], [0, 1, 2, 3])  # drains first: its blocks race the stores
    ck.store([0, 1], [1, 0])  # overwrite, reversed
    ck.store([2], [2])
    ck.load([0, 1, 2, 3, 6, 7], [5, 4, 3, 2, 1, 0])  # slot 3 never stored: an error without IO
    ck.store([3, 4, 5], [3, 4, 5])
    ck.load([3, 4, 5, 0], [0, 1, 2, 3])
    ck.store([0, 1, 2, 3], [6, 7, 0, 1])  # overwrite again after reads
    ck.load([6, 7, 0, 1], [4, 5, 2, 3])
    ck.drain()


def start_backend(osc, directory: Path, named: bool, device="cpu", use_page_cache=False, caches=None):
    """The workload's backend; ``device``: "cpu", "cuda", or a device implementation
    (``device_impl``) over CPU tensors."""
    from kvoffload import DiskBackend

    impl, device = (None, device) if isinstance(device, str) else (device, "cpu")
    caches = caches if caches is not None else make_caches(device, NUM_BLOCKS, TENSOR_BYTES)
    b = DiskBackend()
    slot = sum(TENSOR_BYTES) if use_page_cache else SLOT_BYTES_DIRECT
    b.init(
        caches, device, None, None, str(directory / "kv.bin"), NUM_SLOTS, sum(TENSOR_BYTES),
        use_page_cache=use_page_cache, named_file=named, io_threads=1, io_unit_bytes=IO_UNIT_SLOTS * slot,
        join_timeout=10.0, os_calls=osc, report_load_errors=True, capacity_bytes=NUM_SLOTS * SLOT_BYTES_DIRECT,
        device_impl=impl)
    return b, caches


def _leftover_ok(directory: Path, osc: FaultyOsCalls, allowed: bool) -> bool:
    """The one file an init failure may leave: the named fallback's empty temp file when the
    cleanup unlink failed too (a persistent or second fault; no KV byte was written,
    and the next init removes it). A single transient fault must leave nothing."""
    names = os.listdir(directory)
    if not names:
        return False
    expect(len(names) == 1 and names[0].startswith(".kv.bin.kvoffload-") and allowed and osc.fired["unlink"] >= 1,
           "leaked_files", f"init failure left {names}")
    st = os.lstat(directory / names[0])
    expect(stat.S_ISREG(st.st_mode) and st.st_size == 0, "leaked_files", "leftover holds data")
    return True


def schedule(call: str, n: int, fault: Fault, persistent: bool, background: tuple = ()) -> FaultyOsCalls:
    """A seam failing ``call`` #n (and every later one if ``persistent``), over ``background`` faults."""
    osc = FaultyOsCalls()
    for bcall, bfault in background:
        osc.fail_from(bcall, 1, bfault)
    (osc.fail_from if persistent else osc.fail_nth)(call, n, fault)
    return osc


def run_point(directory: Path, named: bool, call: str, n: int, fault: Fault, persistent: bool,
              background: tuple = (), device="cpu", use_page_cache: bool = False) -> Outcome:
    """One fault point: fail ``call`` #n (and later ones if ``persistent``), run, check."""
    osc = schedule(call, n, fault, persistent, background)
    out = run_workload(directory, named, osc, device, use_page_cache, leftover_ok=persistent)
    out.n, out.fired, out.reached = n, osc.fired[call], osc.calls[call] >= n
    return out


def run_workload(directory: Path, named: bool, osc: FaultyOsCalls, device="cpu", use_page_cache: bool = False,
                 leftover_ok: bool = False) -> Outcome:
    """Prep (fresh backend), body (the standard workload under ``osc``'s schedule) and
    test (acceptable outcomes, fault-free integrity check, nothing left behind).
    Raises AssertionError on any violation."""
    fds = FdWatch()
    try:
        b, caches = start_backend(osc, directory, named, device, use_page_cache)
    except OSError as e:
        from kvoffload.slot_file import SlotFileError

        # Failures at init: a clear error naming the path, caused by the injected
        # fault, with nothing left behind.
        wait_threads_gone()
        fds.check(near=directory)
        left = _leftover_ok(directory, osc, leftover_ok)
        expect(is_injected(e, chain=True), "wrong_data", f"init failed without an injected cause: {e!r}")
        expect(isinstance(e, SlotFileError), "wrong_data", f"init raised a bare {type(e).__name__}: {e}")
        expect(str(directory) in str(e), "wrong_data", f"init error does not name the path: {e}")
        _fault_free_round_trip(directory, named, device, use_page_cache)
        assert_dir_clean(directory)
        return Outcome(0, sum(osc.fired.values()), True, True, e, left)
    ledger = Ledger()
    try:
        ck = KvChecker(b, caches, osc, NUM_SLOTS, ledger)
        ck.attach()
        assert_mode_0600(b.files[0].fd)
        assert_dir_clean(directory)  # no KV byte ever sits under a name
        standard_workload(ck)
        ck.verify_all()  # faults off: acked => exact, failed => never a hit
    finally:
        b.shutdown()  # also when a check failed, so no thread outlives the point
    ledger.check(in_order=True)
    wait_threads_gone()
    fds.check(near=directory)
    assert_dir_clean(directory)
    return Outcome(0, sum(osc.fired.values()), True, False, stats=dict(ck.stats))


def _fault_free_round_trip(directory: Path, named: bool, device, use_page_cache: bool) -> None:
    fds = FdWatch()
    b, caches = start_backend(FaultyOsCalls(), directory, named, device, use_page_cache)
    try:
        ck = KvChecker(b, caches, None, NUM_SLOTS)
        ck.attach()
        ck.store([0, 1], [3, 4])
        ck.load([3, 4], [2, 3])
        ck.drain()
        expect(ck.stats == {"store_ok": 1, "store_fail": 0, "load_ok": 1, "load_fail": 0}, "wrong_data",
               f"fault-free round trip after a failed init: {ck.stats}")
    finally:
        b.shutdown()
    fds.check(near=directory)


def sweep(directory: Path, named: bool, call: str, fault: Fault, persistent: bool,
          background: tuple = (), device="cpu", use_page_cache: bool = False, limit: int = 200) -> list[Outcome]:
    """Fail call ``call`` at N = 1, 2, ... until the workload stops reaching N."""
    outcomes = []
    for n in range(1, limit + 1):
        out = run_point(directory, named, call, n, fault, persistent, background, device, use_page_cache)
        POINTS_RUN["runs"] += 1
        if not out.reached:
            assert out.fired == 0
            break
        assert out.fired >= 1, f"{call} #{n} was reached but no fault fired"
        POINTS_RUN["points"] += 1
        outcomes.append(out)
    else:
        raise AssertionError(f"workload still reached {call} #{limit}")
    return outcomes


# -- the whole catalogue, counted rather than asserted (python -m faults sweep) -------------


@dataclass
class SweepReport:
    """Fault points run, points that kept every invariant, and broken ones by kind
    (``KINDS``), in all and per call site; one line per broken point in ``failures``."""

    points: int = 0
    survived: int = 0
    seconds: float = 0.0
    broken: Counter = field(default_factory=Counter)
    sites: dict[str, Counter] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, call: str, kind: Optional[str], what: str) -> None:
        site = self.sites.setdefault(call, Counter())
        self.points += 1
        site["points"] += 1
        if kind is None:
            self.survived += 1
            site["survived"] += 1
        else:
            self.broken[kind] += 1
            site[kind] += 1
            self.failures.append(f"{kind}: {what}")

    def summary(self) -> dict:
        """The one JSON object: points, survived, each kind, seconds."""
        return {"points": self.points, "survived": self.survived, **{k: self.broken[k] for k in KINDS},
                "seconds": round(self.seconds, 1)}

    def table(self) -> str:
        heads = ["call site", "points", "survived", *KINDS]
        rows = [[call, c["points"], c["survived"], *(c[k] for k in KINDS)] for call, c in self.sites.items()]
        rows.append(["total", self.points, self.survived, *(self.broken[k] for k in KINDS)])
        widths = [max(len(str(r[i])) for r in [heads, *rows]) for i in range(len(heads))]
        fmt = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(r, widths)))
        return "\n".join([fmt(heads), *map(fmt, rows), f"{self.points} fault points in {self.seconds:.1f} s"])


def _judged_point(directory: Path, named: bool, call: str, n: int, fault: Fault, persistent: bool,
                  use_page_cache: bool, timeout: float) -> tuple[bool, Optional[str], str]:
    """(whether call #n was reached, the kind of broken invariant or None, what broke)."""
    osc = schedule(call, n, fault, persistent, BACKGROUND.get(call, ()))
    kind, what = _judged(lambda: run_workload(directory, named, osc, "cpu", use_page_cache,
                                              leftover_ok=persistent), timeout)
    return (True if kind == "hangs" else osc.calls[call] >= n), kind, what


def _judged(body, timeout: float) -> tuple[Optional[str], str]:
    """(the kind of broken invariant or None, what broke) of ``body()`` run in a thread: a
    point that never returns is a hang, judged after ``timeout``, its thread left behind."""
    result: list = []

    def run() -> None:
        try:
            body()
            result.append((None, ""))
        except Violation as v:
            result.append((v.kind, str(v)))
        except BaseException as e:  # noqa: BLE001 - any other exception is a wrong outcome, counted
            result.append(("wrong_data", f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=run, name="faults-sweep-point", daemon=True)
    t.start()
    try:
        t.join(timeout)
    except KeyboardInterrupt:
        # Ctrl-C: the point's backend has threads and files in the sweep's directory. It
        # ends first (within ``timeout``, as a point is judged), so the directory is
        # removed after it, not under it.
        t.join(timeout)
        raise
    return result[0] if result else ("hangs", f"still running after {timeout} s")


def sweep_all(directory: Path, calls: Optional[Iterable[str]] = None, named: Iterable[bool] = (False, True),
              page_cache: Iterable[bool] = (False, True), persistent: Iterable[bool] = (False, True),
              limit: int = 200, timeout: float = 120.0, workloads: Iterable[str] = WORKLOADS,
              progress: Optional[Callable[[str], None]] = None) -> SweepReport:
    """Every call site (of ``calls``) x its faults x N = 1.. until unreached, under every
    combination asked for, for each of ``workloads`` (``standard``: the standard workload,
    in each file mode; ``restart``: a persistent pool's store-then-restart cycle, whose
    files are named); each point in a fresh subdirectory of ``directory``. A call site's
    row counts its points in both. ``progress`` is told where the sweep is before each point."""
    from faults._restart import BOTH_IO, RESTART_SITES, restart_point

    wanted = list(dict.fromkeys([*SITES, *RESTART_SITES])) if calls is None else list(calls)
    unknown = set(wanted) - set(SITES) - set(RESTART_SITES)
    if unknown:
        raise ValueError(f"unknown call site(s) {sorted(unknown)}; known: {', '.join({**SITES, **RESTART_SITES})}")
    workloads = list(workloads)
    report = SweepReport()
    t0 = time.monotonic()
    dirs = itertools.count()

    def where(i: int, call: str) -> None:
        if progress is not None:
            broken = report.points - report.survived
            progress(f"call site {i} of {len(wanted)} ({call}): {report.points} points, "
                     f"{broken} broken, {time.monotonic() - t0:.0f} s")

    for i, call in enumerate(wanted, 1):
        for fault, pers, nm, pc in itertools.product(SITES.get(call, []) if "standard" in workloads else [],
                                                     persistent, named, page_cache):
            for n in range(1, limit + 1):
                where(i, call)
                d = directory / f"p{next(dirs)}"
                d.mkdir(mode=0o700)
                reached, kind, what = _judged_point(d, nm, call, n, fault, pers, pc, timeout)
                if reached or kind is not None:  # the fault-free end of a sweep counts only if it broke
                    report.add(call, kind, f"{call} #{n} {fault!r} {'persistent' if pers else 'transient'} "
                                           f"{'named' if nm else 'anonymous'} {'page cache' if pc else 'O_DIRECT'}: "
                                           f"{what}")
                if not reached:
                    break
        restart_faults = RESTART_SITES.get(call, []) if "restart" in workloads else []
        for fault, pers, pc in itertools.product(restart_faults, persistent, page_cache):
            if pc and call not in BOTH_IO:
                continue
            for n in range(1, limit + 1):
                where(i, call)
                reached = [True]

                def body() -> None:
                    reached[0], _ = restart_point(directory, call, n, fault, pers, pc)  # noqa: B023

                kind, what = _judged(body, timeout)
                if reached[0] or kind is not None:
                    report.add(call, kind, f"restart cycle: {call} #{n} {fault!r} "
                                           f"{'persistent' if pers else 'transient'} "
                                           f"{'page cache' if pc else 'O_DIRECT'}: {what}")
                if not reached[0]:
                    break
    report.seconds = time.monotonic() - t0
    return report
