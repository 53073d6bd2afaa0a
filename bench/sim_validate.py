"""The simulator against this machine: calibrate the host backend from microbenchmarks
only (nccltree.sim.calibrate_host), then predict ``nccltree-bench collectives`` on cpu:2
and cpu:4 (all five collectives, tree/ring/direct, out of place, 1 KiB to 64 MiB) and
measure it in the same run.

    python bench/sim_validate.py [--ranks 2,4] [--iters 5] [--json FILE]

Prints the calibration, a table of predicted / measured per point, and the median of
|predicted / measured - 1| with the worst ratio (the simulator's targets: median <= 25%,
every point within 2x). The machine's load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from nccltree import sim
from nccltree.comm import bench as drv
from nccltree.comm.collectives import COLLECTIVES

COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
ALGS = ("tree", "ring", "direct")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--minbytes", default="1K")
    p.add_argument("--maxbytes", default="64M")
    p.add_argument("--factor", type=float, default=4)
    p.add_argument("--json", default="")
    args = p.parse_args()
    load0 = os.getloadavg()
    ranks = [int(x) for x in args.ranks.split(",")]
    cal = sim.calibrate_host(ranks)
    curve = ", ".join(f"{b >> 10} KiB {g:.1f}" for b, g in cal.copy_gbps[cal.cores])
    print(f"# calibration: nt_copy with {cal.cores} threads (GB/s read + written by working "
          f"set): {curve}; {cal.step_s * 1e6:.3f} us per inline step; a call's fixed cost "
          f"{', '.join(f'{n} ranks {t * 1e6:.1f} us' for n, t in cal.call_s.items())}; load "
          f"{load0[0]:.2f}")  # fmt: skip
    sizes = drv.size_range(drv.parse_size(args.minbytes), drv.parse_size(args.maxbytes),
                           args.factor)  # fmt: skip
    rows = []
    for n in ranks:
        recs = drv.run_benchmark(f"cpu:{n}", algorithms=list(ALGS), collectives=list(COLLS),
                                 sizes=sizes, iters=args.iters, warmup=1, check=0,
                                 placements=["out-of-place"])  # fmt: skip
        for r in recs:
            coll = COLLECTIVES[r.collective]
            item = 4
            # NCCL's count (a block for all_gather and reduce_scatter; the table's count
            # column is the elements of the whole array)
            count = coll.count_for(r.size // item, n)
            pred = sim.predict_host(cal, n, r.algorithm, r.collective, count, item)
            rows.append({"ranks": n, "collective": r.collective, "algorithm": r.algorithm,
                         "size": r.size, "measured_us": r.time_us,
                         "predicted_us": pred * 1e6,
                         "ratio": pred * 1e6 / r.time_us if r.time_us else 0.0})  # fmt: skip
    print("| ranks | collective | algorithm | size | predicted us | measured us | ratio |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['ranks']} | {row['collective']} | {row['algorithm']} | {row['size']} | "
              f"{row['predicted_us']:.1f} | {row['measured_us']:.1f} | {row['ratio']:.2f} |")  # fmt: skip
    errors = [abs(r["ratio"] - 1) for r in rows if r["ratio"] > 0]
    worst = max(max(r["ratio"], 1 / r["ratio"]) for r in rows if r["ratio"] > 0)
    load1 = os.getloadavg()
    med = statistics.median(errors)
    print(f"median |predicted / measured - 1| = {med:.2f} (target <= 0.25); worst ratio "
          f"{worst:.2f}x (target <= 2); {len(rows)} points; load {load0[0]:.2f} -> "
          f"{load1[0]:.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calibration": cal.to_json(),
                       "rows": rows, "median_error": med,
                       "worst_ratio": worst, "load": [load0, load1]}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
