"""The tree's promises: one import name of ours, rooms of a readable size, no import circles.

The import walk reads every import of every module under ``sluicegate/`` — at module level,
inside functions and under ``TYPE_CHECKING`` alike — since a circle hidden behind a local or
type-only import is still two rooms that each need the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "sluicegate"
MAX_FILES_PER_FOLDER = 15


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The first-party modules ``module`` imports, each named by its longest known prefix."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(filter(None, (resolve(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package.pop()
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            found.update(filter(None, (resolve(f"{base}.{a.name}") for a in node.names)))
    # A package's own __init__ runs before any of its modules: not an edge worth reporting.
    return {m for m in found if m != module and not module.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {module: _imported(module, path, known) for module, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
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
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_the_walk_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_walk_sees_type_only_and_local_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from sluicegate.x import y\n"
        "def f():\n    import sluicegate.z\n"
    )
    assert _imported("sluicegate.m", source, {"sluicegate.x", "sluicegate.z"}) == {
        "sluicegate.x",
        "sluicegate.z",
    }


SOURCE_SUFFIXES = (".py", ".cpp", ".h")
"""What a folder's size counts: Python modules and the kernels' C++ sources and headers."""


@pytest.mark.parametrize("room", ["gateway", "engine", "kernels"])
def test_no_folder_holds_more_than_fifteen_source_files(room: str) -> None:
    crowded = {
        str(folder.relative_to(REPO)): count
        for folder in [PACKAGE / room, *(PACKAGE / room).rglob("*")]
        if folder.is_dir()
        and (count := sum(1 for f in folder.iterdir() if f.suffix in SOURCE_SUFFIXES))
        > MAX_FILES_PER_FOLDER
    }
    assert crowded == {}


def test_the_repo_root_imports_nothing_of_ours_by_a_bare_name() -> None:
    """From the root (where ``./scripts/*`` run Python) ``import kernels`` must find Hugging
    Face's, which transformers imports; likewise ``engine`` and ``gateway`` stay free."""
    importable = {
        entry.name
        for entry in REPO.iterdir()
        if (entry.is_dir() and (entry / "__init__.py").is_file()) or entry.suffix == ".py"
    }
    assert importable == {"sluicegate"}
