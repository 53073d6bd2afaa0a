"""Worker: rank numbering, cross-node bytes, symmetric buffers, re-initialisation.
Prints one JSON line per process."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import nccltree as nt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from counting import CountingComm, report

counting = CountingComm(MPI.COMM_WORLD)
out: dict[str, object] = {"mpi_rank": MPI.COMM_WORLD.Get_rank()}
pg = nt.init_process_group(comm=counting, algorithm="tree", timeout=30)
out.update(rank=pg.rank, size=pg.size, node=pg.node, local_rank=pg.local_rank,
           local_size=pg.local_size, nodes=pg.nodes)  # fmt: skip
# cross-node bytes of one 64 Ki-element float32 all_reduce, counted at the MPI layer,
# against the plan's transfers between nodes (the tree's top-level edges)
count = 1 << 16
counting.reset()
x = np.full(count, pg.rank + 1.0, np.float32)
pg.all_reduce(x)
out["sum_ok"] = bool(np.all(x == sum(range(1, pg.size + 1))))
out["remote_bytes"] = counting.remote_bytes
out["local_bytes"] = counting.local_bytes
out["collectives"] = counting.collectives
node_of = [pg.placement.node_of_proc[pg.placement.proc_of_rank[r]] for r in range(pg.size)]
plan = pg.plan("all_reduce", count, algorithm="tree", in_place=True)
out["plan_cross_bytes"] = 4 * sum(c for a, b, c in plan.transfers() if node_of[a] != node_of[b])
# symmetric buffers: used in place, no mirror
y = pg.empty(1000, np.float64)
y[:] = pg.rank
pg.all_reduce(y, op="max")
out["symmetric_ok"] = bool(np.all(y == pg.size - 1))
pg.close()
# a second group after close
pg2 = nt.init_process_group(algorithm="direct", timeout=30)
z = np.ones(10, np.float32)
pg2.all_reduce(z)
out["again_ok"] = bool(np.all(z == pg2.size))
# asynchronous calls keep their order, and a synchronous one waits for them
total = sum(range(1, pg2.size + 1))
xs = [np.full(1000, pg2.rank + 1.0) * (i + 1) for i in range(5)]
works = [pg2.all_reduce(x, async_op=True) for x in xs]
w = np.ones(7, np.float32)
pg2.all_reduce(w)
out["async_ok"] = bool(
    all(np.all(wk.result() == total * (i + 1)) for i, wk in enumerate(works))
    and all(wk.is_completed() for wk in works)
    and np.all(w == pg2.size)
)
s = pg2.devices[0].new_stream()
v = np.full(3, pg2.rank + 1.0)
pg2.all_reduce(v, stream=s)
s.synchronize(30)
out["stream_ok"] = bool(np.all(v == total))
pg2.close()
report(out, out["mpi_rank"])
