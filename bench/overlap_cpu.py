"""Gradient buckets: where each step's CPU goes (a companion of overlap_table.py).

    python bench/overlap_cpu.py [--rounds 3] [--iters 60]

For the 2-rank MLP of overlap_table.py, communication off and buckets of 0, 1, 0.03 and
8 MiB, interleaved: per step, the wall time, the process's CPU time (user + system, from
getrusage), the idle core time (2 cores x step - CPU), context switches, and the exposed
communication. Medians of the rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap_table import BATCH, CLASSES, FEATURES, Case, config, memory_data

from nccltree.cli._training import build_training


def run(case: Case, iters: int = 60, warmup: int = 5) -> dict[str, float]:
    with build_training(config(case), (FEATURES,), CLASSES) as t:
        data = memory_data(case.ranks, BATCH)
        t.driver.fit(data, warmup)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = time.perf_counter()
        res = t.driver.fit(data, warmup + iters)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        w1 = time.perf_counter()
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / iters * 1e3
    sys_ = (r1.ru_stime - r0.ru_stime) / iters * 1e3
    vcs = (r1.ru_nvcsw - r0.ru_nvcsw) / iters
    ivcs = (r1.ru_nivcsw - r0.ru_nivcsw) / iters
    return dict(
        step=1e3 * (w1 - w0) / iters,
        cpu=cpu,
        sys=sys_,
        vcs=vcs,
        ivcs=ivcs,
        exposed=1e3 * statistics.mean(res.exposed_times),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    cases = [
        Case(2, comm=False),
        Case(2, bucket_mb=0),
        Case(2, bucket_mb=1),
        Case(2, bucket_mb=0.03),
        Case(2, bucket_mb=8),
    ]
    out = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            out[c].append(run(c, args.iters))
    for c in cases:
        m = {k: statistics.median(r[k] for r in out[c]) for k in out[c][0]}
        idle = 2 * m["step"] - m["cpu"]
        print(
            f"{c.name:35s} " + " ".join(f"{k}={v:.2f}" for k, v in m.items()) + f" idle={idle:.2f}"
        )


if __name__ == "__main__":
    main()
