"""Dependencies run one way: every pkv module imports only from its own layer or a lower one,
nothing in `pkv.core` imports `pkv.plugins`, and neither modules nor rooms (the folders of
pkv.core) import each other in a cycle. Imports are read from the source (function-level and
TYPE_CHECKING ones included), so a new upward import fails here with the offending pair named.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("cli", "core", "csrc", "plugins", "quantize")

# Rooms, bottom up. A module may import its own room, a room of the same rank (if no cycle
# follows) or any lower rank; a room is the longest matching prefix.
RANKS: dict[str, int] = {
    "pkv.csrc": 0,
    "pkv.core": 1,  # core/__init__.py and the modules at its top level
    "pkv.core.hookspecs": 1, "pkv.core.registry": 1, "pkv.core.progress": 1,
    "pkv.core.config": 1, "pkv.core.tokenizer": 1, "pkv.core.distributed": 1,
    "pkv.core.layers": 2,
    "pkv.core.models": 3,
    "pkv.core.lora": 4, "pkv.core.sample": 4, "pkv.core.structured_output": 4,
    "pkv.core.pooling": 4,
    "pkv.core.model_loader": 4,
    "pkv.core.sched": 5, "pkv.core.worker": 5, "pkv.core.spec_decode": 5,
    "pkv.plugins": 5,
    "pkv.core.engine": 6,
    "pkv.core.server": 7,
    "pkv.quantize": 8, "pkv.cli": 8,
    "pkv": 9,
}
# (importer prefix, imported prefix) pairs forbidden whatever the ranks say.
FORBIDDEN = [("pkv.core", "pkv.plugins")]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("pkv", *parts))


def source_modules() -> dict[str, Path]:
    files = [ROOT / "__init__.py"]
    for folder in SOURCE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return {module_name(path): path for path in files}


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The pkv modules `path` imports (a `from X import y` counts as X.y where that is a
    module, as X otherwise)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return {m for m in found if m == "pkv" or m.startswith("pkv.")} - {name}


@cache  # every test reads the same tree; none changes the graph
def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    return {name: imported_modules(path, name, known) for name, path in modules.items()}


def room_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANKS:
            return prefix
    raise KeyError(module)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = room_of(importer), room_of(target)
            if RANKS[high] > RANKS[low]:
                problems.append(f"{importer} ({low}, rank {RANKS[low]}) imports {target} "
                                f"({high}, rank {RANKS[high]})")
            for a, b in FORBIDDEN:
                if _within(importer, a) and _within(target, b):
                    problems.append(f"{importer} imports {target}: {a} never imports {b}")
    return problems


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_room_of_its_own() -> None:
    """A new folder under core/ (or a new top-level package) gets its place in RANKS first:
    the root's rank is for `pkv/__init__.py` alone, core's for the modules at its top."""
    def unplaced(module: str) -> bool:
        room = room_of(module)
        return (room == "pkv" and module != "pkv"
                or room == "pkv.core" and module.count(".") > 2)

    missing = [m for m in import_graph() if unplaced(m)]
    assert not missing, f"modules in no room (add their folder to RANKS): {missing}"


def test_no_module_imports_a_higher_layer_and_core_never_imports_plugins() -> None:
    problems = upward_imports(import_graph())
    assert not problems, "imports that run back up:\n" + "\n".join(problems)


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which rooms import which (a room importing itself left out)."""
    rooms: dict[str, set[str]] = {room: set() for room in RANKS}
    for importer, targets in graph.items():
        rooms[room_of(importer)].update(room_of(t) for t in targets)
    return {room: imported - {room} for room, imported in rooms.items()}


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(c)
                                                                     for c in found)


def test_no_cycles_between_rooms_of_one_rank() -> None:
    found = cycles(room_graph(import_graph()))
    assert not found, "rooms that import each other:\n" + "\n".join(" <-> ".join(c)
                                                                   for c in found)


@pytest.mark.parametrize("importer,imported", [
    ("pkv.core.sched.scheduler", "pkv.core.engine.llm_engine"),
    ("pkv.core.worker.model_runner", "pkv.plugins.weights.awq"),
])
def test_the_check_names_an_upward_pair(importer: str, imported: str) -> None:
    problems = upward_imports({importer: {imported}, imported: set()})
    assert problems and importer in problems[0] and imported in problems[0]


def test_the_check_finds_a_cycle_through_three_modules() -> None:
    graph = {"pkv.a": {"pkv.b"}, "pkv.b": {"pkv.c"}, "pkv.c": {"pkv.a"}, "pkv.d": {"pkv.a"}}
    assert cycles(graph) == [["pkv.a", "pkv.b", "pkv.c"]]


def test_relative_and_from_imports_resolve_to_modules(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from . import sibling\nfrom pkv.core import registry\n"
                      "from pkv.core.registry import discover\nimport os\n")
    known = {"pkv.core.sibling", "pkv.core.registry"}
    assert imported_modules(module, "pkv.core.m", known) == known
