"""``python -m lmprefetch``: the ``lmprefetch`` command.

The signals are taken in hand before the command's module is imported (the console script
cannot: it imports ``lmprefetch.cli`` first), so a Ctrl-C or a SIGTERM from the very start
ends it with one line.
"""

import signal
import sys

try:
    from . import _stopping

    with _stopping.handling(restore=False):
        from .cli import main

        status = main()
except KeyboardInterrupt as exc:  # while Python imports the command (Stopped is one too)
    signum = getattr(exc, "signum", signal.SIGINT)
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    print(f"lmprefetch: {what}", file=sys.stderr)
    status = 128 + signum
sys.exit(status)
