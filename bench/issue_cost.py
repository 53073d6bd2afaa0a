"""Host time of issuing a plan: driver-side all_reduce calls on the null backend.

Usage: python bench/issue_cost.py [--ranks 2,8] [--sizes 8,1M,256M]
           [--algorithms tree,ring,direct] [--topology nvswitch8] [--reps 5]
           [--chunk-bytes SIZE] [--out FILE]

The null backend (``bench/null_backend.py``) goes through the real World, argument checks,
plan cache and executor, but its streams do nothing, so a call's time is what the engine
itself costs to issue the plan: a LOWER bound for GPUs, where CuPy's argument packing,
device switches, copies, kernel launches and event calls come on top. For each algorithm,
rank count and size (float32, in place, the same arrays every call, the plan cached after
a warm-up) it reports the median over ``reps`` repetitions of the mean time per call, the
plan's step count and the time per step (call time / steps), and the load average.
``measure(...)`` returns the same as a dict (what ``--out`` writes as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from null_backend import null_world

SIZES = (8, 1 << 20, 256 << 20)


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _one(
    n: int,
    nbytes: int,
    algorithm: str,
    topology: str,
    reps: int,
    min_time: float,
    chunk_bytes: int | None,
) -> dict[str, Any]:
    with null_world(n, topology, algorithm, chunk_bytes=chunk_bytes) as w:
        count = max(1, nbytes // 4)
        xs = [w.devices[r].empty((count,), np.float32) for r in range(n)]
        plan = w.plan("all_reduce", count, in_place=True, algorithm=algorithm)
        t0 = time.perf_counter()
        w.all_reduce(xs)  # builds and caches the plan
        first = time.perf_counter() - t0
        # calls per repetition: enough for min_time seconds, at least one
        t0 = time.perf_counter()
        w.all_reduce(xs)
        one = max(time.perf_counter() - t0, 1e-7)
        iters = max(1, int(min_time / one))
        means = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                w.all_reduce(xs)
            means.append((time.perf_counter() - t0) / iters)
        call = statistics.median(means)
        return {
            "algorithm": algorithm,
            "ranks": n,
            "bytes": nbytes,
            # (a World from before the chunk policy has no chunk_for)
            "chunk_bytes": w.chunk_for(nbytes) if hasattr(w, "chunk_for") else w.chunk_bytes,
            "steps": len(plan.steps),
            "data_steps": len(plan.data_steps()),
            "first_call_ms": first * 1e3,
            "call_us": call * 1e6,
            "step_us": call * 1e6 / len(plan.steps),
            "iters": iters,
        }


def measure(
    ranks: Sequence[int] = (2, 8),
    sizes: Sequence[int] = SIZES,
    algorithms: Sequence[str] = ("tree", "ring", "direct"),
    *,
    topology: str = "nvswitch8",
    reps: int = 5,
    min_time: float = 0.05,
    chunk_bytes: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Issue cost of all_reduce on the null backend: one row per (algorithm, ranks, size),
    with ``call_us`` (median over ``reps`` of the mean per call), ``steps`` and
    ``step_us``; plus the machine and the load average before and after. ``chunk_bytes``
    fixes the chunk (None: the GPU policy); ``min_time`` is the least time of one
    repetition (seconds; at least one call); ``log`` gets a line per row as it is
    measured."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    load_before = os.getloadavg()
    rows = []
    for alg in algorithms:
        for n in ranks:
            for s in sizes:
                row = _one(n, s, alg, topology, reps, min_time, chunk_bytes)
                rows.append(row)
                if log is not None:
                    log(f"issue cost: {alg} {n} ranks {s} B: {row['call_us']:.1f} us per call")
    return {
        "what": "host time of issuing a driver-side all_reduce on the null backend (float32, "
        "in place, plan cached); a lower bound for GPUs",
        "topology": topology,
        "chunk_bytes": chunk_bytes,
        "reps": reps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, numpy {np.__version__}",
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "rows": rows,
    }


def _size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(result: dict[str, Any]) -> list[str]:
    """The rows as the lines of a Markdown table."""
    lines = [
        "| algorithm | ranks | size | chunk | steps | per call (µs) | per step (µs) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['algorithm']} | {r['ranks']} | {_size_text(r['bytes'])} | "
            f"{_size_text(r['chunk_bytes'])} | {r['steps']} | {r['call_us']:.1f} | "
            f"{r['step_us']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--ranks", default="2,8", help="comma-separated rank counts")
    p.add_argument("--sizes", default="8,1M,256M", help="comma-separated sizes (K, M, G)")
    p.add_argument("--algorithms", default="tree,ring,direct")
    p.add_argument("--topology", default="nvswitch8", help="a topology preset")
    p.add_argument("--reps", type=int, default=5, help="repetitions (the median is kept)")
    p.add_argument("--chunk-bytes", help="a fixed chunk (K, M, G), instead of the GPU policy")
    p.add_argument("--out", help="write the result as JSON to this file")
    a = p.parse_args(argv)
    result = measure(
        [int(r) for r in a.ranks.split(",")],
        [_parse_size(s) for s in a.sizes.split(",")],
        a.algorithms.split(","),
        topology=a.topology,
        reps=a.reps,
        chunk_bytes=None if a.chunk_bytes is None else _parse_size(a.chunk_bytes),
    )
    print(f"# {result['machine']}; topology {result['topology']}")
    print(f"# load average {' '.join(f'{x:.2f}' for x in result['load_before'])} (before)")
    print("\n".join(table(result)))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
