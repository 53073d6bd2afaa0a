"""Gradient buckets: how much of the communication the backward pass hides, as Markdown.

Usage: python bench/overlap_table.py [--ranks 2 4] [--bucket-mb 0 0.5 1 2 4 8]
                                     [--iters 60] [--warmup 5] [--repeat 5] [--json FILE]
       python bench/overlap_table.py --loss-curve [--iters 500] [--json FILE]

The MLP of train_table.py (512 -> 1024 -> 1024 -> 10, 6.3 MB of gradients), batch 256
per rank, weak scaling, one BLAS thread per rank, batches from memory, the tree. For each
rank count: communication off (the control: each rank steps on its own gradient), then
every bucket size (0: one all-reduce after backward), then the float16 hook without
buckets and with the size given by --hook-mb; all interleaved (every case once per round,
so a change in the machine's load hits every case alike) and repeated; medians. The
load is recorded as the 1-minute load average (which counts this run's own threads) and
as the cores other processes kept busy during the table (from /proc/stat).

Columns: examples/s; vs 0 = examples/s over the unbucketed run's; step ms; exposed ms =
from the end of backward to the update, per step (the communication backward did not
hide); overlap = 1 - exposed / the unbucketed run's exposed; comm cost = 1 - examples/s /
the control's (the throughput communication costs); of which, per step: waiting (the
exposed time) and work inside backward (the rest of the step time over the control's:
the collectives' own CPU work and their launches, which take cores from backward).

``--loss-curve``: the reference task (``nccltree-train``'s defaults: the built-in
synthetic task, MLP 64-256-10, cpu:2, batch 32 per rank, 500 iterations) with float32
gradients and with the float16 hook, without and with buckets: the loss every 50
iterations (mean of the 10 up to it), the final held-out accuracy, and the largest
relative difference of the final parameters from the float32 run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_table import CLASSES, FEATURES, HIDDEN, SOLVER, _markdown, memory_data

from nccltree.cli._training import DriverConfig, bucket_bytes, build_training
from nccltree.comm.bench import machine_description

BATCH = 256


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds every process used, CPU seconds this process used), from
    /proc: what other processes took of the cores during a run is the difference."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    with open("/proc/self/stat", encoding="ascii") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return time.monotonic(), busy / tick, (int(mine[11]) + int(mine[12])) / tick


@dataclass(frozen=True)
class Case:
    ranks: int
    comm: bool = True
    bucket_mb: float = 0.0
    hook: str | None = None

    @property
    def name(self) -> str:
        if not self.comm:
            return f"cpu:{self.ranks}, communication off"
        hook = f", {self.hook} hook" if self.hook else ""
        return f"cpu:{self.ranks}, buckets {self.bucket_mb:g} MiB{hook}"


def config(case: Case) -> DriverConfig:
    """The training a case measures: the MLP, one BLAS thread per rank, its buckets."""
    return DriverConfig(
        devices=f"cpu:{case.ranks}",
        model="mlp",
        batch_size=BATCH,
        hidden=HIDDEN,
        comm=case.comm,
        blas_threads=1,
        bucket_bytes=bucket_bytes(case.bucket_mb),
        comm_hook=case.hook,
        solver=SOLVER,
    )


def measure(case: Case, iters: int, warmup: int) -> dict[str, float]:
    with build_training(config(case), (FEATURES,), CLASSES) as t:
        data = memory_data(case.ranks, BATCH)
        t.driver.fit(data, warmup)
        res = t.driver.fit(data, warmup + iters)
    return {
        "examples_per_s": res.examples_per_s,
        "step_ms": 1e3 * statistics.mean(res.step_times),
        "exposed_ms": 1e3 * statistics.mean(res.exposed_times),
        "comm_ms": 1e3 * statistics.mean(res.comm_times),
    }


def speed_table(
    ranks: int, sizes: list[float], hook_mb: float, iters: int, warmup: int, repeat: int
) -> dict[str, object]:
    cases = [Case(ranks, comm=False)] + [Case(ranks, bucket_mb=mb) for mb in sizes]
    cases += [Case(ranks, hook="float16"), Case(ranks, bucket_mb=hook_mb, hook="float16")]
    runs: dict[Case, list[dict[str, float]]] = {c: [] for c in cases}
    load = [os.getloadavg()[0]]
    t0, busy0, mine0 = cpu_seconds()
    for _ in range(repeat):
        for c in cases:
            runs[c].append(measure(c, iters, warmup))
        load.append(os.getloadavg()[0])
    t1, busy1, mine1 = cpu_seconds()
    # cores other processes kept busy, on average, while this table was measured
    others = ((busy1 - busy0) - (mine1 - mine0)) / (t1 - t0)
    med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in cases}
    off, zero = med[cases[0]], med[cases[1]]
    rows = []
    for c in cases:
        m = med[c]
        row: dict[str, object] = {"case": c.name, **m}
        row["examples_per_s_runs"] = [r["examples_per_s"] for r in runs[c]]
        if c.comm:
            row["vs_unbucketed"] = m["examples_per_s"] / zero["examples_per_s"]
            row["overlap"] = (
                1 - m["exposed_ms"] / zero["exposed_ms"] if zero["exposed_ms"] else None
            )
            row["comm_cost"] = 1 - m["examples_per_s"] / off["examples_per_s"]
            row["work_ms"] = m["step_ms"] - off["step_ms"] - m["exposed_ms"]
        else:
            row.update(vs_unbucketed=None, overlap=None, comm_cost=None, work_ms=None)
        rows.append(row)
    return {"ranks": ranks, "rows": rows, "load_1min": load, "other_cores": others}


SPEED_COLUMNS = [
    ("case", "case", ""),
    ("examples/s", "examples_per_s", ",.0f"),
    ("vs 0", "vs_unbucketed", ".3f"),
    ("step ms", "step_ms", ".2f"),
    ("exposed ms", "exposed_ms", ".2f"),
    ("overlap", "overlap", ".0%"),
    ("comm cost", "comm_cost", ".1%"),
    ("work in backward ms", "work_ms", ".2f"),
]


def loss_curves(iters: int, hook_mb: float) -> dict[str, object]:
    """The reference task with float32 gradients and with the float16 hook."""
    from nccltree.cli import train

    runs = {}
    variants = {
        "float32": [],
        "float16 hook": ["--comm-hook", "float16"],
        f"float32, buckets {hook_mb:g} MiB": ["--bucket-mb", str(hook_mb)],
        f"float16 hook, buckets {hook_mb:g} MiB": [
            "--comm-hook", "float16", "--bucket-mb", str(hook_mb),
        ],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in variants.items():
            out = os.path.join(tmp, str(len(runs)))
            argv = ["--devices", "cpu:2", "--iters", str(iters), "--out", out, "--quiet"]
            assert train.main([*argv, "--eval-every", str(iters), *flags]) == 0
            with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
                records = [json.loads(line) for line in f]
            losses = [r["loss"] for r in records if r["event"] == "train"]
            acc = [r["accuracy"] for r in records if r["event"] == "eval"][-1]
            with np.load(os.path.join(out, "final.npz")) as z:
                final = np.concatenate([z[k].ravel() for k in sorted(z.files)])
            runs[name] = {"losses": losses, "accuracy": acc, "final": final}
    ref = runs["float32"]["final"]
    every = max(1, iters // 10)
    rows = []
    for name, r in runs.items():
        curve = [
            float(np.mean(r["losses"][max(0, i - 10) : i])) for i in range(every, iters + 1, every)
        ]
        diff = float(np.linalg.norm(r["final"] - ref) / np.linalg.norm(ref))
        rows.append({"run": name, "curve": curve, "accuracy": r["accuracy"], "rel_diff": diff})
    return {"every": every, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[0, 0.5, 1, 2, 4, 8])
    ap.add_argument("--hook-mb", type=float, default=1.0, help="bucket size of the hook's run")
    ap.add_argument("--iters", type=int, default=60, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    ap.add_argument("--repeat", type=int, default=5, help="runs per case (median)")
    ap.add_argument("--loss-curve", action="store_true", help="the float16 hook's loss curve")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.bucket_mb[0] != 0:
        ap.error("--bucket-mb must start with 0 (the unbucketed run the others compare with)")
    import nccltree as nt

    devs = nt.devices("cpu:1")
    machine = machine_description(devs)
    devs[0].runtime.shutdown()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result: dict[str, object] = {"machine": machine, "started": started, "args": vars(args)}
    print(f"{machine['cpu']}, {machine['cpu_count']} cores; started {started}\n")
    if args.loss_curve:
        curves = loss_curves(args.iters, args.hook_mb)
        result["loss_curve"] = curves
        every = curves["every"]
        header = ["run", *(f"loss @{i}" for i in range(every, args.iters + 1, every))]
        columns = [(h, h, "") for h in header] + [("accuracy", "accuracy", ".2%"),
                                                    ("parameters vs float32", "rel_diff", ".1e")]  # fmt: skip
        rows = [
            {"run": r["run"], **{h: f"{v:.4f}" for h, v in zip(header[1:], r["curve"])},
             "accuracy": r["accuracy"], "rel_diff": r["rel_diff"]}
            for r in curves["rows"]
        ]  # fmt: skip
        print(_markdown(rows, columns))
    else:
        tables = []
        for ranks in args.ranks:
            t = speed_table(
                ranks, args.bucket_mb, args.hook_mb, args.iters, args.warmup, args.repeat
            )
            tables.append(t)
            load = t["load_1min"]
            print(
                f"cpu:{ranks}: median of {args.repeat} interleaved runs of {args.iters} steps; "
                f"load average (1 min, this run's threads included) {min(load):.2f} to "
                f"{max(load):.2f}; other processes kept {t['other_cores']:.2f} cores busy "
                "on average\n"
            )
            print(_markdown(t["rows"], SPEED_COLUMNS) + "\n", flush=True)
        result["speed"] = tables
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
