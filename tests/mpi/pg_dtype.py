"""Worker: the collectives' ``dtype=`` on host process groups. ``uint16`` numpy buffers
named ``dtype="bfloat16"`` must give bitwise what the same bits in bfloat16 arrays give,
for every reducing collective and algorithm, through the one-rank API, ``pg.call`` and
the per-rank faces of several ranks per process; the data movement collectives and
send/recv take the argument too; MPI is refused its reduction by name, and ``auto``
keeps it off MPI. Prints one JSON line per process.

    mpiexec -n 2 python tests/mpi/pg_dtype.py [--devices cpu:2]
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import nccltree as nt
from nccltree.comm.collectives import COLLECTIVES

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from counting import report

p = argparse.ArgumentParser()
p.add_argument("--devices", default="cpu:1")
args = p.parse_args()

BF = np.dtype(ml_dtypes.bfloat16)
failures: list[str] = []
checked = 0


def data(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    vals = rng.uniform(-1, 1, (n, size)) * 2.0 ** rng.integers(-20, 21, (n, size))
    return [vals[r].astype(BF) for r in range(n)]


def outs_for(coll: str, count: int, n: int, local: int, dt: np.dtype) -> list | None:
    c = COLLECTIVES[coll]
    return None if c.one_buffer else [np.zeros(c.out_count(count, n), dt) for _ in range(local)]


def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
    global checked
    checked += 1
    g, w = np.ascontiguousarray(got).view(np.uint16), np.ascontiguousarray(want).view(np.uint16)
    if g.shape != w.shape or not np.array_equal(g, w):
        failures.append(f"{what}: differs from the bfloat16 arrays' result")


for alg in ("tree", "ring", "direct", "auto"):
    pg = nt.init_process_group(devices=args.devices, algorithm=alg, timeout=30)
    n, local = pg.size, len(pg.ranks)
    for coll in ("all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather"):
        c = COLLECTIVES[coll]
        count = 333
        for op in ("sum", "mean", "max") if c.reduces else ("sum",):
            full = data(n, c.in_count(count, n), seed=len(coll) + len(op))
            kw: dict[str, object] = {"op": op} if c.reduces else {}
            if c.rooted:
                kw["root"] = n - 1

            mine = [full[r] for r in pg.ranks]
            want = pg.call(
                coll, [m.copy() for m in mine], outs_for(coll, count, n, local, BF), **kw
            )
            got = pg.call(coll, [m.view(np.uint16).copy() for m in mine],
                          outs_for(coll, count, n, local, np.dtype(np.uint16)),
                          dtype="bfloat16", **kw)  # fmt: skip
            for i in range(local):
                if coll != "reduce" or pg.ranks[i] == n - 1:
                    check(f"{alg} {coll} {op} call rank {pg.ranks[i]}", got[i], want[i])
            # per rank: the one-rank API, or each local rank's own thread
            bits = {r: full[r].view(np.uint16).copy() for r in pg.ranks}

            def body(comm, bits=bits, kw=kw, coll=coll, count=count, n=n):
                got = outs_for(coll, count, n, 1, np.dtype(np.uint16))
                out = None if got is None else got[0]
                return getattr(comm, coll)(bits[comm.rank], out=out, dtype="bfloat16", **kw)

            mine_got = pg.run(body)
            for i in range(local):
                if coll != "reduce" or pg.ranks[i] == n - 1:
                    check(f"{alg} {coll} {op} per rank {pg.ranks[i]}", mine_got[i], want[i])
    # a carrier without its name, and a dtype the arrays do not fit: refused on every rank
    for bad, dtype, expect in ((np.uint16, None, TypeError), (np.float16, "bfloat16", TypeError)):
        try:
            pg.call("all_reduce", [np.zeros(4, bad) for _ in pg.ranks], dtype=dtype)
            failures.append(f"{alg}: {np.dtype(bad)} with dtype={dtype} was accepted")
        except expect as exc:
            if "dtype" not in str(exc):
                failures.append(f"{alg}: the error does not name dtype: {exc}")
    if local == 1 and n >= 2:
        # send/recv: a uint16 buffer named bfloat16 travels as it is
        src = data(1, 16, seed=3)[0]
        me, peer = pg.rank, (pg.rank + 1) % n
        left = (pg.rank - 1) % n
        out = np.zeros(16, np.uint16)
        pg.sendrecv(src.view(np.uint16).copy(), peer, out, left, dtype="bfloat16")
        check(f"{alg} sendrecv", out, src)
    pg.close()

# MPI cannot reduce bfloat16: refused by name, whatever carries it; auto stays off MPI
mpi_refused = auto_off_mpi = None
pg = nt.init_process_group(algorithm="mpi", timeout=30)
if len(pg.ranks) == 1:
    try:
        pg.all_reduce(np.zeros(8, np.uint16), dtype="bfloat16")
        mpi_refused = False
    except TypeError as exc:
        mpi_refused = "bfloat16" in str(exc)
    x = np.zeros(8, np.uint16)
    pg.broadcast(x, dtype="bfloat16")  # data movement: MPI moves 16-bit words
pg.close()
pg = nt.init_process_group(algorithm="auto", timeout=30)
if len(pg.ranks) == 1:
    from nccltree.comm._args import prepare

    prep = prepare(pg.devices, "all_reduce", [np.zeros(8, np.uint16)], None, "sum", 0,
                   ranks=pg.ranks, size=pg.size, dtype="bfloat16")  # fmt: skip
    auto_off_mpi = pg._choose(prep) != "mpi"
pg.close()

report({"rank": pg.rank, "checked": checked, "failures": failures[:20],
        "nfail": len(failures), "mpi_refused": mpi_refused,
        "auto_off_mpi": auto_off_mpi}, pg.rank)  # fmt: skip
