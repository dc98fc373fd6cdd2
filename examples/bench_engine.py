"""The engine benchmark (16 chunks × 2 MiB): ``python examples/bench_engine.py``.

Same as ``lmprefetch bench-engine``; prints each figure beside the raw read of the same files.
"""

from __future__ import annotations

import sys

from lmprefetch.bench.engine import format_report, run


def main(argv: list[str]) -> int:
    repeats = int(argv[1]) if len(argv) > 1 else 50
    result = run(repeats=repeats)
    print(format_report(result))
    return 0 if result["idle_after"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
