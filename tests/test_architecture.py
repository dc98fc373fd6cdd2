"""The architecture page is the map of the code: every module under ``lmprefetch/`` is in its
module table, in a layer, no module imports from a layer above its own, and no two modules
import each other, directly or through others (within a layer too: a cycle there makes the
layer one module in two files; type-only imports count here, ``test_imports.py`` checks the
imports that run).

Imports are read with :mod:`ast` from the sources, all of them: at module level, inside
functions (lazy imports are still dependencies) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .graphs import cycles

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lmprefetch"
PAGE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name → file."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layers_on_the_page(markdown: str) -> tuple[list[str], dict[str, str]]:
    """The layers of the "Module map" table, bottom first, and each module's layer (a row
    with an empty layer cell continues the layer above it)."""
    section = markdown.split("## Module map", 1)[1].split("\n## ", 1)[0]
    order: list[str] = []
    layer_of: dict[str, str] = {}
    layer = ""
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith(("| layer", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0]:
            layer = cells[0]
            order.append(layer)
        for path in re.findall(r"`([\w/]+\.py)`", cells[1]):
            name = module_name(PACKAGE / path)
            assert name not in layer_of, f"{path} is listed twice"
            layer_of[name] = layer
    return order, layer_of


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from . import protocol`` imports the module protocol, not the package.
            submodules = {f"{target}.{a.name}" for a in node.names} & known.keys()
            if submodules:
                out |= submodules
            elif target in known:
                out.add(target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
    out.discard(name)
    return out


def test_every_module_is_on_the_page_in_one_layer() -> None:
    _, layer_of = layers_on_the_page(PAGE.read_text())
    known = modules()
    missing = sorted(set(known) - set(layer_of))
    assert not missing, f"docs/architecture.md's module map misses {missing}"
    stale = sorted(set(layer_of) - set(known))
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def test_no_import_goes_up_a_layer() -> None:
    order, layer_of = layers_on_the_page(PAGE.read_text())
    rank = {layer: i for i, layer in enumerate(order)}
    known = modules()
    upward = []
    for name, path in known.items():
        if name not in layer_of:
            continue  # reported by the test above
        for dep in sorted(imported_modules(name, path, known)):
            if dep in layer_of and rank[layer_of[dep]] > rank[layer_of[name]]:
                upward.append(f"{name} ({layer_of[name]}) imports {dep} ({layer_of[dep]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_two_modules_import_each_other() -> None:
    known = modules()
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    found = cycles(graph)
    assert not found, "modules that import each other:\n" + "\n".join(map(str, found))


def test_the_checks_see_what_they_check() -> None:
    """The parser finds the layers and the imports (a check that reads nothing passes)."""
    order, layer_of = layers_on_the_page(PAGE.read_text())
    assert order[0] == "helpers" and order[-1] == "entry points"
    assert layer_of["lmprefetch.prefetch"] == "engine"
    assert layer_of["lmprefetch.bench.serve.run"] == "benchmarks"
    known = modules()
    deps = imported_modules("lmprefetch.server", known["lmprefetch.server"], known)
    assert {"lmprefetch.protocol", "lmprefetch.prefetch", "lmprefetch.transport"} <= deps
    assert "lmprefetch" not in deps  # ``from . import protocol`` is protocol
    lazy = imported_modules("lmprefetch.wiring", known["lmprefetch.wiring"], known)
    assert "lmprefetch.tiers.disk" in lazy  # imported inside a function
    # A cycle through type-only imports is in the graph (test_imports.py leaves those out):
    metrics = imported_modules("lmprefetch.metrics", known["lmprefetch.metrics"], known)
    assert "lmprefetch.prefetch" in metrics  # under TYPE_CHECKING only
    # A page whose layers were in the wrong order would be caught:
    swapped = PAGE.read_text().replace("| helpers | `_sync.py`", "| helpers-x | `_sync.py`")
    assert layers_on_the_page(swapped)[0][0] == "helpers-x"
