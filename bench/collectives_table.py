"""The all_reduce comparison on the host backend, in one run, written as JSON.

Usage: python bench/collectives_table.py [--ranks 2,4] [--out FILE.json] [--max 64M]

For each rank count N, in one process run (and one MPI job per N):

* tree, ring and direct all_reduce through the library's benchmark driver (the figures of
  ``nccltree-bench collectives``), float32 sum, 8 B .. 64 MiB, out of place and in place;
* MPICH: ``Allreduce(MPI.IN_PLACE, buf)`` through mpi4py, N processes under the venv's
  ``mpiexec`` (``bench/mpi_allreduce.py``);
* a naive numpy all_reduce: sum the N arrays, then copy the sum into each;
* the library's own copy (``nt_copy``) with as many threads as the devices use in all, and
  ``np.copyto`` on one core, at the largest size (bytes read + written per second);
* a bare ``threading.Barrier`` round trip of N threads.

From these it derives, for each algorithm at the largest size, the ratio of its time to
its own byte-count bound (the bytes its plan reads and writes, ``Plan.bytes_moved``, over
``nt_copy``'s bandwidth at the devices' total thread count, measured in the same run), the
ratio of the best algorithm's time to the minimum-bytes bound (the fewest bytes any of the
algorithms moves, over the same bandwidth: moving more bytes is not rewarded), the ratio of the best bus bandwidth to MPICH's, and at 8 B the ratio of each
algorithm's time to the barrier round trip. ``bench/make_tables.py`` turns the JSON into
the Markdown tables of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from nccltree.cli._common import open_devices
from nccltree.comm.bench import Benchmark, bandwidths, machine_description, parse_size

ALGORITHMS = ("tree", "ring", "direct")
# (smallest size of the group, timed iterations, warm-up): fewer at large sizes
SCHEDULE = ((0, 50, 10), (1 << 20, 20, 5), (16 << 20, 7, 2))
TARGETS = {"bound_ratio_max": 1.3, "mpi_ratio_min": 2.0, "barrier_ratio_max": 3.0}


def iters_for(size: int) -> tuple[int, int]:
    _, iters, warmup = [s for s in SCHEDULE if size >= s[0]][-1]
    return iters, warmup


def sizes_up_to(maxbytes: int) -> list[int]:
    """8 B, then x8 steps, then the largest size itself."""
    sizes, s = [], 8
    while s < maxbytes:
        sizes.append(s)
        s *= 8
    return [*sizes, maxbytes]


def copy_bandwidth(nbytes: int, repeat: int = 9, threads: int | None = None) -> dict:
    """A copy of ``nbytes``: median time and bytes read + written per second. ``threads``
    None: ``np.copyto`` (one core); else the library's ``nt_copy`` with that many threads,
    the rate the devices' own kernels can reach together."""
    from nccltree import _native

    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)

    def once() -> None:
        if threads is None:
            np.copyto(b, a)
        else:
            _native.copy(b, a, nthreads=threads)

    once()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {
        "size": a.nbytes,
        "time_us": t * 1e6,
        "bandwidth": 2 * a.nbytes / t / 1e9,
        "samples_us": [x * 1e6 for x in times],
    }


def barrier_round_trip(n: int, rounds: int = 2000, repeat: int = 5) -> dict:
    """One ``threading.Barrier(n).wait()`` of n threads, median over ``repeat`` runs."""
    per_round = []
    for _ in range(repeat):
        bar = threading.Barrier(n)

        def worker(bar=bar) -> None:
            for _ in range(rounds + 1):
                bar.wait()

        threads = [threading.Thread(target=worker) for _ in range(n - 1)]
        for t in threads:
            t.start()
        bar.wait()  # everyone is running before the clock starts
        t0 = time.perf_counter()
        for _ in range(rounds):
            bar.wait()
        per_round.append((time.perf_counter() - t0) / rounds)
        for t in threads:
            t.join()
    return {"threads": n, "time_us": statistics.median(per_round) * 1e6, "rounds": rounds}


