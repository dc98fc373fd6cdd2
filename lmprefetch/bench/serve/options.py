"""bench-serve's options and scenarios (imports nothing heavy: the command line is built from
this module without vLLM or httpx installed)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .model import BENCH_LLAMA, MODEL_CHOICES, kv_bytes_per_token
from .workloads import ChatSpec, LongDocSpec

__all__ = [
    "DEFAULT_SCENARIOS",
    "LINK_SCENARIOS",
    "SCENARIOS",
    "SCENARIO_NAMES",
    "Scenario",
    "ServeBenchOptions",
    "positive_number",
    "scenario_list",
]

GiB = 1 << 30


@dataclass(frozen=True)
class Scenario:
    """One server configuration.

    Args:
        name: the key in the results.
        title: one line for the table.
        prefix_caching: vLLM's own prefix cache on.
        connector: ``"lmprefetch"``, ``"lmcache"`` (LMCache's in-process
            ``LMCacheConnectorV1``) or ``"lmcache_mp"`` (LMCache's ``LMCacheMPConnector`` with
            an ``lmcache server`` process, the direction LMCache is taking).
        tier: lmprefetch's tier beside the CPU tier: ``"disk"``, ``"redis"`` or
            ``"mooncake"``.
        servers: how many vLLM servers (requests alternate between two).
        restart_between_rounds: stop and start the server between rounds.
        probe: the probe's transition (``"cpu"``, ``"disk"``, ``"redis"``, ``"mooncake"``), if
            any.
        model: ``"sliding-window"``: the servers serve the benchmark's Llama with every other
            layer a sliding window (:func:`.hybrid_models.sliding_window_variant`), which
            vLLM's hybrid KV cache manager splits into two KV cache groups; ``None``: the
            benchmark's Llama.
        link: ``"slow"`` or ``"fast"``: the Redis link scenarios.  A first server computes
            every document and so fills Redis; a second one, started once Redis holds every
            chunk (its CPU tier empty, no disk, too small to keep a document until it comes
            back), is measured, reading Redis through a throttled link (``"slow"``,
            :mod:`.link`) or straight (``"fast"``): its only hit tier is Redis.
        load_policy: lmprefetch's ``load_policy`` on the measured server of a link
            scenario (``"always"``, ``"never"``: recompute, ``"cost"``).
        codec: lmprefetch's ``redis_codec`` on both servers of a link scenario (the chunks
            cross the link as the codec stores them); ``None``: ``"none"``.
    """

    name: str
    title: str
    prefix_caching: bool = True
    connector: str | None = None
    tier: str | None = None
    servers: int = 1
    restart_between_rounds: bool = False
    probe: str | None = None
    model: str | None = None
    link: str | None = None
    load_policy: str | None = None
    codec: str | None = None


#: The link scenarios' names: (link, load policy) → name.
LINK_SCENARIOS = {
    (link, policy): f"{link}_remote_{word}"
    for link in ("slow", "fast")
    for policy, word in (("always", "always"), ("never", "recompute"), ("cost", "cost"))
}
#: The slow link loading always, with ``redis_codec`` set: codec → name (docs/codecs.md; each
#: beside ``slow_remote_always``, the codec ``none``).
CODEC_LINK_SCENARIOS = {codec: f"slow_remote_{codec}" for codec in ("lossless", "bitround3")}
_LINK_TITLES = {
    "always": "loads every hit",
    "never": "load_policy never: recomputes",
    "cost": "load_policy cost",
}


def _link_scenarios() -> tuple[Scenario, ...]:
    out = []
    for (link, policy), name in LINK_SCENARIOS.items():
        how = "a throttled link" if link == "slow" else "an unthrottled link"
        out.append(
            Scenario(
                name,
                f"lmprefetch whose only hit tier is Redis behind {how}; {_LINK_TITLES[policy]}",
                connector="lmprefetch",
                tier="redis",
                link=link,
                load_policy=policy,
            )
        )
    for codec, name in CODEC_LINK_SCENARIOS.items():
        out.append(
            Scenario(
                name,
                "lmprefetch whose only hit tier is Redis behind a throttled link; loads every "
                f"hit; redis_codec {codec}",
                connector="lmprefetch",
                tier="redis",
                link="slow",
                load_policy="always",
                codec=codec,
            )
        )
    return tuple(out)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("recompute", "no connector, vLLM prefix caching off", prefix_caching=False),
    Scenario("apc", "vLLM's own prefix caching (KV pool smaller than the working set)"),
    Scenario(
        "lmprefetch_cpu",
        "prefix caching + lmprefetch, CPU tier",
        connector="lmprefetch",
        probe="cpu",
    ),
    Scenario(
        "lmprefetch_disk_restart",
        "prefix caching + lmprefetch, CPU + disk tiers, server restarted between rounds",
        connector="lmprefetch",
        tier="disk",
        restart_between_rounds=True,
        probe="disk",
    ),
    Scenario(
        "shared_redis",
        "two servers + one Redis, prefix caching + lmprefetch (CPU + Redis); requests alternate",
        connector="lmprefetch",
        tier="redis",
        servers=2,
        probe="redis",
    ),
    Scenario(
        "shared_mooncake",
        "two servers + one Mooncake master, prefix caching + lmprefetch (CPU + Mooncake); "
        "requests alternate",
        connector="lmprefetch",
        tier="mooncake",
        servers=2,
        probe="mooncake",
    ),
    Scenario(
        "lmprefetch_hybrid",
        "prefix caching + lmprefetch, CPU tier, hybrid model (sliding window + full attention)",
        connector="lmprefetch",
        probe="cpu",
        model="sliding-window",
    ),
    Scenario("lmcache", "prefix caching + LMCache 0.5.6 LMCacheConnectorV1", connector="lmcache"),
    Scenario(
        "lmcache_mp",
        "prefix caching + LMCache 0.5.6 multi-process server (LMCacheMPConnector), CPU memory",
        connector="lmcache_mp",
        probe="cpu",
    ),
    *_link_scenarios(),
)
SCENARIO_NAMES = tuple(s.name for s in SCENARIOS)
#: What a run without ``--scenarios`` runs: all but the Redis link scenarios (issue 20's
#: load policy), which are asked for by name.
DEFAULT_SCENARIOS = tuple(s.name for s in SCENARIOS if s.link is None)


# -- the command line's own checks: the value as the user typed it -------------------------------
def scenario_list(text: str) -> str:
    """``--scenarios``: a comma-separated list of at least one known scenario (spaces and
    empty items ignored), returned as such a list, normalized.

    Raises:
        argparse.ArgumentTypeError: no scenario, or an unknown one (the message lists them).
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"name at least one scenario, got {text!r} (known: {', '.join(SCENARIO_NAMES)})"
        )
    unknown = [name for name in names if name not in SCENARIO_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(map(repr, unknown))} (known: {', '.join(SCENARIO_NAMES)})"
        )
    return ",".join(names)


