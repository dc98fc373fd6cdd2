"""MkDocs hooks of lmprefetch's documentation site (``hooks:`` in ``mkdocs.yml``).

The configuration reference is generated from the code, so it cannot drift from it: the page
``docs/configuration.md`` holds the marker :data:`CONFIG_MARKER`, which
:func:`on_page_markdown` replaces with :func:`render_config_reference` — one table per section
of :class:`~lmprefetch.config.PrefetchConfig`, a row per field with its type, default, allowed
values, unit, environment variable and meaning, all read off the field's declaration
(:func:`lmprefetch.config.describe_fields`).
``docs/vllm.md`` gets the table of ``kv_connector_extra_config`` options the same way
(:data:`CONNECTOR_MARKER`, :func:`render_connector_options`).

A field without a description, a number without bounds or unit (both already fail when
``lmprefetch.config`` is imported) or a page without the marker fails the build: the generator
raises instead of writing a row that says nothing.
``tests/test_docs.py`` runs the same generator.

A page with a Mermaid diagram gets a ``<script>`` for the copy of Mermaid in the site
(:data:`MERMAID_JS`, :func:`on_post_page`): Material loads Mermaid from a CDN only when no
``mermaid`` is defined, so the diagrams render from disk with no network, and the pages
without a diagram do not load its 3.5 MB.

This module imports nothing from MkDocs, so the tests can use it without the ``docs`` extra.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmprefetch.config import FieldSpec

CONFIG_MARKER = "<!-- lmprefetch: config-fields -->"
#: Mermaid in the built site (``docs/javascripts/vendor/``; ``tools/vendor_js.py`` fetches it).
MERMAID_JS = "javascripts/vendor/mermaid.min.js"
#: What a rendered page holds where a Mermaid diagram is (pymdownx.superfences' fence).
MERMAID_FENCE = '<pre class="mermaid">'

CONNECTOR_MARKER = "<!-- lmprefetch: connector-options -->"

_SECTION = re.compile(r"^\s*# -- (?P<name>.+?) -+\s*$")
_BINARY = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclass(frozen=True)
class Field:
    """One documented field of a config class: its declaration (``spec``) and its section."""

    spec: FieldSpec
    section: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def annotation(self) -> str:
        return self.spec.type_name

    @property
    def default(self) -> Any:
        return self.spec.default

    @property
    def unit(self) -> str:
        return self.spec.unit

    @property
    def meaning(self) -> str:
        return self.spec.description

    @property
    def env_var(self) -> str:
        return self.spec.env_var


def config_fields(cls: type | None = None) -> list[Field]:
    """Every field of ``cls`` (default: ``PrefetchConfig``) as declared, with its section.

    Type, bounds, unit and meaning come from the field's declaration
    (:func:`lmprefetch.config.describe_fields`); the ``# -- name ---`` line above a group of
    fields names its section.

    Raises:
        TypeError: a declaration without a description, or a number without bounds or unit.
    """
    from lmprefetch.config import PrefetchConfig, describe_fields

    if cls is None:
        cls = PrefetchConfig
    specs = describe_fields(cls)
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    (class_def,) = ast.parse("\n".join(lines)).body
    assert isinstance(class_def, ast.ClassDef)
    sections: dict[str, str] = {}
    for node in class_def.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            sections[node.target.id] = next(
                (
                    m.group("name")
                    for above in reversed(lines[: node.lineno - 1])
                    if (m := _SECTION.match(above))
                ),
                "",
            )
    return [Field(spec, sections.get(spec.name, "")) for spec in specs]


def format_amount(value: float, unit: str) -> str:
    """A bound as the reference shows it: ``4 GiB`` for bytes, else the number."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if unit == "bytes":
        for suffix, size in _BINARY:
            if value >= size and value % size == 0:
                return f"{value // size} {suffix}"
    if unit == "seconds" and value >= 86400 and value % 86400 == 0:
        return f"{value} ({value // 86400} days)"
    return f"{value}"


def allowed_values(field: Field) -> str:
    """The values a field may take, from its declaration: ``1 … 4096``, ``> 0 … 31536000``,
    ``one of ...``; ``—`` when any value of its type will do."""
    spec = field.spec
    if spec.one_of is not None:
        return "one of " + ", ".join(f"`{v}`" for v in spec.one_of)
    if spec.type in (int, float):
        low = (
            format_amount(spec.ge, spec.unit)
            if spec.ge is not None
            else f"> {format_amount(spec.gt, spec.unit)}"
            if spec.gt is not None
            else ""
        )
        high = (
            format_amount(spec.le, spec.unit)
            if spec.le is not None
            else f"< {format_amount(spec.lt, spec.unit)}"
            if spec.lt is not None
            else ""
        )
        return f"{low} … {high}"
    if spec.min_length:
        return "not empty"
    return "—"


