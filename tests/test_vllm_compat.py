"""The vLLM releases the connector runs on (0.30 to 0.34), on whichever of them is installed:
what it refuses and how (one line), what it turns off and says so once, the plugin that
registers it by name, and what ``may_load_async`` buys on vLLM 0.34's real scheduler
(``examples/bench_may_load_async.py``).

The nox sessions ``vllm-030``, ``vllm`` (0.32) and ``vllm-034`` run this module."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from .vllm_support import needs_plugin, vllm_imports

with vllm_imports():
    import vllm.distributed.kv_transfer.kv_connector.v1.base as vllm_base
    from vllm.config import KVTransferConfig, SchedulerConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import lmprefetch_vllm_plugin
    from lmprefetch.integration.vllm import LMPrefetchConnector, UnsupportedVLLMError, compat

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "examples" / "bench_may_load_async.py"
HAS_INFLIGHT_LOADS = "max_num_inflight_kv_loads" in {
    f.name for f in dataclasses.fields(SchedulerConfig)
}


# -- the range ----------------------------------------------------------------------------
def test_the_installed_vllm_has_what_the_connector_needs() -> None:
    assert compat.missing_requirements() == []
    compat.require_supported()


def test_the_vllm_types_the_connector_names_exist_in_the_installed_vllm() -> None:
    """The connector names vLLM's types (``Request``, ``KVCacheBlocks``, ...) in its signatures,
    imported only for type checkers; mypy cannot check them (vLLM is ``follow_imports =
    skip``: every vLLM name is ``Any`` to it), and the imports never run.  So each is imported
    here, on every vLLM of the range: a name moved or renamed is a signature that lies."""
    import ast

    package = Path(compat.__file__).parent
    named: list[tuple[str, str, str]] = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                named += [
                    (path.name, stmt.module, alias.name)
                    for stmt in node.body
                    if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("vllm")
                    for alias in stmt.names
                ]
    assert {"Request", "KVCacheBlocks", "SchedulerOutput", "VllmConfig"} <= {n for *_, n in named}
    missing = [
        f"{module}.{name} ({where})"
        for where, module, name in named
        if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []


def test_a_vllm_without_what_the_connector_needs_is_refused_in_one_line() -> None:
    class OldBase:  # no bind_kv_cache_manager: nothing could be saved
        pass

    @dataclasses.dataclass
    class Results:  # finished sets, but no request-level failed_recving
        finished_sending: set[str]
        finished_recving: set[str]

    old_module = types.SimpleNamespace(KVConnectorTransferResults=Results)
    with pytest.raises(UnsupportedVLLMError) as info:
        compat.require_supported(OldBase, old_module)
    message = str(info.value)
    assert "\n" not in message
    assert f"vLLM {compat.vllm_version()} has no" in message
    assert "supports vLLM 0.30 to 0.34" in message
    assert "bind_kv_cache_manager" in message and "failed_recving" in message
    # Either feature alone is enough to refuse.
    assert compat.missing_requirements(vllm_base.KVConnectorBase_V1, old_module) == [
        "request-level failed_recving (KVConnectorTransferResults)"
    ]
    assert compat.missing_requirements(OldBase, vllm_base) == [
        "KVConnectorBase_V1.bind_kv_cache_manager (what to save)"
    ]


def test_an_old_vllm_is_refused_at_start_up_with_one_line_not_an_import_error() -> None:
    """As vLLM loads the connector (importing its module): the process ends with one line
    that names the installed version and the supported range."""
    code = (
        "import vllm.distributed.kv_transfer.kv_connector.v1.base as base\n"
        "del base.KVConnectorTransferResults, base.KVConnectorBase_V1.bind_kv_cache_manager\n"
        "import importlib\n"
        "importlib.import_module('lmprefetch.integration.vllm')\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore", VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "lmprefetch.integration.vllm.compat.UnsupportedVLLMError: lmprefetch's vLLM connector "
        f"supports vLLM 0.30 to 0.34; the installed vLLM {compat.vllm_version()} has no "
    ), last
    assert "ImportError" not in done.stderr


def test_the_connector_refuses_to_be_built_on_an_old_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(vllm_base, "KVConnectorTransferResults")
    with pytest.raises(UnsupportedVLLMError, match="supports vLLM 0.30 to 0.34"):
        LMPrefetchConnector(None, vllm_base.KVConnectorRole.SCHEDULER, None)


def test_each_missing_feature_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a vLLM without ``cache_hit_source`` (0.30, 0.31) and ``may_load_async`` (before
    0.34), each is said once, with what lmprefetch turns off."""
    monkeypatch.setattr(compat, "CacheHitSource", None)
    monkeypatch.delattr(vllm_base.KVConnectorBase_V1, "may_load_async", raising=False)
    monkeypatch.setattr(compat, "_logged", False)
    logger = logging.getLogger("test-compat")
    with caplog.at_level(logging.WARNING, logger="test-compat"):
        lines = compat.log_degradations(logger)
        assert compat.log_degradations(logger) == []
    version = compat.vllm_version()
    assert lines == [
        f"vLLM {version} has no vllm.v1.metrics.cache_hit_source: splitting lmprefetch's hits "
        "by tier (host, disk, remote) in vLLM's metrics is off",
        f"vLLM {version} has no KVConnectorBase_V1.may_load_async: starting lmprefetch's loads "
        "while the running batch is full is off",
    ]
    assert [r.getMessage() for r in caplog.records] == lines


