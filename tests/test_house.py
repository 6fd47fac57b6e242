"""The house stays readable: no circle among kvoffload's modules, rooms of one screen, and
scripts/ holding only tools the docs name.

A circle means no module of it can be read, tested or replaced without the others; a
function over 100 lines or a file over 600 no newcomer reads in one sitting. The native
engine's C is outside the count (one translation unit per job, as C is written).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvoffload"
MAX_FUNCTION_LINES = 100
MAX_FILE_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, at any depth of its code (an import
    inside a function is an arrow too: it only defers the circle to run time)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # from kvoffload import run
    return {m for m in found if m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of ``graph`` (its modules in order), or [] where there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def _package_graph() -> dict[str, set[str]]:
    sources = _sources()
    graph = {m: _imports(p, set(sources)) - {m} for m, p in sources.items()}
    # A package's __init__ importing its own modules is how a package is made, not a circle.
    return {m: {n for n in deps if not m.startswith(n + ".")} for m, deps in graph.items()}


def test_no_circle_among_the_packages_modules():
    graph = _package_graph()
    # The graph is the real one: lazy imports and "from kvoffload import x" included.
    assert {"kvoffload.run", "kvoffload.engine_choice"} <= graph["kvoffload.disk_backend"]
    assert "kvoffload.native_engine" in graph["kvoffload.engine_choice"]
    assert _cycle(graph) == []


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_function_over_100_lines_and_no_file_over_600():
    long_functions, long_files = [], []
    for name, path in _sources().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long_files == [] and long_functions == []


def test_scripts_holds_only_tools_the_docs_name():
    docs = " ".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    unnamed = [p.name for p in sorted((ROOT / "scripts").iterdir()) if p.is_file() and f"scripts/{p.name}" not in docs]
    assert unnamed == []


# Where kvoffload asks about persistence outside persist/: where the operator chooses it
# (config), where start-up acts on the choice (the budget of a pool, opening it, the
# vLLM adapters' start-up and restore) and forget. The data path (run.py, the engines,
# the lanes, the seal, the records) sees only the keeper (slot_keeper.py), the door.
PERSISTENCE_ASKED = {
    "kvoffload.__main__": {"_forget"},
    "kvoffload.budget": {"<module>", "check", "slot_state_bytes"},
    "kvoffload.config": {"<module>", "DiskSettings", "DiskSettings.__post_init__", "DiskSettings.parse",
                         "PersistConfig.operator_key"},
    "kvoffload.disk_backend": {"<module>", "DiskBackend.init", "DiskBackend._open_files", "_Plan.check",
                               "_Plan.check_budget"},
    "kvoffload.vllm_connector": {"<module>", "KvoffloadConnector.__init__", "KvoffloadConnector._restore"},
    "kvoffload.vllm_slot_tier": {"<module>", "SlotTier.__init__"},
    "kvoffload.vllm_tier_manager": {"KvoffloadTier.__init__"},
    "kvoffload.vllm_worker": {"<module>", "KvoffloadWorker._init_disk_mode"},
}


def _persistence_places(tree: ast.AST) -> set[str]:
    """The functions (``Class.method``; ``<module>`` for module level) of ``tree`` whose code
    names persistence: an identifier, attribute, argument or keyword with "persist" in
    it, or an import from kvoffload.persist."""
    found: set[str] = set()

    def walk(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, [*where, child.name])
                continue
            names = []
            if isinstance(child, ast.Name):
                names = [child.id]
            elif isinstance(child, ast.Attribute):
                names = [child.attr]
            elif isinstance(child, (ast.arg, ast.keyword)):
                names = [child.arg or ""]
            elif isinstance(child, ast.ImportFrom):
                names = [child.module or "", *(a.name for a in child.names)]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            if any("persist" in n.lower() for n in names):
                found.add(".".join(where) or "<module>")
            walk(child, where)

    walk(tree, [])
    return found


def test_persistence_is_asked_only_where_it_is_chosen_started_or_forgotten():
    asked = {}
    for name, path in _sources().items():
        if name.startswith(("kvoffload.persist", "kvoffload.bench")):  # persist itself; bench is no deployment's
            continue
        places = _persistence_places(ast.parse(path.read_text()))
        if places:
            asked[name] = places
    beyond = {m: sorted(p - PERSISTENCE_ASKED.get(m, set())) for m, p in asked.items()}
    assert {m: p for m, p in beyond.items() if p} == {}
    # The table is no wider than the code: a place that no longer asks leaves it.
    assert {m: sorted(PERSISTENCE_ASKED[m] - asked.get(m, set())) for m in PERSISTENCE_ASKED
            if PERSISTENCE_ASKED[m] - asked.get(m, set())} == {}


def test_the_persistence_count_finds_a_question_on_the_data_path():
    tree = ast.parse("class Run:\n    def settle(self):\n        if self.pool.persistent:\n            pass\n")
    assert _persistence_places(tree) == {"Run.settle"}
