"""Small all_reduce between processes of one node: nccltree's native small path against
MPICH's ``MPI_Allreduce`` in the same processes, per call.

Usage:

    python bench/small_pg.py [--procs 2,3,4] [--sizes 8,4K,64K] [--iters 10000]
                             [--sweep 8,4K,64K,256K,1M] [--big 64M] [--json FILE]

The script starts the venv's ``mpiexec`` (MPICH's) itself, once per process count, each
job running this file again with ``--worker``; it prints Markdown tables and, with
``--json``, writes everything it measured. In every job (float32 sum all_reduce, in
place, one rank per process, ``algorithm="auto"``):

* **per call**: ``--iters`` rounds, each calling every case once at every size, interleaved
  (so every case sees the same load): nccltree's ``pg.all_reduce`` (the small path) and
  MPICH's ``Allreduce(MPI.IN_PLACE)`` through mpi4py. Each call is timed on its own
  (``perf_counter_ns``); the table gives p50 and p99 over every call of every process.
* **breakdown**: the same calls again with the extension's timing on: the median of the
  native entry (argument checks, the cache look-up), the exchange (the copy into the
  slot, the signature, the arrival), the wait for the other processes and the result
  (the reduce); "Python" is the median over calls of each call's time less its native
  parts (the method, the lock, the call numbering and the flight recorder).
* **sweep** (``--sweep``; the job runs with ``NCCLTREE_SMALL`` at the largest size so the
  path takes every one): the small path against the general paths in the same group,
  interleaved: ``auto`` as it was before the small path (MPI's ``Allreduce`` after the
  ``MPI_Iallreduce`` agreement) and the ``direct`` plan on the schedule engine, selected
  by switching the group's private settings the same way in every process (a benchmark
  device, not an API); p50 of per-call times. The threshold is where the small path
  stops being the fastest.
* **big** (``--big``): ``auto`` at that size with and without the small path (its only
  effect there: the agreement by arrival instead of ``MPI_Iallreduce``), median of
  ``--big-reps`` calls each.

The CPU model and the load average (before and after each job) are recorded with every
figure. Process counts above the CPUs this process may use run oversubscribed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from nccltree.comm.bench import cpu_name

HERE = Path(__file__).resolve()


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if mult > 1 else s) * mult


def human(n: int) -> str:
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) / 1e3  # ns -> us


# -- the worker (one process of an mpiexec job) -----------------------------------------------
def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import nccltree as nt

    comm = MPI.COMM_WORLD
    pg = nt.init_process_group(algorithm="auto", timeout=60.0)
    small = pg._small
    if small is None:
        raise SystemExit("the small path is not active here (extension missing, or off)")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {"procs": pg.size, "rank": pg.rank}
    xs = {s: np.ones(max(1, s // 4), np.float32) for s in sizes}
    bs = {s: np.ones(max(1, s // 4), np.float32) for s in sizes}
    for s in sizes:  # warm up (the first call of a signature takes the general path)
        for _ in range(50):
            pg.all_reduce(xs[s])
            comm.Allreduce(MPI.IN_PLACE, bs[s])
    out["wrong"] = {str(s): _wrong(pg, comm, lambda x: pg.all_reduce(x), s) for s in sizes}
    n = args.iters
    t_nt = {s: np.empty(n, np.int64) for s in sizes}
    t_mpi = {s: np.empty(n, np.int64) for s in sizes}
    clock = time.perf_counter_ns
    for i in range(n):
        for s in sizes:
            x, b = xs[s], bs[s]
            t0 = clock()
            pg.all_reduce(x)
            t1 = clock()
            comm.Allreduce(MPI.IN_PLACE, b)
            t2 = clock()
            t_nt[s][i] = t1 - t0
            t_mpi[s][i] = t2 - t1
            if i % 64 == 0:  # keep the values finite and equal everywhere
                x.fill(1.0)
                b.fill(1.0)
                comm.Barrier()
    # the breakdown, with the extension's clock on
    parts = {s: np.empty((min(n, 5000), 4), np.int64) for s in sizes}
    totals = {s: np.empty(min(n, 5000), np.int64) for s in sizes}
    small.breakdown(True)
    for i in range(min(n, 5000)):
        for s in sizes:
            t0 = clock()
            pg.all_reduce(xs[s])
            totals[s][i] = clock() - t0
            parts[s][i] = small.breakdown(True)
            if i % 64 == 0:
                xs[s].fill(1.0)
    small.breakdown(False)
    out["calls"] = {str(s): {"small": t_nt[s].tolist(), "mpich": t_mpi[s].tolist()} for s in sizes}
    out["breakdown"] = {
        str(s): {
            "total_us": float(np.median(totals[s])) / 1e3,
            "parts_us": [float(v) / 1e3 for v in np.median(parts[s], axis=0)],
            # per call: the call's time less its native parts
            "python_us": float(np.median(totals[s] - parts[s].sum(axis=1))) / 1e3,
        }
        for s in sizes
    }
    if args.sweep:
        out["sweep"] = sweep(pg, comm, MPI, [parse_size(s) for s in args.sweep.split(",")], args)
    if args.big:
        out["big"] = big(pg, comm, parse_size(args.big), args.big_reps)
    pg.close()
    got = comm.gather(out, root=0)
    if comm.Get_rank() == 0:
        Path(args.worker).write_text(json.dumps(got))


def _wrong(pg: Any, comm: Any, call: Any, size: int) -> int:
    """Elements that differ from the exact sum after ``call`` (twice: the first call of a
    signature takes the general path), summed over the processes."""
    bad = 0
    want = pg.size * (pg.size + 1) / 2
    for _ in range(2):
        x = np.full(max(1, size // 4), pg.rank + 1.0, np.float32)
        call(x)
        bad += int(np.count_nonzero(x != want))
    return int(comm.allreduce(bad))


def _modes(pg: Any) -> dict[str, tuple[Any, str]]:
    """The group's private settings for each path measured (every process switches alike)."""
    return {"small": (pg._small, "auto"), "auto before": (None, "auto"),
            "direct": (None, "direct")}  # fmt: skip


