"""The exhaustive single-fault sweeps over a persistent pool: its store-then-restart cycle,
and its start-up alone.

One workload (``restart_workload``): a persistent backend is created, stores, overwrites
and loads, and shuts down; a second one starts on the same files (the fault schedule
still counting, so a fault can hit its header or index reads),
loads what it restored and stores once more; a third, fault-free start then checks the
files. Every call site of ``RESTART_SITES`` fails at N = 1, 2, ... (``sweep_restart``),
transient and persistent, with the standard sweep's invariants (no hang, no lost
completion, no leaked fd, one clear injected-caused error where a start-up fails) and
the restart's own: every block served, in any of the three runs, is the one stored under
the key its slot claims, and with no fault fired everything stored comes back.

The start-up sweep (``sweep_startup``) fails only the calls of a start on a healthy pool:
the start serves the pool as it was, or refuses in one line with every file byte for
byte as it was; either way the next, fault-free start serves every block (0 pools lost).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
from pathlib import Path
from typing import Optional

from faults._invariants import FdWatch, Violation, expect, wait_threads_gone
from faults._seam import Fault, FaultyOsCalls, is_injected

RESTART_SITES: dict[str, list[Fault]] = {
    "open": [Fault.error(errno.EACCES)],
    "lstat": [Fault.error(errno.EIO)],
    "flock": [Fault.error(errno.EWOULDBLOCK), Fault.error(errno.EIO)],
    "fchmod": [Fault.error(errno.EPERM)],
    "fstat": [Fault.error(errno.EIO)],
    "fstatvfs": [Fault.error(errno.EIO)],
    "dio_alignment": [Fault.error(errno.EIO)],
    "fallocate": [Fault.error(errno.ENOSPC), Fault.error(errno.EIO)],
    "fdatasync": [Fault.error(errno.EIO)],
    "fsync": [Fault.error(errno.EIO)],
    "unlink": [Fault.error(errno.EACCES)],
    "close": [Fault.error(errno.EIO)],
    "pwritev": [Fault.error(errno.EIO), Fault.error(errno.ENOSPC), Fault.short(0.5), Fault.lie(),
                Fault.error(errno.EIO, after=True)],
    "preadv": [Fault.error(errno.EIO), Fault.short(0.5), Fault.bitflip(0, 3), Fault.error(errno.EIO, after=True)],
}
# Sites run on the page cache too (the others' calls do not depend on it).
BOTH_IO = ("pwritev", "preadv", "fdatasync")

TENSORS = [576 * 2, 3072]  # the standard workload's 4224-B block: padded to 8192 under O_DIRECT
BLOCK = sum(TENSORS)
BLOCKS, SLOTS = 8, 8
KEY = bytes(range(32))
FP = {"model": "sweep"}
# The workload's stores (slots and keys, in order) and what a fault-free cycle restores.
STORES_A = [([1, 2, 3], [b"a", b"b", b"c"]), ([5], [b"d"]), ([2, 1], [b"e", b"f"])]
STORES_B = [([6], [b"g"])]
EXPECTED = {3: b"c", 5: b"d", 2: b"e", 1: b"f", 6: b"g"}


def content(key: bytes) -> bytes:
    """A block stored under ``key``: what a load of it must return, whatever happened."""
    return hashlib.shake_256(key).digest(BLOCK)


class _Cycle:
    """One cycle's backends and what was stored where (every key a slot ever got)."""

    def __init__(self, directory: Path, use_page_cache: bool) -> None:
        self.directory, self.use_page_cache = directory, use_page_cache
        self.history: dict[int, set[bytes]] = {}
        self.latest: dict[int, Optional[bytes]] = {}  # the last store's key; None: it failed

    def start(self, osc: FaultyOsCalls):
        import torch

        from kvoffload import DiskBackend
        from kvoffload.persist import Persist

        caches = {f"t{i}": torch.zeros(BLOCKS, n, dtype=torch.int8) for i, n in enumerate(TENSORS)}
        b = DiskBackend()
        b.init(caches, "cpu", None, None, str(self.directory / "kv"), SLOTS, BLOCK, use_page_cache=self.use_page_cache,
               io_threads=1, io_unit_bytes=2 * 8192, report_load_errors=True, os_calls=osc, join_timeout=10.0,
               capacity_bytes=SLOTS * 8192, persist=Persist(KEY, FP))
        return b, caches

    def store(self, b, caches, slots: list[int], keys: list[bytes]) -> None:
        import torch

        for i, k in enumerate(keys):
            raw = torch.frombuffer(bytearray(content(k)), dtype=torch.int8)
            caches["t0"][i], caches["t1"][i] = raw[:TENSORS[0]], raw[TENSORS[0]:]
        ev: list = []
        b.launch_copy(list(range(len(slots))), slots, True, 0, ev, keys=keys)
        expect(len(ev) == 1 and ev[0][1].wait(30), "lost_completions", f"store to {slots} did not complete")
        failed = b.get_failed_store_slots()
        expect(ev[0][1].ok == (not failed), "wrong_data", f"store event ok={ev[0][1].ok} with failed slots {failed}")
        for s, k in zip(slots, keys):
            self.history.setdefault(s, set()).add(k)
            self.latest[s] = None if s in failed else k

    def load(self, b, caches, slots: list[int], keys: dict[int, bytes], run: str) -> dict[int, bool]:
        """Load ``slots``; each one that loads must be ``keys[slot]``'s block. Whether each did."""
        for t in caches.values():
            t.fill_(7)
        ev: list = []
        b.launch_copy(slots, list(range(len(slots))), False, 0, ev)
        expect(len(ev) == 1 and ev[0][1].wait(30), "lost_completions", f"{run}: load of {slots} did not complete")
        bad = b.get_block_ids_with_load_errors()
        out = {}
        for i, s in enumerate(slots):
            out[s] = i not in bad
            if out[s]:
                data = caches["t0"][i].numpy().tobytes() + caches["t1"][i].numpy().tobytes()
                expect(data == content(keys[s]), "wrong_data", f"{run}: slot {s} served bytes that are not "
                                                               f"{keys[s]!r}'s")
        return out

    def restored(self, b, run: str) -> dict[int, bytes]:
        found = dict(b.restored().entries())
        for s, k in found.items():
            expect(k in self.history.get(s, ()), "wrong_data", f"{run}: slot {s} restored as {k!r}, never stored there")
        return found


