"""Start-up time of a job: ``nccltree-run`` against ``mpiexec``, in one run.

Usage:

    python bench/startup.py [--procs 4] [--reps 7] [--what group|bootstrap] [--json FILE]

Each repetition starts the same worker (this file with ``--worker``) once under
``nccltree-run --nproc-per-node N`` and once under the venv's ``mpiexec -n N`` (MPICH's
Hydra), alternating which goes first, and measures:

* **wall**: from starting the launcher to its exit (interpreter start-up, imports, the
  start, one all_reduce, close, teardown): what a user waits for.
* **imports**: in the worker, numpy and nccltree's modules (the slowest process).
* **ready**: in the worker, from just before the start (after the imports) to the end of one all_reduce of
  1 KiB, the slowest process counting (``group``: ``nt.init_process_group()`` then
  ``pg.all_reduce``; ``bootstrap``: ``launch_env.start(None, ...)`` then the bootstrap's
  ``exchange`` of a placement-sized entry and a ``barrier``: the store against MPI's
  roll call and non-blocking allgather, without the group built on top).

The worker checks what it computed (the sum of the ranks, or every process's entry) and
fails otherwise. ``--what group`` needs a process group that starts without MPI; the
default is ``group`` where ``init_process_group`` takes ``init_method``, else
``bootstrap`` (said in the output). Medians over the repetitions, and the ratio
nccltree-run / mpiexec of each; the machine's CPU and load average are printed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def worker(what: str) -> None:
    t_in = time.perf_counter()
    import numpy as np

    import nccltree as nt
    from nccltree.comm.group import init_process_group
    from nccltree.comm.group.launch_env import start

    t0 = time.perf_counter()
    if what == "group":
        pg = init_process_group(timeout=60.0)
        x = np.full(256, float(pg.rank), np.float32)
        pg.all_reduce(x)
        ok = bool(np.all(x == sum(range(pg.size))))
        rank, size = pg.rank, pg.size
        dt = time.perf_counter() - t0
        pg.close()
    else:
        s = start(None, None, None, 60.0)
        entry = ["node", 1, os.getpid(), True, "abcd1234", {"algorithm": "auto"}]
        got = s.boot.exchange([*entry, s.rank])
        s.boot.barrier()
        ok = all(isinstance(g, list) and g[-1] == p and g[:2] == entry[:2]
                 for p, g in enumerate(got))  # fmt: skip
        rank, size = s.rank, s.size
        dt = time.perf_counter() - t0
        s.boot.close()
    assert nt.__version__
    row = {"rank": rank, "size": size, "import": t0 - t_in, "ready": dt, "ok": ok}
    sys.stdout.write(json.dumps(row) + "\n")  # one write: the processes share the pipe
    sys.stdout.flush()
    if not ok:
        sys.exit(3)


def one(cmd: list[str], n: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if len(rows) != n or not all(r["ok"] and r["size"] == n for r in rows):
        raise SystemExit(f"{cmd[0]}: unexpected output:\n{p.stdout}\n{p.stderr}")
    return wall, max(r["import"] for r in rows), max(r["ready"] for r in rows)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--what", choices=["group", "bootstrap"], default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
        return
    # (not at the top: a worker times its own imports of nccltree)
    from nccltree.comm.bench import cpu_name

    what = a.what
    if what is None:
        from nccltree.comm.group import init_process_group

        takes = "init_method" in inspect.signature(init_process_group).parameters
        what = "group" if takes else "bootstrap"
        if not takes:
            print("init_process_group has no init_method here: measuring the bootstrap only")
    n, me = a.procs, os.path.abspath(__file__)
    env_note = {k: v for k, v in os.environ.items() if k.startswith("NCCLTREE")}
    cmds = {
        "nccltree-run": [sys.executable, "-m", "nccltree.run", "--nproc-per-node", str(n),
                         me, "--worker", what],
        "mpiexec": [os.path.join(BIN, "mpiexec"), "-n", str(n), sys.executable, me,
                    "--worker", what],
    }  # fmt: skip
    print(f"# {n} processes, {what}; CPU {cpu_name()}, {os.cpu_count()} cores; "
          f"load {loadavg()} (before); {env_note or ''}", flush=True)  # fmt: skip
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
    one(cmds["nccltree-run"], n)  # warm the file cache, once each
    one(cmds["mpiexec"], n)
    for rep in range(a.reps):
        order = list(cmds) if rep % 2 == 0 else list(reversed(cmds))
        for k in order:
            got[k].append(one(cmds[k], n))
        print(f"rep {rep + 1}/{a.reps}: " + ", ".join(
            f"{k} wall {got[k][-1][0]:.3f} s ready {got[k][-1][2] * 1e3:.1f} ms" for k in cmds),
            flush=True)  # fmt: skip
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3))
           for k, v in got.items()}  # fmt: skip
    print(f"\nload {loadavg()} (after)\n")
    print(
        "| launcher | wall | imports in a worker | ready: start + "
        + ("one all_reduce |" if what == "group" else "exchange + barrier |")
    )
    print("|---|---|---|---|")
    for k, (w, i, r) in med.items():
        print(f"| {k} | {w:.2f} s | {i * 1e3:.0f} ms | {r * 1e3:.1f} ms |")
    ratio = [med["nccltree-run"][i] / med["mpiexec"][i] for i in range(3)]
    print("| ratio nccltree-run / mpiexec | " + " | ".join(f"{x:.2f}" for x in ratio) + " |")
    print("(medians over the repetitions; a worker's figures are its slowest process's)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"procs": n, "what": what, "cpu": cpu_name(), "runs": got,
                       "median": med}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