def sweep(pg: Any, comm: Any, MPI: Any, sizes: list[int], args: argparse.Namespace) -> Any:
    modes = _modes(pg)
    res: dict[str, Any] = {}
    wrong = 0
    for s in sizes:
        x = np.ones(max(1, s // 4), np.float32)
        b = np.ones_like(x)
        iters = max(50, min(args.sweep_iters, int(args.sweep_iters * 4096 / max(s, 4096))))
        times: dict[str, list[int]] = {m: [] for m in [*modes, "mpich"]}
        for sp, alg in modes.values():  # warm up every path, and check it
            pg._small, pg.algorithm = sp, alg
            wrong += _wrong(pg, comm, lambda v: pg.all_reduce(v), s)
            for _ in range(5):
                pg.all_reduce(x)
        for i in range(iters):
            for m, (sp, alg) in modes.items():
                pg._small, pg.algorithm = sp, alg
                t0 = time.perf_counter_ns()
                pg.all_reduce(x)
                times[m].append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            comm.Allreduce(MPI.IN_PLACE, b)
            times["mpich"].append(time.perf_counter_ns() - t0)
            if i % 16 == 0:
                x.fill(1.0)
                b.fill(1.0)
        pg._small, pg.algorithm = modes["small"]
        res[str(s)] = {m: float(np.median(v)) / 1e3 for m, v in times.items()}
    res["wrong"] = wrong
    return res


def big(pg: Any, comm: Any, size: int, reps: int) -> Any:
    modes = _modes(pg)
    x = np.ones(size // 4, np.float32)
    times: dict[str, list[float]] = {"small": [], "auto before": []}
    for i in range(reps + 1):
        for m in times:
            pg._small, pg.algorithm = modes[m]
            comm.Barrier()
            t0 = time.perf_counter()
            pg.all_reduce(x)
            if i:
                times[m].append(time.perf_counter() - t0)
        x.fill(1.0)
    pg._small, pg.algorithm = modes["small"]
    return {m: float(np.median(v)) * 1e3 for m, v in times.items()}  # ms


# -- the driver -------------------------------------------------------------------------------
def run_job(procs: int, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    exe = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("mpiexec not found (pip install 'nccltree[mpi]')")
    res = tmp / f"small_{procs}.json"
    cmd = [exe, "-n", str(procs), sys.executable, str(HERE), "--worker", str(res),
           "--sizes", args.sizes, "--iters", str(args.iters),
           "--sweep", args.sweep, "--sweep-iters", str(args.sweep_iters),
           "--big", args.big, "--big-reps", str(args.big_reps)]  # fmt: skip
    env = dict(os.environ)
    if args.sweep:
        top = max(parse_size(s) for s in args.sweep.split(","))
        env["NCCLTREE_SMALL"] = str(max(top, *(parse_size(s) for s in args.sizes.split(","))))
    subprocess.run(cmd, check=True, env=env, timeout=args.timeout)
    got: list[dict[str, Any]] = json.loads(res.read_text())
    res.unlink()
    return got


def report(
    procs: int, got: list[dict[str, Any]], load: tuple[Any, Any], cpus: int
) -> dict[str, Any]:
    sizes = list(got[0]["calls"])
    over = " (oversubscribed)" if procs > cpus else ""
    print(f"\n### {procs} processes{over}: load {load[0]} -> {load[1]}\n")
    print("| size | small p50 | small p99 | MPICH p50 | MPICH p99 | p50 ratio | p99 ratio | "
          "Python | entry | exchange | wait | reduce |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for s in sizes:
        nt_all = np.concatenate([np.asarray(g["calls"][s]["small"]) for g in got])
        mp_all = np.concatenate([np.asarray(g["calls"][s]["mpich"]) for g in got])
        r = {"small_p50": _pct(nt_all, 50), "small_p99": _pct(nt_all, 99),
             "mpich_p50": _pct(mp_all, 50), "mpich_p99": _pct(mp_all, 99)}  # fmt: skip
        bd = [g["breakdown"][s] for g in got]
        py = float(np.median([b["python_us"] for b in bd]))
        parts = np.median(np.array([b["parts_us"] for b in bd]), axis=0).tolist()
        r["breakdown_us"] = {"python": py, "entry": parts[0],
                             "exchange": parts[1], "wait": parts[2], "reduce": parts[3]}  # fmt: skip
        rows[s] = r
        b = r["breakdown_us"]
        print(f"| {human(int(s))} | {r['small_p50']:.2f} | {r['small_p99']:.2f} | "
              f"{r['mpich_p50']:.2f} | {r['mpich_p99']:.2f} | "
              f"{r['small_p50'] / r['mpich_p50']:.2f} | {r['small_p99'] / r['mpich_p99']:.2f} | "
              f"{b['python']:.2f} | {b['entry']:.2f} | {b['exchange']:.2f} | {b['wait']:.2f} | "
              f"{b['reduce']:.2f} |")  # fmt: skip
    wrong = {s: got[0]["wrong"][s] for s in sizes}
    out: dict[str, Any] = {"procs": procs, "load": load, "per_call_us": rows, "wrong": wrong}
    print(f"\nwrong elements (small path, summed over processes): {wrong}")
    if "sweep" in got[0]:
        print("\nsweep, p50 of per-call times (us), median over processes:\n")
        print("| size | small | auto before (MPI) | direct | MPICH |")
        print("|---:|---:|---:|---:|---:|")
        sw = {}
        wrong["sweep"] = got[0]["sweep"]["wrong"]
        for s in got[0]["sweep"]:
            if s == "wrong":
                continue
            med = {m: float(np.median([g["sweep"][s][m] for g in got])) for m in got[0]["sweep"][s]}
            sw[s] = med
            print(f"| {human(int(s))} | {med['small']:.1f} | {med['auto before']:.1f} | "
                  f"{med['direct']:.1f} | {med['mpich']:.1f} |")  # fmt: skip
        out["sweep_p50_us"] = sw
    if "big" in got[0]:
        bg = {m: float(np.median([g["big"][m] for g in got])) for m in got[0]["big"]}
        print(
            f"\nbig: auto with the small path {bg['small']:.1f} ms, before {bg['auto before']:.1f} ms"
        )
        out["big_ms"] = bg
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", default="2,3,4", help="process counts, one job each (default 2,3,4)")
    ap.add_argument("--sizes", default="8,4K,64K", help="bytes per rank of the per-call rows")
    ap.add_argument("--iters", type=int, default=10000, help="interleaved rounds (default 10000)")
    ap.add_argument(
        "--sweep", default="", help="sizes of the threshold sweep (e.g. 8,4K,64K,256K,1M)"
    )
    ap.add_argument(
        "--sweep-iters", type=int, default=2000, help="rounds per sweep size at <= 4 KiB"
    )
    ap.add_argument("--big", default="", help="a large size for the 'no worse' check (e.g. 64M)")
    ap.add_argument("--big-reps", type=int, default=5, help="calls of the large size per path")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for label, v in (
        ("--iters", args.iters),
        ("--sweep-iters", args.sweep_iters),
        ("--big-reps", args.big_reps),
    ):
        if v < 1:
            ap.error(f"{label} must be at least 1, got {v}")
    if args.worker:
        worker(args)
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"CPU: {cpu_name()}, {cpus} usable CPUs; float32 sum all_reduce in place, "
          f"{args.iters} interleaved calls per case and size; times in us")  # fmt: skip
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for procs in [int(p) for p in args.procs.split(",")]:
            print(f"running {procs} processes ...", file=sys.stderr, flush=True)
            load0 = os.getloadavg()
            got = run_job(procs, args, Path(tmp))
            load = ([round(v, 2) for v in load0], [round(v, 2) for v in os.getloadavg()])
            results.append(report(procs, got, load, cpus))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_name(), "cpus": cpus, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
