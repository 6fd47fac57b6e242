"""pytest plugin for the faults harness, loaded by ``tests/conftest.py`` (``pytest_plugins``).

Adds ``--fault-seed`` (printed in the header so any run replays), the Hypothesis
profiles ``ci`` and ``soak``, the fixtures below, and a closing line with the
number of fault points the sweep ran. Nothing here is autouse: loading the
plugin changes no other test.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from faults._invariants import TMPFS_MAGIC, FdWatch, Ledger, fs_type, private_tempdir
from faults._seam import FaultyOsCalls

_SEED_KEY = pytest.StashKey[int]()


def pytest_addoption(parser):
    group = parser.getgroup("faults", "kvoffload fault injection")
    group.addoption(
        "--fault-seed", type=int, default=None,
        help="seed for seeded-random fault schedules (default: random, printed in the header)",
    )


def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:
        return
    # CI: many short examples, reproducible from the commit alone.
    settings.register_profile(
        "ci", max_examples=2000, stateful_step_count=15, deadline=None, derandomize=True,
        database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow],
    )
    # Soak: longer programs, new randomness each run (keep the database to replay).
    settings.register_profile(
        "soak", max_examples=20000, stateful_step_count=60, deadline=None, derandomize=False,
        print_blob=True, suppress_health_check=[HealthCheck.too_slow],
    )
    if os.environ.get("CI") and not os.environ.get("HYPOTHESIS_PROFILE"):
        settings.load_profile("ci")
    elif os.environ.get("HYPOTHESIS_PROFILE") in ("ci", "soak"):
        settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


def pytest_configure(config):
    seed = config.getoption("fault_seed")
    config.stash[_SEED_KEY] = seed if seed is not None else random.SystemRandom().randrange(2**32)
    _register_hypothesis_profiles()


def pytest_report_header(config):
    seed = config.stash[_SEED_KEY]
    return f"faults: fault seed {seed} (replay with --fault-seed={seed})"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from faults._sweep import POINTS_RUN

    if POINTS_RUN["runs"]:
        terminalreporter.write_line(
            f"faults: {POINTS_RUN['points']} single-fault points run "
            f"({POINTS_RUN['runs']} workload runs incl. the fault-free end of each sweep); "
            f"fault seed {config.stash[_SEED_KEY]}"
        )


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture
def fault_seed(request) -> int:
    """The session's fault seed (``--fault-seed``); printed in the header and on failure."""
    seed = request.config.stash[_SEED_KEY]
    print(f"fault seed {seed}")
    return seed


@pytest.fixture
def fd_guard():
    """No fd leaked by the test, except those declared with ``fd_guard.declare_leak(fd)``,
    which teardown checks are still open and then closes. Request it first so it tears down last."""
    watch = FdWatch()
    yield watch
    try:
        watch.check()
    finally:
        watch.close_declared()


@pytest.fixture(scope="module")
def nothing_left_in_tmp(tmp_path_factory):
    """The module's temporary files go in a private directory that must be empty when the
    module ends (``private_tempdir``); pytest's own ``tmp_path`` stays where it is. Use
    ``pytestmark = pytest.mark.usefixtures("nothing_left_in_tmp")``."""
    tmp_path_factory.getbasetemp()  # made now, so it is not made in the private directory
    with private_tempdir() as d:
        yield d


@pytest.fixture
def faulty_os():
    """A FaultyOsCalls over the real OS; teardown releases every hang it scheduled."""
    osc = FaultyOsCalls()
    yield osc
    osc.release_hangs()
    osc.enabled = False


@pytest.fixture
def ledger() -> Ledger:
    """A Jepsen-style job ledger: every launched job ends exactly once, in order per direction."""
    return Ledger()


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """A private (0700) directory for the slot file."""
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def ext4_dir(cache_dir) -> Path:
    """cache_dir, if it is on a real block file system (not tmpfs: tmpfs accepts misaligned O_DIRECT)."""
    if fs_type(cache_dir) == TMPFS_MAGIC:
        pytest.skip(f"{cache_dir} is on tmpfs; O_DIRECT alignment needs a real block file system")
    return cache_dir


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs mounted by the test (root), or None where mounting is not allowed.

    Yields ``(path, description)``; ``path`` is None when the caller must fall back
    to injected ENOSPC, with the reason in ``description``.
    """
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        yield None, "not root: cannot mount a size-limited tmpfs"
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        yield None, f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
        return
    try:
        yield mnt, "real 4 MiB tmpfs (mount -t tmpfs -o size=4m)"
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
