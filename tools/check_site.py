"""Check the built documentation site in a real headless Chromium (``nox -s docs-browser``).

The site is checked twice, the two ways a reader opens it: served on a free loopback port
(``http``), and opened from disk (``file``: ``site/index.html``, as the README says), with every
request that would leave the machine refused.  With Playwright driving Debian's Chromium, in
each way:

* every page (each ``.html`` outside ``assets/``) loads with no console error, uncaught page
  error, failed request, HTTP error, or request for anything outside the site: the site loads
  nothing from the network (Mermaid and the search worker's shim are part of it);
* every link from one page of the site to another leads to a file that exists (from disk, a
  link to a directory would open a directory listing);
* every Mermaid diagram renders as an SVG, and is drawn whole: the SVG is no wider than the
  room the page gives it, and its own drawing (every label included) lies inside it;
* typing ``claim_ttl_s`` into the search box finds it on the configuration page;
* screenshots of the home page and of the cancellation page (its top, and its state diagram
  alone) go to ``--out``, with ``report.json``.

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
from urllib.parse import unquote

from playwright.sync_api import BrowserContext, Page, Route, sync_playwright

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODES = ("http", "file")
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
# For each rendered diagram: how much wider its SVG is than the room the page gives it, and
# how far its drawing (the bounding box of everything in it) reaches past the SVG's own box,
# in CSS pixels; more than half a pixel is a diagram cut off.
DIAGRAM_OVERFLOW = """
() => [...document.querySelectorAll('div.mermaid')].map((host, i) => {
    const svg = host.shadowRoot && host.shadowRoot.querySelector('svg');
    if (!svg) return {index: i, rendered: false};
    const room = host.parentElement.getBoundingClientRect();
    const box = svg.getBoundingClientRect();
    let drawing = box;
    try {
        const b = svg.getBBox();  // user units: map through the SVG's screen transform
        const m = svg.getScreenCTM();
        const p1 = new DOMPoint(b.x, b.y).matrixTransform(m);
        const p2 = new DOMPoint(b.x + b.width, b.y + b.height).matrixTransform(m);
        drawing = {left: p1.x, top: p1.y, right: p2.x, bottom: p2.y};
    } catch (e) {}
    return {
        index: i,
        rendered: true,
        wider_than_room: box.width - room.width,
        past_left: box.left - drawing.left,
        past_right: drawing.right - box.right,
        past_top: box.top - drawing.top,
        past_bottom: drawing.bottom - box.bottom,
    };
})
"""
OVERFLOW_TOLERANCE_PX = 0.5
# Every link of a page to another file of the site, resolved against the page.
INTERNAL_LINKS = """
(base) => [...document.querySelectorAll('a[href]')]
    .map(a => new URL(a.getAttribute('href'), location.href))
    .filter(u => u.href.startsWith(base))
    .map(u => u.origin + u.pathname)
