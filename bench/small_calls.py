"""Host time of small driver-side all_reduce calls (the per-call cost of the engine).

Usage: python bench/small_calls.py [--ranks 2,4] [--sizes 8,65536] [--iters 2000] [--reps 5]

For each rank count and size: ``World(f"cpu:{n}").all_reduce(xs)`` on float32 arrays, the
same arrays every call (what a training step does), after a warm-up; prints the median
over ``reps`` repetitions of the mean time of ``iters`` calls, in microseconds, and the
machine's load average. Calls of these sizes run inline in the calling thread, so this
measures the engine's own cost: argument checks, plan lookup and issuing the steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import nccltree as nt


def call_time_us(n: int, nbytes: int, iters: int, reps: int) -> float:
    with nt.World(f"cpu:{n}") as w:
        xs = [np.ones(max(1, nbytes // 4), np.float32) for _ in range(n)]
        for _ in range(min(iters, 200)):
            w.all_reduce(xs)
        means = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                w.all_reduce(xs)
            means.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(means)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--sizes", default="8,65536", help="comma-separated sizes in bytes")
    p.add_argument("--iters", type=int, default=2000, help="calls per repetition")
    p.add_argument("--reps", type=int, default=5, help="repetitions (the median is printed)")
    a = p.parse_args(argv)
    print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| ranks | size (B) | driver-side all_reduce (µs) |")
    print("| ---: | ---: | ---: |")
    for n in (int(r) for r in a.ranks.split(",")):
        for size in (int(s) for s in a.sizes.split(",")):
            print(f"| {n} | {size} | {call_time_us(n, size, a.iters, a.reps):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
