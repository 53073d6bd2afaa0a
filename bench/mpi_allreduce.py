"""MPI baseline for the all_reduce comparison: ``Allreduce(MPI.IN_PLACE, buf)`` per size.

Run under MPI, one process per rank:

    mpiexec -n 4 python bench/mpi_allreduce.py --sizes 8,1M,64M --iters 20 --warmup 5

Measured as the nccltree driver measures: warm-up calls, then timed calls each started
after a barrier and timed on every rank, the slowest rank's time counting; the median of
those; algbw/busbw with nccl-tests' all_reduce factor 2(n-1)/n. Each size is checked once
on the same seeded data the nccltree driver uses. Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
from mpi4py import MPI

from nccltree.comm.bench import bandwidths, count_wrong, init_data, parse_size, reference


def iters_for(size: int, args: argparse.Namespace) -> tuple[int, int]:
    """(timed, warm-up) iterations: fewer at large sizes, where one call is long."""
    if args.large and size >= args.large:
        return args.large_iters, args.large_warmup
    return args.iters, args.warmup


def measure(comm: MPI.Comm, size: int, args: argparse.Namespace) -> dict:
    n, rank = comm.size, comm.rank
    dtype = np.dtype(args.dtype)
    count = size // dtype.itemsize
    iters, warmup = iters_for(size, args)
    buf = init_data(rank, n, count, dtype, "sum", args.seed)
    for _ in range(warmup):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = MPI.Wtime()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        dt = MPI.Wtime() - t0
        times.append(comm.allreduce(dt, op=MPI.MAX))
    # the check, on fresh data: every rank computes the expected sum of all ranks' inputs
    buf = init_data(rank, n, count, dtype, "sum", args.seed)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    want = reference("sum", [init_data(r, n, count, dtype, "sum", args.seed) for r in range(n)])
    wrong = comm.allreduce(count_wrong(buf, want, dtype), op=MPI.SUM)
    t = statistics.median(times)
    nbytes = count * dtype.itemsize
    algbw, busbw = bandwidths(nbytes, t, 2 * (n - 1) / n)
    return {
        "size": nbytes,
        "count": count,
        "time_us": t * 1e6,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": wrong,
        "iters": iters,
        "warmup": warmup,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", required=True, help="comma-separated sizes (K/M/G suffixes)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--large", default="0", help="from this size on use --large-iters/--large-warmup (0: never)"
    )
    p.add_argument("--large-iters", type=int, default=5)
    p.add_argument("--large-warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.large = parse_size(args.large)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    comm = MPI.COMM_WORLD
    rows = [measure(comm, s, args) for s in sizes]
    if comm.rank == 0:
        json.dump(
            {
                "library": MPI.Get_library_version().splitlines()[0].strip(),
                "ranks": comm.size,
                "dtype": args.dtype,
                "rows": rows,
            },
            sys.stdout,
        )
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