"""


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def keep_inside(base: str, problems: list[str], route: Route) -> None:
    """Let a request for a file of the site through; refuse any other, as a problem."""
    url = route.request.url
    if url.startswith(base):
        route.continue_()
    else:
        problems.append(f"{base}: a request left the site: {url}")
        route.abort()


def pages_of(site: Path, mode: str) -> list[str]:
    """Every page's path relative to the site root (``index.html``, ``api/engine.html``, ...),
    as a URL path; over http also ``404.html``, which only a server shows (its links start at
    the server's root, so from disk it could not load its own style sheets)."""
    assets = site / "assets"
    out = []
    for p in site.rglob("*.html"):
        rel = p.relative_to(site).as_posix()
        if assets not in p.parents and (mode == "http" or rel != "404.html"):
            out.append(rel)
    return sorted(out)


def target_problem(site: Path, base: str, url: str) -> str | None:
    """Why a link to ``url`` (inside ``base``) would not open a page of the site, or None.

    Over http the server answers a directory with its ``index.html``, so only a missing file
    is a problem; from disk a directory opens as a listing, so it must be a file."""
    rel = unquote(url[len(base) :])
    path = site / rel if rel else site
    if path.is_file():
        return None
    if path.is_dir() and base.startswith("http") and (path / "index.html").is_file():
        return None
    return "a directory (a listing from disk)" if path.is_dir() else "no such file"


def check_page(
    page: Page, site: Path, base: str, path: str, problems: list[str]
) -> dict[str, Any]:
    """Load one page and check its links and diagrams; returns what the report keeps."""
    url = base + path
    response = page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
    if base.startswith("http") and (
        response is None or (response.status >= 400 and path != "404.html")
    ):
        problems.append(f"{url}: HTTP {None if response is None else response.status}")
    links = sorted(set(page.evaluate(INTERNAL_LINKS, base)))
    for link in links:
        why = target_problem(site, base, link)
        if why is not None:
            problems.append(f"{url}: the link to {link} leads to {why}")
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
        except Exception as exc:
            problems.append(f"{url}: {diagrams} Mermaid diagram(s) did not render ({exc})")
            return {"diagrams": diagrams, "links": len(links)}
        errors = page.evaluate(
            "() => [...document.querySelectorAll('div.mermaid')]"
            ".filter(h => /Syntax error|Parse error/i.test(h.shadowRoot.textContent))"
            ".length"
        )
        if errors:
            problems.append(f"{url}: {errors} Mermaid diagram(s) drawn as a syntax error")
        for d in page.evaluate(DIAGRAM_OVERFLOW):
            over = {k: v for k, v in d.items() if k not in ("index", "rendered")}
            cut = {k: round(v, 1) for k, v in over.items() if v > OVERFLOW_TOLERANCE_PX}
            if cut:
                problems.append(f"{url}: diagram {d['index'] + 1} is cut off (px: {cut})")
    return {"diagrams": diagrams, "links": len(links)}


def check_search(page: Page, base: str, problems: list[str]) -> list[str]:
    """Search from the home page; returns the result links."""
    page.goto(base + "index.html", wait_until="load", timeout=TIMEOUT_MS)
    box = page.locator("input.md-search__input")
    box.click()
    box.press_sequentially(SEARCH_TERM)  # key by key, as a person types (Material reads keyup)
    items = page.locator(".md-search-result__item")
    try:
        items.first.wait_for(timeout=TIMEOUT_MS)
    except Exception as exc:
        problems.append(f"{base}: search for {SEARCH_TERM!r}: no result ({exc})")
        return []
    links = [a.get_attribute("href") or "" for a in page.locator(".md-search-result a").all()]
    text = page.locator(".md-search-result").inner_text()
    if SEARCH_TERM not in text:
        problems.append(f"{base}: search for {SEARCH_TERM!r}: the results do not show it")
    if not any("configuration" in link for link in links):
        problems.append(f"{base}: search for {SEARCH_TERM!r}: no result on the configuration page")
    return links


def check_mode(
    context: BrowserContext, site: Path, base: str, out: Path, mode: str, problems: list[str]
) -> dict[str, Any]:
    """Every check above, with the site at ``base``; screenshots named ``{mode}-*.png``."""
    report: dict[str, Any] = {"base": base, "pages": {}}
    current = {"url": ""}
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
        lambda r: problems.append(f"{current['url']}: request failed: {r.url} ({r.failure})"),
    )
    for path in pages_of(site, mode):
        current["url"] = base + path
        before = len(problems)
        info = check_page(page, site, base, path, problems)
        report["pages"][path] = {**info, "problems": problems[before:]}

    current["url"] = f"{mode} search"
    report["search_results"] = check_search(page, base, problems)

    current["url"] = f"{mode} screenshots"
    try:
        page.goto(base + "index.html", wait_until="load", timeout=TIMEOUT_MS)
        page.screenshot(path=str(out / f"{mode}-home.png"), full_page=True)
        page.goto(base + "cancellation.html", wait_until="load", timeout=TIMEOUT_MS)
        page.screenshot(path=str(out / f"{mode}-cancellation.png"))
        page.locator("div.mermaid").first.screenshot(
            path=str(out / f"{mode}-cancellation-states.png"), timeout=TIMEOUT_MS
        )
    except Exception as exc:
        problems.append(f"{base}: screenshots: {type(exc).__name__}: {exc}".splitlines()[0])
    page.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True, help="the built site")
    parser.add_argument("--out", type=Path, required=True, help="where screenshots go")
    parser.add_argument("--chromium", required=True, help="the Chromium executable")
    parser.add_argument(
        "--mode", choices=MODES, action="append", help="http and/or file (default: both)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    site = args.site.resolve()
    modes = args.mode or list(MODES)

    handler = functools.partial(QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bases = {
        "http": f"http://127.0.0.1:{server.server_address[1]}/",
        "file": site.as_uri() + "/",
    }

    problems: list[str] = []
    report: dict[str, Any] = {"modes": {}}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS
            )
            for mode in modes:
                base = bases[mode]
                context = browser.new_context(viewport={"width": 1280, "height": 900})
                context.route("**/*", functools.partial(keep_inside, base, problems))
                context.add_init_script(OPEN_SHADOW_ROOTS)
                report["modes"][mode] = check_mode(context, site, base, args.out, mode, problems)
                context.close()
            browser.close()
    finally:
        server.shutdown()
        server.server_close()

    report["problems"] = problems
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    for mode, r in report["modes"].items():
        n_pages = len(r["pages"])
        n_diagrams = sum(p["diagrams"] for p in r["pages"].values())
        n_links = sum(p["links"] for p in r["pages"].values())
        print(
            f"{mode}: {n_pages} pages, {n_links} links, {n_diagrams} Mermaid diagrams, "
            f"search for {SEARCH_TERM!r}: {len(r['search_results'])} results ({r['base']})"
        )
    print(f"in {args.chromium}")
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"screenshots and report.json in {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
