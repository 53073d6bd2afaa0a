"""The per-call cost of argument agreement in process groups, measured side by side.

Usage:

    python bench/agreement_cost.py [--procs 2] [--reps 7] [--json FILE]

Starts the venv's ``mpiexec`` itself (the job runs this file again with ``--worker``).
In one job, every process opens the same groups twice, once with ``NCCLTREE_CHECK=on``
(the default) and once with ``off``, for ``algorithm="mpi"`` and ``"auto"`` (whose calls
agree first) and ``"tree"`` (whose agreement is the engine's own arrival, the same in
both), plus MPICH's blocking ``Allreduce`` in the same processes. Each repetition runs
every case once, interleaved (so every case sees the same load): a float32 sum
all_reduce of 8 B and of 64 KiB, ``iters`` calls back to back after a barrier, the
slowest process counting. The table gives the median per call over the repetitions,
and for each algorithm the difference on minus off: what agreement costs per call.
The machine's CPU and load average are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nccltree.comm.bench import cpu_name

SIZES = {"8 B": 2, "64 KiB": 16384}
ITERS = {"8 B": 2000, "64 KiB": 400}
ALGS = ("mpi", "auto", "tree")


def worker(reps: int) -> None:
    import numpy as np
    from mpi4py import MPI

    from nccltree.comm.group.group import ProcessGroup

    comm = MPI.COMM_WORLD
    groups = {}
    for alg in ALGS:
        for check in ("on", "off"):
            os.environ["NCCLTREE_CHECK"] = check
            groups[(alg, check)] = ProcessGroup(comm, "cpu", alg, 60.0)
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for size, count in SIZES.items():
            x = np.ones(count, np.float32)
            n = ITERS[size]
            cases = [(f"{a} check={c}", g) for (a, c), g in groups.items()]
            cases.append(("MPICH Allreduce", None))
            for name, g in cases:
                comm.Barrier()
                t0 = time.perf_counter()
                if g is None:
                    for _ in range(n):
                        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
                else:
                    for _ in range(n):
                        g.all_reduce(x)
                took = (time.perf_counter() - t0) / n
                slowest = comm.allreduce(took, MPI.MAX)
                times.setdefault(f"{size}|{name}", []).append(slowest * 1e6)
    for g in groups.values():
        g.close()
    if comm.Get_rank() == 0:
        print(json.dumps(times), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions (default 7)")
    ap.add_argument("--json", help="write the medians and every repetition here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.reps)
        return
    here = Path(sys.executable).parent / "mpiexec"
    load0 = os.getloadavg()
    proc = subprocess.run(
        [str(here), "-n", str(args.procs), sys.executable, __file__, "--worker",
         "--reps", str(args.reps)],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"the job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average before {load0[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f}; {args.procs} processes, {args.reps} repetitions")  # fmt: skip
    print()
    print("| all_reduce, float32 sum | check on (µs) | check off (µs) | agreement costs (µs) |")
    print("|---|---|---|---|")
    for size in SIZES:
        for alg in ALGS:
            on, off = med[f"{size}|{alg} check=on"], med[f"{size}|{alg} check=off"]
            print(f"| {size}, {alg} | {on:.1f} | {off:.1f} | {on - off:+.1f} |")
        print(f"| {size}, MPICH Allreduce | {med[f'{size}|MPICH Allreduce']:.1f} | | |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu": cpu_name(),
                    "load": [load0, os.getloadavg()],
                    "procs": args.procs,
                    "median_us": med,
                    "runs_us": times,
                },
                indent=1,
            )  # fmt: skip
        )


if __name__ == "__main__":
    main()
