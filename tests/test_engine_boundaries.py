"""One engine interface: outside an engine, no code asks which engine runs or touches C.

A lint over the package's own source (kvoffload, faults, kvsim): the native engine's
compiled module and C structures (``ffi``, ``lib``, ``kvo_*``) appear only in
``kvoffload/native_engine/``; no code outside the two engines compares an engine's name or
type, or reaches into an engine's lanes or workers. ``engine_choice.py`` makes the one choice
(it alone asks whether the native engine can run); ``config.py`` parses the ``native_io``
key an operator sets.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("kvoffload/native_engine/", "kvoffload/python_engine/")

FORBIDDEN = {
    "the native engine's compiled module": re.compile(r"native_engine\._core|import _core|_native\b"),
    "C structures or the core's library": re.compile(r"\bffi\.|\.lib\.|\bkvo_[a-z]"),
    "which engine runs": re.compile(r"engine\.name\s*[!=]=|isinstance\([^)]*(Native|Python)Engine|"
                                    r"io_path\s*[!=]=\s*[\"'](native|python)|\.native\b"),
    "an engine's insides": re.compile(r"engine\.(lanes|workers|jobs|gate|collector)\b"),
}
# engine_choice.py makes the choice, so it alone may name the engines and ask whether the core loads.
ALLOWED = {"kvoffload/engine_choice.py": {"which engine runs"}}


def sources() -> list[Path]:
    out = []
    for top in ("kvoffload", "faults", "kvsim"):
        out += sorted((ROOT / top).rglob("*.py"))
    return out


def test_no_code_outside_the_engines_asks_which_engine_runs_or_touches_c():
    found = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ENGINES):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for what, pattern in FORBIDDEN.items():
                if what not in ALLOWED.get(rel, ()) and pattern.search(code):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_the_lint_sees_what_it_forbids():
    # The patterns are not blind: each catches the line it is meant for.
    samples = {"the native engine's compiled module": "from kvoffload.native_engine._core import lib",
               "C structures or the core's library": "u = ffi.new('kvo_unit *')",
               "which engine runs": "if run.engine.name == 'native':",
               "an engine's insides": "lane = run.engine.lanes[True][0]"}
    for what, line in samples.items():
        assert FORBIDDEN[what].search(line), what


def test_what_the_native_engine_runs_on_is_declared():
    # cffi loads and calls the native engine at run time: a declared dependency of the
    # package, not one that happens to arrive with cryptography.
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"cffi\b", d) for d in deps), deps
