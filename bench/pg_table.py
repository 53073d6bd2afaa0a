"""All_reduce across processes: nccltree's process group against MPICH, in one run.

Usage:

    python bench/pg_table.py [--procs 2,4] [--sizes 8,64K,1M,16M,64M] [--reps 5]
                             [--placement-size 64M] [--no-placement] [--json FILE]

The script starts the venv's ``mpiexec`` (MPICH's) itself, once per configuration, each
job running this file again with ``--worker``; it prints Markdown tables and, with
``--json``, writes everything it measured. Configurations:

* **one node, N processes** (N in ``--procs``), one rank each: float32 sum all_reduce, in
  place, at every size. Each repetition runs every case once, interleaved (so every case
  sees the same load): nccltree ``tree``, ``ring`` and ``direct`` on user buffers (plain
  numpy arrays, staged through the group's shared mirrors) and on a symmetric buffer
  (``pg.empty``, used in place), and MPICH's ``Allreduce(MPI.IN_PLACE)`` in the same
  processes. A case is timed as ``iters`` calls back to back after an MPI barrier, the
  slowest process counting; the table gives the median over the repetitions and the
  spread ((max - min) / median). Every case is checked once per size (``wrong``: elements
  that differ from the exact sum, summed over processes).
* **the bound**: in the same job, every process runs the library's ``nt_copy`` at once with
  the thread count the group gives it (before and after the sweep, the faster counting);
  the node's aggregate rate (bytes read + written per second) over each plan's
  ``Plan.bytes_moved(4)`` is the least time that plan can take on this host. The staging
  copies of user buffers are not part of the plan: their cost is what the user-buffer
  rows' ratio adds to the symmetric ones'.
* **latency**: an 8 B round trip between processes 0 and 1 over a pair of
  ``nccltree._native.Counter`` in shared memory (the wait primitive the group uses: the
  floor of any hand-off between two processes), and MPI's 8 B ``Send``/``Recv`` round trip,
  next to the 8 B all_reduce rows.
* **placement**: 2 simulated nodes x 2 processes (``mpiexec -n 2 -env NCCLTREE_NODE a ...
  : -n 2 -env NCCLTREE_NODE b ...``) at ``--placement-size``: the same cases, plus the
  payload bytes that crossed between the nodes per call (``pg.sent_bytes`` summed over the
  processes) against the plan's cross-node traffic; for ``tree`` the top level moves
  2 x size (each node's partial sum up once, the result down once).

The machine's load average is recorded before and after each job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
ALGORITHMS = ("tree", "ring", "direct")
CASES = [f"{a}/{b}" for a in ALGORITHMS for b in ("user", "sym")] + ["mpich"]
DEFAULT_SIZES = "8,64K,1M,16M,64M"


def parse_size(text: str) -> int:
    from nccltree.comm.bench import parse_size as parse

    return int(parse(text))


def human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# -- the worker: runs under mpiexec ---------------------------------------------------------


def _iters(size: int, budget: float) -> int:
    """Calls per timed case: about ``budget`` seconds at a rough guess of a call's time."""
    guess = 40e-6 + size / 2e9
    return max(1, min(200, int(budget / guess)))