def test_what_this_vllm_lacks_is_what_compat_turns_off() -> None:
    """The degradations follow the installed vLLM's features, not its version number."""
    missing = {d.missing for d in compat.degradations()}
    has_sources = importlib.util.find_spec("vllm.v1.metrics.cache_hit_source") is not None
    assert ("vllm.v1.metrics.cache_hit_source" in missing) is not has_sources
    has_hook = callable(getattr(vllm_base.KVConnectorBase_V1, "may_load_async", None))
    assert ("KVConnectorBase_V1.may_load_async" in missing) is not has_hook
    if not has_sources:  # vLLM never asks; the connector would have no names to answer with
        assert LMPrefetchConnector.get_external_cache_hit_sources(None, None, 64) == {}  # type: ignore[arg-type]


# -- registration by name ----------------------------------------------------------------------
@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """vLLM's connector registry, restored afterwards."""
    fresh = dict(KVConnectorFactory._registry)
    fresh.pop(lmprefetch_vllm_plugin.CONNECTOR_NAME, None)
    monkeypatch.setattr(KVConnectorFactory, "_registry", fresh)
    return fresh


def test_the_plugin_registers_the_connector_under_its_class_name(registry: dict[str, Any]) -> None:
    lmprefetch_vllm_plugin.register()
    lmprefetch_vllm_plugin.register()  # vLLM calls plugins once per process; twice is fine
    cls = KVConnectorFactory.get_connector_class_by_name("LMPrefetchConnector")
    assert cls is LMPrefetchConnector
    assert cls.__name__ == "LMPrefetchConnector"  # MultiConnector looks children up by it
    # A configuration with the name alone finds the class (a module path would still win).
    config = KVTransferConfig(kv_connector="LMPrefetchConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is LMPrefetchConnector


def test_a_name_taken_by_another_package_is_left_alone(registry: dict[str, Any]) -> None:
    def theirs() -> type:
        return object

    registry["LMPrefetchConnector"] = theirs
    lmprefetch_vllm_plugin.register()  # no error
    assert registry["LMPrefetchConnector"] is theirs


@needs_plugin
def test_vllm_loads_the_installed_plugin(
    registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry point, as vLLM finds it in the installed metadata of lmprefetch."""
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    assert KVConnectorFactory.get_connector_class_by_name("LMPrefetchConnector") is (
        LMPrefetchConnector
    )


# -- speculative decoding ----------------------------------------------------------------------
def test_lookahead_block_hashes_are_not_claimed() -> None:
    """lmprefetch keys a chunk by its own tokens, never by the tokens after it, so it does not
    support vLLM's lookahead block hashes (vLLM 0.34 then keeps its EAGLE block drop)."""
    config = KVTransferConfig(
        kv_connector="LMPrefetchConnector",
        kv_connector_module_path="lmprefetch.integration.vllm",
        kv_role="kv_both",
    )
    assert LMPrefetchConnector.supports_lookahead_block_hashes(config) is False
    assert (
        KVConnectorFactory.get_connector_class(config).supports_lookahead_block_hashes(config)
        is False
    )


# -- may_load_async on vLLM 0.34's scheduler -------------------------------------------------
def _load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_may_load_async", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_may_load_async_gets_a_queued_hit_its_first_token_sooner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The benchmark of docs/benchmarks.md, run once (vLLM 0.34): with the running batch full,
    loads capped and three requests queued before it, the hit request's load starts at once
    with the hook and its first token comes with the first free slot; without, it waits its
    turn.  A vLLM without the hook: the benchmark says so in one line and exits with 2."""
    bench = _load_bench()
    if not HAS_INFLIGHT_LOADS:
        assert bench.main([]) == 2
        assert capsys.readouterr().err.strip() == (
            f"bench_may_load_async: vLLM {compat.vllm_version()} has no "
            "max_num_inflight_kv_loads (may_load_async, vLLM 0.34): nothing to measure"
        )
        return
    off = bench.run(bench.Scenario(), False, tmp_path)
    on = bench.run(bench.Scenario(), True, tmp_path)
    assert on["lmprefetch_hit_tokens"] == off["lmprefetch_hit_tokens"] == 512
    assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] == 8
    assert on["steps_to_load"] == 1  # loaded while the batch was full
    assert off["steps_to_load"] == off["steps_to_first_token"]  # loaded when admitted
    assert on["steps_to_first_token"] < off["steps_to_first_token"]
