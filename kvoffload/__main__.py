"""`python -m kvoffload`: a store/load round trip through a real slot file, with throughput.

``python -m kvoffload forget DISK_PATH...`` wipes a persistent pool instead (``persist``):
the files at each disk path as configured (and the per-rank ``DISK_PATH.dpD.rankR`` files
the vLLM connector makes) are made unreadable and removed; a pool a server holds is refused.

A quick check that a directory works for the backend (O_DIRECT, space,
permissions, and the backend's own refusals: a symlinked directory, or a
world-writable one without the sticky bit) and how fast the whole pipeline moves
blocks there. ``--dir D`` puts the slot file in D itself, exactly as
``disk_path=D/<name>`` would. Runs on CPU tensors unless ``--device cuda`` is
given. A mistake in the arguments or the directory is one line on stderr, exit
code 2; a failed round trip exits 1; Ctrl-C is one line, exit code 130, with nothing
left in the directory. On a terminal a line on stderr shows how far it has got (making
the blocks, storing, loading, comparing); into a pipe it prints only its result.

torch and the backend are imported once the command runs, under ``cli_args.main``:
a Ctrl-C during the seconds torch takes to import is one line too.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from kvoffload import cli_args
from kvoffload.cli_args import UsageError

if TYPE_CHECKING:
    import torch

PROG = "python -m kvoffload"
# The slot file's name in --dir. Anonymous by default, so it never appears; where the
# file system has no O_TMPFILE, the named fallback would remove a stale file of this
# name, hence one nobody else uses.
CHECK_NAME = ".kvoffload-selfcheck"
# The caches and the copy they are checked against are both in memory at once.
COPIES_IN_MEMORY = 2
# The round trip's blocks go in up to this many jobs, launched at once as a busy scheduler
# step launches its jobs, each of at least JOB_BYTES (many of the backend's IO units, so
# its threads are as busy as with one job): each job done is progress to show.
JOBS = 64
JOB_BYTES = 64 << 20
COMMANDS = {"forget": "wipe persistent pools and remove them (python -m kvoffload forget --help)"}


def _device(name: str) -> "torch.device":
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {name!r}: {str(e).splitlines()[0]}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available (torch {torch.__version__}, "
                             f"{torch.cuda.device_count()} GPU(s) visible)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
    elif device.type != "cpu":
        raise UsageError(f"--device {name}: use cpu or cuda")
    return device


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["forget"]:
        return cli_args.main(f"{PROG} forget", lambda: _forget(argv[1:]))
    return cli_args.main(PROG, lambda: _run(argv))


def build_forget_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=f"{PROG} forget",
                        description="Wipe persistent kvoffload pools so nothing in them is readable, and remove them. "
                                    "Only a file set proved kvoffload's is touched; a refusal changes nothing.")
    p.add_argument("disk_paths", nargs="+", metavar="DISK_PATH", help="a disk_path as configured")
    p.add_argument("--without-index", action="store_true",
                   help="also wipe a data file that has no kvoffload index (nothing shows it is kvoffload's)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--key-file", metavar="PATH", help="the pool's key file: its index must verify under it")
    key.add_argument("--key-env", metavar="NAME", help="an environment variable holding the pool's key (hex)")
    return p


def _forget(argv: list[str]) -> int:
    from kvoffload import persist

    a = build_forget_parser().parse_args(argv)
    operator_key = None
    if a.key_file is not None or a.key_env is not None:
        with cli_args.usage_errors(ValueError):
            operator_key = persist.read_operator_key(a.key_file, a.key_env)
    targets = []
    for path in a.disk_paths:
        found = persist.forget_targets(os.path.abspath(path))
        if not found:
            raise UsageError(f"{path}: no kvoffload pool file or index there")
        targets += found
    # Every target proved kvoffload's before any is wiped: a refusal leaves them all as they were.
    refusals = []
    for target in targets:
        try:
            persist.check_forget(target, a.without_index, operator_key)
        except ValueError as e:  # a PersistError
            refusals.append(cli_args.one_line(e))
    if refusals:
        more = f" (and {len(refusals) - 1} more refused; nothing was wiped)" if len(refusals) > 1 else ""
        raise UsageError(refusals[0] + more)
    failed = 0
    for target in targets:
        try:
            print(persist.forget(target, a.without_index, operator_key=operator_key))
        except ValueError as e:  # the wipe itself failed (an IO error): the job's failure, exit 1
            print(f"{PROG} forget: {cli_args.one_line(e)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def build_parser() -> cli_args.Parser:
    # forget is dispatched by hand in main (the round trip takes no command): its usage
    # and the line below are how --help shows it.
    commands = "\n".join(f"  {name:<8} {what}" for name, what in COMMANDS.items())
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0], epilog=f"commands:\n{commands}",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    # A symlinked, unwritable or world-writable --dir: the backend refuses it itself, with its own words.
    p.add_argument("--dir", type=cli_args.Directory(writable=False), default=None,
                   help="directory the slot file goes in, as the backend would use it (default: a private temp dir here)")
    p.add_argument("--mib", type=cli_args.Integer(1), default=256, help="MiB to store and load (default 256)")
    p.add_argument("--tensors", type=cli_args.Integer(1), default=64, metavar="N",
                   help="cache tensors per block (default 64)")
    p.add_argument("--tensor-kib", type=cli_args.Integer(1), default=32, metavar="KIB",
                   help="KiB per tensor per block (default 32)")
    p.add_argument("--page-cache", action="store_true", help="use the page cache instead of O_DIRECT")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    # The usage shows both forms: the round trip's, as argparse makes it, and forget's.
    forms = [q.format_usage().removeprefix("usage: ").strip() for q in (p, build_forget_parser())]
    p.usage = "\n       ".join(forms)
    return p


def _run(argv: list[str]) -> int:
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        raise UsageError(f"unknown command {argv[0]!r}" + (f" (did you mean {close[0]}?)" if close else "")
                         + f"; the commands are {', '.join(COMMANDS)}, or none for the round trip")
    a = build_parser().parse_args(argv)
    device = _device(a.device)
    block = a.tensors * a.tensor_kib * 1024
    nblocks = (a.mib << 20) // block
    if nblocks < 1:
        raise UsageError(f"--mib {a.mib} holds no whole block of {block >> 10} KiB "
                         f"(--tensors {a.tensors} x --tensor-kib {a.tensor_kib})")
    if a.dir is not None:
        return _round_trip(a.dir, device, nblocks, a)
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".kvoffload-") as d:
        return _round_trip(d, device, nblocks, a)


def _round_trip(directory: str, device: "torch.device", nblocks: int, a: argparse.Namespace) -> int:
    import torch

    from kvoffload import budget
    from kvoffload.disk_backend import DiskBackend
    from kvoffload.os_calls import OsCalls
    from kvoffload.slot_file import SlotFileError, round_up

    block = a.tensors * a.tensor_kib * 1024
    path = os.path.join(directory, CHECK_NAME)
    # The backend's own check of disk and memory, before the caches are made: a --mib
    # larger than either is one line, not an allocator's traceback.
    with cli_args.usage_errors(SlotFileError, ValueError):
        budget.check(OsCalls(), f"--mib {a.mib}", [path], nblocks, block, a.page_cache,
                     COPIES_IN_MEMORY * nblocks * block)
    mib = nblocks * block / 2**20
    with cli_args.Progress(PROG) as progress:
        caches = _random_caches(device, nblocks, a, progress)
        progress(f"copying {mib:,.0f} MiB to compare against", "copy")
        want = {k: v.clone() for k, v in caches.items()}
        b = DiskBackend()
        try:
            progress(f"opening the slot file for {mib:,.0f} MiB", "init")
            with cli_args.usage_errors(SlotFileError, ValueError):
                b.init(caches, device, None, None, path, nblocks, block, use_page_cache=a.page_cache,
                       report_load_errors=True, capacity_bytes=nblocks * round_up(block, 4096))
            io_path = b.stats()["io_path_detail"]
            rates = {}
            for name, is_store in (("store", True), ("load", False)):
                if not is_store:
                    for t in caches.values():
                        t.zero_()
                rate = _move(b, nblocks, block, is_store, progress)
                if rate is None:
                    progress.clear()
                    print(f"{PROG}: {name} failed: see the log", file=sys.stderr)
                    return 1
                rates[name] = rate
        finally:
            b.shutdown()
        ok = True
        for i, k in enumerate(caches):
            progress(f"comparing what was loaded: tensor {i + 1} of {len(caches)}", "compare")
            ok = torch.equal(caches[k], want[k]) and ok
    print(f"kvoffload round trip in {os.path.abspath(directory)}: {nblocks} blocks x {block // 1024} KiB on {device}, "
          f"{'page cache' if a.page_cache else 'O_DIRECT'}")
    print(f"  IO path: {io_path}")
    print(f"  store {rates['store']:.2f} GiB/s   load {rates['load']:.2f} GiB/s   bytes verified: {ok}")
    return 0 if ok else 1


def _random_caches(device: "torch.device", nblocks: int, a: argparse.Namespace,
                   progress: cli_args.Progress) -> dict[str, "torch.Tensor"]:
    """The random blocks, a tensor at a time (the slowest part of a large --mib)."""
    from kvoffload.device import random_caches

    mib = nblocks * a.tensors * a.tensor_kib / 1024
    caches = {}
    for i in range(a.tensors):
        progress(f"making {mib:,.0f} MiB of random blocks: tensor {i + 1} of {a.tensors}", "make")
        caches[f"layer{i}"] = random_caches(device, nblocks, [a.tensor_kib * 1024], seed=i)["layer0"]
    return caches


def _move(b, nblocks: int, block: int, is_store: bool, progress: cli_args.Progress) -> "float | None":
    """Every block stored (or loaded) in up to ``JOBS`` jobs launched at once; GiB/s from
    the first launch to the last completion, or None if a job failed."""
    what = "storing" if is_store else "loading"
    per = max(-(-nblocks // JOBS), JOB_BYTES // block, 1)
    events: list = []
    t0 = time.perf_counter()
    for k, first in enumerate(range(0, nblocks, per)):
        ids = list(range(first, min(nblocks, first + per)))
        b.launch_copy(ids, ids, is_store, k, events)
    done = 0
    for _, ev in events:
        progress(f"{what} {done * block / 2**20:,.0f} of {nblocks * block / 2**20:,.0f} MiB", what)
        ev.synchronize()
        done = min(nblocks, done + per)
    seconds = time.perf_counter() - t0
    if not all(ev.ok for _, ev in events):
        return None
    return nblocks * block / seconds / 2**30


if __name__ == "__main__":
    sys.exit(main())