def worker(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    import nccltree as nt
    from nccltree import _native
    from nccltree.comm.group.shm import Segment, segment_name

    world = MPI.COMM_WORLD
    mpi = world.Dup()  # MPICH's own measurements, on their own communicator
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    pg = nt.init_process_group(timeout=args.timeout)
    n = pg.size
    node_of = dict(world.allgather((pg.rank, pg.node)))
    maxcount = max(max(sizes) // 4, 1)
    sym = pg.empty(maxcount, np.float32)  # the symmetric buffer, sliced per size
    users = {s: np.zeros(max(s // 4, 1), np.float32) for s in sizes}
    threads = max(1, (os.cpu_count() or 1) // pg.local_size)

    def slowest(t: float) -> float:
        return float(world.allreduce(t, op=MPI.MAX))

    def copy_rate() -> dict[str, float]:
        nbytes = max(max(sizes), 1 << 20)
        a = np.ones(nbytes // 4, np.float32)
        b = np.empty_like(a)
        _native.copy(b, a, nthreads=threads)
        times = []
        for _ in range(5):
            world.Barrier()
            t0 = time.perf_counter()
            _native.copy(b, a, nthreads=threads)
            times.append(slowest(time.perf_counter() - t0))
        t = statistics.median(times)
        return {"bytes": a.nbytes, "threads": threads, "gbps": 2 * a.nbytes * pg.nprocs / t / 1e9}

    def buffer_of(case: str, size: int) -> np.ndarray:
        count = max(size // 4, 1)
        return sym[:count] if case.endswith("/sym") else users[size]

    def call(case: str, x: np.ndarray) -> None:
        if case == "mpich":
            mpi.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], op=MPI.SUM)
        else:
            pg.algorithm = case.split("/")[0]  # every process switches alike
            pg.all_reduce(x)

    def check(case: str, size: int) -> int:
        x = buffer_of(case, size)
        x[:] = pg.rank + 1
        call(case, x)
        wrong = int(np.count_nonzero(x != n * (n + 1) / 2))
        x[:] = 0  # timed calls run on zeros: sums stay finite
        return int(world.allreduce(wrong, op=MPI.SUM))

    def timed(case: str, size: int, iters: int) -> tuple[float, int]:
        x = buffer_of(case, size)
        world.Barrier()
        sent0 = pg.sent_bytes
        t0 = time.perf_counter()
        for _ in range(iters):
            call(case, x)
        t = slowest((time.perf_counter() - t0) / iters)
        cross = int(world.allreduce(pg.sent_bytes - sent0, op=MPI.SUM)) // iters
        return t, cross

    def pingpong(rounds: int) -> dict[str, float | None]:
        """8 B round trips between processes 0 and 1: shared-memory counters, MPI."""
        me = world.Get_rank()
        seg = None
        if me == 0:
            seg = Segment.create(segment_name(f"bench{os.getpid()}", "pingpong"), 4096)
        name = world.bcast(seg.name if seg is not None else None, root=0)
        if me == 1:
            seg = Segment.attach(name)
        world.Barrier()
        if me == 0 and seg is not None:
            seg.unlink()  # mapped by both: nothing is left in /dev/shm
        out: dict[str, float | None] = {"shm_us": None, "mpi_us": None}
        box = np.zeros(2, np.float32)
        if me in (0, 1) and seg is not None:
            ping = _native.Counter(seg.buf, 0, shared=True)
            pong = _native.Counter(seg.buf, 8, shared=True)
            t0 = time.perf_counter()
            for i in range(1, rounds + 1):
                if me == 0:
                    ping.add(1)
                    if not pong.wait(i, args.timeout):
                        raise TimeoutError("ping-pong: no answer")
                else:
                    if not ping.wait(i, args.timeout):
                        raise TimeoutError("ping-pong: no ball")
                    pong.add(1)
            out["shm_us"] = (time.perf_counter() - t0) / rounds * 1e6
        world.Barrier()
        if me in (0, 1):
            t0 = time.perf_counter()
            for _ in range(rounds):
                if me == 0:
                    mpi.Send([box, MPI.FLOAT], 1, 7)
                    mpi.Recv([box, MPI.FLOAT], 1, 7)
                else:
                    mpi.Recv([box, MPI.FLOAT], 0, 7)
                    mpi.Send([box, MPI.FLOAT], 0, 7)
            out["mpi_us"] = (time.perf_counter() - t0) / rounds * 1e6
        world.Barrier()
        del box
        if seg is not None:
            ping = pong = None  # the counters hold views of the mapping
            seg.close()
        got: dict[str, float | None] = world.bcast(out, root=0)
        return got

    iters = {s: _iters(s, args.budget) for s in sizes}
    copy_before = copy_rate()
    wrong = {f"{c}@{s}": check(c, s) for s in sizes for c in CASES}  # also the warm-up
    samples: dict[str, list[float]] = {f"{c}@{s}": [] for s in sizes for c in CASES}
    cross: dict[str, int] = {}
    pings: list[dict[str, float | None]] = []
    for _ in range(args.reps):
        if world.Get_size() >= 2:
            pings.append(pingpong(args.pingpong_rounds))
        for s in sizes:
            for c in CASES:
                t, sent = timed(c, s, iters[s])
                samples[f"{c}@{s}"].append(t * 1e6)
                cross[f"{c}@{s}"] = sent
    copy_after = copy_rate()
    rate = max(copy_before["gbps"], copy_after["gbps"])
    rows = []
    for s in sizes:
        count = max(s // 4, 1)
        for c in CASES:
            key = f"{c}@{s}"
            row: dict[str, Any] = {
                "size": count * 4,
                "case": c,
                "iters": iters[s],
                "samples_us": samples[key],
                "wrong": wrong[key],
                "cross_node_bytes": cross.get(key, 0),
            }
            if c != "mpich":
                plan = pg.plan("all_reduce", count, algorithm=c.split("/")[0], in_place=True)
                moved = plan.bytes_moved(4)
                row["bytes_moved"] = moved
                row["bound_us"] = moved / (rate * 1e9) * 1e6
                row["plan_cross_node_bytes"] = 4 * sum(
                    k for a, b, k in plan.transfers() if node_of[a] != node_of[b]
                )
            rows.append(row)
    result = {
        "procs": pg.nprocs,
        "ranks": n,
        "nodes": pg.nodes,
        "node_of_rank": [node_of[r] for r in range(n)],
        "threads_per_process": threads,
        "nt_copy": {"before": copy_before, "after": copy_after, "gbps": rate},
        "pingpong": pings,
        "rows": rows,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
    }
    pg.close()
    mpi.Free()
    if world.Get_rank() == 0:
        print("PG_TABLE_JSON " + json.dumps(result), flush=True)
    return 0


# -- the driver: starts the jobs, prints the tables -----------------------------------------


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    exe = str(here) if here.exists() else shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("mpiexec not found: install the mpi extra (mpi4py and mpich)")
    return exe


def launch(parts: list[tuple[int, dict[str, str]]], wargs: list[str], timeout: float) -> dict:
    cmd = [mpiexec()]
    for i, (n, env) in enumerate(parts):
        if i:
            cmd.append(":")
        cmd += ["-n", str(n)]
        for k, v in env.items():
            cmd += ["-env", k, v]
        cmd += [sys.executable, str(HERE), "--worker", *wargs]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("PG_TABLE_JSON "):
            got: dict = json.loads(line.split(" ", 1)[1])
            got["command"] = " ".join(cmd)
            return got
    raise RuntimeError(
        f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}"
    )


def _stats(samples: list[float]) -> tuple[float, float]:
    med = statistics.median(samples)
    return med, (max(samples) - min(samples)) / med if med > 0 else 0.0


def tables(runs: list[dict], placement: dict | None) -> str:
    out = [
        "| procs | size | case | median (µs) | spread | busbw (GB/s) | bound (µs) | "
        "time / bound | wrong |",
        "| ---: | ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        n = run["ranks"]
        for r in run["rows"]:
            med, spread = _stats(r["samples_us"])
            busbw = r["size"] / (med * 1e-6) * 2 * (n - 1) / n / 1e9
            bound = f"{r['bound_us']:.2f}" if "bound_us" in r else ""
            ratio = f"{med / r['bound_us']:.2f}" if r.get("bound_us") else ""
            out.append(
                f"| {n} | {human(r['size'])} | {r['case']} | {med:.1f} | {spread:.0%} | "
                f"{busbw:.2f} | {bound} | {ratio} | {r['wrong']} |"
            )
    out += ["", "| procs | size | best nccltree | its median (µs) | MPICH (µs) | MPICH / best |"]
    out.append("| ---: | ---: | :--- | ---: | ---: | ---: |")
    for run in runs:
        by_size: dict[int, dict[str, float]] = {}
        for r in run["rows"]:
            by_size.setdefault(r["size"], {})[r["case"]] = _stats(r["samples_us"])[0]
        for size, meds in by_size.items():
            best = min((c for c in meds if c != "mpich"), key=meds.__getitem__)
            out.append(
                f"| {run['ranks']} | {human(size)} | {best} | {meds[best]:.1f} | "
                f"{meds['mpich']:.1f} | {meds['mpich'] / meds[best]:.2f} |"
            )
    out += ["", "| procs | nt_copy threads / process | node copy rate (GB/s, before, after) |"]
    out.append("| ---: | ---: | :--- |")
    for run in runs:
        c = run["nt_copy"]
        out.append(
            f"| {run['procs']} | {c['before']['threads']} | {c['gbps']:.1f} "
            f"({c['before']['gbps']:.1f}, {c['after']['gbps']:.1f}) |"
        )
    out += [
        "",
        "| procs | shm counter ping-pong 8 B (µs) | MPI Send/Recv ping-pong 8 B (µs) |",
        "| ---: | ---: | ---: |",
    ]
    for run in runs:
        cells = []
        for key in ("shm_us", "mpi_us"):
            vals = [p[key] for p in run["pingpong"] if p.get(key) is not None]
            if vals:
                med, spread = _stats(vals)
                cells.append(f"{med:.2f} (spread {spread:.0%})")
            else:
                cells.append("n/a")
        out.append(f"| {run['procs']} | {cells[0]} | {cells[1]} |")
    if placement is not None:
        out += [
            "",
            f"2 simulated nodes x 2 processes (ranks on nodes {placement['node_of_rank']}):",
            "",
            "| size | case | median (µs) | spread | cross-node bytes / call | plan's cross-node "
            "bytes | tree top level (2 x size) | wrong |",
            "| ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in placement["rows"]:
            med, spread = _stats(r["samples_us"])
            plan_cross = r.get("plan_cross_node_bytes", "")
            measured = r["cross_node_bytes"] if r["case"] != "mpich" else "(MPI's own)"
            top = 2 * r["size"] if r["case"].startswith("tree") else ""
            out.append(
                f"| {human(r['size'])} | {r['case']} | {med:.1f} | {spread:.0%} | {measured} | "
                f"{plan_cross} | {top} | {r['wrong']} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", default="2,4", help="process counts on one node (%(default)s)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="all_reduce sizes (%(default)s)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (%(default)s)")
    p.add_argument("--budget", type=float, default=0.02, help="seconds per timed case (a guess)")
    p.add_argument("--pingpong-rounds", type=int, default=2000)
    p.add_argument("--placement-size", default="64M", help="size of the 2x2 placement run")
    p.add_argument("--no-placement", action="store_true", help="skip the 2 nodes x 2 run")
    p.add_argument("--timeout", type=float, default=60.0, help="the group's timeout (s)")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="per mpiexec job (s)")
    p.add_argument("--json", metavar="FILE", help="write everything measured as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: where a worker is
        return worker(args)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    common = [
        "--reps", str(args.reps), "--budget", str(args.budget),
        "--pingpong-rounds", str(args.pingpong_rounds), "--timeout", str(args.timeout),
    ]  # fmt: skip
    runs = []
    for n in [int(x) for x in args.procs.split(",") if x]:
        before = [round(x, 2) for x in os.getloadavg()]
        log(f"{n} processes on one node (load {before})")
        run = launch([(n, {})], ["--sizes", args.sizes, *common], args.job_timeout)
        run["load_average"] = {"before": before, "after": [round(x, 2) for x in os.getloadavg()]}
        runs.append(run)
    placement = None
    if not args.no_placement:
        before = [round(x, 2) for x in os.getloadavg()]
        log(f"2 simulated nodes x 2 processes at {args.placement_size} (load {before})")
        placement = launch(
            [(2, {"NCCLTREE_NODE": "a"}), (2, {"NCCLTREE_NODE": "b"})],
            ["--sizes", args.placement_size, *common],
            args.job_timeout,
        )
        placement["load_average"] = {
            "before": before,
            "after": [round(x, 2) for x in os.getloadavg()],
        }
    text = tables(runs, placement)
    if args.reps < 5:
        text = f"(only {args.reps} repetition(s): a smoke run, not a measurement)\n\n{text}"
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "tool": "bench/pg_table.py",
                    "argv": argv if argv is not None else sys.argv[1:],
                    "cpus": os.cpu_count(),
                    "runs": runs,
                    "placement": placement,
                    "elapsed_s": time.perf_counter() - t0,
                },
                f,
                indent=1,
            )
            f.write("\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
