"""``python -m nccltree.run``: the same as ``nccltree-run`` (see :mod:`nccltree.cli.run`)."""

from __future__ import annotations

import sys

from .cli.run import main

if __name__ == "__main__":
    sys.exit(main())