def positive_number(unit: str) -> Callable[[str], float]:
    """An argparse ``type``: a positive, finite number of ``unit``, refused with the text the
    user wrote (not a value converted from it)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text}")
        return value

    parse.__name__ = f"positive number of {unit}"  # argparse's fallback message names it
    return parse


@dataclass
class ServeBenchOptions:
    """Everything one run uses; :meth:`full` and :meth:`quick` are the two presets."""

    rounds: int = 4
    long_doc: LongDocSpec = field(
        default_factory=lambda: LongDocSpec(
            docs=8, doc_tokens=3840, question_tokens=64, answer_tokens=16
        )
    )
    chat: ChatSpec = field(
        default_factory=lambda: ChatSpec(
            sessions=16, system_tokens=1024, user_tokens=384, answer_tokens=32, concurrency=4
        )
    )
    probes: int = 5
    probe_repeats: int = 3
    probe_chunks: int = 15
    kv_pool_tokens: int = 16384
    chunk_size: int = 256
    block_size: int = 32
    cpu_bytes: int = 1 * GiB
    model: dict[str, Any] = field(default_factory=lambda: dict(BENCH_LLAMA))
    #: ``--model``: ``auto``, ``trained`` or ``random`` (:mod:`.model`); resolved by
    #: :func:`.model.choose_model` into ``model``, ``model_dir`` and ``prompt_corpus``.
    model_kind: str = "auto"
    #: The built model's directory (``None``: the random model, written per run).
    model_dir: str | None = None
    #: Token ids of English text prompts are cut from (empty: random token ids).
    prompt_corpus: tuple[int, ...] = ()
    seed: int = 0
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    python: str = sys.executable
    lmcache_python: str | None = None
    redis_server: str | None = None
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    progress: bool = True
    quick: bool = False
    #: The slow link of the ``slow_remote_*`` scenarios: bytes per second each way, and the
    #: one-way delay (see docs/benchmarks.md for why these).
    slow_link_rate: float = 10e6
    slow_link_delay_s: float = 0.02
    #: Run the scenarios in the order ``scenarios`` names them (default: :data:`SCENARIOS`'s).
    in_order: bool = False
    #: Run the link scenarios of one link (and codec) side by side: one Redis and link, one
    #: measured server for all, each request naming its scenario's load policy
    #: (:meth:`scenario_groups`, :func:`.link_scenario.run_link_scenarios`).
    side_by_side: bool = False

    def scenarios_to_run(self) -> tuple[Scenario, ...]:
        """The selected scenarios, in the order they run."""
        if self.in_order:
            by_name = {s.name: s for s in SCENARIOS}
            return tuple(by_name[n] for n in dict.fromkeys(self.scenarios))
        return tuple(s for s in SCENARIOS if s.name in self.scenarios)

    def scenario_groups(self) -> tuple[tuple[Scenario, ...], ...]:
        """The selected scenarios in the order they run, as the groups that run together: one
        scenario each, except with :attr:`side_by_side`, where the link scenarios of one link
        and codec form one group, at the place of the first of them."""
        groups: list[list[Scenario]] = []
        by_link: dict[tuple[str | None, str | None], list[Scenario]] = {}
        for sc in self.scenarios_to_run():
            if self.side_by_side and sc.link is not None:
                together = by_link.get((sc.link, sc.codec))
                if together is not None:
                    together.append(sc)
                    continue
                by_link[(sc.link, sc.codec)] = together = [sc]
                groups.append(together)
            else:
                groups.append([sc])
        return tuple(tuple(g) for g in groups)

    @classmethod
    def full(cls, **changes: Any) -> ServeBenchOptions:
        return cls(**changes)

    @classmethod
    def quick_preset(cls, **changes: Any) -> ServeBenchOptions:
        base: dict[str, Any] = {
            "rounds": 2,
            "long_doc": LongDocSpec(docs=4, doc_tokens=2048, question_tokens=32, answer_tokens=8),
            "chat": ChatSpec(
                sessions=4, system_tokens=512, user_tokens=256, answer_tokens=16, concurrency=2
            ),
            "probes": 2,
            "probe_repeats": 2,
            "probe_chunks": 8,
            "kv_pool_tokens": 4096,
            "cpu_bytes": 256 << 20,
            "quick": True,
        }
        base.update(changes)
        return cls(**base)

    @property
    def probe_tokens(self) -> int:
        return self.probe_chunks * self.chunk_size + 1

    @property
    def vocab(self) -> int:
        return int(self.model["vocab_size"])

    def validate(self) -> None:
        """Raises ValueError naming the field."""
        if self.rounds < 2:
            raise ValueError(
                f"rounds: at least 2 (a warm-up and a measured round), got {self.rounds}"
            )
        for name in (
            "probes",
            "probe_repeats",
            "probe_chunks",
            "kv_pool_tokens",
            "chunk_size",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size: {self.chunk_size} is not a multiple of block_size {self.block_size}"
            )
        for spec in (self.long_doc, self.chat):
            for f in dataclasses.fields(spec):
                if getattr(spec, f.name) < 1:
                    raise ValueError(f"{f.name}: must be at least 1, got {getattr(spec, f.name)}")
        for name in ("slow_link_rate", "slow_link_delay_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name}: must be a positive number, got {value}")
        if self.model_kind not in MODEL_CHOICES:
            raise ValueError(f"model: one of {', '.join(MODEL_CHOICES)}, got {self.model_kind!r}")
        if not self.scenarios:
            raise ValueError(f"scenarios: none given (known: {', '.join(SCENARIO_NAMES)})")
        unknown = [s for s in self.scenarios if s not in SCENARIO_NAMES]
        if unknown:
            raise ValueError(
                f"scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIO_NAMES)})"
            )
        if self.max_model_len() > self.kv_pool_tokens:
            raise ValueError(
                f"kv_pool_tokens: {self.kv_pool_tokens} cannot hold the longest request "
                f"({self.max_model_len()} tokens)"
            )

    def max_model_len(self) -> int:
        ld, ch = self.long_doc, self.chat
        longest = max(
            ld.doc_tokens + ld.question_tokens + ld.answer_tokens,
            ch.system_tokens + self.rounds * (ch.user_tokens + ch.answer_tokens),
            self.probe_tokens + ld.answer_tokens,
        )
        return -(-longest // self.block_size) * self.block_size

    def settings(self) -> dict[str, Any]:
        """The settings as plain data (for the JSON and the report)."""
        return {
            "quick": self.quick,
            "scenario_order": [s.name for s in self.scenarios_to_run()],
            "side_by_side": [[s.name for s in g] for g in self.scenario_groups() if len(g) > 1],
            "rounds": self.rounds,
            "long_doc_qa": dataclasses.asdict(self.long_doc),
            "chat": dataclasses.asdict(self.chat),
            "probes": self.probes,
            "probe_repeats": self.probe_repeats,
            "probe_tokens": self.probe_tokens,
            "kv_pool_tokens": self.kv_pool_tokens,
            "kv_pool_bytes": self.kv_pool_bytes,
            "max_model_len": self.max_model_len(),
            "chunk_size": self.chunk_size,
            "block_size": self.block_size,
            "lmprefetch_cpu_bytes": self.cpu_bytes,
            "model": dict(self.model),
            "model_kind": self.model_kind,
            "prompts": "English text" if self.prompt_corpus else "random token ids",
            "seed": self.seed,
            "slow_link": {
                "rate_bytes_per_s": self.slow_link_rate,
                "delay_ms": self.slow_link_delay_s * 1e3,
            },
        }

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool_tokens * kv_bytes_per_token(self.model)
