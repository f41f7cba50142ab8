"""``python -m ecekern.captures``: :func:`ecekern.captures.runner.main`."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