def _check_refusal(e: BaseException, directory: Path, run: str, osc: FaultyOsCalls) -> None:
    from kvoffload.persist import PersistError
    from kvoffload.slot_file import SlotFileError

    # A short, lying or flipped transfer raises nothing itself: what it left (or read) is
    # what start-up refuses.
    quiet = any(f.fault.kind in ("short", "lie", "bitflip") for f in osc.log)
    expect(is_injected(e, chain=True) or quiet, "wrong_data", f"{run}: start-up failed without an injected cause: "
                                                              f"{e!r}")
    expect(isinstance(e, (PersistError, SlotFileError)), "wrong_data",
           f"{run}: start-up raised a bare {type(e).__name__}: {e}")
    expect("\n" not in str(e) and str(directory) in str(e), "wrong_data", f"{run}: unclear start-up error: {e}")


def restart_workload(directory: Path, osc: FaultyOsCalls, use_page_cache: bool = False) -> dict[str, int]:
    """The cycle under ``osc``'s schedule, then the fault-free check; raises ``Violation``.
    Returns counts: how many blocks the fault-free start restored and served."""
    fds = FdWatch()
    cy = _Cycle(directory, use_page_cache)
    for run in ("A", "B"):
        try:
            b, caches = cy.start(osc)
        except OSError as e:  # PersistError is a ValueError; both are checked below
            _check_refusal(e, directory, run, osc)
            break
        except ValueError as e:
            _check_refusal(e, directory, run, osc)
            break
        try:
            if run == "A":
                for slots, keys in STORES_A:
                    cy.store(b, caches, slots, keys)
                    live = {s: k for s, k in cy.latest.items() if k is not None}
                    cy.load(b, caches, sorted(live), live, run)
            else:
                found = cy.restored(b, run)
                if found:
                    cy.load(b, caches, sorted(found), found, run)
                for slots, keys in STORES_B:
                    cy.store(b, caches, slots, keys)
        finally:
            b.shutdown()
    wait_threads_gone()
    fds.check(near=directory)
    # The pool's two files, or nothing; a start-up that failed creating it may leave an empty
    # file (an index it could not lock, one whose removal failed): the next start-up reuses it.
    left = [n for n in sorted(os.listdir(directory)) if os.path.getsize(directory / n) or n not in ("kv", "kv.index")]
    expect(left in ([], ["kv", "kv.index"]) or osc.fired["unlink"], "leaked_files", f"left in the directory: {left}")
    # The fault-free start: it may refuse only what a fault left half made.
    clean = FaultyOsCalls()
    try:
        b, caches = cy.start(clean)
    except (OSError, ValueError) as e:
        expect(sum(osc.fired.values()) and "\n" not in str(e), "wrong_data",
               f"fault-free start-up failed: {e!r}")
        return {"restored": 0, "served": 0}
    try:
        found = cy.restored(b, "check")
        served = cy.load(b, caches, sorted(found), found, "check") if found else {}
        if not sum(osc.fired.values()):
            expect(found == EXPECTED and all(served.values()), "wrong_data",
                   f"no fault fired, yet restored {found} (served {served}), not {EXPECTED}")
        # And the pool works: a store and its load, fault-free, whatever the cycle left.
        cy.store(b, caches, [7], [b"z"])
        expect(cy.load(b, caches, [7], {7: b"z"}, "check") == {7: True}, "wrong_data",
               "a fault-free store and load after the cycle failed")
    finally:
        b.shutdown()
    wait_threads_gone()
    fds.check(near=directory)
    return {"restored": len(found), "served": sum(served.values())}


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


