"""Send and receive within a node: a host process group's ``pg.sendrecv`` in a ring against
MPI's own ``Sendrecv`` in the same processes, in one run.

    mpiexec -n 2 python bench/pg_p2p_bench.py [--sizes 8,1M,64M] [--reps 5] [--iters 10]
        [--json FILE]

Cases, per size, interleaved within each repetition (so every case sees the same load):
``user`` (numpy buffers: copied into the sender's arena and out of it; above 4 MiB in 2 MiB
chunks, the receiver copying one out while the sender copies the next in), ``sym`` (the
sender's ``pg.empty`` buffer, read in place: one copy) and ``mpi`` (mpi4py's ``Sendrecv``
on the group's processes, the MPI library's own shared-memory path): each process sends S
bytes to the next and receives S from the previous per call. ``user 0->1`` and ``mpi
0->1``: process 0 sends S bytes to process 1 (``pg.send``/``pg.recv``, MPI's
``Send``/``Recv``), where the chunks overlap the sender's copy with the receiver's. ``--iters`` calls between
barriers, the slowest process counting; the table gives microseconds per call, the median
over the repetitions. Every case is checked once per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import nccltree as nt
from nccltree.comm.bench import parse_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,1M,64M")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    pg = nt.init_process_group(devices="cpu")
    me, n = pg.rank, pg.size
    nxt, prv = (me + 1) % n, (me - 1) % n
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    times: dict[tuple[int, str], list[float]] = {}
    wrong: list[str] = []
    for size in sizes:
        count = max(1, size // 4)
        x = np.full(count, me, np.float32)
        sym = pg.empty(count)
        sym[:] = me
        out = np.zeros(count, np.float32)

        def one_way(x: np.ndarray, out: np.ndarray, mpi: bool) -> None:
            if me == 0:
                comm.Send(x, 1, 1) if mpi else pg.send(x, 1)
            elif me == 1:
                comm.Recv(out, 0, 1) if mpi else pg.recv(out, 0)

        cases = {
            "user": lambda x=x, out=out: pg.sendrecv(x, nxt, out, prv),
            "sym": lambda sym=sym, out=out: pg.sendrecv(sym, nxt, out, prv),
            "mpi": lambda x=x, out=out: comm.Sendrecv(x, nxt, 0, out, prv, 0),
            "user 0->1": lambda x=x, out=out: one_way(x, out, False),
            "mpi 0->1": lambda x=x, out=out: one_way(x, out, True),
        }
        for name, call in cases.items():  # warm up and check
            out[:] = -1
            call()
            want = 0 if "0->1" in name else prv
            if (me == 1 or "0->1" not in name) and not np.all(out == want):
                wrong.append(f"{name} {size}")
        for _ in range(args.reps):
            for name, call in cases.items():
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    call()
                t = (time.perf_counter() - t0) / args.iters
                times.setdefault((size, name), []).append(comm.allreduce(t, MPI.MAX))
    pg.close()
    if me == 0:
        print(f"# {n} processes, one node; microseconds per sendrecv call, median of "
              f"{args.reps} repetitions of {args.iters} calls")  # fmt: skip
        names = ("user", "sym", "mpi", "user 0->1", "mpi 0->1")
        print("| S | sendrecv: user | sym | MPI | one way 0 -> 1: user | MPI |")
        print("|---:|---:|---:|---:|---:|---:|")
        rows = {}
        for size in sizes:
            med = {c: statistics.median(times[size, c]) * 1e6 for c in names}
            rows[str(size)] = med
            print(f"| {size} | " + " | ".join(f"{med[c]:.0f}" for c in names) + " |")
        if wrong:
            print("wrong:", ", ".join(wrong))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"processes": n, "us_per_call": rows, "wrong": wrong}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
