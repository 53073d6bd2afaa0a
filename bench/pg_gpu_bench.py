"""All_reduce across processes sharing GPUs: a GPU process group (CUDA IPC) against the
same algorithm on logical ranks of one process, in one run.

    mpiexec -n 2 python bench/pg_gpu_bench.py [--devices gpu:0] [--sizes 1M,16M,256M]
        [--algorithms tree,ring,direct] [--reps 5] [--iters 10] [--json FILE]

Cases, per size, interleaved within each repetition (so every case sees the same load):

* ``world/<alg>``: an in-process World on ``gpu:K,K,...`` (as many logical ranks of the
  GPU ``--devices`` names as there are processes), run by process 0 while the others wait;
* ``pg/<alg>/sym``: the process group (``init_process_group(devices=...)``) on a symmetric
  buffer (``pg.empty``: used in place through IPC);
* ``pg/<alg>/user``: the group on an ordinary CuPy array (staged through the arena).

Every case is float32 sum, in place, ``--iters`` calls back to back between a barrier and
a device synchronisation, the slowest process counting; the table gives the median over
the repetitions and busbw as nccl-tests computes it (2(n-1)/n x bytes / time). Each case is
checked once per size against the exact sum. ``--devices cpu`` runs the same pipeline on
host groups and ``cpu:N`` Worlds (how CI keeps the script working without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import nccltree as nt
from nccltree.comm.bench import parse_size


def quiet_barrier(comm: Any) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="gpu:0", help="gpu:K (every process on GPU K), "
                   "gpu (a GPU per process) or cpu (host groups: the dry run)")  # fmt: skip
    p.add_argument("--sizes", default="1M,16M,256M")
    p.add_argument("--algorithms", default="tree,ring,direct")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args()
    world_comm = MPI.COMM_WORLD
    me, n = world_comm.Get_rank(), world_comm.Get_size()
    gpu = args.devices.startswith("gpu")
    algs = args.algorithms.split(",")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    xp: Any = np
    if gpu:
        import cupy

        xp = cupy

        k = args.devices[4:] or "0"
        world_spec = "gpu:" + ",".join([k] * n)
    else:
        world_spec = f"cpu:{n}"
    results: dict[str, dict[int, list[float]]] = {}
    wrong: dict[str, int] = {}

    def sync_all(devs: list[Any]) -> None:
        for d in devs:
            d.synchronize()

    worlds = {a: nt.World(world_spec, algorithm=a) for a in algs} if me == 0 else {}
    pgs: dict[str, Any] = {}
    for rep in range(args.reps):
        for size in sizes:
            count = size // 4
            for a in algs:
                # the in-process World: process 0 alone
                world_comm.Barrier()
                if me == 0:
                    w = worlds[a]
                    xs = [d.zeros(count, np.float32) for d in w.devices]
                    for i, x in enumerate(xs):
                        x.fill(i + 1)
                    w.all_reduce(xs)
                    sync_all(w.devices)
                    if rep == 0:
                        got = xp.asnumpy(xs[0]) if gpu else xs[0]
                        wrong[f"world/{a}"] = wrong.get(f"world/{a}", 0) + int(
                            np.count_nonzero(got != n * (n + 1) / 2)
                        )
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        w.all_reduce(xs)
                    sync_all(w.devices)
                    results.setdefault(f"world/{a}", {}).setdefault(size, []).append(
                        (time.perf_counter() - t0) / args.iters
                    )
                quiet_barrier(world_comm)  # the others wait without spinning on a core
                # the process group
                if a not in pgs:
                    for other in list(pgs):
                        pgs.pop(other).close()
                    pgs[a] = nt.init_process_group(devices=args.devices, algorithm=a)
                pg = pgs[a]
                for kind in ("sym", "user"):
                    if kind == "sym":
                        x = pg.empty(count, np.float32)
                    else:
                        x = xp.zeros(count, np.float32)
                    x.fill(me + 1)
                    pg.all_reduce(x)
                    sync_all(pg.devices)
                    name = f"pg/{a}/{kind}"
                    if rep == 0:
                        got = xp.asnumpy(x) if gpu else x
                        bad = int(np.count_nonzero(got != n * (n + 1) / 2))
                        wrong[name] = wrong.get(name, 0) + world_comm.allreduce(bad)
                    world_comm.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        pg.all_reduce(x)
                    sync_all(pg.devices)
                    took = world_comm.allreduce((time.perf_counter() - t0) / args.iters, MPI.MAX)
                    results.setdefault(name, {}).setdefault(size, []).append(took)
    for pg in pgs.values():
        pg.close()
    if me != 0:
        return 0
    factor = 2 * (n - 1) / n
    table: dict[str, Any] = {"processes": n, "devices": args.devices, "iters": args.iters,
                             "reps": args.reps, "wrong": wrong, "cases": {}}  # fmt: skip
    print(f"# all_reduce float32 sum in place, {n} processes, devices={args.devices}; "
          f"median of {args.reps} x {args.iters} calls; busbw GB/s")  # fmt: skip
    print("| case | " + " | ".join(f"{s >> 20} MiB" if s >= 1 << 20 else f"{s} B"
                                   for s in sizes) + " |")  # fmt: skip
    print("|---|" + "---|" * len(sizes))
    for name, by_size in results.items():
        row = []
        for s in sizes:
            med = statistics.median(by_size[s])
            bw = factor * s / med / 1e9
            table["cases"].setdefault(name, {})[str(s)] = {"median_s": med, "busbw_GBs": bw,
                                                           "times_s": by_size[s]}  # fmt: skip
            row.append(f"{bw:.1f}")
        print(f"| {name} | " + " | ".join(row) + " |")
    for a in algs:
        for kind in ("sym", "user"):
            for s in sizes:
                c = table["cases"]
                ratio = (
                    c[f"world/{a}"][str(s)]["median_s"] / c[f"pg/{a}/{kind}"][str(s)]["median_s"]
                )
                table.setdefault("ratio_pg_to_world", {})[f"{a}/{kind}/{s}"] = ratio
    biggest = sizes[-1]
    print(f"busbw of the group / busbw of the World at {biggest >> 20} MiB: " + ", ".join(
        f"{k.rsplit('/', 1)[0]} {v:.2f}" for k, v in table["ratio_pg_to_world"].items()
        if k.endswith(f"/{biggest}")))  # fmt: skip
    print(f"wrong elements: {wrong}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 1 if any(wrong.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
