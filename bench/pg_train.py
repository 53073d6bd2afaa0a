"""Weak scaling of training over processes: 1 rank in one process against 2 ranks in 2
processes (``mpiexec -n 2``) and 2 ranks in one process, interleaved.

    python bench/pg_train.py [--reps 5] [--iters 30] [--json FILE]

Each repetition runs, in turn: ``nccltree-bench train --devices cpu:1``, ``... --devices
cpu:2`` and ``mpiexec -n 2 nccltree-bench train --devices cpu``, all on the MLP of
docs/performance.md ("Training": 512-1024-1024-10, 256 examples per rank, one BLAS
thread per rank). Efficiency = examples/s / (ranks x the 1-rank examples/s), medians
over the repetitions; comm = the fraction of step time inside collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
MODEL = ["--hidden", "1024,1024", "--features", "512", "--batch-size", "256"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", help="write the measurements here")
    a = p.parse_args(argv)
    bench = [str(BIN / "nccltree-bench"), "train"]
    runs = {
        "cpu:1 (1 process)": (1, bench + ["--devices", "cpu:1"]),
        "cpu:2 (1 process)": (2, bench + ["--devices", "cpu:2"]),
        "cpu x 2 processes (mpiexec -n 2)": (
            2, [str(BIN / "mpiexec"), "-n", "2", *bench, "--devices", "cpu"]),
    }  # fmt: skip
    common = [*MODEL, "--iters", str(a.iters), "-w", str(a.warmup), "--quiet"]
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        for rep in range(a.reps):
            for name, (_, cmd) in runs.items():
                subprocess.run([*cmd, *common, "--json", str(out)], check=True,
                               capture_output=True, env=env)  # fmt: skip
                point = json.loads(out.read_text())["points"][0]
                got[name].append((point["examples_per_s"], point["comm_fraction"]))
            print(f"repetition {rep + 1}/{a.reps} done", file=sys.stderr, flush=True)
    base = statistics.median(e for e, _ in got["cpu:1 (1 process)"])
    print("| ranks | how | examples/s (median, min–max) | efficiency | comm |")
    print("| ---: | :--- | ---: | ---: | ---: |")
    rows = []
    for name, (ranks, _) in runs.items():
        eps = [e for e, _ in got[name]]
        med = statistics.median(eps)
        comm = statistics.median(c for _, c in got[name])
        eff = med / (ranks * base)
        rows.append({"name": name, "ranks": ranks, "examples_per_s": eps, "efficiency": eff,
                     "comm": comm})  # fmt: skip
        print(f"| {ranks} | {name} | {med:,.0f} ({min(eps):,.0f}–{max(eps):,.0f}) | "
              f"{eff:.2f} | {comm * 100:.1f}% |")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
