"""Worker: the host process-group grid (tests/mpi/grid_cases.py: every collective x
algorithm x dtype x op x count, against numpy and bitwise against the in-process World)
on a group started without MPI, as the environment says (torchrun's or Slurm's
variables, or nccltree-run). Writes one JSON report per process to $NCCLTREE_TEST_OUT.

    RANK=0 WORLD_SIZE=2 ... python tests/pg_nompi/grid.py [--devices cpu:2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "mpi"))
from grid_cases import check_group  # noqa: E402

import nccltree as nt  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--devices", default="cpu")
p.add_argument("--algorithms", default="tree,ring,direct,auto")
p.add_argument("--counts", default="1,1000,70001")
p.add_argument("--dtypes", default="float32,int32")
p.add_argument("--ops", default="sum,max")
p.add_argument("--init-method", default=None)
args = p.parse_args()

failures: list[str] = []
checked = 0
for alg in args.algorithms.split(","):
    pg = nt.init_process_group(devices=args.devices, algorithm=alg, timeout=60,
                               init_method=args.init_method)  # fmt: skip
    checked += check_group(pg, alg, args.dtypes.split(","), args.ops.split(","),
                           [int(c) for c in args.counts.split(",")], failures)  # fmt: skip
    if alg == "auto" and len(pg.ranks) == 1:
        # a split without MPI (through the bootstrap): the even and the odd ranks
        sub = pg.split(pg.rank % 2, key=pg.size - pg.rank)
        assert sub is not None
        x = sub.all_reduce(__import__("numpy").full(3, float(pg.rank)))
        want = float(sum(r for r in range(pg.size) if r % 2 == pg.rank % 2))
        if not (x == want).all():
            failures.append(f"split: {x} != {want}")
        sub.close()
    pg.close()
report = {"rank": pg.rank, "ranks": list(pg.ranks), "size": pg.size, "nodes": pg.nodes,
          "checked": checked, "failures": failures[:20], "nfail": len(failures),
          "mpi4py_loaded": sys.modules.get("mpi4py") is not None}  # fmt: skip
out = os.environ.get("NCCLTREE_TEST_OUT")
text = json.dumps(report)
print(text, flush=True)
if out:
    with open(os.path.join(out, f"{pg.rank}.json"), "w") as f:
        f.write(text)
