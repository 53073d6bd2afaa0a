"""The one-pass reduce (``nt_reduce_many``) against a reduction followed by copies,
side by side in one run.

Usage:

    python bench/one_pass_reduce.py [--reps 15] [--iters 3] [--json FILE]

Host Worlds (``cpu:2`` and ``cpu:4``), float32 sum all_reduce in place at 64 MiB and
4 MiB per rank: for each case two Worlds, one whose inline programs were lowered with
``executor.FUSE_REDUCE_COPIES`` on (a reduction and the copies of its result in one
pass: every source read once, every destination written once) and one with it off (a
reduction, then a copy per peer, each reading the result again). Each repetition times
``iters`` calls of every case, interleaved, so every case sees the same load; the table
gives medians and the speed-up (off / on). Results are checked bitwise equal. The
machine's CPU and load average are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

import nccltree as nt
from nccltree.comm import executor
from nccltree.comm.bench import cpu_name

CASES = [("direct", 2, 64 << 20), ("tree", 2, 64 << 20), ("direct", 4, 64 << 20),
         ("direct", 2, 4 << 20)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions")
    ap.add_argument("--iters", type=int, default=3, help="calls per timing")
    ap.add_argument("--json", help="write medians and every repetition here")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    worlds = {}
    for alg, n, nbytes in CASES:
        for fuse in (True, False):
            executor.FUSE_REDUCE_COPIES = fuse
            w = nt.World(nt.devices(f"cpu:{n}"), algorithm=alg)
            xs = [np.full(nbytes // 4, 1.0 / (r + 1), np.float32) for r in range(n)]
            w.all_reduce(xs)  # lowered now, with the setting above
            worlds[(alg, n, nbytes, fuse)] = (w, xs)
    executor.FUSE_REDUCE_COPIES = True
    times: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for key, (w, xs) in worlds.items():
            for x in xs:
                x[:] = 1.0
            t0 = time.perf_counter()
            for _ in range(args.iters):
                w.all_reduce(xs)
            times.setdefault(repr(key), []).append((time.perf_counter() - t0) / args.iters * 1e3)
    # bitwise: the same inputs through both
    for alg, n, nbytes in CASES:
        got = []
        for fuse in (True, False):
            w, xs = worlds[(alg, n, nbytes, fuse)]
            for r, x in enumerate(xs):
                x[:] = np.float32(1.0 / (r + 3))
            w.all_reduce(xs)
            got.append([x.tobytes() for x in xs])
        assert got[0] == got[1], (alg, n, nbytes)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average before {load0:.2f}, after "
          f"{os.getloadavg()[0]:.2f}; {args.reps} repetitions of {args.iters} calls")  # fmt: skip
    print()
    print("| all_reduce, float32, in place | one pass (ms) | reduce, then copies (ms) | speed-up |")
    print("|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for alg, n, nbytes in CASES:
        on, off = med[repr((alg, n, nbytes, True))], med[repr((alg, n, nbytes, False))]
        print(f"| {alg}, cpu:{n}, {nbytes >> 20} MiB | {on:.2f} | {off:.2f} | {off / on:.2f}x |")
    for w, _ in worlds.values():
        w.close()
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cpu": cpu_name(), "load_before": load0, "median_ms": med, "runs_ms": times}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
