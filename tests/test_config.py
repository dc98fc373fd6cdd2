"""PrefetchConfig: defaults, validation naming the field, dict / TOML / env loading."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from lmprefetch import PrefetchConfig
from lmprefetch.config import FieldSpec, describe_fields


def test_defaults_are_a_working_cpu_only_setup() -> None:
    c = PrefetchConfig()
    assert c.chunk_size == 256
    assert c.cpu_bytes == 1 << 30
    assert c.chunk_bytes == 2 << 20
    assert c.disk_path is None and c.disk_bytes == 16 << 30
    assert c.redis_url is None
    assert c.lookup_timeout_s == 3.0 and c.claim_ttl_s == 30.0
    assert c.hash_algorithm == "blake2b"
    assert c.keys_per_chunk == 1 and c.arena_slots == 512
    assert c.arena_prefault_bytes == 1 << 30  # the whole default arena


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_size", 0),
        ("chunk_size", "x"),
        ("hash_algorithm", "md5"),
        ("kv_dtype", "float64x"),
        ("num_layers", 0),
        ("lookup_timeout_s", 0),
        ("claim_ttl_s", -1.0),
        ("cpu_bytes", 10),
        ("chunk_bytes", 0),
        ("disk_path", ""),
        ("redis_url", "http://localhost:6379"),
        ("model_name", "a@b"),
        ("buffer_backend", "cuda"),
        ("disk_read_threads", 0),
        ("arena_prefault_bytes", -1),
        ("save_partial_chunks", "maybe"),
        ("kv_events", "sometimes"),
        ("kv_events_max_pending", 0),
        ("kv_events_max_pending", "many"),
    ],
)
def test_bad_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        PrefetchConfig.from_dict({field: value})


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ValueError, match="^chunk_size: "):
        PrefetchConfig(chunk_size=-1)
    with pytest.raises(ValueError, match="^chunk_bytes: "):
        PrefetchConfig(layerwise=True, num_layers=3, chunk_bytes=1000)


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValueError, match="^chunk_sise: unknown"):
        PrefetchConfig.from_dict({"chunk_sise": 4})


def test_from_dict_accepts_strings_for_numbers() -> None:
    c = PrefetchConfig.from_dict({"chunk_size": "128", "layerwise": "true", "num_layers": "4"})
    assert c.chunk_size == 128 and c.layerwise and c.num_layers == 4


def test_from_file_top_level_and_table(tmp_path: Path) -> None:
    p = tmp_path / "a.toml"
    p.write_text('chunk_size = 64\ndisk_path = "/tmp/x"\n')
    assert PrefetchConfig.from_file(p).chunk_size == 64
    p.write_text("[lmprefetch]\nchunk_size = 32\n")
    assert PrefetchConfig.from_file(p).chunk_size == 32
    p.write_text("chunk_size = \n")
    with pytest.raises(ValueError, match="TOML"):
        PrefetchConfig.from_file(p)
    p.write_text("chunk_size = -3\n")
    with pytest.raises(ValueError, match="^chunk_size: "):
        PrefetchConfig.from_file(p)


def test_from_env(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("chunk_size = 64\nmodel_name = 'm'\n")
    env = {"LMPREFETCH_CONFIG": str(p), "LMPREFETCH_CHUNK_SIZE": "16", "LMPREFETCH_DISK_PATH": ""}
    c = PrefetchConfig.from_env(env)
    assert c.chunk_size == 16 and c.model_name == "m" and c.disk_path is None


def test_replace_validates() -> None:
    c = PrefetchConfig()
    assert c.replace(chunk_size=8).chunk_size == 8
    with pytest.raises(ValueError, match="^chunk_size: "):
        c.replace(chunk_size=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_bytes", 99999999999999999999),
        ("arena_prefault_bytes", 1 << 49),
        ("chunk_size", 1 << 40),
        ("disk_bytes", 1 << 70),
        ("socket_hwm", 1 << 31),
        ("max_message_bytes", 1 << 31),
        ("disk_read_threads", 100_000),
        ("kv_events_max_pending", (1 << 24) + 1),
        ("lookup_timeout_s", 1e12),
        ("claim_ttl_s", float("inf")),
        ("tier_timeout_s", float("nan")),
    ],
)
def test_values_beyond_sane_bounds_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        PrefetchConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        PrefetchConfig.from_dict({field: str(value)})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mooncake_master", "127.0.0.1", "must be host:port"),
        ("mooncake_master", "127.0.0.1:0", "must be host:port"),
        ("mooncake_master", "127.0.0.1:65536", "must be host:port"),
        ("mooncake_master", "a host:50051", "must be host:port"),
        ("mooncake_master", "http://h:1", "must be host:port"),
        ("mooncake_segment_bytes", 1, "must be 0 .* or at least 16777216"),
        ("mooncake_segment_bytes", (16 << 20) - 1, "must be 0 .* or at least 16777216"),
        ("mooncake_segment_bytes", -1, "must be at least 0"),
        ("mooncake_timeout_s", 10.5, "must be more than 0 and at most 10 seconds"),
        ("mooncake_timeout_s", 0, "must be more than 0"),
        ("mooncake_protocol", "udp", "must be one of"),
        ("mooncake_metadata_server", "", "must not be empty"),
        ("mooncake_metadata_server", "http://h:1/ metadata", "must not contain spaces"),
        ("mooncake_local_hostname", "10.0.0.1\n", "must not contain spaces"),
    ],
)
def test_mooncake_fields_name_themselves_and_say_the_rule(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}: {message}"):
        PrefetchConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"^{field}: {message}"):
        PrefetchConfig.from_env({"LMPREFETCH_" + field.upper(): str(value)})


def test_mooncake_fields_accept_what_mooncake_takes() -> None:
    c = PrefetchConfig(
        mooncake_master="[::1]:50051",
        mooncake_segment_bytes=0,  # the standalone-store deployment: no memory given
        mooncake_timeout_s=10,
        mooncake_protocol="rdma",
    )
    assert c.mooncake_segment_bytes == 0 and c.mooncake_timeout_s == 10
    assert PrefetchConfig(mooncake_segment_bytes=16 << 20).mooncake_segment_bytes == 16 << 20
    assert PrefetchConfig.from_env({"LMPREFETCH_MOONCAKE_MASTER": "h:1"}).mooncake_master == "h:1"
    # An empty variable means unset: the tier is off.
    assert PrefetchConfig.from_env({"LMPREFETCH_MOONCAKE_MASTER": ""}).mooncake_master is None
    defaults = PrefetchConfig()
    assert defaults.mooncake_master is None
    assert defaults.mooncake_segment_bytes == 1 << 30 and defaults.mooncake_timeout_s == 1.0


def test_unknown_environment_variables_are_rejected_like_unknown_keys() -> None:
    with pytest.raises(ValueError, match="^LMPREFETCH_CHUNKSIZE: unknown variable"):
        PrefetchConfig.from_env({"LMPREFETCH_CHUNKSIZE": "16"})
    # Other prefixes are none of our business; a known name still works.
    cfg = PrefetchConfig.from_env({"LMPREFETCHER_X": "1", "LMPREFETCH_CHUNK_SIZE": "16"})
    assert cfg.chunk_size == 16


def test_config_file_that_cannot_be_read_is_a_value_error_and_an_os_error(
    tmp_path: Path,
) -> None:
    from lmprefetch.config import ConfigFileError

    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigFileError, match="missing.toml: config file not found") as caught:
        PrefetchConfig.from_file(missing)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, OSError)
    assert caught.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="is a directory"):
        PrefetchConfig.from_file(tmp_path)


# -- found by fuzzing (tests/test_fuzz_config_cli.py) ------------------------------------------
def test_a_toml_file_nested_too_deeply_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    """tomllib is recursive: a few kilobytes of ``[[[…]]]`` raised RecursionError, which
    ``lmprefetch worker --config`` printed as a traceback."""
    p = tmp_path / "deep.toml"
    for doc in (
        "chunk_size = " + "[" * 3000 + "]" * 3000,
        "x = " + "{a = " * 3000 + "1" + "}" * 3000,
    ):
        p.write_text(doc)
        with pytest.raises(ValueError, match=r"deep\.toml: not a valid TOML file: .*too deeply"):
            PrefetchConfig.from_file(p)


@pytest.mark.parametrize("field", ["chunk_size", "lookup_timeout_s", "layerwise", "model_name"])
def test_an_environment_variable_that_is_not_utf8_names_its_field(field: str) -> None:
    """Python decodes a variable that is not UTF-8 with lone surrogates; msgspec then failed
    with an error naming no field (numbers), or the value was accepted and every store raised
    UnicodeEncodeError later (model_name: it goes into keys and file names)."""
    not_utf8 = b"4\xff".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match=rf"^{field}: must be valid UTF-8 text"):
        PrefetchConfig.from_env({f"LMPREFETCH_{field.upper()}": not_utf8})


def test_text_fields_that_cannot_be_written_name_the_field() -> None:
    with pytest.raises(ValueError, match="^model_name: must be valid UTF-8 text"):
        PrefetchConfig(model_name="m\udcff")
    with pytest.raises(ValueError, match="^redis_url: must be valid UTF-8 text"):
        PrefetchConfig(redis_url="redis://h\udcff:1")
    with pytest.raises(ValueError, match="^disk_path: must not contain a NUL character"):
        PrefetchConfig(disk_path="/tmp/a\x00b")
    # A path may be any bytes but NUL (os.fsencode turns the surrogates back into them).
    assert PrefetchConfig(disk_path="/tmp/\udcff").disk_path == "/tmp/\udcff"


def test_names_that_are_not_printable_are_quoted_so_a_message_is_one_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"^'a\\nb': unknown PrefetchConfig field") as caught:
        PrefetchConfig.from_dict({"a\nb": 1})
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"^'LMPREFETCH_\\x1e': unknown variable"):
        PrefetchConfig.from_env({"LMPREFETCH_\x1e": "1"})
    with pytest.raises(ValueError, match=r"^'a\\x00b': not a usable file name"):
        PrefetchConfig.from_file("a\x00b")
    p = tmp_path / "line\nbreak.toml"
    with pytest.raises(ValueError, match=r"break\.toml': config file not found") as caught:
        PrefetchConfig.from_file(p)
    assert "\n" not in str(caught.value)


# -- every field's rules are its declaration -------------------------------------------------
def _out_of_bounds(spec: FieldSpec) -> list[float]:
    """Values just past each declared bound of a numeric field."""
    step = 1 if spec.type is int else 1e-9
    values: list[float] = []
    if spec.ge is not None:
        values.append(spec.ge - step)
    if spec.gt is not None:
        values.append(spec.gt)
    if spec.le is not None:
        values.append(spec.le + step if spec.type is int else spec.le * (1 + 1e-9))
    if spec.lt is not None:
        values.append(spec.lt)
    return values


NUMERIC = [s for s in describe_fields() if s.type in (int, float)]
#: Fields whose lower bound is only the floor of a rule with another field: a value under it is
#: refused with the rule, which is what to fix (``cpu_bytes=-5`` said "at least 2").
STATED_AS_A_RULE = {"cpu_bytes": r"must hold at least two chunks of chunk_bytes \(2097152\)"}


def test_every_field_is_declared_with_a_meaning_and_every_number_with_bounds_and_unit() -> None:
    specs = describe_fields()
    assert [s.name for s in specs] == list(PrefetchConfig.__struct_fields__)
    for spec in specs:
        assert len(spec.description) > 15, spec.name
        assert spec.default == getattr(PrefetchConfig(), spec.name)
        assert spec.env_var == "LMPREFETCH_" + spec.name.upper()
        if spec.type in (int, float):
            assert spec.ge is not None or spec.gt is not None, spec.name
            assert spec.le is not None or spec.lt is not None, spec.name
            assert spec.unit, spec.name
    assert {"disk_path", "redis_url"} <= {s.name for s in specs if s.optional}


@pytest.mark.parametrize("spec", NUMERIC, ids=lambda s: s.name)
def test_every_declared_bound_is_enforced_on_every_path(spec: FieldSpec) -> None:
    """Derived, not listed: a new numeric field is covered here the day it is declared."""
    bad_values = _out_of_bounds(spec)
    assert bad_values
    for value in bad_values:
        expected = rf"^{spec.name}: must be {re.escape(spec.bounds_text())}, got "
        if spec.name in STATED_AS_A_RULE and value < (spec.ge or 0):
            expected = rf"^{spec.name}: {STATED_AS_A_RULE[spec.name]}, got "
        with pytest.raises(ValueError, match=expected):
            PrefetchConfig(**{spec.name: value})
        with pytest.raises(ValueError, match=expected):
            PrefetchConfig.from_dict({spec.name: str(value)})
        with pytest.raises(ValueError, match=expected + rf".* \(from {spec.env_var}\)$"):
            PrefetchConfig.from_env({spec.env_var: str(value)})


MEANING = "What this field means, in a sentence."


class NoMeta(msgspec.Struct, kw_only=True):
    n_bytes: int = 1


class NoUpperBound(msgspec.Struct, kw_only=True):
    n_bytes: Annotated[int, msgspec.Meta(ge=0, description=MEANING)] = 1


class NoLowerBound(msgspec.Struct, kw_only=True):
    wait_s: Annotated[float, msgspec.Meta(le=9, description=MEANING)] = 1.0


class NoDescription(msgspec.Struct, kw_only=True):
    wait_s: Annotated[float, msgspec.Meta(gt=0, lt=9)] = 1.0


class NoUnit(msgspec.Struct, kw_only=True):
    n: Annotated[int, msgspec.Meta(ge=0, le=9, description=MEANING)] = 1


class MisspeltExtra(msgspec.Struct, kw_only=True):
    n: Annotated[int, msgspec.Meta(ge=0, le=9, description=MEANING, extra={"units": "x"})] = 1


class NotAScalar(msgspec.Struct, kw_only=True):
    names: Annotated[list[str], msgspec.Meta(description=MEANING)] = []


class NoDefault(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(description=MEANING)]


@pytest.mark.parametrize(
    ("cls", "problem"),
    [
        (NoMeta, r"^n_bytes: no description"),
        (NoUpperBound, r"^n_bytes: a number needs an upper bound"),
        (NoLowerBound, r"^wait_s: a number needs a lower bound"),
        (NoDescription, r"^wait_s: no description"),
        (NoUnit, r"^n: a number needs a unit"),
        (MisspeltExtra, r"^n: unknown Meta\(extra=...\) keys \['units'\]"),
        (NotAScalar, r"^names: a field is an int, float, bool or str"),
        (NoDefault, r"^name: every field needs a default"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_a_declaration_the_checks_cannot_be_derived_from_is_refused(
    cls: type[msgspec.Struct], problem: str
) -> None:
    """What keeps "every number has bounds and a unit, every field a meaning" true: the
    function that reads PrefetchConfig's declarations at import refuses these."""
    with pytest.raises(TypeError, match=problem):
        describe_fields(cls)