def format_default(field: Field) -> str:
    """The default as a TOML value, with a readable size for bytes."""
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if field.unit == "bytes" and isinstance(value, int):
        for suffix, size in _BINARY:
            if value >= size and value % size == 0:
                return f"`{value}` ({value // size} {suffix})"
    return f"`{value}`"


def _markdown_meaning(text: str) -> str:
    # ``x`` (reST literal) -> `x` (Markdown code); pipes would end the table cell.
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", r"\|")


def render_config_reference(cls: type | None = None) -> str:
    """The Markdown tables of the configuration reference."""
    out: list[str] = []
    section = None
    for field in config_fields(cls):
        if field.section != section:
            section = field.section
            title = section[:1].upper() + section[1:] if section else "Other"
            out += [
                "",
                f"### {title}",
                "",
                "| field | type | default | allowed | unit | meaning |",
                "|---|---|---|---|---|---|",
            ]
        out.append(
            f'| <span id="{field.name}"></span>`{field.name}`<br>`{field.env_var}` '
            f"| `{field.annotation}` | {format_default(field)} | {allowed_values(field)} "
            f"| {field.unit or '—'} | {_markdown_meaning(field.meaning)} |"
        )
    return "\n".join(out).strip() + "\n"


#: What the vLLM connector does with a field the user leaves out of
#: ``kv_connector_extra_config`` (lmprefetch/integration/vllm/worker.py, ``_finalize_config``).
DERIVED_BY_CONNECTOR = {
    "chunk_size": "256, rounded up to a multiple of every KV cache group's block size",
    "model_name": "the model path (`@` replaced by `_`)",
    "kv_dtype": "the KV cache tensors' dtype",
    "chunk_bytes": "exactly one chunk's KV on the rank",
    "num_layers": "the number of KV cache layers (layerwise mode)",
}


def render_connector_options(cls: type | None = None) -> str:
    """The table of ``kv_connector_extra_config`` options: ``config_file``, then every field."""
    out = [
        "| option | default | unit | meaning |",
        "|---|---|---|---|",
        "| `config_file` | unset | — | A TOML file of these fields (see "
        "[Configuration](configuration.md)), read first; the other options override it. |",
    ]
    for field in config_fields(cls):
        default = format_default(field)
        if field.name in DERIVED_BY_CONNECTOR:
            default = f"derived: {DERIVED_BY_CONNECTOR[field.name]}"
        out.append(
            f"| [`{field.name}`](configuration.md#{field.name}) | {default} "
            f"| {field.unit or '—'} | {_markdown_meaning(field.meaning)} |"
        )
    return "\n".join(out) + "\n"


# -- MkDocs hooks ----------------------------------------------------------------------------
_GENERATED = {
    "configuration.md": (CONFIG_MARKER, render_config_reference),
    "vllm.md": (CONNECTOR_MARKER, render_connector_options),
}


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    generated = _GENERATED.get(page.file.src_uri)
    if generated is None:
        return markdown
    marker, render = generated
    if markdown.count(marker) != 1:
        raise ValueError(f"{page.file.src_uri}: expected the marker {marker!r} once")
    return markdown.replace(marker, render())


def relative_url(target: str, page_url: str) -> str:
    """``target`` (a path from the site root) as a link from the page at ``page_url`` (a path
    from the site root, such as ``api/engine.html``; the offline build has no directory URLs).
    """
    return "../" * page_url.count("/") + target


def add_mermaid_script(html: str, page_url: str) -> str:
    """``html`` with a ``<script>`` for :data:`MERMAID_JS` at the end of its ``<head>`` when it
    has a Mermaid diagram, else unchanged.  In the head it has run before any of Material's
    scripts, whenever those look for ``mermaid``."""
    if MERMAID_FENCE not in html:
        return html
    before, head_end, after = html.partition("</head>")
    if not head_end:
        raise ValueError(f"{page_url}: a Mermaid diagram but no </head>")
    script = f'<script src="{relative_url(MERMAID_JS, page_url)}"></script>\n'
    return before + script + head_end + after


def on_post_page(output: str, page: Any, **_: Any) -> str:
    return add_mermaid_script(output, page.url)
