"""``python -m faults sweep``: the exhaustive single-fault sweep, outside pytest.

Prints a table by call site, or with ``--json`` one JSON object
``{"points", "survived", "hangs", "lost_completions", "wrong_data", "leaked_files",
"leaked_fds", "seconds"}``; each broken point is described on stderr. Exit code 0
when every point survived, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from faults._sweep import SITES, sweep_all


def _choices(allowed: dict[str, object]):
    def parse(text: str) -> list:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return [allowed[n] for n in names]

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m faults", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="fail every OS call site at every occurrence, once each")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    s.add_argument("--calls", type=_choices({c: c for c in SITES}), default=None,
                   help=f"comma-separated call sites (default all: {','.join(SITES)})")
    s.add_argument("--file-modes", type=_choices({"anonymous": False, "named": True}), default=[False, True],
                   help="anonymous,named (default both)")
    s.add_argument("--io", type=_choices({"direct": False, "pagecache": True}), default=[False, True],
                   help="direct,pagecache (default both)")
    s.add_argument("--kinds", type=_choices({"transient": False, "persistent": True}), default=[False, True],
                   help="transient,persistent (default both)")
    s.add_argument("--dir", default=None, help="where the slot files go (default: a new temporary directory)")
    a = p.parse_args(argv)
    # The backend logs every injected failure; only errors are worth showing here.
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvoffload-sweep-") as d:
        os.chmod(d, 0o700)
        report = sweep_all(Path(d), a.calls, a.file_modes, a.io, a.kinds)
    for line in report.failures:
        print(line, file=sys.stderr)
    print(json.dumps(report.summary()) if a.json else report.table())
    return 0 if report.survived == report.points else 1


if __name__ == "__main__":
    sys.exit(main())
