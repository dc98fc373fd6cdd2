"""The two workloads, as rounds of requests (token ids, the same in every scenario).

**Long-document QA** (as LMCache's long-doc QA benchmark): ``docs`` documents of
``doc_tokens`` tokens; round ``r`` asks every document, in order, its question ``r``
(``question_tokens`` fresh tokens after the document).  Between two questions to one document
all the other documents pass, so when their KV is larger than vLLM's KV pool, vLLM's own
prefix cache has evicted the document by the time it comes back.  Round 0 is the warm-up (each
document computed once); the later rounds are measured.

**Multi-round chat** (as the multi-round QA benchmarks of LMCache and SGLang): ``sessions``
users share a ``system_tokens`` system prompt; in round ``r`` every session sends its whole
history (system prompt, then each earlier round's user message and assistant answer) plus a new
``user_tokens`` message, ``concurrency`` sessions at a time.  The answers in the history are
fixed token ids of ``answer_tokens`` tokens drawn in advance, not the generated ones (a
random-weight model's output is arbitrary, and fixed answers keep the prompts identical in
every scenario); the request still generates ``answer_tokens`` tokens.  Round 0 is measured too
(the system prompt is shared), but it is mostly cold.

Token ids are drawn from a seeded generator in ``[3, vocab)``, so no two texts share a prefix
by accident; or, with a ``corpus`` (the token ids of English text, for a trained model), each
text is the corpus read from a seeded random position (wrapping around), so texts are English
and still differ from their first token on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ChatSpec", "LongDocSpec", "Request", "chat_rounds", "long_doc_rounds", "probe_prompts"]


@dataclass(frozen=True)
class Request:
    """One request of a workload round.

    ``key`` is the document or session index (requests are routed by it), ``measured`` says
    whether its time counts in the workload's figures.
    """

    workload: str
    key: int
    round: int
    prompt: tuple[int, ...]
    max_tokens: int
    measured: bool


@dataclass(frozen=True)
class LongDocSpec:
    docs: int
    doc_tokens: int
    question_tokens: int
    answer_tokens: int


@dataclass(frozen=True)
class ChatSpec:
    sessions: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    concurrency: int


def _text(
    rng: random.Random, n: int, vocab: int, corpus: Sequence[int] | None = None
) -> tuple[int, ...]:
    if not corpus:
        return tuple(rng.randrange(3, vocab) for _ in range(n))
    start = rng.randrange(len(corpus))
    return tuple(corpus[(start + i) % len(corpus)] for i in range(n))


def long_doc_rounds(
    spec: LongDocSpec, rounds: int, vocab: int, seed: int, corpus: Sequence[int] | None = None
) -> list[list[Request]]:
    """The long-document QA requests, one list per round (round 0 is the warm-up)."""
    rng = random.Random(f"long-doc-{seed}")
    docs = [_text(rng, spec.doc_tokens, vocab, corpus) for _ in range(spec.docs)]
    out = []
    for r in range(rounds):
        out.append(
            [
                Request(
                    "long_doc_qa",
                    i,
                    r,
                    doc + _text(rng, spec.question_tokens, vocab, corpus),
                    spec.answer_tokens,
                    measured=r > 0,
                )
                for i, doc in enumerate(docs)
            ]
        )
    return out


def chat_rounds(
    spec: ChatSpec, rounds: int, vocab: int, seed: int, corpus: Sequence[int] | None = None
) -> list[list[Request]]:
    """The chat requests, one list per round (all sessions' turn ``r``)."""
    rng = random.Random(f"chat-{seed}")
    system = _text(rng, spec.system_tokens, vocab, corpus)
    histories = [system] * spec.sessions
    out = []
    for r in range(rounds):
        batch = []
        for s in range(spec.sessions):
            user = _text(rng, spec.user_tokens, vocab, corpus)
            batch.append(
                Request("chat", s, r, histories[s] + user, spec.answer_tokens, measured=True)
            )
            histories[s] = histories[s] + user + _text(rng, spec.answer_tokens, vocab, corpus)
        out.append(batch)
    return out


def probe_prompts(
    count: int, tokens: int, vocab: int, seed: int, corpus: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """Fresh prompts for the same-prompt hit probes (used nowhere else)."""
    rng = random.Random(f"probe-{seed}")
    return [_text(rng, tokens, vocab, corpus) for _ in range(count)]
