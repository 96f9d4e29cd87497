"""The house's layers, read from the source: shared imports neither side, the sides never import each
other, and no module of api/ or worker/ imports one that imports it back (directly or by a chain).
Every import counts: at the top, inside a function, under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "worker", "shared")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``path`` imports, by any import statement in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module in modules and module != name}


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]], within: str) -> list[list[str]]:
    """The strongly connected groups of more than one module inside the package ``within`` (Tarjan)."""
    nodes = sorted(name for name in edges if name == within or name.startswith(within + "."))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node] & set(nodes)):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            group.append(node)
            if len(group) > 1:
                groups.append(sorted(group))

    for node in nodes:
        if node not in index:
            visit(node)
    return groups


@pytest.mark.parametrize("package", ["api", "worker", "shared"])
def test_no_module_imports_one_that_imports_it_back(package: str) -> None:
    assert cycles(graph(), package) == []


@pytest.mark.parametrize(("package", "forbidden"), [("shared", ("api", "worker")), ("api", ("worker",)),
                                                    ("worker", ("api",))])
def test_layers_import_only_downwards(package: str, forbidden: tuple[str, ...]) -> None:
    reaching = {name: sorted(target for target in targets if target.split(".")[0] in forbidden)
                for name, targets in graph().items() if name.split(".")[0] == package}
    assert {name: targets for name, targets in reaching.items() if targets} == {}


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"api.a": {"api.b"}, "api.b": {"api.c"}, "api.c": {"api.a"}, "api.d": {"api.a"}}
    assert cycles(edges, "api") == [["api.a", "api.b", "api.c"]]
