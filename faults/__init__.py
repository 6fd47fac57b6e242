"""faults: fault injection for kvoffload, tested like a storage engine.

``FaultyOsCalls`` wraps the backend's OS seam (``kvoffload.os_calls.OsCalls``)
and, per call site and per occurrence counted across all threads, injects an
errno, a real short write or read, a lying write, a bit flip read back, a delay
or a hang on an Event the test holds. ``LineInterrupt`` raises a Ctrl-C at the
N-th line a call runs; ``Tamper`` changes a live slot file from outside;
``faults._rawscan`` scans a loop-mounted ext4 for plaintext. ``faults.plugin``
(loaded by ``tests/conftest.py``) adds ``--fault-seed``, the Hypothesis profiles
``ci``/``soak`` and the fixtures; ``pytest -m faults`` runs the suite and
``python -m faults sweep [--json]`` the exhaustive single-fault sweep alone.

What the fakes do NOT model (RocksDB style):

- Crashes of the machine: there is no page-cache or unsynced-data loss, no torn
  sector and no reordering of writes. The slot file is ephemeral (anonymous or
  unlinked at creation) and never read after a restart, so durability is out of
  scope; ``kill -9`` of a process is tested for real, a power cut is not.
- Real O_DIRECT alignment errors come only from the kernel, on a real ext4
  file (the alignment tests); an injected EINVAL does not check alignment.
  Injected short transfers on an O_DIRECT fd are rounded down to 4096 bytes, so
  they stay transfers the kernel could return.
- Errors raised by the device (CUDA) are not injected here; see the backend's
  ``device_impl`` seam. Neither is EINTR: CPython retries it (PEP 475).
- Only calls through the seam can fail: glibc-internal calls, the interpreter's
  own IO, memory allocation and thread creation cannot.
- A lying write (``Fault.lie``) is detected only because the backend seals
  every slot (AES-GCM tag or xxh3 checksum); with ``encrypt=False,
  checksums=False`` nothing could detect it.
- Bit flips happen in the bytes read back (``preadv``), not on the media; the
  corruption tests flip a real bit on disk separately.
- A hang blocks the Python thread inside the seam before the real call; a
  thread stuck in the kernel (D state) behaves the same for the backend, but
  cannot be released by the test.
- Counts are per call site; a schedule cannot target one file of several (use a
  hook and compare ``info.args[0]`` with the fd instead).
"""

from faults._attacks import SymlinkRace, Tamper, Victim, plant_symlink, symlinked_parent, world_writable_dir
from faults._interrupt import LineInterrupt, Where, sweep_lines
from faults._invariants import (
    KINDS,
    FdWatch,
    Ledger,
    Op,
    PinWatch,
    Violation,
    assert_dir_clean,
    assert_mode_0600,
    fd_table,
    fs_type,
    kvoffload_threads,
    private_tempdir,
    wait_threads_gone,
)
from faults._model import ABSENT, INVALID, KvChecker, Maybe, block_data, make_caches
from faults._seam import (
    CALL_SITES,
    DEFAULT_ERRNO,
    CallInfo,
    Fault,
    FaultyOsCalls,
    Fired,
    InjectedOSError,
    injected_error,
    is_injected,
)
from faults._sweep import SITES, SweepReport, run_point, run_workload, standard_workload, sweep, sweep_all

__all__ = [
    "ABSENT", "CALL_SITES", "DEFAULT_ERRNO", "INVALID", "KINDS", "SITES", "SweepReport", "Violation", "CallInfo", "Fault", "FaultyOsCalls", "FdWatch",
    "Fired", "InjectedOSError", "KvChecker", "Ledger", "LineInterrupt", "Maybe", "Op", "PinWatch", "SymlinkRace",
    "Tamper", "Victim", "Where",
    "assert_dir_clean", "assert_mode_0600", "block_data", "fd_table", "fs_type", "injected_error",
    "is_injected", "kvoffload_threads", "make_caches", "plant_symlink", "private_tempdir", "run_point", "run_workload",
    "standard_workload", "sweep", "sweep_all", "sweep_lines", "symlinked_parent", "wait_threads_gone", "world_writable_dir",
]
