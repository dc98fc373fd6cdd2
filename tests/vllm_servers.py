"""vLLM's OpenAI server (CPU build) for tests: a tiny random-weight Llama served by child
processes on free loopback ports, with or without lmprefetch's connector.

Servers are started and stopped by their own process group (``lmprefetch.bench.serve.procs``);
vLLM's own prefix cache is off unless a server's :class:`ServerOptions` turn it on, so every
cached token a response reports was served by lmprefetch.  Import this only from a test module
that has skipped itself without vLLM and httpx (``pytest.importorskip``).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from lmprefetch.bench.serve.client import Completion, complete, metrics_delta, scrape_metrics
from lmprefetch.bench.serve.model import TINY_LLAMA, kv_bytes_per_token
from lmprefetch.bench.serve.procs import ManagedProcess, ProcessSet, free_port
from lmprefetch.bench.serve.servers import base_env, private_dirs, server_argv

CHUNK = 64
BLOCK = 32
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0

SHARED = [(i * 37) % 991 + 3 for i in range(192)]
#: Two prompts sharing a 3-chunk prefix; a third one unrelated to them.
P1 = [*SHARED, 5, 6, 7, 8, 9, 10, 11, 12]  # 200 tokens: 3 whole chunks
P2 = SHARED + [(i * 11) % 991 + 3 for i in range(90)]  # 282 tokens: 4 whole chunks
P3 = [(i * 13) % 991 + 3 for i in range(200)]  # 200 tokens: 3 whole chunks
#: Prompts that together fill vLLM's whole KV pool (POOL_TOKENS) more than once, so that no
#: block still holds a previous request's KV: what a later request finds in its blocks is
#: what was computed or loaded for it.
POOL_TOKENS = 2048
FILLERS = [[(i * 17 + k) % 991 + 3 for i in range(960)] for k in range(3)]


def whole_chunks(prompt: Sequence[int]) -> int:
    return len(prompt) // CHUNK * CHUNK


def connector_config(*, by_name: bool = False, **extra: Any) -> dict[str, Any]:
    """lmprefetch's ``--kv-transfer-config``: by module path, or (``by_name``) by the name its
    vLLM plugin registers (needs lmprefetch installed, entry point and all)."""
    module = {} if by_name else {"kv_connector_module_path": "lmprefetch.integration.vllm"}
    return {
        "kv_connector": "LMPrefetchConnector",
        **module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # A generous lookup deadline: a busy machine must not turn a hit into a miss.
        "kv_connector_extra_config": {
            "chunk_size": CHUNK,
            "cpu_bytes": 64 << 20,
            "lookup_timeout_s": 120.0,
            **extra,
        },
    }


class Server:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def complete(self, prompt: Sequence[int]) -> Completion:
        with trio.fail_after(REQUEST_TIMEOUT_S):
            return await complete(self.client, "bench", prompt, 8)

    async def metrics_after(self, before: dict[str, float], requests: int) -> dict[str, float]:
        """The metrics' change once they count ``requests`` more finished requests (vLLM
        records a request just after its stream ends)."""
        with trio.fail_after(60):
            while True:
                delta = metrics_delta(before, await scrape_metrics(self.client))
                if delta["queue_count"] >= requests and delta["prefill_count"] >= requests:
                    return delta
                await trio.sleep(0.05)


def write_random_llama(directory: Path) -> Path:
    """TINY_LLAMA with real random weights (transformers' initialisation, normal with std
    0.02), written as safetensors.  vLLM's dummy weights (uniform in +-1e-3) make the attention
    output so small that the generated tokens hardly depend on the KV cache: a KV copy that
    was skipped or went to the wrong blocks would go unnoticed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@dataclass(frozen=True)
class ServerOptions:
    """How one server differs from the others: vLLM's own prefix cache (off by default, so
    that every cached token is lmprefetch's), more command-line arguments, more environment."""

    prefix_caching: bool = False
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None


@asynccontextmanager
async def vllm_servers(
    tmp: Path,
    configs: Sequence[dict[str, Any] | None],
    *,
    options: Sequence[ServerOptions] | None = None,
    model: Path | None = None,
) -> AsyncIterator[list[Server]]:
    """One vLLM server per entry of ``configs`` (a ``--kv-transfer-config``, or None), with
    the matching ``options``, serving ``model`` (default: the tiny random Llama)."""
    if model is None:
        model = write_random_llama(tmp / "model")
    per_server = list(options) if options is not None else [ServerOptions()] * len(configs)
    assert len(per_server) == len(configs)
    async with private_dirs() as (_, runtime), trio.open_nursery() as nursery:
        procs = ProcessSet(nursery)
        servers = []
        try:
            for i, (config, opts) in enumerate(zip(configs, per_server)):
                port = free_port()
                argv = server_argv(
                    sys.executable,
                    model,
                    port,
                    max_model_len=1024,
                    block_size=BLOCK,
                    kv_pool_bytes=POOL_TOKENS * kv_bytes_per_token(TINY_LLAMA),
                    prefix_caching=opts.prefix_caching,
                    kv_transfer_config=config,
                    load_format="safetensors",
                )
                env = base_env(runtime)
                env.update(opts.env or {})
                proc = ManagedProcess(
                    f"server {i}", [*argv, *opts.args], env, "Application startup complete",
                    cwd=tmp, port=port,
                )  # fmt: skip
                await procs.start(proc, STARTUP_TIMEOUT_S)
                client = httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}",
                    timeout=REQUEST_TIMEOUT_S,
                    trust_env=False,
                )
                servers.append(Server(client))
            yield servers
        finally:
            for server in servers:
                await server.client.aclose()
            await procs.stop_all()
