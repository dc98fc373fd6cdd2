"""Load or recompute: how much of a cache hit a lookup loads.

A hit is only a win when loading it is faster than computing it.  Once a lookup has probed its
tiers it knows which tier holds each hit chunk; a :class:`LoadPolicy` then returns a
**truncation point**: how many of the hit chunks (counted after the chunks the engine already
holds) to load.  The chunks past it are released at once and recomputed by the engine.

The engine asks the policy with a :class:`LoadRequest`: the hit split into :class:`HitPart`\\ s
(one per tier, in prefix order, each with the tier's measured :class:`TierCost`), the tokens of
each chunk, and the engine's :class:`PrefillModel` (seconds to compute a span of tokens).

A policy says when it decides (its ``decides`` attribute, :class:`Decides`): once every tier
was probed (the default: the loads wait for its answer), or before probing, without seeing the
hit (``always`` and ``never``: its answer bounds what the lookup probes, and each tier's load
starts as soon as its probe answers).  The engine asks every policy the same one question,
:meth:`LoadPolicy.chunks_to_load`, at the moment the policy chose.

Policies (``PrefetchConfig.load_policy``):

* ``"always"``: load the whole hit (:class:`AlwaysLoad`, the default);
* ``"never"``: load nothing (:class:`NeverLoad`; the engine answers at once without probing);
* ``"cost"``: load the prefix whose expected time to the first token is lowest
  (:class:`CostPolicy`);
* ``"package.module:Class"``: a class of your own, built with no arguments, with a
  ``chunks_to_load(request) -> int`` method (see :class:`LoadPolicy` and ``docs/policy.md``).

Cost model (:class:`CostPolicy`).  The tiers' loads run concurrently, so loading the first
``k`` chunks takes ``max`` over the tiers with a chunk among them of ``latency + bytes /
throughput + bytes / decode rate`` (:meth:`TierCost.seconds`; the decode rate is that of the
tier's codec stage, docs/codecs.md; a zero-copy tier, the CPU tier, costs nothing).
Computing instead of loading them adds ``prefill(s, k)``, the prefill time of those tokens.
The policy takes the ``k`` that minimises ``load(k) - prefill(s, k)`` (ties: the longer
prefix), so a slow tier's chunks at the end of the prefix are the first to go.  Until the
prefill model is calibrated (or ``prefill_tokens_per_s`` configured) it loads everything, as
``"always"`` does.  A tier whose throughput has no estimate yet (no load measured it, and it
wrote nothing over its link) is not trusted: its chunks are recomputed, and the engine measures
it in the background.

Threads: :class:`PrefillModel` is fed from the model runner's thread and read on the engine's
Trio thread (a lock guards it); everything else runs on the engine's thread.
"""

from __future__ import annotations

import enum
import importlib
import threading
from collections import deque
from typing import Final, Protocol, runtime_checkable

import msgspec

from .config_checks import LOAD_POLICIES, load_policy

__all__ = [
    "BUILTIN_POLICIES",
    "AlwaysLoad",
    "CostPolicy",
    "Decides",
    "HitPart",
    "LoadPolicy",
    "LoadRequest",
    "NeverLoad",
    "PrefillModel",
    "TierCost",
    "make_policy",
    "predict",
    "when_decides",
]

#: The policies ``load_policy`` names without a module.
BUILTIN_POLICIES: Final = LOAD_POLICIES
#: The weight of a new sample in every moving average here.
EWMA_ALPHA: Final = 0.2
#: Steps the prefill model needs before it is trusted.
MIN_PREFILL_SAMPLES: Final = 3
#: The steps of one size the prefill model keeps (its point is their median).
BUCKET_STEPS: Final = 5


