"""Per-rank latency against the futex floor and MPICH, in one interleaved run.

Usage: python bench/handoff.py [--ranks 2,4] [--sizes 8,64K,1M] [--reps 5] [--out FILE]

Each repetition measures, one after the other (so every row sees the same load):

* the bare two-thread futex round trip in C (``nccltree._native.futex_pingpong``): with
  no spinning (the floor of any hand-off between two sleeping threads) and with the
  adaptive spin, the threads left to the scheduler, pinned to one CPU (a switch on one
  CPU) and pinned to two (a wake-up on another CPU: the floor the ratios use); the same between two Python threads (GIL hand-offs included); and a
  1-rank World's per-rank and driver-side 8 B calls (the rendezvous' own cost);
* per rank count and size, the per-rank API (``World.run``: a thread per rank calling
  ``comm.all_reduce(x)`` back to back, float32 sum, in place; rank 0's mean per call) and
  the driver-side call (``world.all_reduce(xs)`` from one thread);
* MPICH's ``MPI_Allreduce`` at the same process counts (``mpiexec -n N python
  bench/mpi_allreduce.py``: the median of calls each started after a barrier, the slowest
  rank counting), when mpi4py and an ``mpiexec`` are installed.

It prints the medians and the spread (min-max) over the repetitions, the ratios the
targets name, and ``os.getloadavg()`` before and after; ``--out`` writes the same as JSON.
:func:`measure` is the importable entry point.
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
from typing import Any

import numpy as np

import nccltree as nt
from nccltree import _native
from nccltree.cli._common import human_bytes
from nccltree.comm.bench import parse_size

_HERE = Path(__file__).resolve().parent


def _iters(nbytes: int, budget_s: float, guess_us: float) -> int:
    """Calls per repetition: about ``budget_s`` of work at ``guess_us`` per call."""
    return max(20, min(5000, int(budget_s / (guess_us * 1e-6))))


def _guess_us(nbytes: int, n: int) -> float:
    return 30.0 * n + nbytes / 2e3  # about 2 GB/s per rank on a small machine


def per_rank_us(world: nt.World, xs: list[np.ndarray], iters: int) -> float:
    """Mean time of one per-rank ``all_reduce`` seen by rank 0, back to back (µs)."""

    def fn(comm: Any) -> float:
        x = xs[comm.rank]
        for _ in range(3):
            comm.all_reduce(x)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x)
        return (time.perf_counter() - t0) / iters * 1e6

    return float(world.run(fn)[0])


def driver_us(world: nt.World, xs: list[np.ndarray], iters: int) -> float:
    """Mean time of one driver-side ``all_reduce`` of every rank's array (µs)."""
    for _ in range(3):
        world.all_reduce(xs)
    t0 = time.perf_counter()
    for _ in range(iters):
        world.all_reduce(xs)
    return (time.perf_counter() - t0) / iters * 1e6


def python_pingpong_us(rounds: int, spin: float | None = 0.0) -> float:
    """Two Python threads passing :class:`nccltree._native.Counter` values back and
    forth: µs per round trip, GIL hand-offs included (the floor of a per-rank hand-off)."""
    ping, pong = _native.Counter(), _native.Counter()

    def other() -> None:
        for i in range(1, rounds + 1):
            if not ping.wait(i, 30.0, spin):
                return
            pong.add()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    t0 = time.perf_counter()
    for i in range(1, rounds + 1):
        ping.add()
        if not pong.wait(i, 30.0, spin):
            raise RuntimeError("the ping-pong thread stopped answering")
    dt = time.perf_counter() - t0
    t.join(30)
    return dt / rounds * 1e6


