"""``algorithm="auto"``'s regret on the host backend: what its choice costs against the best.

Usage: python bench/auto_regret.py [--ranks 2,4] [--max 64M] [--reps 5] [--out FILE.json]

For each rank count and size (8 B, then x8 steps, up to ``--max``): driver-side float32 sum
all_reduce, in place, through one World per algorithm (tree, ring, direct, auto) on the same
devices and arrays. The algorithms are interleaved: each repetition times every algorithm
once in turn (the mean of several calls at small sizes), so a load change hits them all.
Per size: the median and spread (min..max over repetitions) of each, the algorithm ``auto``
ran (``World.plan`` tells), and the regret: auto's median over the best median. A miss
counts only when it is larger than the spread of the two medians compared (the relative
half-width of the min..max ranges of auto and of the best, added): within that, the run
cannot tell them apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from collectives_table import sizes_up_to  # this directory: the sweep's sizes

from nccltree.cli._common import open_devices
from nccltree.comm import World
from nccltree.comm.bench import machine_description, parse_size

ALGORITHMS = ("tree", "ring", "direct", "auto")
TARGET = 1.10  # regret at most 10%


def calls_for(size: int) -> int:
    """Calls timed together in one repetition: enough for ~10 ms at small sizes."""
    if size <= 64 << 10:
        return 200
    if size <= 1 << 20:
        return 40
    if size <= 16 << 20:
        return 6
    return 3


def measure(n: int, sizes: list[int], reps: int = 5, log=print) -> dict:
    """Regret rows for ``cpu:n``: one per size."""
    rows = []
    with open_devices(f"cpu:{n}") as devs:
        machine = machine_description(devs)
        worlds = {a: World(devs, algorithm=a) for a in ALGORITHMS}
        try:
            for size in sizes:
                count = max(1, size // 4)
                xs = [np.ones(count, np.float32) for _ in range(n)]
                calls = calls_for(size)
                for w in worlds.values():  # warm-up: plans cached, pages touched
                    for _ in range(2):
                        w.all_reduce(xs)
                times: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
                for _ in range(reps):
                    for a, w in worlds.items():
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            w.all_reduce(xs)
                        times[a].append((time.perf_counter() - t0) / calls * 1e6)
                med = {a: statistics.median(t) for a, t in times.items()}
                spread = {a: (min(t), max(t)) for a, t in times.items()}
                chose = worlds["auto"].plan("all_reduce", count, in_place=True, dtype=np.float32)
                chosen = chose.description.split()[0]
                best = min(("tree", "ring", "direct"), key=lambda a: med[a])
                regret = med["auto"] / med[best]

                noise = sum((spread[a][1] - spread[a][0]) / 2 / med[a] for a in ("auto", best))
                miss = regret - 1 > noise and regret > TARGET
                rows.append(
                    {
                        "size": count * 4,
                        "median_us": med,
                        "spread_us": spread,
                        "auto_ran": chosen,
                        "best": best,
                        "regret": regret,
                        "noise": noise,
                        "miss": miss,
                    }
                )
                log(
                    f"cpu:{n} {count * 4:>9} B  auto={chosen:<6} best={best:<6} "
                    f"regret {regret:.2f} (noise {noise:.2f}){'  MISS' if miss else ''}"
                )
        finally:
            for w in worlds.values():
                w.close()
    return {"ranks": n, "machine": machine, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--max", default="64M", help="largest size (default: %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (>= 5)")
    p.add_argument("--out", default=None, help="JSON output file")
    a = p.parse_args(argv)
    sizes = sizes_up_to(parse_size(a.max))
    load_before = os.getloadavg()
    runs = [measure(int(n), sizes, a.reps) for n in a.ranks.split(",")]
    out = {
        "tool": "bench/auto_regret.py",
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "target": TARGET,
        "runs": runs,
    }
    misses = [(r["ranks"], row["size"]) for r in runs for row in r["rows"] if row["miss"]]
    print(f"misses beyond the spread and {TARGET:.2f}: {misses or 'none'}")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
