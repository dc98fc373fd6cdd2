"""Per-tenant encryption at rest (lmprefetch.codec.encryption and the stage): a chunk opens only
for its own tenant under its own chunk key; anything else is a miss, never plaintext."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("cryptography")
pytest.importorskip("numpy")
pytest.importorskip("zstandard")

from lmprefetch.codec import (
    ChunkStage,
    CodecMiss,
    DecryptionMiss,
    KeyFileError,
    TenantCipher,
    get_codec,
    load_master_key,
    tenant_id,
)
from lmprefetch.hashing import tenant_salt

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASTER = bytes(range(32))
KEY_A = b"model@1@0@00000000000000aa@bfloat16"
KEY_B = b"model@1@0@00000000000000bb@bfloat16"
ALICE = tenant_id(tenant_salt("alice"))
BOB = tenant_id(tenant_salt("bob"))
PAYLOAD = bytes(range(256)) * 40


def stage(codec: str = "lossless", master: bytes | None = MASTER) -> ChunkStage:
    cipher = None if master is None else TenantCipher(master)
    return ChunkStage(get_codec(codec, dtype="bfloat16"), cipher)


def opened(s: ChunkStage, blob: bytes | bytearray, *, key: bytes, tenant: bytes) -> bytes | None:
    out = bytearray(len(PAYLOAD) + 16)
    try:
        n = s.decode_into(blob, out, key_name=key, tenant=tenant)
    except CodecMiss:
        return None
    return bytes(out[:n])


@pytest.mark.parametrize("codec", ["none", "lossless", "bitround3"])
def test_a_tenant_reads_its_own_chunk_and_nothing_else_reads_it(codec: str) -> None:
    s = stage(codec)
    blob = s.encode(PAYLOAD, key_name=KEY_A, tenant=ALICE)
    assert PAYLOAD[:64] not in blob  # no plaintext at rest
    mine = opened(s, blob, key=KEY_A, tenant=ALICE)
    assert mine is not None and len(mine) == len(PAYLOAD)
    if codec != "bitround3":
        assert mine == PAYLOAD
    assert opened(s, blob, key=KEY_A, tenant=BOB) is None  # another tenant's key
    assert opened(s, blob, key=KEY_A, tenant=b"") is None  # the shared name space
    assert opened(s, blob, key=KEY_B, tenant=ALICE) is None  # moved under another chunk key
    assert opened(stage(codec, bytes(32)), blob, key=KEY_A, tenant=ALICE) is None  # other master
    assert opened(stage(codec, None), blob, key=KEY_A, tenant=ALICE) is None  # no key here


def test_with_encryption_on_plaintext_and_merely_encoded_chunks_are_refused() -> None:
    s = stage()
    for plain in (PAYLOAD, get_codec("lossless", dtype="bfloat16").encode(PAYLOAD)):
        with pytest.raises(DecryptionMiss, match="not sealed"):
            s.decode_into(plain, bytearray(len(PAYLOAD)), key_name=KEY_A, tenant=ALICE)


@SETTINGS
@given(data=st.data(), codec=st.sampled_from(["none", "lossless"]))
def test_every_tampered_or_truncated_sealed_chunk_is_a_miss(
    data: st.DataObject, codec: str
) -> None:
    s = stage(codec)
    blob = s.encode(PAYLOAD, key_name=KEY_A, tenant=ALICE)
    bit = data.draw(st.integers(0, 8 * len(blob) - 1))
    damaged = bytearray(blob)
    damaged[bit // 8] ^= 1 << (bit % 8)
    assert opened(s, damaged, key=KEY_A, tenant=ALICE) is None
    cut = data.draw(st.integers(0, len(blob) - 1))
    assert opened(s, blob[:cut], key=KEY_A, tenant=ALICE) is None


def test_the_same_payload_seals_differently_each_time() -> None:
    s = stage("none")
    first = s.encode(PAYLOAD, key_name=KEY_A, tenant=ALICE)
    assert first != s.encode(PAYLOAD, key_name=KEY_A, tenant=ALICE)  # a fresh nonce


def test_tenant_ids_name_tenants_without_their_salt() -> None:
    assert tenant_id(None) == b""
    assert len(ALICE) == 16 and ALICE != BOB
    assert b"alice" not in ALICE


def test_the_master_key_file(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_text("ab" * 32 + "\n")
    assert load_master_key(good) == b"ab" * 32  # a text key: its newline is not key
    # A binary key is taken as it is, whitespace bytes at its ends included (stripped, a
    # random 32-byte key ending in b"\n" was a 31-byte key, refused: about one start in 20).
    for binary in (b"\x01" * 31 + b"\n", b" " + b"\xff" * 31, b"\t\x80" * 16 + b"\r\n"):
        good.write_bytes(binary)
        assert load_master_key(good) == binary
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    with pytest.raises(KeyFileError, match=r"^encryption_key_file: .*holds 31 bytes"):
        load_master_key(short)
    with pytest.raises(KeyFileError, match=r"not found"):
        load_master_key(tmp_path / "missing")
    with pytest.raises(KeyFileError, match=r"cannot read"):
        load_master_key(tmp_path)  # a directory
    with pytest.raises(ValueError, match="at least 32"):
        TenantCipher(b"short")


def test_a_key_file_must_be_a_small_regular_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_master_key("/dev/zero")
    big = tmp_path / "big"
    big.write_bytes(b"k" * (64 * 1024 + 1))
    with pytest.raises(KeyFileError, match="not a key file"):
        load_master_key(big)
    with pytest.raises(KeyFileError, match="cannot read"):
        load_master_key("bad\0name")
