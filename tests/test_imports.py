"""Imports that keep the code readable in one direction: no import cycle in ``lmprefetch`` (a
lazy import inside a function counts: it is a cycle all the same, only deferred), and no test
file importing another test file (what several share lives in ``tests/helpers.py``).

Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from .graphs import cycles

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, in function bodies too, except under ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_imports_of(child))
            continue
        yield from _runtime_imports_of(node)


def _runtime_imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _runtime_imports(node)


def import_graph(package: str = "lmprefetch") -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (a name taken from a package's
    ``__init__`` counts as importing the package; ``from . import mod`` imports ``mod``)."""
    files = {_module_name(p, ROOT): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in files:
                    deps.add(submodule)
                elif target in files:
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def test_the_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_lmprefetch_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "lmprefetch.bench.engine" in graph  # the walk found the package
    found = cycles(graph)
    assert found == [], "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
        for c in found
    )


def test_no_test_file_imports_another() -> None:
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in _runtime_imports(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [a.name for a in node.names]
            )
            if any(n.rsplit(".", 1)[-1].startswith("test_") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == [], "move what is shared into tests/helpers.py"