class TierCost(msgspec.Struct, frozen=True, gc=False):
    """What one tier's loads have cost lately (moving averages; ``None``: not measured yet).

    ``latency_s`` is the time of a call that moves no payload (a probe); ``bytes_per_s`` is
    payload bytes over the rest of a load's time, less its decoding.  ``stale``: no load
    measured the throughput within ``tier_cost_max_age_s`` (or ever); the engine measures it
    again in the background when a policy drops the tier's chunks.  Before any load measured
    a tier that writes over a link (Redis, Mooncake), ``bytes_per_s`` is its write-behind's
    throughput, and ``stale`` is true: the chunks a lookup finds there went through the same
    link, so a tier is not taken for unknown, and its first hit recomputed, only because no
    lookup loaded from it yet.

    ``decode_bytes_per_s`` is the rate at which the payload is decoded once it has arrived
    (a tier that stores chunks encoded: a codec), ``None`` for a tier that stores them as
    they are; :meth:`seconds` and :meth:`decode_seconds` count it, so a policy that prices a
    load with them prices the decoding too."""

    latency_s: float | None = None
    bytes_per_s: float | None = None
    stale: bool = False
    decode_bytes_per_s: float | None = None

    @property
    def measured(self) -> bool:
        """Whether the tier's throughput has an estimate (by its loads, or before the first
        one by its writes; its latency is measured by every probe)."""
        return self.bytes_per_s is not None

    def seconds(self, n_bytes: int) -> float:
        """Expected seconds of one load call of ``n_bytes``, its decoding included (0 for what
        is not measured)."""
        t = self.latency_s or 0.0
        if self.bytes_per_s:
            t += n_bytes / self.bytes_per_s
        return t + self.decode_seconds(n_bytes)

    def decode_seconds(self, n_bytes: int) -> float:
        """Expected seconds to decode ``n_bytes`` of payload (0 for a tier that does not
        encode, so a zero-copy tier's hit costs this alone)."""
        return n_bytes / self.decode_bytes_per_s if self.decode_bytes_per_s else 0.0


class HitPart(msgspec.Struct, frozen=True, gc=False):
    """One tier's share of a hit: ``chunks`` chunks (``bytes`` payload bytes, estimated)
    right after the previous part's.  ``zero_copy``: already in memory (the CPU tier)."""

    tier: str
    chunks: int
    bytes: int
    zero_copy: bool
    cost: TierCost


class LoadRequest(msgspec.Struct, frozen=True, gc=False):
    """What a policy decides on.

    A policy that decides before probing (:attr:`Decides.BEFORE_PROBING`) is asked with no
    ``parts`` and ``chunk_tokens`` covering every chunk the lookup could hit: its answer is
    the most chunks the lookup probes and loads.

    Attributes:
        parts: the hit, tier by tier, in prefix order (only tiers with hit chunks; empty
            before probing).
        chunk_tokens: tokens of each hit chunk, in order (``len`` = the parts' chunks; before
            probing, every chunk the lookup could hit).
        computed_tokens: tokens before the hit (the chunks the engine holds already).
        prompt_tokens: tokens in the looked-up prompt.
        prefill: the engine's prefill cost model.
    """

    parts: tuple[HitPart, ...]
    chunk_tokens: tuple[int, ...]
    computed_tokens: int
    prompt_tokens: int
    prefill: PrefillModel

    @property
    def hit_chunks(self) -> int:
        return len(self.chunk_tokens)


class Decides(enum.Enum):
    """When a policy decides how much of a hit to load (a policy's ``decides`` attribute),
    which is when a lookup's loads may start."""

    #: Once every tier was probed, knowing which tier holds each hit chunk: the loads wait for
    #: the policy's answer.  The default for a policy that does not say.
    AFTER_PROBING = "after_probing"
    #: Before any probe, without seeing the hit (``parts`` is empty): the answer bounds the
    #: chunks the lookup probes, and each tier's load starts as soon as its probe answers.
    #: An answer of 0 probes nothing: the lookup answers at once.
    BEFORE_PROBING = "before_probing"


@runtime_checkable
class LoadPolicy(Protocol):
    """A load-or-recompute policy: how many of the hit chunks to load.

    ``chunks_to_load`` runs on the engine's Trio thread once per lookup, when the policy
    decides (see :class:`Decides`; by default once every tier was probed, and only for a
    lookup that found a hit), so it must be quick and must not block.  It returns a number
    from 0 (recompute everything) to ``request.hit_chunks`` (load the whole hit); the engine
    clamps anything else into that range.  An exception is logged and the whole hit is
    loaded.

    A policy may say when it decides with a class attribute ``decides`` (a :class:`Decides`;
    read once, when the engine opens, by :func:`when_decides`).  A subclass inherits it, and is
    asked the same way as its base."""

    def chunks_to_load(self, request: LoadRequest) -> int: ...


class AlwaysLoad:
    """Load every hit chunk: decided before probing, so each tier's load starts as soon as its
    probe answers."""

    decides = Decides.BEFORE_PROBING

    def chunks_to_load(self, request: LoadRequest) -> int:
        return request.hit_chunks


class NeverLoad:
    """Load nothing: recompute (decided before probing, so a lookup probes nothing)."""

    decides = Decides.BEFORE_PROBING

    def chunks_to_load(self, request: LoadRequest) -> int:
        return 0


