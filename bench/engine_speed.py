"""The engine-speed figures in one run: bounds, auto's regret, latencies, issue cost.

Usage: python bench/engine_speed.py [--ranks 2,4] [--max 64M] [--reps 5] [--out FILE.json]
                                    [--skip SECTION ...]

Sections, each measured in this one process run (MPICH in its own ``mpiexec`` jobs,
started from here between the nccltree measurements):

* ``bounds`` — ``bench/collectives_table.py``: tree, ring and direct all_reduce, float32
  sum, 8 B .. 64 MiB, in place and out of place, with MPICH, ``nt_copy`` at the devices'
  thread count before and after the sweep; at the largest size every algorithm against
  its own byte-count bound and the best against the minimum-bytes bound.
* ``regret`` — ``bench/auto_regret.py``: the algorithm ``auto`` runs against the best
  median at every size, the algorithms interleaved in each repetition.
* ``latency`` — ``bench/handoff.py``: 8 B, 64 KiB and 1 MiB all_reduce through the
  per-rank API and the driver-side call, the bare C two-thread futex round trip, MPICH.
* ``issue`` — ``bench/issue_cost.py``: the executor's own cost of issuing a cached plan on
  the null backend (8 B, 1 MiB and 256 MiB on 2 and 8 ranks).

``--busy N`` measures the latencies once more while N processes spin on the CPU: MPICH's
ranks poll, which wins on idle cores and loses when the cores are taken, so both
pictures are reported.

Prints the Markdown tables of docs/performance.md and writes everything as JSON. The
machine's load average is recorded before and after each section.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
SECTIONS = ("bounds", "regret", "latency", "issue")


def _bench_module(name: str) -> ModuleType:
    """A sibling script of this one, imported as a module."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", HERE / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"bench/{name}.py not found")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def bounds_section(ranks: list[int], maxbytes: int, log) -> dict[str, Any]:
    ct = _bench_module("collectives_table")
    sizes = ct.sizes_up_to(maxbytes)
    runs = {}
    for n in ranks:
        run = ct.measure(n, sizes, log)
        run["summary"] = ct.summarise(n, run, maxbytes)
        runs[str(n)] = run
    return {"sizes": sizes, "runs": runs, "targets": ct.TARGETS}


def bounds_tables(sec: dict[str, Any]) -> list[str]:
    out = [
        "| ranks | algorithm | placement | time (ms) | own bound (ms) | ratio | "
        "min-bytes ratio | bytes / size |",
        "| ---: | :--- | :--- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, run in sec["runs"].items():
        for b in run["summary"]["bounds"]:
            out.append(
                f"| {n} | {b['algorithm']} | {b['placement']} | {b['time_us'] / 1e3:.2f} | "
                f"{b['bound_us'] / 1e3:.2f} | {b['ratio']:.2f} | {b['min_bytes_ratio']:.2f} | "
                f"{b['bytes_over_size']:.0f} |"
            )
    out.append("")
    out.append(
        "| ranks | nt_copy threads | nt_copy GB/s (before, after) | MPICH busbw | best busbw |"
    )
    out.append("| ---: | ---: | :--- | ---: | ---: |")
    for n, run in sec["runs"].items():
        nt = run["nt_copy"]
        mpi = run["summary"].get("mpi")
        mpi_cell = f"{mpi['mpi_busbw']:.2f}" if mpi else "n/a"
        best = f"{mpi['best']['busbw']:.2f} ({mpi['best']['algorithm']})" if mpi else "n/a"
        out.append(
            f"| {n} | {nt['threads']} | {nt['bandwidth']:.1f} ({nt['before']:.1f}, "
            f"{nt['after']:.1f}) | {mpi_cell} | {best} |"
        )
    return out


def regret_section(ranks: list[int], maxbytes: int, reps: int, log) -> dict[str, Any]:
    ar = _bench_module("auto_regret")
    sizes = ar.sizes_up_to(maxbytes)
    return {"target": ar.TARGET, "runs": [ar.measure(n, sizes, reps, log) for n in ranks]}


def regret_tables(sec: dict[str, Any]) -> list[str]:
    out = [
        "| ranks | size | auto ran | best | tree (µs) | ring (µs) | direct (µs) | auto (µs) | "
        "regret | spread | miss |",
        "| ---: | ---: | :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    for run in sec["runs"]:
        for row in run["rows"]:
            m = row["median_us"]
            out.append(
                f"| {run['ranks']} | {row['size']} | {row['auto_ran']} | {row['best']} | "
                f"{m['tree']:.1f} | {m['ring']:.1f} | {m['direct']:.1f} | {m['auto']:.1f} | "
                f"{row['regret']:.2f} | {row['noise']:.2f} | {'yes' if row['miss'] else 'no'} |"
            )
    return out


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each while the block runs (0: none): the
    latency figures on a machine whose cores are taken, where polling loses its edge."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if procs else 0.0)  # let them take their cores
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _module_section(name: str, ranks: list[int], reps: int, log) -> dict[str, Any]:
    mod = _bench_module(name)
    if name == "handoff":  # per-rank and driver-side latency at the rank counts asked
        result: dict[str, Any] = mod.measure(ranks=tuple(ranks), reps=reps)
        return result
    # the issue cost: the null backend at its own rank counts (2 and 8)
    result = mod.measure(reps=reps, log=log)
    return result


def _module_tables(name: str, sec: dict[str, Any]) -> list[str]:
    mod = _bench_module(name)
    rows = mod.table(sec)
    return rows.splitlines() if isinstance(rows, str) else list(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--max", default="64M", help="largest all_reduce size (default: %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (>= 5)")
    p.add_argument("--out", default="engine_speed.json", help="JSON output file")
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to skip")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="measure the latencies a second time with N spinning processes running",
    )
    args = p.parse_args(argv)
    if args.reps < 5:
        p.error("--reps must be at least 5")
    from nccltree.comm.bench import parse_size

    ranks = [int(x) for x in args.ranks.split(",")]
    maxbytes = parse_size(args.max)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "tool": "bench/engine_speed.py",
        "command": "python bench/engine_speed.py " + " ".join(argv or sys.argv[1:]),
        "sections": {},
    }
    tables: list[str] = []
    for name in SECTIONS:
        if name in args.skip:
            continue
        before = _load()
        log(f"{name}: start (load {before})")
        if name == "bounds":
            sec = bounds_section(ranks, maxbytes, log)
            rows = bounds_tables(sec)
        elif name == "regret":
            sec = regret_section(ranks, maxbytes, args.reps, log)
            rows = regret_tables(sec)
        else:
            module = {"latency": "handoff", "issue": "issue_cost"}[name]
            sec = _module_section(module, ranks, args.reps, log)
            rows = _module_tables(module, sec)
            if name == "latency" and args.busy:
                log(f"latency again with {args.busy} spinning processes")
                with busy(args.busy):
                    loaded = _module_section(module, ranks, args.reps, log)
                    loaded["load_average"] = _load()
                sec["busy"] = {"spinning_processes": args.busy, "result": loaded}
                rows += ["", f"With {args.busy} spinning processes:", ""]
                rows += _module_tables(module, loaded)
        sec["load_average"] = {"before": before, "after": _load()}
        result["sections"][name] = sec
        tables += [f"### {name} (load {before} -> {sec['load_average']['after']})", "", *rows, ""]
    result["elapsed_s"] = time.perf_counter() - t0
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print("\n".join(tables))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
