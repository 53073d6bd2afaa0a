"""Worker: the process group's start. ``absent``: MPI rank 2 never calls
``init_process_group`` (it sleeps, then leaves); the others must name it within the
timeout. ``settings``: MPI rank 1 asks for another algorithm; every process must refuse.
Each process reports what it saw."""

from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

import nccltree as nt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from counting import report

mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
me = MPI.COMM_WORLD.Get_rank()
out: dict[str, object] = {"rank": me}
t0 = time.monotonic()
if mode == "absent" and me == 2:
    time.sleep(3 * timeout)
    out["seen"] = "slept"
    report(out, me)
    os._exit(0)
algorithm = "tree" if mode == "settings" and me == 1 else "auto"
try:
    pg = nt.init_process_group(algorithm=algorithm, timeout=timeout)
    out["seen"] = "started"
    pg.close()
except (nt.CommError, ValueError) as exc:
    out["seen"] = f"{type(exc).__name__}: {exc}"
out["took"] = time.monotonic() - t0
report(out, me)