def test_a_well_declared_struct_is_described_as_declared() -> None:
    class C(msgspec.Struct, kw_only=True):
        #: (a comment is not a description)
        queue: Annotated[
            int, msgspec.Meta(ge=1, le=64, description="Items waiting.", extra={"unit": "items"})
        ] = 8
        where: Annotated[
            str | None, msgspec.Meta(description="A directory.", extra={"path": True})
        ] = None

    queue, where = describe_fields(C)
    assert (queue.type, queue.ge, queue.le, queue.unit) == (int, 1, 64, "items")
    assert queue.bounds_text() == "at least 1 and at most 64 items"
    assert (where.type_name, where.path, where.default) == ("str | None", True, None)


# -- where a value was set, and what was meant ---------------------------------------------------
@pytest.mark.parametrize("value", [-5, 0, 1, 2, 3, (2 << 20) * 2 - 1])
def test_too_small_a_cpu_bytes_is_refused_with_the_two_chunk_rule(value: int) -> None:
    """``cpu_bytes=-5`` said "must be at least 2" while the rule is two chunks."""
    with pytest.raises(ValueError) as caught:
        PrefetchConfig(cpu_bytes=value)
    assert str(caught.value) == (
        f"cpu_bytes: must hold at least two chunks of chunk_bytes (2097152), got {value}"
    )
    # With a chunk_bytes that is itself wrong, that is what the message is about.
    with pytest.raises(ValueError, match="^chunk_bytes: must be at least 1"):
        PrefetchConfig(cpu_bytes=4096, chunk_bytes=0)
    assert PrefetchConfig(cpu_bytes=(2 << 20) * 2).cpu_bytes == 4 << 20


