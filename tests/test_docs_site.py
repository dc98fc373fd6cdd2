"""The documentation site works opened from disk with no network: every link of a page leads
to a file, the diagrams' Mermaid and the search worker's shim are part of the site, and nothing
is loaded from elsewhere.

The built site is checked statically here (when MkDocs is installed: the ``docs`` extra); ``nox
-s docs-browser`` opens it in Chromium, over http and from disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "docs" / "javascripts" / "vendor"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hooks = _load("mkdocs_hooks")
vendor_js = _load("vendor_js")


def test_the_vendored_scripts_are_the_ones_their_versions_file_names() -> None:
    """A vendored script that was edited, truncated or swapped no longer matches the sha256
    ``tools/vendor_js.py`` wrote when it fetched it."""
    rows = [
        line.split()
        for line in (VENDOR / "VERSIONS.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert {row[2] for row in rows} == set(vendor_js.VENDORED)
    for package, version, name, sha256 in rows:
        assert vendor_js.VENDORED[name][:2] == (package, version)
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == sha256, name
        assert (VENDOR / f"{package}.LICENSE.txt").is_file()
    assert (VENDOR / hooks.MERMAID_JS.rsplit("/", 1)[1]).is_file()


@pytest.mark.parametrize(
    ("page_url", "src"),
    [
        ("index.html", "javascripts/vendor/mermaid.min.js"),
        ("api/engine.html", "../javascripts/vendor/mermaid.min.js"),
        ("a/b/c.html", "../../javascripts/vendor/mermaid.min.js"),
    ],
)
def test_a_page_with_a_diagram_loads_mermaid_from_the_site(page_url: str, src: str) -> None:
    html = '<html><head><title>t</title></head><body><pre class="mermaid">x</pre></body></html>'
    out = hooks.add_mermaid_script(html, page_url)
    head = out.split("</head>")[0]
    assert head.endswith(f'<script src="{src}"></script>\n')
    assert out.count("<script") == 1


def test_a_page_without_a_diagram_is_left_alone() -> None:
    html = "<html><head></head><body><pre><code>mermaid</code></pre></body></html>"
    assert hooks.add_mermaid_script(html, "index.html") == html


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("MkDocs is not installed (the docs extra)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def _pages(site: Path) -> list[Path]:
    # 404.html is shown by a server only (its links start at the server's root).
    return [
        p
        for p in site.rglob("*.html")
        if site / "assets" not in p.parents and p.name != "404.html"
    ]


_REF = re.compile(r'<(a|link|script|img)\b[^>]*?\b(?:href|src)="([^"]+)"')


def test_every_reference_of_every_page_leads_to_a_file_of_the_site(site: Path) -> None:
    """From disk, a link to a directory opens a listing and an asset on another host needs
    the network: every link, style sheet, script and image must be a file of the site (a
    link to another web site excepted)."""
    pages = _pages(site)
    assert len(pages) > 10
    problems = []
    for page in pages:
        for tag, ref in _REF.findall(page.read_text()):
            external = re.match(r"([a-z]+:)?//", ref) is not None or ref.startswith("mailto:")
            if external and tag == "a":
                continue
            target = ref.split("#", 1)[0].split("?", 1)[0]
            if not external and not target:
                continue  # a link within the page
            if external or not (page.parent / target).resolve().is_file():
                problems.append(f"{page.relative_to(site)}: <{tag}> {ref}")
    assert problems == []


def test_search_works_without_a_server(site: Path) -> None:
    """From disk the search index is a script (the offline plugin), and the worker that
    searches it runs through the iframe-worker shim, which every page loads first."""
    assert (site / "search" / "search_index.js").is_file()
    for page in _pages(site):
        scripts = re.findall(r'<script src="([^"]+)"', page.read_text())
        assert scripts and scripts[0].endswith("javascripts/vendor/iframe-worker-shim.js"), page


def test_pages_with_a_diagram_and_only_those_load_mermaid(site: Path) -> None:
    with_diagram = 0
    for page in _pages(site):
        html = page.read_text()
        loads = "javascripts/vendor/mermaid.min.js" in html
        has = '<pre class="mermaid">' in html
        assert loads == has, page.relative_to(site)
        with_diagram += has
    assert with_diagram >= 2  # the home page and the cancellation page
