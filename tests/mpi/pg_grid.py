"""Worker: every collective x algorithm x dtype x op x placement on a process group,
checked against numpy and, bitwise, against an in-process World of the same ranks and
topology. Prints one JSON line per process: what was checked, what failed, and what the
MPI layer saw (collectives after bootstrap, payload bytes to other nodes).

    mpiexec -n 3 python tests/mpi/pg_grid.py [--devices cpu:2] [--algorithms tree,ring]
"""

from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

import nccltree as nt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from counting import CountingComm, report
from grid_cases import check_group

p = argparse.ArgumentParser()
p.add_argument("--devices", default="cpu")
p.add_argument("--algorithms", default="tree,ring,direct,mpi,auto")
p.add_argument("--counts", default="1,5,1000,70001")
p.add_argument("--dtypes", default="float32,float64,int32,float16")
p.add_argument("--ops", default="sum,mean,max,prod")
args = p.parse_args()

counting = CountingComm(MPI.COMM_WORLD)
failures: list[str] = []
checked = 0
seen: dict[str, object] = {}
DTYPES = args.dtypes.split(",")
OPS = args.ops.split(",")
counts = [int(c) for c in args.counts.split(",")]
for alg in args.algorithms.split(","):
    pg = nt.init_process_group(comm=counting, devices=args.devices, algorithm=alg, timeout=30)
    counting.reset()
    n = pg.size
    checked += check_group(pg, alg, DTYPES, OPS, counts, failures)
    seen[alg] = {
        "collectives_after_init": counting.collectives,
        "payload_to_other_nodes": counting.remote_bytes,
        "payload_within_node": counting.local_bytes,
        "sent_bytes": pg.sent_bytes,
    }
    pg.close()
summary = {"ranks": list(pg.ranks), "nodes": pg.nodes, "checked": checked,
           "failures": failures[:20], "mpi": seen}  # fmt: skip
report(summary, MPI.COMM_WORLD.Get_rank())