class CostPolicy:
    """The prefix with the lowest expected time to first token (see the module docstring).

    Beyond the cost model itself:

    * **A tier is measured before it is trusted.**  Chunks on a tier whose throughput has no
      estimate yet count as too dear to load (unless the prefill cost is unknown too: then
      the whole hit is loaded, as ``always`` does); the engine measures the tier in the
      background from the chunks dropped (see ``docs/policy.md``).  A tier that writes over
      a link has an estimate from its first write: the write-behind's throughput, which
      the first load replaces (:class:`TierCost`).
    * **Hysteresis.**  Once the policy loaded a tier's chunks, recomputing them must win by
      :attr:`hysteresis` (a fraction of the load's cost) before it stops loading from that
      tier, and once it skipped them, loading must win by as much before it loads again: two
      costs within a few percent of each other do not flip the decision back and forth with
      every small change of the estimates.
    * **No probe where no load can win** (:meth:`worth_probing`): a tier so slow that even
      the dearest run of the prompt's chunks is cheaper to recompute is not probed, so the
      lookup does not wait for its round trip.
    """

    decides = Decides.AFTER_PROBING
    #: How much the other choice must win by before the policy changes its mind about a tier.
    hysteresis: float = 0.15

    def __init__(self) -> None:
        #: Per tier: whether the last decision that saw its chunks loaded any of them.
        self._loaded: dict[str, bool] = {}

    def _factor(self, tier: str) -> float:
        """The weight of a tier's load cost: below 1 while the policy loads from it, above 1
        while it recomputes instead (see :attr:`hysteresis`)."""
        loaded = self._loaded.get(tier)
        if loaded is None:
            return 1.0
        return 1.0 - self.hysteresis if loaded else 1.0 + self.hysteresis

    def chunks_to_load(self, request: LoadRequest) -> int:
        n = request.hit_chunks
        coefficients = request.prefill.coefficients()  # one read: the model may move meanwhile
        if n == 0 or coefficients is None:
            return n
        best_k = self._best(request, coefficients)
        # Remember, per measured tier that held chunks, whether any of them is loaded.
        first = 0
        for part in request.parts:
            if not part.zero_copy and part.cost.measured:
                self._loaded[part.tier] = best_k > first
            first += part.chunks
        return best_k

    def _best(self, request: LoadRequest, coefficients: tuple[float, float]) -> int:
        """The ``k`` that minimises ``load(k) − prefill(k)`` (ties: the longer prefix), a
        tier's load weighted by :meth:`_factor`; nothing from a tier not measured."""
        a, b = coefficients
        best_k, best = 0, 0.0  # load nothing: cost 0 relative to recomputing all
        slowest = 0.0  # the load time of the chunks taken so far (the tiers load side by side)
        k = 0
        start = request.computed_tokens
        end = start
        for part in request.parts:
            if not part.zero_copy and not part.cost.measured:
                break  # not measured yet: not trusted; nothing from here on is loaded
            per_chunk = part.bytes / part.chunks if part.chunks else 0.0
            factor = 1.0 if part.zero_copy else self._factor(part.tier)
            for j in range(1, part.chunks + 1):
                end += request.chunk_tokens[k]
                k += 1
                n_bytes = int(per_chunk * j)
                if part.zero_copy:
                    slowest = max(slowest, part.cost.decode_seconds(n_bytes))
                else:
                    slowest = max(slowest, factor * part.cost.seconds(n_bytes))
                gain = slowest - (a * (end - start) + b * (end * end - start * start))
                if gain <= best:
                    best_k, best = k, gain
        return best_k

    def worth_probing(self, request: LoadRequest) -> bool:
        """Whether probing a tier could lead to loading from it.  ``request.parts`` is the hit
        as far as it is known without I/O (the chunks the CPU tier holds, free), then one
        hypothetical part: the tier asked about, holding every further chunk the lookup could
        hit.

        ``True`` when that tier is zero-copy, not measured (or measured long ago: a probe,
        and the measurement that may follow, keep its cost current), when the prefill cost is
        not known, or when the best prefix of the hypothetical hit takes some of the tier's
        chunks (a shorter part of it is among the prefixes weighed); ``False`` otherwise: the
        lookup then answers without waiting for the tier's round trip."""
        coefficients = request.prefill.coefficients()
        if coefficients is None or not request.parts:
            return True
        part = request.parts[-1]
        cost = part.cost
        if part.zero_copy or not cost.measured or cost.stale:
            return True
        before = request.hit_chunks - part.chunks
        return self._best(request, coefficients) > before


