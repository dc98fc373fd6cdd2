import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the command: no traceback
    sys.exit(130)

sys.exit(main())
