"""LMCache 0.5.6 beside lmprefetch: the engine benchmark's workload, both measured in one run.

    python examples/bench_lmcache_peer.py [--chunks 16] [--chunk-bytes 2097152] [--repeats 50]
                                          [--json]

Runs only where ``lmcache`` is importable (``nox -s lmcache`` installs it); elsewhere it says so
and exits 0.  It is ``lmprefetch bench-engine --lmcache on``: 16 chunks × 2 MiB per lookup; a
CPU hit, a disk hit (files in the page cache), a full miss, and 8 concurrent disk lookups of 8
different prompts; one LMCache sample beside each lmprefetch sample (they alternate, so both see
the same machine), medians over ``--repeats`` (``max(3, repeats // 5)`` for the 8-way case),
and the median of the per-pair ratios with its interquartile range.

What is measured on the LMCache side is described in :mod:`lmprefetch.bench.lmcache_peer`: a
real ``LMCacheEngine`` with async loading, CPU and disk backends, timed from
``async_lookup_and_prefetch`` to its ``send_response_to_scheduler``, plus
``cleanup_memory_objs``.  lmprefetch's side is ``Engine.lookup_and_prefetch`` plus the
``claim`` block that releases the result, in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys

from lmprefetch.bench.engine import format_report, run
from lmprefetch.bench.lmcache_peer import lmcache_available


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-bytes", type=int, default=2 * 1024 * 1024)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not lmcache_available():
        print("lmcache is not installed: nothing to compare (nox -s lmcache installs it)")
        return 0
    r = run(args.chunks, args.chunk_bytes, args.repeats, lmcache="on")
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    lmc = r["lmcache"]
    return 0 if lmc["answers_ok"] and r["idle_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