def predict(request: LoadRequest, keep: int) -> tuple[float | None, float | None]:
    """What the engine's cost model expects of loading the first ``keep`` hit chunks and
    recomputing the rest of the hit: ``(load seconds, recompute seconds)``.

    Loading costs the slowest of the tiers holding any of the first ``keep`` chunks (they
    load side by side; a zero-copy tier costs nothing); ``None`` when one of them has not
    been measured yet.  Recomputing chunks ``keep`` to the end of the hit costs
    ``request.prefill.seconds``; ``None`` while the prefill model is not calibrated.  Every
    policy's decision is recorded with these (:mod:`lmprefetch.trace`), whatever it used.
    """
    load: float | None = 0.0
    left = keep
    for part in request.parts:
        if left <= 0:
            break
        take = min(left, part.chunks)
        left -= take
        if part.zero_copy or load is None:
            continue
        if part.cost.bytes_per_s is None:
            load = None
            continue
        per_chunk = part.bytes / part.chunks if part.chunks else 0.0
        load = max(load, part.cost.seconds(int(per_chunk * take)))
    recompute: float | None = None
    coefficients = request.prefill.coefficients()
    if coefficients is not None:
        start = request.computed_tokens + sum(request.chunk_tokens[:keep])
        end = request.computed_tokens + sum(request.chunk_tokens)
        a, b = coefficients
        recompute = a * (end - start) + b * (end * end - start * start) if end > start else 0.0
    return load, recompute


class _StepBucket:
    """The last steps of one size (see :class:`PrefillModel`): its point is a low quantile of
    the last :data:`BUCKET_STEPS` by time (the fastest of up to four, the second fastest of
    five), so that a slow step (the first of its size after a start, a step that shared the
    machine with another process) does not move the fit, and a lasting change does within a
    few steps.

    Low, not central: a step is only ever slowed down by what it shares the machine with, and
    the estimate must not err towards dear recomputing.  A policy that believes recomputing is
    dearer than it is loads instead, and so never computes a step of that size again to learn
    otherwise; one that believes it cheaper recomputes, and the steps it computes correct the
    estimate."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps: deque[tuple[float, float, float]] = deque(maxlen=BUCKET_STEPS)

    def add(self, t: float, q: float, y: float) -> None:
        self.steps.append((t, q, y))

    def point(self) -> tuple[float, float, float]:
        ordered = sorted(self.steps, key=lambda step: step[2])
        return ordered[(len(ordered) - 1) // 4]


class PrefillModel:
    """Seconds the engine takes to compute tokens, measured from its steps.

    A step that computes ``n`` tokens of a request after its first ``c`` costs, summed over
    the step's requests, ``overhead + a·n + b·((c+n)² − c²)``: a per-token term (the MLPs,
    the projections) and attention's term, which grows with the context.  Each step reports
    its tokens ``T = Σn``, its attention work ``Q = Σ((c+n)² − c²)`` and its time.

    Steps are kept by size: one bucket per power of two of ``T`` and of ``Q``, each holding
    moving averages of its steps (weight :data:`EWMA_ALPHA` per new step).  ``(a, b)`` are
    fitted by least squares over the buckets, one point each, so the many small steps of
    decoding (and of prompts whose prefix was loaded) do not wash out what the few long
    prefills showed: an average over steps forgets a long prefill after a few dozen decode
    steps, and a rate fitted from small steps alone is their timing noise.  With at least
    four buckets whose ``Q`` varies apart from ``T`` both terms are fitted; otherwise, or when
    that fit gives a negative term, the per-token term alone.  Computing tokens ``[start,
    end)`` of a prompt then costs ``a·(end − start) + b·(end² − start²)``.

    Until steps of two different sizes were seen (and :data:`MIN_PREFILL_SAMPLES` steps in
    all), ``configured_tokens_per_s`` is used (``a = 1 / rate``, ``b = 0``), or the model is
    not calibrated.
    """

    def __init__(self, configured_tokens_per_s: float | None = None) -> None:
        self.configured_tokens_per_s = configured_tokens_per_s
        self._lock = threading.Lock()
        self._samples = 0
        self._buckets: dict[tuple[int, int], _StepBucket] = {}

    def observe_step(self, tokens: int, seconds: float, attention: int = 0) -> None:
        """One engine step computed ``tokens`` tokens (``attention``: their ``Σ((c+n)² −
        c²)``, 0 when unknown) in ``seconds``.  Any thread."""
        if tokens <= 0 or not seconds > 0:
            return
        attention = max(0, attention)
        key = (tokens.bit_length(), attention.bit_length())
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _StepBucket()
            bucket.add(float(tokens), float(attention), float(seconds))
            self._samples += 1

    @property
    def samples(self) -> int:
        """Steps observed so far."""
        return self._samples

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per token and per unit of attention work (the measured ones,
        else the configured rate's), or ``None`` when not calibrated.  Any thread."""
        return self.state()[0]

    def state(self) -> tuple[tuple[float, float] | None, str | None]:
        """``(coefficients(), where they come from)``: ``"measured"`` (fitted from the
        steps), ``"configured"`` (``configured_tokens_per_s``) or ``None`` (not calibrated)."""
        fitted = self._fitted()
        if fitted is not None:
            return fitted[1:], "measured"
        rate = self.configured_tokens_per_s
        return (None, None) if rate is None else ((1.0 / rate, 0.0), "configured")

    def _fitted(self) -> tuple[float, float, float] | None:
        with self._lock:
            points = [b.point() for b in self._buckets.values()]
            samples = self._samples
        return _fit(points) if samples >= MIN_PREFILL_SAMPLES else None

    def step_seconds(self, tokens: int, attention: int) -> float | None:
        """The seconds the fit expects of one step of ``tokens`` tokens and ``attention``
        work, its fixed overhead included (``None`` until the steps were fitted)."""
        fitted = self._fitted()
        if fitted is None:
            return None
        c, a, b = fitted
        return c + a * tokens + b * attention

    def tokens_per_s(self) -> float | None:
        """The per-token rate (``1 / a``: measured, else configured), or ``None``."""
        coefficients = self.coefficients()
        return None if coefficients is None else 1.0 / coefficients[0]

    def calibrated(self) -> bool:
        return self.coefficients() is not None

    def seconds(self, start: int, end: int) -> float:
        """Expected seconds to compute tokens ``[start, end)`` of a prompt (0 when not
        calibrated)."""
        coefficients = self.coefficients()
        if coefficients is None or end <= start:
            return 0.0
        a, b = coefficients
        return a * (end - start) + b * (end * end - start * start)


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """Least squares of ``y = c + a·T + b·Q`` over ``(T, Q, y)`` points, one per bucket:
    ``(c, a, b)``."""
    n = len(points)
    if n < 2:
        return None
    mt = sum(t for t, _, _ in points) / n
    mq = sum(q for _, q, _ in points) / n
    my = sum(y for _, _, y in points) / n
    vt = sum((t - mt) ** 2 for t, _, _ in points)
    vq = sum((q - mq) ** 2 for _, q, _ in points)
    ctq = sum((t - mt) * (q - mq) for t, q, _ in points)
    cty = sum((t - mt) * (y - my) for t, _, y in points)
    cqy = sum((q - mq) * (y - my) for _, q, y in points)
    if not vt > 0:
        return None  # every step the same size: no rate to tell
    det = vt * vq - ctq * ctq
    if n >= 4 and det > 1e-6 * vt * vq:  # the terms vary apart enough to separate them
        a = (cty * vq - cqy * ctq) / det
        b = (cqy * vt - cty * ctq) / det
        if a > 0 and b >= 0:
            return my - a * mt - b * mq, a, b
    a = cty / vt
    return (my - a * mt, a, 0.0) if a > 0 else None


