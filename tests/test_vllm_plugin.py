"""lmprefetch's vLLM plugin without vLLM: it is declared where vLLM looks for it, and importing
it costs a vLLM process nothing (vLLM imports it in every process, lmprefetch configured or
not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_the_entry_point_is_declared_for_vllm() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"lmprefetch": "lmprefetch_vllm_plugin:register"}


def python(code: str) -> str:
    """What a fresh interpreter prints running ``code`` in the repository."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return done.stdout


def test_importing_the_plugin_imports_nothing_heavy() -> None:
    """Neither torch, vLLM, Trio, ZeroMQ nor lmprefetch itself (its engine)."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import lmprefetch_vllm_plugin\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    assert python(code).split() == ["lmprefetch_vllm_plugin"]


def test_register_without_vllm_does_nothing() -> None:
    """vLLM absent (or without a connector factory): nothing to register, no error."""
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None  # import vllm raises ImportError\n"
        "import lmprefetch_vllm_plugin\n"
        "lmprefetch_vllm_plugin.register()\n"
        "print('ok')\n"
    )
    assert python(code).strip() == "ok"