def naive_numpy(n: int, sizes: list[int], seed: int = 0) -> list[dict]:
    """All_reduce the simple way: sum the N arrays with np.add, copy the sum into each."""
    rows = []
    rng = np.random.default_rng(seed)
    for size in sizes:
        count = size // 4
        xs = [rng.integers(-4, 5, count).astype(np.float32) for _ in range(n)]
        tmp = np.empty(count, np.float32)

        def run(xs=xs, tmp=tmp) -> None:
            np.add(xs[0], xs[1], out=tmp)
            for x in xs[2:]:
                np.add(tmp, x, out=tmp)
            for x in xs:
                np.copyto(x, tmp)

        iters, warmup = iters_for(size)
        for _ in range(warmup):
            run()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        algbw, busbw = bandwidths(count * 4, t, 2 * (n - 1) / n)
        rows.append({"size": count * 4, "time_us": t * 1e6, "algbw": algbw, "busbw": busbw})
    return rows


def run_mpi(n: int, sizes: list[int]) -> dict:
    here = Path(__file__).resolve().parent
    exe = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(exe) if exe.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        return {"error": "mpiexec not found (install the mpi extra: mpi4py and mpich)"}
    large = [s for s in SCHEDULE if s[0] > 0]
    cmd = [
        mpiexec,
        "-n",
        str(n),
        sys.executable,
        str(here / "mpi_allreduce.py"),
        "--sizes",
        ",".join(map(str, sizes)),
        "--iters",
        str(SCHEDULE[0][1]),
        "--warmup",
        str(SCHEDULE[0][2]),
        "--large",
        str(large[-1][0]),
        "--large-iters",
        str(large[-1][1]),
        "--large-warmup",
        str(large[-1][2]),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode:
        return {"error": f"mpiexec exited with {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(n: int, run: dict, maxbytes: int) -> dict:
    """The three target ratios (bound, MPI, barrier) from one rank count's measurements."""
    recs = run["records"]
    # the honest bound: the library's own copy at the devices' thread count (older runs
    # measured only one core's np.copyto, which a multi-threaded engine can beat)
    basis = "nt_copy" if "nt_copy" in run else "copy"
    copy_bw = run[basis]["bandwidth"] * 1e9
    from nccltree.comm import World

    bounds = []
    with open_devices(f"cpu:{n}") as devs, World(devs, algorithm="tree") as w:
        for r in recs:
            if r["size"] != maxbytes:
                continue
            plan = w.plan(
                "all_reduce",
                r["count"],
                in_place=r["placement"] == "in-place",
                dtype=r["dtype"],
                algorithm=r["algorithm"],
            )
            moved = plan.bytes_moved(np.dtype(r["dtype"]).itemsize)
            bound_us = moved / copy_bw * 1e6
            bounds.append(
                {
                    "algorithm": r["algorithm"],
                    "placement": r["placement"],
                    "bytes_moved": moved,
                    "bytes_over_size": moved / r["size"],
                    "bound_us": bound_us,
                    "time_us": r["time_us"],
                    "ratio": r["time_us"] / bound_us,
                }
            )
    # the minimum-bytes bound per placement: the fewest bytes any algorithm moves, so the
    # best algorithm is not rewarded for moving more
    for placement in {b["placement"] for b in bounds}:
        rows = [b for b in bounds if b["placement"] == placement]
        least = min(b["bytes_moved"] for b in rows)
        for b in rows:
            b["min_bytes_ratio"] = b["time_us"] / (least / copy_bw * 1e6)
    out = {"bounds": bounds, "bound_basis": basis}
    mpi_rows = {row["size"]: row for row in run["mpi"].get("rows", [])}
    big = [r for r in recs if r["size"] == maxbytes]
    if maxbytes in mpi_rows and big:
        best = max(big, key=lambda r: r["busbw"])
        best_ip = max((r for r in big if r["placement"] == "in-place"), key=lambda r: r["busbw"])
        mpi_bw = mpi_rows[maxbytes]["busbw"]
        out["mpi"] = {
            "size": maxbytes,
            "mpi_busbw": mpi_bw,
            "best": {k: best[k] for k in ("algorithm", "placement", "busbw")},
            "best_ratio": best["busbw"] / mpi_bw,
            "best_in_place": {k: best_ip[k] for k in ("algorithm", "busbw")},
            "best_in_place_ratio": best_ip["busbw"] / mpi_bw,
        }
    barrier = run["barrier"]["time_us"]
    smallest = min(r["size"] for r in recs)
    out["small"] = [
        {
            "algorithm": r["algorithm"],
            "placement": r["placement"],
            "size": r["size"],
            "time_us": r["time_us"],
            "barrier_us": barrier,
            "ratio": r["time_us"] / barrier,
        }
        for r in recs
        if r["size"] == smallest
    ]
    return out


def _merged(before: dict, after: dict) -> dict:
    """One copy rate from the measurements before and after the sweep (their median)."""
    t = statistics.median(before["samples_us"] + after["samples_us"]) / 1e6
    return {
        "size": before["size"],
        "time_us": t * 1e6,
        "bandwidth": 2 * before["size"] / t / 1e9,
        "before": before["bandwidth"],
        "after": after["bandwidth"],
    }


def measure(n: int, sizes: list[int], log) -> dict:
    records = []
    groups: dict[tuple[int, int], list[int]] = {}
    for s in sizes:
        groups.setdefault(iters_for(s), []).append(s)
    with open_devices(f"cpu:{n}") as devs:
        machine = machine_description(devs)
        threads = sum(d.threads for d in devs)
        copy_before = copy_bandwidth(sizes[-1])
        nt_before = copy_bandwidth(sizes[-1], threads=threads)
        for (iters, warmup), group in groups.items():
            log(f"cpu:{n}: tree/ring/direct at {len(group)} size(s), {iters} iterations")
            with Benchmark(
                devs,
                ALGORITHMS,
                ["all_reduce"],
                group,
                iters=iters,
                warmup=warmup,
                devices_label=f"cpu:{n}",
            ) as bench:
                records.extend(r.as_dict() for r in bench)
        copy_after = copy_bandwidth(sizes[-1])
        nt_after = copy_bandwidth(sizes[-1], threads=threads)
    copy, nt_copy = (_merged(b, a) for b, a in ((copy_before, copy_after), (nt_before, nt_after)))
    nt_copy["threads"] = threads
    log(f"cpu:{n}: numpy, barrier")
    numpy_rows = naive_numpy(n, sizes)
    barrier = barrier_round_trip(n)
    log(f"cpu:{n}: MPICH, mpiexec -n {n}")
    mpi = run_mpi(n, sizes)
    return {
        "ranks": n,
        "machine": machine,
        "records": records,
        "copy": copy,
        "nt_copy": nt_copy,
        "numpy": numpy_rows,
        "barrier": barrier,
        "mpi": mpi,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--max", default="64M", help="largest size (default: %(default)s)")
    p.add_argument("--out", default="collectives.json", help="JSON output file")
    args = p.parse_args(argv)
    maxbytes = parse_size(args.max)
    sizes = sizes_up_to(maxbytes)
    t0 = time.perf_counter()
    load_before = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    runs = {}
    for n in (int(x) for x in args.ranks.split(",")):
        run = measure(n, sizes, log)
        run["summary"] = summarise(n, run, maxbytes)
        runs[str(n)] = run
    payload = {
        "tool": "bench/collectives_table.py",
        "command": "python bench/collectives_table.py " + " ".join(argv or sys.argv[1:]),
        # the devices of the largest rank count measured (each run carries its own)
        "machine": max(runs.values(), key=lambda r: r["ranks"])["machine"],
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "sizes": sizes,
        "dtype": "float32",
        "op": "sum",
        "algorithms": list(ALGORITHMS),
        "schedule": [{"from_size": a, "iters": b, "warmup": c} for a, b, c in SCHEDULE],
        "targets": TARGETS,
        "runs": runs,
        "elapsed_s": time.perf_counter() - t0,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
