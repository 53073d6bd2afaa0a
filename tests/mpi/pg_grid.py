"""Worker: every collective x algorithm x dtype x op x placement on a process group,
checked against numpy and, bitwise, against an in-process World of the same ranks and
topology. Prints one JSON line per process: what was checked, what failed, and what the
MPI layer saw (collectives after bootstrap, payload bytes to other nodes).

    mpiexec -n 3 python tests/mpi/pg_grid.py [--devices cpu:2] [--algorithms tree,ring]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np
from mpi4py import MPI

import nccltree as nt
from nccltree.backends.base import FLOAT_DTYPES
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.faces import driver_method

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from counting import CountingComm, report

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
    ref = nt.World(nt.devices(f"cpu:{n}"), algorithm="tree" if alg in ("auto", "mpi") else alg,
                   topology=pg.topology)  # fmt: skip
    for coll, dtype, op, count, in_place in itertools.product(
        ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "gather",
         "scatter", "all_to_all", "sendrecv"),
        DTYPES, OPS, counts, (False, True),
    ):  # fmt: skip
        c = COLLECTIVES[coll]
        is_float = np.dtype(dtype) in FLOAT_DTYPES
        if op == "mean" and not is_float:
            continue
        if (not c.reduces and op != "sum") or (in_place and not c.in_place_ok):
            continue
        if alg == "mpi" and dtype in ("float16", "bfloat16") and c.reduces:
            # refused, by name
            try:
                pg.call(coll, [np.zeros(c.in_count(count, n), dtype) for _ in pg.ranks],
                        [np.zeros(c.out_count(count, n), dtype) for _ in pg.ranks],
                        op=op, root=n - 1 if c.rooted else 0)  # fmt: skip
                failures.append(f"mpi {coll} {dtype}: not refused")
            except TypeError as exc:
                if f"cannot reduce {dtype}" not in str(exc):
                    failures.append(f"mpi {coll} {dtype}: {exc}")
            continue
        if alg == "mpi" and pg.nodes > 1 and coll in (
            "all_gather", "gather", "scatter", "all_to_all", "sendrecv"
        ):  # fmt: skip
            continue
        if op == "prod" and count > 1000:
            continue
        root = n - 1 if c.rooted else 0
        rng = np.random.default_rng(count * 7 + len(coll))
        if not is_float:
            full = [rng.integers(-3, 4, c.in_count(count, n)).astype(dtype) for _ in range(n)]
        else:
            lo, hi = (0.8, 1.25) if op == "prod" else (-1, 1)
            full = [rng.uniform(lo, hi, c.in_count(count, n)).astype(dtype) for _ in range(n)]
        xs = [full[r].copy() for r in pg.ranks]
        outs = None
        if not in_place:
            outs = [np.full(c.out_count(count, n), 7, dtype) for _ in pg.ranks]
        elif coll in ("all_gather", "gather"):
            bufs = [np.zeros(c.out_count(count, n), dtype) for _ in pg.ranks]
            for i, r in enumerate(pg.ranks):
                bufs[i][r * count : (r + 1) * count] = full[r]
            xs = [bufs[i][r * count : (r + 1) * count] for i, r in enumerate(pg.ranks)]
            outs = bufs
        elif coll in ("reduce_scatter", "scatter"):
            outs = [xs[i][r * count : (r + 1) * count] for i, r in enumerate(pg.ranks)]
        what = f"{alg} {coll} {dtype} {op} count={count} in_place={in_place}"
        try:
            res = pg.call(coll, xs, outs, op=op, root=root)
        except Exception as exc:  # noqa: BLE001 - reported
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        # the in-process World of the same ranks and topology
        wxs = [f.copy() for f in full]
        wouts = (
            None if outs is None else [np.full(c.out_count(count, n), 7, dtype) for _ in range(n)]
        )
        if in_place and coll in ("all_gather", "gather"):
            wouts = [np.zeros(c.out_count(count, n), dtype) for _ in range(n)]
            for r in range(n):
                wouts[r][r * count : (r + 1) * count] = full[r]
            wxs = [wouts[r][r * count : (r + 1) * count] for r in range(n)]
        elif in_place and coll in ("reduce_scatter", "scatter"):
            wouts = [wxs[r][r * count : (r + 1) * count] for r in range(n)]
        kw = {"root": root} if c.rooted else {}
        if c.reduces:
            kw["op"] = op
        method = getattr(ref, driver_method(coll))  # sendrecv: the ring shift, shift
        wres = (
            method(wxs, **kw)
            if wouts is None
            else method(wxs, wouts, **kw)
            if not c.one_buffer
            else method(wxs, outs=wouts, **kw)
        )
        expected = c.expected([f.copy() for f in full], op, root)
        for i, r in enumerate(pg.ranks):
            which, want = expected[r]
            got = np.asarray(res[i]).reshape(-1)
            if which == "in":
                if not np.array_equal(xs[i], full[r]):
                    failures.append(f"{what} rank {r}: input changed")
                continue
            tol = {"float16": 2e-2, "float32": 2e-5, "float64": 1e-12, "bfloat16": 5e-2}.get(
                dtype, 0
            )
            if not is_float:
                want = want.astype(dtype)  # integers wrap (uint8 of negative data)
            if not np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol):
                failures.append(f"{what} rank {r}: wrong result")
            elif alg not in ("mpi", "auto") and not np.array_equal(
                got, np.asarray(wres[r]).reshape(-1)
            ):
                failures.append(f"{what} rank {r}: not bitwise the in-process World's")
            checked += 1
    seen[alg] = {
        "collectives_after_init": counting.collectives,
        "payload_to_other_nodes": counting.remote_bytes,
        "payload_within_node": counting.local_bytes,
        "sent_bytes": pg.sent_bytes,
    }
    ref.close()
    pg.close()
summary = {"ranks": list(pg.ranks), "nodes": pg.nodes, "checked": checked,
           "failures": failures[:20], "mpi": seen}  # fmt: skip
report(summary, MPI.COMM_WORLD.Get_rank())
