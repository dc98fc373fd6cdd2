"""``python -m lmprefetch``: the ``lmprefetch`` command.

The signals are taken in hand before the command's module is imported (the console script
cannot: it imports ``lmprefetch.cli`` first), so a Ctrl-C or a SIGTERM from the very start
ends it with one line.
"""

import sys

from . import _stopping

with _stopping.handling():
    try:
        from .cli import main
    except _stopping.Stopped as exc:
        print(f"lmprefetch: {exc.what}", file=sys.stderr)
        sys.exit(128 + exc.signum)
    status = main()
sys.exit(status)
