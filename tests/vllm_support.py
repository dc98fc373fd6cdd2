"""What every vLLM test module does before it imports vLLM, in one place, and the two shims
vLLM 0.34's official wheel needs on this CPU-only machine (they live here, never in the
package).

* :func:`vllm_imports`: a context manager around a test module's vLLM imports: the CPU
  platform, no downloads, vLLM's import-time warnings silenced (the suite turns warnings into
  errors), the module skipped where vLLM, torch or trio is missing, and the shims applied.
* :func:`skip_without_vllm`: the same for modules that run vLLM in child processes only.
* :func:`model_runner_output`: vLLM's ``ModelRunnerOutput`` built from the fields the installed
  vLLM has (0.34 dropped ``req_id_to_index``; the scheduler never read it).

The shims:

* **Triton.**  vLLM 0.34 refuses x86 CPUs without Triton-CPU when it validates a config
  (``CpuPlatform.check_and_update_config``); the scheduler-level tests run no kernel, so where
  the platform asks for it and Triton is missing, ``vllm.triton_utils.HAS_TRITON`` is set.  A
  vLLM that does not ask (0.30 to 0.32) is left alone.
* **ModelRunnerOutput**: above.

Run a script under these shims (the ``may_load_async`` benchmark on vLLM 0.34):
``python -m tests.vllm_support examples/bench_may_load_async.py [ARGS]``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import runpy
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from lmprefetch.client import LookupClient
    from lmprefetch.runtime import WorkerRuntime
    from lmprefetch.worker_statistics import WorkerStatistics

__all__ = [
    "PLUGIN_INSTALLED",
    "apply_shims",
    "assert_worker_idle",
    "expected_sources",
    "model_runner_output",
    "needs_plugin",
    "skip_without_vllm",
    "vllm_imports",
    "vllm_version",
    "wait_worker_quiet",
]


def _plugin_installed() -> bool:
    """lmprefetch's ``vllm.general_plugins`` entry point is in the installed metadata (an
    install from before it existed lacks it: ``pip install -e .`` again)."""
    import importlib.metadata

    return any(
        ep.name == "lmprefetch" and ep.value == "lmprefetch_vllm_plugin:register"
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
    )


#: Whether vLLM processes started here register ``LMPrefetchConnector`` by name.
PLUGIN_INSTALLED = _plugin_installed()
#: Marks a test that configures the connector by name alone.
needs_plugin = pytest.mark.skipif(
    not PLUGIN_INSTALLED,
    reason="lmprefetch's vllm.general_plugins entry point is not installed here (an install "
    "from before it existed): pip install -e .",
)


def _cpu_defaults() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def skip_without_vllm() -> None:
    """Skip the calling test module unless vLLM imports (the CPU platform, offline)."""
    _cpu_defaults()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm")


@contextmanager
def vllm_imports() -> Iterator[None]:
    """Wrap a test module's vLLM imports (see the module docstring)."""
    _cpu_defaults()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm")
        pytest.importorskip("torch")
        pytest.importorskip("trio")
        apply_shims()
        yield


def apply_shims() -> list[str]:
    """Apply the shims this vLLM needs here; returns what was done (for a log line)."""
    done = []
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = inspect.getsource(CpuPlatform.check_and_update_config)
    if "HAS_TRITON" in check and not triton_utils.HAS_TRITON:
        triton_utils.HAS_TRITON = True
        done.append("vllm.triton_utils.HAS_TRITON = True (no Triton-CPU; no kernel runs)")
    return done


def model_runner_output(**fields: Any) -> Any:
    """``ModelRunnerOutput(**fields)`` without the fields the installed vLLM does not have."""
    from vllm.v1.outputs import ModelRunnerOutput

    known = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    return ModelRunnerOutput(**{k: v for k, v in fields.items() if k in known})


def expected_sources(**tokens_by_source: int) -> dict[Any, int]:
    """What ``get_external_cache_hit_sources`` answers, e.g. ``expected_sources(HOST=64)``:
    vLLM's ``CacheHitSource`` names (0.32), or nothing on a vLLM without them (it never asks,
    and the connector has no names to answer with)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return {}
    return {getattr(CacheHitSource, name): n for name, n in tokens_by_source.items()}


def wait_worker_quiet(
    client: LookupClient, runtime: WorkerRuntime, probe: str, timeout_s: float
) -> WorkerStatistics:
    """Wait until the worker has handled every message ``client`` sent so far, and no lookup
    task is alive; return the worker's statistics.

    A probe lookup under the fresh id ``probe`` (no whole chunk: answered 0 at once, holding
    nothing) is queued behind everything sent before on the same socket; its answer proves
    the worker handled those (e.g. a cleanup).  Then ``Engine.wait_quiet`` (a Trio event)
    under the deadline.
    """
    import trio

    assert client.lookup(probe, [1]) is None
    assert client.wait(probe, timeout_s) == 0
    client.forget(probe)
    engine = runtime.engine

    async def quiet() -> None:
        with trio.fail_after(timeout_s):
            await engine.wait_quiet()

    runtime.call(quiet)
    return runtime.statistics()


def assert_worker_idle(stats: WorkerStatistics) -> None:
    """Nothing in flight or held, no pin, no limiter weight, no arena slot but the CPU tier's."""
    engine = stats.engine
    assert engine.lookups.inflight == 0
    assert engine.lookups.held == 0
    assert engine.pinned_chunks == 0
    assert engine.limiter.used == 0
    assert engine.arena.used_bytes == engine.cpu_resident_bytes


def vllm_version() -> str:
    from lmprefetch.integration.vllm.compat import vllm_version as version

    return version()


def main(argv: list[str]) -> int:
    """``python -m tests.vllm_support SCRIPT [ARGS]``: run SCRIPT as ``__main__`` under the
    shims."""
    if not argv:
        print("usage: python -m tests.vllm_support SCRIPT [ARGS]", file=sys.stderr)
        return 2
    _cpu_defaults()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm  # noqa: F401

        for line in apply_shims():
            print(f"vllm_support: {line}", file=sys.stderr)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