def test_variables_override_the_file_and_the_whole_is_checked_once(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    # Alone, this file is invalid: the default arena (1 GiB) cannot hold two 1-GiB chunks.
    p.write_text(f"chunk_bytes = {1 << 30}\nchunk_size = 64\n")
    with pytest.raises(ValueError, match="^cpu_bytes: must hold at least two chunks"):
        PrefetchConfig.from_file(p)
    env = {"LMPREFETCH_CPU_BYTES": str(4 << 30), "LMPREFETCH_CHUNK_SIZE": "16"}
    c = PrefetchConfig.from_env(env, config_file=p)
    assert (c.chunk_bytes, c.cpu_bytes, c.chunk_size) == (1 << 30, 4 << 30, 16)
    # config_file= (lmprefetch worker --config) wins over LMPREFETCH_CONFIG.
    env["LMPREFETCH_CONFIG"] = str(tmp_path / "missing.toml")
    assert PrefetchConfig.from_env(env, config_file=p) == c
    with pytest.raises(ValueError, match="missing.toml: config file not found"):
        PrefetchConfig.from_env(env)


def test_a_bad_value_says_which_variable_or_file_set_it(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("chunk_size = 0\n")
    with pytest.raises(ValueError, match=rf"^chunk_size: must be .*, got 0 \(in {p}\)$"):
        PrefetchConfig.from_file(p)
    p.write_text("chunk_size = 0\nclaim_ttl_s = 'soon'\n")
    env = {"LMPREFETCH_CHUNK_SIZE": "x"}
    with pytest.raises(
        ValueError, match=r"^chunk_size: expected int, got str 'x' \(from LMPREFETCH_CHUNK_SIZE\)$"
    ):
        PrefetchConfig.from_env(env, config_file=p)
    # The variable fixes chunk_size; the file's claim_ttl_s is still wrong, and named as such.
    env = {"LMPREFETCH_CHUNK_SIZE": "8"}
    with pytest.raises(ValueError, match=rf"^claim_ttl_s: expected float, .* \(in {p}\)$"):
        PrefetchConfig.from_env(env, config_file=p)
    # Python, a dict: nothing to point at.
    with pytest.raises(ValueError, match=r"^chunk_size: must be .*, got 0$"):
        PrefetchConfig.from_dict({"chunk_size": 0})


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("chunk_sise", "chunk_size"), ("CHUNK_SIZE", "chunk_size"), ("disk_byte", "disk_bytes"),
     ("redis_timeout", "redis_timeout_s"), ("claim_ttl", "claim_ttl_s")],
)  # fmt: skip
def test_an_unknown_name_is_answered_with_the_nearest_field_in_a_short_message(
    name: str, suggestion: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as caught:
        PrefetchConfig.from_dict({name: 1})
    assert str(caught.value) == (
        f"{name}: unknown PrefetchConfig field; did you mean {suggestion!r}?"
    )
    var = "LMPREFETCH_" + name.upper()
    if name.lower() != suggestion:  # (LMPREFETCH_CHUNK_SIZE is the right name)
        with pytest.raises(ValueError) as caught:
            PrefetchConfig.from_env({var: "1"})
        assert str(caught.value) == (
            f"{var}: unknown variable: no PrefetchConfig field is called {name.lower()!r}; "
            f"did you mean LMPREFETCH_{suggestion.upper()}?"
        )
    p = tmp_path / "c.toml"
    p.write_text(f"{name} = 1\n")
    with pytest.raises(ValueError, match=rf"did you mean {suggestion!r}\? \(in {p}\)$"):
        PrefetchConfig.from_file(p)


def test_an_unknown_name_far_from_every_field_gets_no_guess_and_no_list() -> None:
    with pytest.raises(ValueError) as caught:
        PrefetchConfig.from_dict({"colour": "blue"})
    assert str(caught.value) == "colour: unknown PrefetchConfig field"
    with pytest.raises(ValueError) as caught:
        PrefetchConfig.from_env({"LMPREFETCH_COLOUR": "blue"})
    assert str(caught.value).endswith("no PrefetchConfig field is called 'colour'")