def when_decides(policy: LoadPolicy) -> Decides:
    """When ``policy`` decides: its ``decides`` attribute, :attr:`Decides.AFTER_PROBING` when
    it has none.

    Raises:
        ValueError: ``decides`` is not a :class:`Decides` (the message starts with
            ``load_policy``).
    """
    when = getattr(policy, "decides", Decides.AFTER_PROBING)
    if not isinstance(when, Decides):
        raise ValueError(
            f"load_policy: {type(policy).__name__}.decides must be a lmprefetch.policy.Decides, "
            f"got {when!r}"
        )
    return when


def make_policy(name: str) -> LoadPolicy:
    """The policy ``load_policy`` names, built.

    Raises:
        ValueError: the name is malformed, its module cannot be imported, it names no class,
            or the class's instances lack ``chunks_to_load``; the message starts with
            ``load_policy``.
    """
    problem = load_policy(name)
    if problem is not None:
        raise ValueError(f"load_policy: {problem}")
    if name == "always":
        return AlwaysLoad()
    if name == "never":
        return NeverLoad()
    if name == "cost":
        return CostPolicy()
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"load_policy: cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"load_policy: {module_name!r} has no class {class_name!r}")
    try:
        policy = cls()
    except Exception as exc:
        raise ValueError(f"load_policy: {name} could not be built: {exc!r}") from None
    if not callable(getattr(policy, "chunks_to_load", None)):
        raise ValueError(f"load_policy: {name} has no chunks_to_load(request) method")
    when_decides(policy)  # a ValueError naming load_policy if it says something else
    return policy  # type: ignore[no-any-return]
