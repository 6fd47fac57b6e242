"""``python -m faults sweep``: the exhaustive single-fault sweep, outside pytest.

Prints a table by call site, or with ``--json`` one JSON object
``{"points", "survived", "hangs", "lost_completions", "wrong_data", "leaked_files",
"leaked_fds", "seconds"}``; each broken point is described on stderr. Exit code 0
when every point survived, 1 otherwise, 2 on a usage error (one line on stderr), 130
on Ctrl-C (one line on stderr, the point under way finished and the sweep's
directory removed). On a terminal a line on stderr shows where the sweep is; into a
pipe nothing but the result is written.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from faults._restart import RESTART_SITES
from faults._sweep import SITES, WORKLOADS, sweep_all
from kvoffload import cli_args

PROG = "python -m faults"
# What each comma list's names mean to sweep_all.
FILE_MODES = {"anonymous": False, "named": True}
IO = {"direct": False, "pagecache": True}
KINDS = {"transient": False, "persistent": True}


def build_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="fail every OS call site at every occurrence, once each")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sites = tuple(dict.fromkeys([*SITES, *RESTART_SITES]))
    s.add_argument("--calls", type=cli_args.Names(sites), default=None,
                   help=f"comma-separated call sites (default all: {','.join(sites)})")
    s.add_argument("--workloads", type=cli_args.Names(WORKLOADS), default=list(WORKLOADS),
                   help="standard (the standard workload), restart (a persistent pool's store-then-restart "
                        "cycle); default both")
    s.add_argument("--file-modes", type=cli_args.Names(tuple(FILE_MODES)), default=list(FILE_MODES),
                   help="anonymous,named (default both)")
    s.add_argument("--io", type=cli_args.Names(tuple(IO)), default=list(IO), help="direct,pagecache (default both)")
    s.add_argument("--kinds", type=cli_args.Names(tuple(KINDS)), default=list(KINDS),
                   help="transient,persistent (default both)")
    s.add_argument("--dir", type=cli_args.Directory(), default=None,
                   help="where the slot files go (default: a new temporary directory)")
    return p


def main(argv: list[str] | None = None) -> int:
    return cli_args.main(PROG, lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    # The backend logs every injected failure; only errors are worth showing here.
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    # A point still running after its timeout (a hang) may hold files in it: the directory
    # goes as far as it can, and an error there does not hide the sweep's result or Ctrl-C.
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvoffload-sweep-", ignore_cleanup_errors=True) as d, \
            cli_args.Progress(PROG) as progress:
        os.chmod(d, 0o700)
        report = sweep_all(Path(d), a.calls, [FILE_MODES[m] for m in a.file_modes], [IO[m] for m in a.io],
                           [KINDS[k] for k in a.kinds], workloads=a.workloads,
                           progress=lambda text: progress(f"sweep: {text}"))
    for line in report.failures:
        print(line, file=sys.stderr)
    print(json.dumps(report.summary()) if a.json else report.table())
    return 0 if report.survived == report.points else 1


if __name__ == "__main__":
    sys.exit(main())
