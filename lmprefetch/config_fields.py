"""The configuration's field machinery: a ``Struct``'s declarations read once, then used to
check, parse and document every field.

:func:`describe_struct` reads each field's declaration (its ``Annotated`` type, msgspec's
``Meta`` bounds and description, and the ``Meta(extra=...)`` keys below) into a
:class:`FieldSpec`; :class:`~lmprefetch.config.PrefetchConfig` checks every value with
:meth:`FieldSpec.problem` when it is built and parses text with :meth:`FieldSpec.parse`, and
the documentation's configuration reference is written from the same specs.  msgspec checks
``Meta`` bounds only when it decodes, not when a ``Struct`` is built, and says "Expected `int` >=
1" without the field's name or unit; these checks run on every path and their messages start
with the field's name.  The helpers at the end say where a bad value was set and which field a
misspelt name meant.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

__all__ = [
    "ENV_PREFIX",
    "FieldSpec",
    "GiB",
    "KiB",
    "MiB",
    "PiB",
    "TiB",
    "close_name",
    "describe_struct",
    "located",
    "shown",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB
PiB = 1024 * TiB

#: The prefix of the environment variables :meth:`PrefetchConfig.from_env
#: <lmprefetch.config.PrefetchConfig.from_env>` reads.
ENV_PREFIX = "LMPREFETCH_"


_T = TypeVar("_T")


# -- what a declaration may say -----------------------------------------------------------------
# Bounds and lengths are msgspec's own ``Meta`` constraints (``ge``, ``gt``, ``le``, ``lt``,
# ``multiple_of``, ``min_length``, ``max_length``, ``pattern``), so msgspec enforces them too
# when it decodes a config; the meaning is ``Meta(description=...)``.  What msgspec has no word
# for goes into ``Meta(extra={...})`` under these keys:
#
# * ``unit``: the unit of a number whose name does not end in ``_bytes`` or ``_s``;
# * ``one_of``: the values a text field may take;
# * ``path``: a file-system path, which may be any text but NUL (os.fsencode writes lone
#   surrogates back as the bytes they came from); other text must be valid UTF-8, because it
#   is written into keys, URLs and commands;
# * ``check``: a further rule of this one field, a function of the value returning what is
#   wrong with it (a phrase like the others: "must ..., got <value>"), or ``None``.
_EXTRA_KEYS = frozenset({"unit", "one_of", "path", "check"})


# -- the declarations, read ---------------------------------------------------------------------
@dataclass(frozen=True)
class FieldSpec:
    """One field of a config class as its declaration states it (see :func:`describe_struct`).

    Everything that checks, parses or documents a field reads it from here.
    """

    name: str
    #: ``int``, ``float``, ``bool`` or ``str`` (a ``float`` field also takes an ``int``).
    type: type
    #: ``None`` is allowed (and means "off").
    optional: bool
    default: Any
    #: What the field means (``Meta(description=...)``), in reStructuredText.
    description: str
    #: ``bytes``, ``seconds``, or ``extra["unit"]``; ``""`` for flags, names and paths.
    unit: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    multiple_of: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    one_of: tuple[str, ...] | None = None
    #: A file-system path: any text but NUL (other text must be valid UTF-8).
    path: bool = False
    check: Callable[[Any], str | None] | None = None

    @property
    def type_name(self) -> str:
        """The type as a person writes it: ``int``, ``str | None``."""
        return self.type.__name__ + (" | None" if self.optional else "")

    @property
    def env_var(self) -> str:
        """The environment variable :meth:`PrefetchConfig.from_env
        <lmprefetch.config.PrefetchConfig.from_env>` reads for this field."""
        return ENV_PREFIX + self.name.upper()

    def bounds_text(self) -> str:
        """The declared bounds in words (``at least 1 and at most 4096 layers``), or ``""``."""
        bounds = [
            (words, bound)
            for words, bound in (
                ("at least", self.ge),
                ("more than", self.gt),
                ("at most", self.le),
                ("less than", self.lt),
                ("a multiple of", self.multiple_of),
            )
            if bound is not None
        ]
        return " and ".join(
            f"{words} {_amount(bound, self.unit, with_unit=i == len(bounds) - 1)}"
            for i, (words, bound) in enumerate(bounds)
        )

    def parse(self, value: Any) -> Any:
        """``value`` as this field's type: from TOML, or from text (``"256"``, ``"true"``).

        Only the type is checked here; the value's rules are checked when the config is built.

        Raises:
            ValueError: the value cannot be read as this type; the message names the field.
        """
        if isinstance(value, str) and not self.path and not _is_utf8(value):
            # Lone surrogates: an environment variable that is not UTF-8.  msgspec would fail
            # on them with an error that names no field.
            raise ValueError(f"{self.name}: must be valid UTF-8 text, got {value!r}")
        target: Any = self.type | None if self.optional else self.type
        try:
            return msgspec.convert(value, target, strict=False)
        except msgspec.ValidationError as exc:
            reason = str(exc)  # "Expected `int`, got `str`", or "Number out of range"
            why = "" if reason.startswith("Expected") else f" ({reason[:1].lower()}{reason[1:]})"
            raise ValueError(
                f"{self.name}: expected {self.type_name}, got {type(value).__name__} "
                f"{_short(value)}{why}"
            ) from None

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` for this field (a phrase such as ``must be at least 1,
        got 0``), or ``None`` if it is a valid value."""
        if value is None:
            return None if self.optional else f"expected {self.type_name}, got None"
        if not _is_a(value, self.type):
            return f"expected {self.type_name}, got {type(value).__name__} {_short(value)}"
        if isinstance(value, int | float) and not self._within_bounds(value):
            return f"must be {self.bounds_text()}, got {value!r}"
        if isinstance(value, str):
            problem = self._text_problem(value)
            if problem is not None:
                return problem
        return None if self.check is None else self.check(value)

    def _within_bounds(self, value: float) -> bool:
        # ``not value >= bound`` rather than ``value < bound``: NaN fails every bound.
        return not (
            (self.ge is not None and not value >= self.ge)
            or (self.gt is not None and not value > self.gt)
            or (self.le is not None and not value <= self.le)
            or (self.lt is not None and not value < self.lt)
            or (self.multiple_of is not None and value % self.multiple_of != 0)
        )

    def _text_problem(self, text: str) -> str | None:
        if self.path:
            if "\x00" in text:
                return f"must not contain a NUL character, got {text!r}"
        elif not _is_utf8(text):
            return f"must be valid UTF-8 text, got {text!r}"
        if self.min_length is not None and len(text) < self.min_length:
            if self.min_length == 1:
                return f"must not be empty, got {text!r}"
            return f"must be at least {self.min_length} characters long, got {text!r}"
        if self.max_length is not None and len(text) > self.max_length:
            return f"must be at most {self.max_length} characters long, got {_short(text)}"
        if self.pattern is not None and re.search(self.pattern, text) is None:
            return f"must match the pattern {self.pattern!r}, got {text!r}"
        if self.one_of is not None and text not in self.one_of:
            return f"must be one of {self.one_of}, got {text!r}"
        return None


