"""Worker: process groups split into sub-groups (4 processes): by parity with keys that
reverse the order, new_group of two ranks, collectives in the sub-groups and the parent
interleaved, each against numpy. One JSON report per process."""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counting import report  # noqa: E402

xp = np
devices = "cpu"
if "--fake" in sys.argv:  # GPU groups on the fake of CuPy's layer (wiring only)
    sys.path.insert(0, os.path.dirname(HERE))
    import fakecupy

    fakecupy.private_kernel_cache()
    installed = fakecupy.install(n_gpus=4)
    fake = installed.__enter__()
    fake.mpi_comm = MPI.COMM_WORLD
    import cupy

    xp = cupy  # type: ignore[assignment]
    devices = "gpu"

import nccltree as nt  # noqa: E402


def host(a: object) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else xp.asnumpy(a)


pg = nt.init_process_group(devices=devices, algorithm=os.environ.get("ALG", "tree"))
me, n = pg.rank, pg.size
failures: list[str] = []

# parity groups, higher ranks first within a group
half = pg.split(me % 2, key=n - me)
assert half is not None
members = sorted((r for r in range(n) if r % 2 == me % 2), reverse=True)
if half.size != len(members) or half.rank != members.index(me):
    failures.append(f"split: rank {half.rank} of {half.size}, expected "
                    f"{members.index(me)} of {len(members)}")  # fmt: skip
for round_ in range(3):
    x = xp.asarray(np.full(1000, me + 1, np.float32))
    half.all_reduce(x)  # the sub-group ...
    if not np.all(host(x) == sum(r + 1 for r in members)):
        failures.append(f"round {round_}: parity all_reduce {host(x)[0]}")
    y = xp.asarray(np.full(10, me + 1, np.float64))
    pg.all_reduce(y)  # ... and the parent, interleaved
    if not np.all(host(y) == n * (n + 1) / 2):
        failures.append(f"round {round_}: parent all_reduce {host(y)[0]}")
    g = xp.asarray(np.zeros(len(members) * 3, np.float32))
    half.all_gather(xp.asarray(np.full(3, me, np.float32)), g)
    if not np.array_equal(host(g), np.repeat(np.array(members, np.float32), 3)):
        failures.append(f"round {round_}: parity all_gather {host(g)}")

pair = pg.new_group([3, 1])
if me in (1, 3):
    assert pair is not None
    z = xp.asarray(np.full(4, me, np.float32))
    pair.broadcast(z, root=0)  # the pair's rank 0 is global rank 3
    if pair.rank != [3, 1].index(me) or not np.all(host(z) == 3):
        failures.append(f"new_group: rank {pair.rank}, broadcast {host(z)[0]}")
    pair.close()
elif pair is not None:
    failures.append("new_group: a group for a process outside it")
half.close()
w = xp.asarray(np.full(2, 1.0))
pg.all_reduce(w)  # the parent still works after its sub-groups closed
if not np.all(host(w) == n):
    failures.append("parent after close")
pg.close()
report({"rank": me, "failures": failures}, me)
