"""MkDocs hooks of lmprefetch's documentation site (``hooks:`` in ``mkdocs.yml``).

The configuration reference is generated from the code, so it cannot drift from it: the page
``docs/configuration.md`` holds the marker :data:`CONFIG_MARKER`, which
:func:`on_page_markdown` replaces with :func:`render_config_reference` — one table per section
of :class:`~lmprefetch.config.PrefetchConfig`, a row per field with its type (as annotated),
default (read off the class), unit, environment variable and meaning (its ``#:`` comment).
``docs/vllm.md`` gets the table of ``kv_connector_extra_config`` options the same way
(:data:`CONNECTOR_MARKER`, :func:`render_connector_options`).

A field without a ``#:`` comment, a number without a known unit or a page without the marker
fails the build: the generator raises instead of writing a row that says nothing.
``tests/test_docs.py`` runs the same generator.

This module imports nothing from MkDocs, so the tests can use it without the ``docs`` extra.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any

CONFIG_MARKER = "<!-- lmprefetch: config-fields -->"
CONNECTOR_MARKER = "<!-- lmprefetch: connector-options -->"
ENV_PREFIX = "LMPREFETCH_"

#: Units of the numeric fields whose name does not say it (``*_bytes`` are bytes and ``*_s``
#: seconds, by the convention of ``lmprefetch/config.py``).
UNITS = {
    "chunk_size": "tokens",
    "num_layers": "layers",
    "disk_read_threads": "threads",
    "redis_threads": "threads",
    "disk_write_queue": "chunks",
    "redis_write_queue": "chunks",
    "socket_hwm": "messages",
    "kv_events_max_pending": "events",
}

_SECTION = re.compile(r"^\s*# -- (?P<name>.+?) -+\s*$")
_BINARY = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclass(frozen=True)
class Field:
    """One documented field of a config class."""

    name: str
    section: str
    annotation: str
    default: Any
    unit: str
    meaning: str

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


def unit_of(name: str, annotation: str) -> str:
    """The unit of a field, ``""`` for one that has none (a flag, a name, a path)."""
    if name in UNITS:
        return UNITS[name]
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "seconds"
    if annotation in ("int", "float"):
        raise ValueError(
            f"{name}: a number without a known unit; name it *_bytes or *_s, or add it to "
            "UNITS in tools/mkdocs_hooks.py"
        )
    return ""


def config_fields(cls: type | None = None) -> list[Field]:
    """Every field of ``cls`` (default: ``PrefetchConfig``) with its ``#:`` comment.

    The comment lines directly above a field are its meaning; the ``# -- name ---`` line above
    a group of fields names its section.

    Raises:
        ValueError: a field has no ``#:`` comment, or is a number without a known unit.
    """
    import msgspec

    if cls is None:
        from lmprefetch.config import PrefetchConfig

        cls = PrefetchConfig
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    lines = source.splitlines()
    (class_def,) = ast.parse(source).body
    assert isinstance(class_def, ast.ClassDef)
    defaults = {f.name: f.default for f in msgspec.structs.fields(cls)}

    fields: list[Field] = []
    for node in class_def.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        comment: list[str] = []
        row = node.lineno - 2  # the line above the field (0-based)
        while row >= 0 and lines[row].strip().startswith("#:"):
            comment.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        if not comment:
            raise ValueError(
                f"{name}: no '#:' comment above the field in {cls.__qualname__}; its meaning "
                "is what the configuration reference shows"
            )
        section = ""
        for above in reversed(lines[: node.lineno - 1]):
            m = _SECTION.match(above)
            if m:
                section = m.group("name")
                break
        annotation = ast.unparse(node.annotation)
        fields.append(
            Field(
                name=name,
                section=section,
                annotation=annotation,
                default=defaults[name],
                unit=unit_of(name, annotation),
                meaning=" ".join(comment),
            )
        )
    missing = set(defaults) - {f.name for f in fields}
    if missing:  # pragma: no cover - a field declared some other way
        raise ValueError(f"{sorted(missing)}: fields the generator could not read")
    return fields


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
    from lmprefetch.config import KV_DTYPES

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
                "| field | type | default | unit | meaning |",
                "|---|---|---|---|---|",
            ]
        meaning = _markdown_meaning(field.meaning)
        if field.name == "kv_dtype":
            meaning += " One of " + ", ".join(f"`{d}`" for d in KV_DTYPES) + "."
        out.append(
            f'| <span id="{field.name}"></span>`{field.name}`<br>`{field.env_var}` '
            f"| `{field.annotation}` | {format_default(field)} | {field.unit or '—'} "
            f"| {meaning} |"
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
