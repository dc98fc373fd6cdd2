"""The documentation says what the code does: generated references cover every field, samples
load, the defect table names tests that exist, the metrics reference and the Grafana dashboard
name the metrics a worker serves, and nothing points outside the repository.

These tests need no MkDocs: the generator in ``tools/mkdocs_hooks.py`` is plain Python.  The
site itself is built, with every link checked, by ``nox -s docs``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Annotated

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmprefetch import PrefetchConfig, WorkerRuntime

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def load_hooks() -> ModuleType:
    path = ROOT / "tools" / "mkdocs_hooks.py"
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


hooks = load_hooks()


def cells_of(line: str) -> list[str]:
    """The cells of one table row; a ``|`` in a code span or escaped does not end a cell."""
    cells, cell, in_code, escaped = [], "", False, False
    for ch in line.strip()[1:]:
        if ch == "|" and not in_code and not escaped:
            cells.append(cell.strip())
            cell = ""
            continue
        in_code ^= ch == "`"
        escaped = ch == "\\"
        cell += ch
    return cells


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    return [cells_of(line) for line in markdown.splitlines() if line.strip().startswith("|")]


# -- the configuration reference ------------------------------------------------------------------
def test_every_config_field_is_in_the_reference_with_type_default_unit_and_meaning() -> None:
    rows = {
        re.match(r'<span id="(\w+)">', cells[0]).group(1): cells  # type: ignore[union-attr]
        for cells in table_rows(hooks.render_config_reference())
        if cells[0].startswith("<span id=")
    }
    fields = msgspec.structs.fields(PrefetchConfig)
    assert set(rows) == {f.name for f in fields}
    for f in fields:
        name, type_, default, allowed, unit, meaning = rows[f.name]
        assert f"`{f.name}`" in name and f"`LMPREFETCH_{f.name.upper()}`" in name
        assert type_.strip("`") in ("int", "float", "bool", "str", "str | None", "float | None"), (
            f.name,
            type_,
        )
        if f.default is None:
            assert default == "unset"
        elif isinstance(f.default, bool):
            assert default == f"`{str(f.default).lower()}`"
        elif isinstance(f.default, str):
            assert default == f'`"{f.default}"`'
        else:
            assert default.startswith(f"`{f.default}`"), (f.name, default)
        if type_ in ("`int`", "`float`", "`float | None`"):
            assert unit not in ("", "—"), f"{f.name}: a number without a unit"
            assert re.fullmatch(r">? ?[\d.]+( \w+)? … [\d.]+( \w+)?( \(\d+ days\))?", allowed), (
                f.name,
                allowed,
            )
        assert len(meaning) > 15, (f.name, meaning)


def test_every_config_field_is_a_connector_option() -> None:
    options = {cells[0] for cells in table_rows(hooks.render_connector_options())}
    for f in msgspec.structs.fields(PrefetchConfig):
        assert f"[`{f.name}`](configuration.md#{f.name})" in options, f.name
    assert "`config_file`" in options


def test_a_field_the_reference_cannot_be_derived_from_fails_the_build() -> None:
    # What lmprefetch.config checks for every declaration (tests/test_config.py has the rest).
    class Undocumented(msgspec.Struct, kw_only=True):
        flag: Annotated[bool, msgspec.Meta(description="A documented flag.")] = False
        timeout_s: Annotated[float, msgspec.Meta(gt=0, le=10)] = 1.0

    class Unitless(msgspec.Struct, kw_only=True):
        count: Annotated[int, msgspec.Meta(ge=0, le=9, description="How many of something.")] = 3

    with pytest.raises(TypeError, match=r"^timeout_s: no description"):
        hooks.config_fields(Undocumented)
    with pytest.raises(TypeError, match="^count: a number needs a unit"):
        hooks.config_fields(Unitless)


def test_the_generated_tables_replace_their_markers_once() -> None:
    for page, marker in (
        ("configuration.md", hooks.CONFIG_MARKER),
        ("vllm.md", hooks.CONNECTOR_MARKER),
    ):
        text = (DOCS / page).read_text()
        assert text.count(marker) == 1, page
        fake_page = SimpleNamespace(file=SimpleNamespace(src_uri=page))
        rendered = hooks.on_page_markdown(text, page=fake_page)
        assert marker not in rendered and "`chunk_size`" in rendered
        with pytest.raises(ValueError, match="marker"):
            hooks.on_page_markdown(text.replace(marker, ""), page=fake_page)


def test_the_sample_toml_loads_and_says_what_it_claims() -> None:
    sample = ROOT / "examples" / "lmprefetch.toml"
    config = PrefetchConfig.from_file(sample)
    assert config.cpu_bytes == 16 << 30
    assert config.chunk_bytes == 32 << 20
    assert config.disk_path == "/var/cache/lmprefetch"
    assert config.disk_bytes == 512 << 30
    assert config.redis_url == "redis://127.0.0.1:6379"
    assert config.model_name == "llama-3.1-8b"
    assert '--8<-- "examples/lmprefetch.toml"' in (DOCS / "configuration.md").read_text()


# -- the defect table -----------------------------------------------------------------------------
def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_every_defect_row_names_tests_that_exist() -> None:
    page = (DOCS / "cancellation.md").read_text()
    rows = [r for r in table_rows(page) if re.fullmatch(r"D\d\d", r[0])]
    assert [r[0] for r in rows] == [f"D{n:02}" for n in range(1, 20)]
    for row in rows:
        tests_cell = row[-1]
        own: list[str] = []
        for file, name in re.findall(r"`(test_\w+\.py)(?:::(test_\w+\*?))?`", tests_cell):
            path = ROOT / "tests" / file
            assert path.exists(), (row[0], file)
            if name:
                defined = defined_tests(path)
                if name.endswith("*"):
                    matches = [d for d in defined if d.startswith(name[:-1])]
                else:
                    matches = [name] if name in defined else []
                assert matches, f"{row[0]}: {file}::{name} is not a test"
                own += [m for m in matches if m.startswith(f"test_{row[0].lower()}_")]
        assert own, f"{row[0]}: no test named test_{row[0].lower()}_... in its row"


# -- the examples the pages include ---------------------------------------------------------------
def test_getting_started_shows_the_first_lookup_and_its_output() -> None:
    page = (DOCS / "getting-started.md").read_text()
    assert '--8<-- "examples/first_lookup.py"' in page
    # tests/test_examples.py checks that the example prints exactly these lines.
    assert "cached prefix: 96 of 100 tokens\n" in page
    assert "claimed 6 chunks; the last one starts with b'\\x05\\x05'\n" in page


# -- metrics and the Grafana dashboard ------------------------------------------------------------
@pytest.fixture(scope="module")
def scraped() -> dict[str, tuple[str, set[str]]]:
    """``{name as queried: (type, label names)}`` for every lmprefetch family a worker serves."""
    with tempfile.TemporaryDirectory() as disk:
        config = PrefetchConfig(chunk_bytes=4096, cpu_bytes=1 << 20, disk_path=disk)
        with WorkerRuntime.start(config, metrics_port=0) as runtime:
            url = f"http://127.0.0.1:{runtime.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=30) as response:
                text = response.read().decode()
    families: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("lmprefetch_") or family.name.endswith("_created"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        families[name] = (family.type, labels)
    assert families
    return families


def test_the_metrics_reference_lists_every_family_with_its_labels(
    scraped: dict[str, tuple[str, set[str]]],
) -> None:
    rows = {
        cells[0].strip("`"): cells
        for cells in table_rows((DOCS / "operations.md").read_text())
        if cells and cells[0].startswith("`lmprefetch_")
    }
    for name, (kind, labels) in scraped.items():
        assert name in rows, f"{name} is not in the metrics reference"
        _, documented_kind, documented_labels, meaning = rows[name]
        assert documented_kind == kind, name
        for label in labels:
            assert f"`{label}`" in documented_labels, (name, label)
        assert meaning
    assert set(rows) == set(scraped), set(rows) ^ set(scraped)


def test_the_grafana_dashboard_queries_only_metrics_a_worker_serves(
    scraped: dict[str, tuple[str, set[str]]],
) -> None:
    dashboard = json.loads((DOCS / "grafana" / "lmprefetch.json").read_text())
    served = set(scraped)
    for name, (kind, _) in scraped.items():
        if kind == "histogram":
            served |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queried |= set(re.findall(r"\blmprefetch_\w+", target["expr"]))
    assert queried, "the dashboard queries nothing"
    assert queried <= served, queried - served
    # Every family a worker serves is on some panel.
    assert {n for n in served if not n.endswith(("_sum", "_count"))} - queried <= {
        "lmprefetch_lookup_latency_seconds"
    }


# -- the troubleshooting page ---------------------------------------------------------------------
def test_the_troubleshooting_page_has_a_template_per_message() -> None:
    templates = re.findall(
        r"```text\n(lmprefetch.*?)\n```", (DOCS / "troubleshooting.md").read_text()
    )
    assert len(templates) >= 30
    assert len(set(templates)) == len(templates)
    # tests/test_startup_errors.py checks every message it provokes against these.


# -- nothing outside the repository ---------------------------------------------------------------
def test_docs_and_readme_point_only_inside_the_repository() -> None:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", *DOCS.rglob("*.md")]
    for path in files:
        text = path.read_text()
        for bad in ("../shared", "shared/", "DESIGN.md", "DEFECTS.md", "DESIGN §", "/work/"):
            assert bad not in text, f"{path.relative_to(ROOT)} mentions {bad!r}"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(ROOT), f"{path.relative_to(ROOT)} links to {target}"
            assert resolved.exists(), f"{path.relative_to(ROOT)} links to missing {target}"


# -- the lookup's state table --------------------------------------------------------------------
def test_the_state_table_is_rendered_from_the_record_and_the_diagram_matches_it() -> None:
    """The state table lives in one place, the docstring of the lookup's record: the pages
    render it (mkdocstrings) instead of keeping copies, and the cancellation page's diagram
    has exactly its transitions."""
    from lmprefetch.lookup import TRANSITIONS

    for name in ("architecture.md", "cancellation.md"):
        page = (DOCS / name).read_text()
        assert "::: lmprefetch.lookup._Lookup" in page, name
        copies = [r for r in table_rows(page) if r and r[0] in ("LOADING", "HELD", "CANCELLED")]
        assert not copies, f"{name} keeps its own copy of the state table: {copies}"
    page = (DOCS / "cancellation.md").read_text()
    diagram = page.split("stateDiagram-v2", 1)[1].split("```", 1)[0]
    edges = set()
    for frm, to, event in re.findall(r"(\[\*\]|\w+) --> (\[\*\]|\w+)(?:: (\w+))?", diagram):
        if to == "[*]":
            continue  # a final state
        edges.add((None if frm == "[*]" else frm, event, to))
    assert edges == {(f and f.name, event, to.name) for f, event, to in TRANSITIONS}
