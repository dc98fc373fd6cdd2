"""PrefetchConfig: defaults, validation naming the field, dict / TOML / env loading."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from lmprefetch import PrefetchConfig


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