# What the pool holds once STORES_A ran: the start-up sweep's healthy pool.
HEALTHY = {3: b"c", 5: b"d", 2: b"e", 1: b"f"}


def startup_workload(directory: Path, osc: FaultyOsCalls, use_page_cache: bool = False) -> str:
    """A healthy pool made fault-free, then one start under ``osc`` (its schedule on for the
    start only), then a fault-free start; raises ``Violation``. Returns how the faulty
    start ended: ``served`` (every block, as before) or ``refused`` (files unchanged)."""
    fds = FdWatch()
    cy = _Cycle(directory, use_page_cache)
    b, caches = cy.start(FaultyOsCalls())
    try:
        for slots, keys in STORES_A:
            cy.store(b, caches, slots, keys)
    finally:
        b.shutdown()
    expect(cy.latest == {s: k for s, k in cy.latest.items() if k is not None}, "wrong_data", "a fault-free store failed")
    before = _digests(directory)
    try:
        b, caches = cy.start(osc)
    except (OSError, ValueError) as e:  # PersistError is a ValueError
        _check_refusal(e, directory, "start-up", osc)
        expect(_digests(directory) == before, "files_changed", f"a refused start-up changed the files: {e}")
        outcome = "refused"
    else:
        osc.enabled = False  # the start-up's calls only
        try:
            found = cy.restored(b, "start-up")
            expect(found == HEALTHY, "lost_blocks", f"started under a fault, it restored {found}, not {HEALTHY}")
            served = cy.load(b, caches, sorted(found), found, "start-up")
            expect(all(served.values()), "lost_blocks", f"started under a fault, it served {served}")
        finally:
            b.shutdown()
        outcome = "served"
    wait_threads_gone()
    b, caches = cy.start(FaultyOsCalls())
    try:
        found = cy.restored(b, "check")
        expect(found == HEALTHY, "lost_blocks", f"after the start-up fault the pool restored {found}, not {HEALTHY}")
        expect(all(cy.load(b, caches, sorted(found), found, "check").values()), "lost_blocks",
               "after the start-up fault a restored block failed to load")
    finally:
        b.shutdown()
    wait_threads_gone()
    fds.check(near=directory)
    return outcome


_POINT = itertools.count()


def restart_point(directory: Path, call: str, n: int, fault: Fault, persistent: bool,
                  use_page_cache: bool = False) -> tuple[bool, int]:
    """One point in a fresh directory under ``directory``: (whether call #n was reached,
    faults fired). Raises ``Violation`` on a broken invariant."""
    d = directory / f"{call}-{n}-{next(_POINT)}"
    d.mkdir(mode=0o700)
    osc = FaultyOsCalls()
    (osc.fail_from if persistent else osc.fail_nth)(call, n, fault)
    try:
        restart_workload(d, osc, use_page_cache)
    except Violation:
        raise
    except Exception as e:  # noqa: BLE001 - any other exception is a wrong outcome
        raise Violation("wrong_data", f"{call} #{n} {fault!r}: {type(e).__name__}: {e}") from e
    return osc.calls[call] >= n, sum(osc.fired.values())


def startup_point(directory: Path, call: str, n: int, fault: Fault, persistent: bool,
                  use_page_cache: bool = False) -> tuple[bool, str]:
    """One start-up point in a fresh directory: (whether call #n was reached, outcome)."""
    d = directory / f"start-{call}-{n}-{next(_POINT)}"
    d.mkdir(mode=0o700)
    osc = FaultyOsCalls()
    (osc.fail_from if persistent else osc.fail_nth)(call, n, fault)
    try:
        outcome = startup_workload(d, osc, use_page_cache)
    except Violation:
        raise
    except Exception as e:  # noqa: BLE001 - any other exception is a wrong outcome
        raise Violation("wrong_data", f"start-up {call} #{n} {fault!r}: {type(e).__name__}: {e}") from e
    return osc.calls[call] >= n, outcome


def sweep_startup(directory: Path, call: str, fault: Fault, persistent: bool, use_page_cache: bool = False,
                  limit: int = 100) -> dict[str, int]:
    """``startup_point`` at N = 1, 2, ... until the start no longer reaches N: the outcomes counted."""
    out = {"served": 0, "refused": 0}
    for n in range(1, limit + 1):
        reached, outcome = startup_point(directory, call, n, fault, persistent, use_page_cache)
        if not reached:
            return out
        out[outcome] += 1
    raise AssertionError(f"the start-up still reached {call} #{limit}")


def sweep_restart(directory: Path, call: str, fault: Fault, persistent: bool, use_page_cache: bool = False,
                  limit: int = 200) -> int:
    """``restart_point`` at N = 1, 2, ... until the cycle no longer reaches N; the points run."""
    for n in range(1, limit + 1):
        reached, fired = restart_point(directory, call, n, fault, persistent, use_page_cache)
        if not reached:
            return n - 1
        expect(fired >= 1, "wrong_data", f"{call} #{n} was reached but no fault fired")
    raise AssertionError(f"the restart cycle still reached {call} #{limit}")
