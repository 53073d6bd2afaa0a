"""Put this folder first on PYTHONPATH to make mpi4py unimportable in a process (as on a
machine without it): ``import mpi4py`` then raises ImportError."""

import sys

sys.modules["mpi4py"] = None  # type: ignore[assignment]
