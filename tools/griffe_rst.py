"""A Griffe extension for the API reference: lmprefetch's docstrings use a few reST habits
(Sphinx roles such as ``:class:`~lmprefetch.memory.Buffer```, double-backquote literals,
``::`` before a literal block, ``\\ `` escapes) inside Google-style sections.  MkDocs renders
Markdown, so this rewrites them, when the package is loaded, into Markdown code spans:

* ``:role:`~a.b.Name``` -> ```Name```, ``:role:`a.b.Name``` -> ```a.b.Name```;
* double-backquoted literals -> single-backquoted code;
* a line ending in ``::`` -> ``:`` (the indented block after it is a code block in Markdown
  too); the reST escaped space ``\\ `` is dropped.

Nothing is imported: Griffe reads the sources, so the vLLM connector (which imports vLLM and
torch) renders without either installed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj):`(?P<target>[^`]+)`")
_LITERAL = re.compile(r"``(?P<text>[^`\n]+?)``")
_DOUBLE_COLON = re.compile(r"(?<=\S)::$", re.MULTILINE)
_LONE_DOUBLE_COLON = re.compile(r"^\s*::$\n?", re.MULTILINE)


def _role(m: re.Match[str]) -> str:
    target = m.group("target")
    if "<" in target and target.endswith(">"):  # :class:`text <target>`
        return f"`{target[: target.index('<')].strip()}`"
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target.lstrip('.')}`"


def markdown_docstring(text: str) -> str:
    """``text`` with lmprefetch's reST habits turned into Markdown."""
    text = _ROLE.sub(_role, text)
    text = _LITERAL.sub(lambda m: f"`{m.group('text')}`", text)
    text = _LONE_DOUBLE_COLON.sub("", text)
    text = _DOUBLE_COLON.sub(":", text)
    return text.replace("\\ ", "")


class ReSTToMarkdown(griffe.Extension):
    """Rewrite every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: Any, **kwargs: Any) -> None:
        seen: set[int] = set()
        stack: list[Any] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_alias or id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = markdown_docstring(obj.docstring.value)
            stack.extend(obj.members.values())
