"""The per-call cost of argument agreement in GPU process groups started without MPI,
measured side by side ON THE FAKE OF CUPY (tests/fakecupy): wiring, not GPU timing.

Usage:

    python bench/agreement_nompi.py [--procs 2] [--reps 5] [--iters 300] [--json FILE]

Starts ``--procs`` processes itself with torchrun's variables (mpi4py hidden), twice: all
on one node, then half on each of two simulated nodes (``NCCLTREE_NODE``). Each process
opens two GPU groups (``algorithm="nccl"``) on the fake, one with ``NCCLTREE_CHECK=on``
and one ``off``, and times ``iters`` 8-byte all_reduce calls back to back per repetition,
the cases interleaved, the slowest process counting. The table gives the median per call
and the difference on minus off: the agreement's cost per call. On one node that is a
round trip through the node's control block (real shared memory, the same code a GPU
runs); across nodes it is the fake's NCCL all_reduce of two int64 carried between the
processes over files, which says nothing of NCCL's latency on real hardware. The CPU
and load average are printed with the table.
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

ROOT = Path(__file__).resolve().parent.parent


def worker(reps: int, iters: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import fakecupy

    fakecupy.private_kernel_cache()
    installed = fakecupy.install(n_gpus=4)
    fake = installed.__enter__()
    fake.nccl_files = True
    import cupy as cp
    import numpy as np

    from nccltree.comm.group.group import ProcessGroup
    from nccltree.comm.group.launch_env import start

    started = start("env://", None, None, 60.0)
    boot = started.boot
    groups = {}
    for check in ("on", "off"):
        os.environ["NCCLTREE_CHECK"] = check
        sub = boot.sub(f"bench{check}", list(range(started.size)))  # type: ignore[attr-defined]
        groups[check] = ProcessGroup(None, "gpu", "nccl", 60.0, bootstrap=sub, method="env://")
    x = cp.asarray(np.ones(2, np.float32))
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(reps):
        for check, pg in groups.items():
            pg.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                pg.all_reduce(x)
            pg.barrier()
            times[check].append((time.perf_counter() - t0) / iters)
    for pg in groups.values():
        pg.close()
    print(json.dumps({"rank": started.rank, "times": times}), flush=True)
    boot.close()  # type: ignore[attr-defined]
    installed.__exit__(None, None, None)


def launch(procs: int, nodes: int, reps: int, iters: int) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "nompi"), str(ROOT)])
    env.update(OMP_NUM_THREADS="1", WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(procs // nodes))  # fmt: skip
    children = []
    for r in range(procs):
        node = r * nodes // procs
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r % (procs // nodes)),
                 NCCLTREE_NODE=f"bench{node}")  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "--reps", str(reps), "--iters", str(iters)]
        children.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, text=True))
    got = []
    for c in children:
        out, _ = c.communicate(timeout=600)
        if c.returncode != 0:
            raise SystemExit(f"a worker failed (exit {c.returncode})")
        got.append(json.loads(out.strip().splitlines()[-1]))
    # the slowest process per repetition, then the median over repetitions
    med = {}
    for check in ("on", "off"):
        per_rep = [max(g["times"][check][i] for g in got) for i in range(reps)]
        med[check] = statistics.median(per_rep) * 1e6
    med["agreement"] = med["on"] - med["off"]
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.reps, a.iters)
        return
    cpu = cpu_name()
    results = {}
    for nodes in (1, 2):
        print(f"{a.procs} processes on {nodes} node(s) ...", file=sys.stderr, flush=True)
        results[f"{nodes} node(s)"] = launch(a.procs, nodes, a.reps, a.iters)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"FAKE of CuPy (wiring, not GPU timing); CPU: {cpu}; load: {' '.join(load)}")
    print(f"{'placement':<12} {'check on us':>12} {'check off us':>13} {'agreement us':>13}")
    for name, m in results.items():
        print(f"{name:<12} {m['on']:>12.1f} {m['off']:>13.1f} {m['agreement']:>13.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu, "load": load, **results}, indent=1))


if __name__ == "__main__":
    main()
