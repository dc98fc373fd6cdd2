"""Check the built documentation site in a real headless Chromium (``nox -s docs-browser``).

Serves the site on a free loopback port and, with Playwright driving Debian's Chromium:

* loads every page (each ``index.html``, and ``404.html``) and fails on any console error,
  uncaught page error, failed request, HTTP error, or request leaving the machine (the site
  must load nothing from the network, with one exception: Mermaid, which Material fetches from
  a CDN and which this check serves from a local copy);
* checks that every Mermaid diagram rendered as an SVG;
* types ``claim_ttl_s`` into the search box and expects a result on the configuration page;
* writes screenshots of the home page and of the cancellation page (its top, and its state
  diagram alone) to ``--out``, with ``report.json``.

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, Route, sync_playwright

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SEARCH_TERM = "claim_ttl_s"
TIMEOUT_MS = 30_000
# Material attaches each rendered diagram in a closed shadow root; open it so the check can
# see the SVG.  Nothing else on the page changes.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
    return attach.call(this, { ...init, mode: "open" });
};
"""


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def pages_of(site: Path) -> list[str]:
    """Every page's path relative to the site root, as a URL path."""
    out = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        out.append("" if rel == "." else rel + "/")
    if (site / "404.html").exists():
        out.append("404.html")
    return out


def check_page(page: Page, url: str, problems: list[str]) -> int:
    """Load one page; returns the number of Mermaid diagrams on it (all must render)."""
    response = page.goto(url, wait_until="networkidle", timeout=TIMEOUT_MS)
    if response is None or (response.status >= 400 and not url.endswith("404.html")):
        problems.append(f"{url}: HTTP {None if response is None else response.status}")
    diagrams = page.locator(".mermaid").count()
    if diagrams:
        # Material swaps each ``pre.mermaid`` for a ``div.mermaid`` whose shadow root holds
        # the SVG (opened by OPEN_SHADOW_ROOTS); Mermaid draws a syntax error as an SVG too.
        try:
            page.wait_for_function(
                "n => { const hosts = [...document.querySelectorAll('div.mermaid')];"
                " return hosts.length === n && hosts.every(h => h.shadowRoot &&"
                " h.shadowRoot.querySelector('svg')); }",
                arg=diagrams,
                timeout=TIMEOUT_MS,
            )
            errors = page.evaluate(
                "() => [...document.querySelectorAll('div.mermaid')]"
                ".filter(h => /Syntax error|Parse error/i.test(h.shadowRoot.textContent))"
                ".length"
            )
            if errors:
                problems.append(f"{url}: {errors} Mermaid diagram(s) drawn as a syntax error")
        except Exception as exc:
            problems.append(f"{url}: {diagrams} Mermaid diagram(s) did not render ({exc})")
    return diagrams


def check_search(page: Page, base: str, problems: list[str]) -> list[str]:
    """Search from the home page; returns the result links."""
    page.goto(base, wait_until="networkidle", timeout=TIMEOUT_MS)
    box = page.locator("input.md-search__input")
    box.click()
    box.press_sequentially(SEARCH_TERM)  # key by key, as a person types (Material reads keyup)
    items = page.locator(".md-search-result__item")
    try:
        items.first.wait_for(timeout=TIMEOUT_MS)
    except Exception as exc:
        problems.append(f"search for {SEARCH_TERM!r}: no result ({exc})")
        return []
    links = [a.get_attribute("href") or "" for a in page.locator(".md-search-result a").all()]
    text = page.locator(".md-search-result").inner_text()
    if SEARCH_TERM not in text:
        problems.append(f"search for {SEARCH_TERM!r}: the results do not show it")
    if not any("configuration/" in link for link in links):
        problems.append(f"search for {SEARCH_TERM!r}: no result on the configuration page")
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True, help="the built site")
    parser.add_argument("--out", type=Path, required=True, help="where screenshots go")
    parser.add_argument("--chromium", required=True, help="the Chromium executable")
    parser.add_argument("--mermaid", type=Path, required=True, help="a local mermaid.min.js")
    parser.add_argument("--mermaid-url", required=True, help="the address Material loads")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    handler = functools.partial(QuietHandler, directory=str(args.site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    mermaid_js = args.mermaid.read_bytes()

    problems: list[str] = []
    report: dict[str, Any] = {"base": base, "pages": {}}
    current = {"url": ""}

    def route(route: Route) -> None:
        url = route.request.url
        if url.startswith(base):
            route.continue_()
        elif url == args.mermaid_url:
            route.fulfill(body=mermaid_js, content_type="application/javascript")
        else:
            problems.append(f"{current['url']}: a request left the machine: {url}")
            route.abort()

    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS
            )
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.route("**/*", route)
            context.add_init_script(OPEN_SHADOW_ROOTS)
            page = context.new_page()
            page.on(
                "console",
                lambda m: problems.append(f"{current['url']}: console {m.type}: {m.text}")
                if m.type == "error"
                else None,
            )
            page.on("pageerror", lambda e: problems.append(f"{current['url']}: page error: {e}"))
            page.on(
                "requestfailed",
                lambda r: problems.append(
                    f"{current['url']}: request failed: {r.url} ({r.failure})"
                ),
            )

            for path in pages_of(args.site):
                current["url"] = url = base + path
                before = len(problems)
                diagrams = check_page(page, url, problems)
                report["pages"][path or "/"] = {
                    "diagrams": diagrams,
                    "problems": problems[before:],
                }

            current["url"] = "search"
            report["search_results"] = check_search(page, base, problems)

            current["url"] = "screenshots"
            page.goto(base, wait_until="networkidle")
            page.screenshot(path=str(args.out / "home.png"))
            page.goto(base + "cancellation/", wait_until="networkidle")
            page.screenshot(path=str(args.out / "cancellation.png"))
            page.locator("div.mermaid").first.screenshot(
                path=str(args.out / "cancellation-states.png")
            )
            browser.close()
    finally:
        server.shutdown()
        server.server_close()

    report["problems"] = problems
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    n_pages = len(report["pages"])
    n_diagrams = sum(p["diagrams"] for p in report["pages"].values())
    print(f"checked {n_pages} pages ({n_diagrams} Mermaid diagrams) in {args.chromium}")
    print(f"search for {SEARCH_TERM!r}: {len(report['search_results'])} results")
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"screenshots and report.json in {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
