"""The benchmarks that ship with lmprefetch (they must run after ``pip install``).

* ``lmprefetch bench`` — the main job, the whole system (worker processes, lookups over ipc,
  a chat workload with aborts): :mod:`.system`, with its workload (:mod:`.workload`), the
  processes it starts (:mod:`.processes`), its measurements (:mod:`.measure`) and its report
  (:mod:`.report`).
* ``lmprefetch bench-engine`` — the engine alone against the raw read of its files:
  :mod:`.engine`, with LMCache 0.5.6 beside it when installed (:mod:`.lmcache_peer`).
* ``lmprefetch bench-disk`` — every disk figure that has a goal, alone and beside CPU-bound
  processes, LMCache alternating with it: :mod:`.disk`.
* ``lmprefetch bench-serve`` — time to first token on vLLM's OpenAI server, lmprefetch beside
  vLLM's own prefix cache and LMCache: the package :mod:`.serve` (its Mooncake and slow-link
  scenarios run in a private network namespace, :mod:`.netns`).

Each figure with a goal is marked when missed (:mod:`.goals`).

Every figure is printed beside the peer or the physical limit measured in the same run.  The
command line imports these modules lazily, so ``lmprefetch worker`` never pays for them.
"""

from __future__ import annotations

from .system import BenchOptions as BenchOptions
from .system import add_arguments as add_arguments
from .system import main as main
from .system import run_bench as run_bench

__all__ = ["BenchOptions", "add_arguments", "main", "run_bench"]