def mpi_us(n: int, sizes: list[int], iters: int) -> dict[int, float] | None:
    """MPICH's median ``MPI_Allreduce`` time per size at ``n`` processes, or None when
    mpi4py or ``mpiexec`` is missing (or the run fails)."""
    exe = shutil.which(
        "mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}" + os.environ.get("PATH", "")
    )
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    if exe is None:
        return None
    cmd = [
        exe, "-n", str(n), sys.executable, str(_HERE / "mpi_allreduce.py"),
        "--sizes", ",".join(str(s) for s in sizes),
        "--iters", str(iters), "--warmup", str(max(3, iters // 10)),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None
    return {int(r["size"]): float(r["time_us"]) for r in doc["rows"]}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(
    ranks: tuple[int, ...] = (2, 4),
    sizes: tuple[int, ...] = (8, 64 << 10, 1 << 20),
    reps: int = 5,
    budget_s: float = 0.25,
    pingpong_rounds: int = 5000,
    mpi: bool = True,
) -> dict[str, Any]:
    """Run the interleaved measurement; returns a JSON-ready dict (times in µs): ``rows``
    (one per rank count and size: per_rank, driver, mpi, each with median/min/max),
    ``futex`` (unpinned, same CPU, two CPUs; no spin and the adaptive spin),
    ``futex_floor`` (the case the ratios divide by: two CPUs, no spin, where the process
    may use two), the Python ping-pong, a 1-rank World, and the load before and after."""
    load_before = os.getloadavg()
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            samples.setdefault(key, []).append(value)

    worlds = {n: nt.World(f"cpu:{n}") for n in (1, *ranks)}
    arrays = {
        (n, s): [np.ones(max(1, s // 4), np.float32) for _ in range(n)]
        for n in ranks
        for s in sizes
    }
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    futex_cases: list[tuple[str, float | None, tuple[int, int] | None]] = [
        ("futex/unpinned", 0.0, None),
        ("futex/unpinned_spin", None, None),
    ]
    if len(cpus) >= 2:
        futex_cases += [
            ("futex/same_cpu", 0.0, (cpus[0], cpus[0])),
            ("futex/cross_cpu", 0.0, (cpus[0], cpus[1])),
            ("futex/cross_cpu_spin", None, (cpus[0], cpus[1])),
        ]
    mpi_missing = False
    try:
        for _ in range(reps):
            for key, spin, pin in futex_cases:
                add(key, _native.futex_pingpong(pingpong_rounds, spin, pin) * 1e6)
            add("python/spin0", python_pingpong_us(pingpong_rounds // 5, 0.0))
            add("python/spin", python_pingpong_us(pingpong_rounds // 5, None))
            # one rank: the rendezvous' own bookkeeping, with no hand-off at all
            one = [np.ones(2, np.float32)]
            add("one/per_rank", per_rank_us(worlds[1], one, _iters(8, budget_s, 15.0)))
            add("one/driver", driver_us(worlds[1], one, _iters(8, budget_s, 15.0)))
            for n in ranks:
                w = worlds[n]
                for s in sizes:
                    iters = _iters(s, budget_s, _guess_us(s, n))
                    xs = arrays[(n, s)]
                    add(f"per_rank/{n}/{s}", per_rank_us(w, xs, iters))
                    add(f"driver/{n}/{s}", driver_us(w, xs, iters))
                if mpi and not mpi_missing:
                    got = mpi_us(n, list(sizes), _iters(sizes[0], budget_s, 100.0) // 4)
                    if got is None:
                        mpi_missing = True
                    else:
                        for s in sizes:
                            add(f"mpi/{n}/{s}", got.get(s))
    finally:
        for w in worlds.values():
            w.close()
    stats = {k: _stats(v) for k, v in samples.items()}
    # the target's floor: two sleeping threads, no spin, on two CPUs where there are two
    floor_key = "futex/cross_cpu" if "futex/cross_cpu" in stats else "futex/unpinned"
    floor = stats[floor_key]["median"]
    rows = []
    for n in ranks:
        for s in sizes:
            row: dict[str, Any] = {"ranks": n, "size": s}
            for kind in ("per_rank", "driver", "mpi"):
                row[kind] = stats.get(f"{kind}/{n}/{s}")
            pr = row["per_rank"]["median"]
            row["per_rank_vs_futex"] = pr / floor
            row["per_rank_vs_mpi"] = None if row["mpi"] is None else pr / row["mpi"]["median"]
            rows.append(row)
    return {
        "reps": reps,
        "cpus": os.cpu_count(),
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "futex": {k.split("/", 1)[1]: stats[k] for k, _, _ in futex_cases},
        "futex_floor": floor_key.split("/", 1)[1],
        "python_pingpong": {"spin0": stats["python/spin0"], "spin_adaptive": stats["python/spin"]},
        "one_rank_8B": {"per_rank": stats["one/per_rank"], "driver": stats["one/driver"]},
        "spin_default_us": _native.spin_default() * 1e6,
        "mpi": None if (not mpi or mpi_missing) else "MPICH via mpi4py",
        "mpi_note": "mpi4py or mpiexec not installed: no MPI rows" if mpi_missing else None,
        "rows": rows,
    }


def _fmt(st: dict[str, float] | None) -> str:
    if st is None:
        return "-"
    return f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f})"


def table(result: dict[str, Any]) -> str:
    """A short Markdown table of :func:`measure`'s result."""
    lines = [
        f"# load average before {' '.join(f'{x:.2f}' for x in result['load_before'])}, "
        f"after {' '.join(f'{x:.2f}' for x in result['load_after'])}; "
        f"{result['reps']} repetitions, median (min-max), µs",
        "# futex round trip in C: "
        + ", ".join(f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in result["futex"].items())
        + " ('spin': the adaptive spin, else none)",
        f"# Python threads passing a Counter (GIL included), round trip: spin 0 "
        f"{_fmt(result['python_pingpong']['spin0'])}, adaptive spin "
        f"{_fmt(result['python_pingpong']['spin_adaptive'])}",
        f"# 1 rank, 8 B: per-rank {_fmt(result['one_rank_8B']['per_rank'])}, driver-side "
        f"{_fmt(result['one_rank_8B']['driver'])}",
    ]
    if result["mpi_note"]:
        lines.append(f"# {result['mpi_note']}")
    lines += [
        f"| ranks | size | per-rank | driver-side | MPICH | per-rank / futex "
        f"({result['futex_floor'].replace('_', ' ')}) | per-rank / MPICH |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        vs_mpi = "-" if r["per_rank_vs_mpi"] is None else f"{r['per_rank_vs_mpi']:.2f}"
        lines.append(
            f"| {r['ranks']} | {human_bytes(r['size'])} | {_fmt(r['per_rank'])} | "
            f"{_fmt(r['driver'])} | {_fmt(r['mpi'])} | {r['per_rank_vs_futex']:.2f} | {vs_mpi} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--sizes", default="8,64K,1M", help="comma-separated sizes (K/M suffixes)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--budget", type=float, default=0.25, help="seconds per measurement")
    p.add_argument("--no-mpi", action="store_true", help="skip the MPICH rows")
    p.add_argument("--out", help="write the result as JSON to this file")
    a = p.parse_args(argv)
    result = measure(
        tuple(int(r) for r in a.ranks.split(",")),
        tuple(parse_size(s) for s in a.sizes.split(",")),
        reps=a.reps,
        budget_s=a.budget,
        mpi=not a.no_mpi,
    )
    print(table(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