_TYPES: dict[type, type] = {
    msgspec.inspect.IntType: int,
    msgspec.inspect.FloatType: float,
    msgspec.inspect.BoolType: bool,
    msgspec.inspect.StrType: str,
}


def describe_struct(cls: type[msgspec.Struct]) -> tuple[FieldSpec, ...]:
    """Every field of ``cls`` as its declaration states it, in declaration order.

    Reads the fields' annotations through :func:`msgspec.inspect.type_info`, so it sees what
    msgspec sees: ``Meta`` constraints and descriptions, merged across nested ``Annotated``.

    Raises:
        TypeError: a declaration that the checks and the documentation cannot be derived from:
            a field without a default or a description, a number without both a lower and an
            upper bound or without a unit, a type other than ``int``, ``float``, ``bool`` or
            ``str`` (each optionally ``| None``), or an unknown ``Meta(extra=...)`` key.  The
            message names the field and says what to declare.
    """
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(_describe(field) for field in info.fields)


def _describe(field: msgspec.inspect.Field) -> FieldSpec:
    name = field.name
    kind, description, extra = field.type, "", dict[str, Any]()
    optional = False
    while True:  # Annotated (Metadata) and ``| None`` (a union with None), in any nesting
        if isinstance(kind, msgspec.inspect.Metadata):
            description = (kind.extra_json_schema or {}).get("description", description)
            extra |= kind.extra or {}
            kind = kind.type
        elif isinstance(kind, msgspec.inspect.UnionType):
            others = [t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(others) != 1:
                raise TypeError(f"{name}: a field is one type, optionally `| None`")
            optional, kind = True, others[0]
        else:
            break
    if type(kind) not in _TYPES:
        raise TypeError(f"{name}: a field is an int, float, bool or str (optionally `| None`)")
    base = _TYPES[type(kind)]
    if field.default is msgspec.NODEFAULT:
        raise TypeError(f"{name}: every field needs a default")
    if not description.strip():
        raise TypeError(
            f"{name}: no description; declare what it means: Annotated[{base.__name__}, "
            "Meta(description=...)]"
        )
    unknown = set(extra) - _EXTRA_KEYS
    if unknown:
        raise TypeError(f"{name}: unknown Meta(extra=...) keys {sorted(unknown)}")
    unit = str(extra.get("unit", ""))
    if not unit and base in (int, float):
        unit = "bytes" if name.endswith("_bytes") else "seconds" if name.endswith("_s") else ""
    constraints = {
        attr: getattr(kind, attr, None)
        for attr in ("ge", "gt", "le", "lt", "multiple_of", "min_length", "max_length", "pattern")
    }
    if base in (int, float):
        if constraints["ge"] is None and constraints["gt"] is None:
            raise TypeError(f"{name}: a number needs a lower bound: Meta(ge=...) or Meta(gt=...)")
        if constraints["le"] is None and constraints["lt"] is None:
            raise TypeError(
                f"{name}: a number needs an upper bound: Meta(le=...) or Meta(lt=...); far "
                "beyond any real deployment, low enough that a typo is an error"
            )
        if not unit:
            raise TypeError(
                f"{name}: a number needs a unit: name it *_bytes or *_s, or declare "
                'Meta(extra={"unit": ...})'
            )
    one_of = extra.get("one_of")
    return FieldSpec(
        name=name,
        type=base,
        optional=optional,
        default=field.default,
        description=" ".join(description.split()),
        unit=unit,
        one_of=tuple(one_of) if one_of is not None else None,
        path=bool(extra.get("path", False)),
        check=extra.get("check"),
        **constraints,
    )


# -- loading helpers ----------------------------------------------------------------------------
def located(
    build: Callable[[Mapping[str, Any]], _T], values: Mapping[str, Any], where: Mapping[str, str]
) -> _T:
    """``build(values)``, with a bad value's message saying where it was set:
    ``chunk_size: must be ..., got 0 (from LMPREFETCH_CHUNK_SIZE)``."""
    try:
        return build(values)
    except ValueError as exc:
        name = str(exc).partition(": ")[0]
        if name in where:
            raise ValueError(f"{exc} ({where[name]})") from None
        raise


def close_name(name: object, names: Iterable[str], *, prefix: str = "") -> str:
    """``; did you mean 'chunk_size'?`` for a near miss of one of ``names``, else ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name.lower(), list(names), n=1, cutoff=0.75)
    if not close:
        return ""
    return f"; did you mean {prefix + close[0].upper() if prefix else repr(close[0])}?"


def shown(name: object) -> str:
    """A name as an error message starts with it: as is if it is printable text, else its
    ``repr`` (so that a message is always one line)."""
    return name if isinstance(name, str) and name.isprintable() and name else repr(name)


def _short(value: object) -> str:
    """``repr(value)``, cut to a length that fits in a one-line message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:76] + " ..."


def _amount(value: float, unit: str, *, with_unit: bool = True) -> str:
    """A bound in words: ``4096 layers``, ``4 GiB (4294967296 bytes)``; just the number if not
    ``with_unit`` (the last of several bounds says the unit for them all)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if unit == "bytes" and value >= KiB:
        for suffix, size in (("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if value % size == 0:
                return f"{value // size} {suffix} ({value} bytes)"
    if not with_unit or not unit:
        return f"{value}"
    if unit == "seconds" and value >= 86400 and value % 86400 == 0:
        return f"{value} seconds ({value // 86400} days)"
    return f"{value} {unit}"


def _is_a(value: object, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
