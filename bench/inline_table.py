"""Synchronous host all_reduce: on the ranks' streams, or inline in the calling thread.

Usage: python bench/inline_table.py [--ranks 2,4] [--reps 5] [--per-rank]

For each rank count and size (64 KiB .. 64 MiB per rank, float32 sum, in place), four
ways per algorithm on the same devices and arrays, interleaved in each repetition:
``inline_bytes=0`` (every call on the ranks' streams, the devices' threads per kernel);
inline with one thread per kernel (``inline_threads=1``); inline with every core (the
devices' threads together, at most the CPU count) at every size; and the World's
default (every core from the sizes ``issuer.INLINE_EVERY_CORE_FROM`` gives). The calls
are driver-side, or with ``--per-rank`` made by the ranks' threads together
(``World.run``, each rank calling ``comm.all_reduce``). Prints the median time per call
in microseconds as a Markdown table, with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import nccltree as nt
from nccltree.cli._common import open_devices
from nccltree.comm import issuer as issuer_module

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
MODES = {
    "streams": {"inline_bytes": 0},
    "inline, 1 thread": {"inline_threads": 1},
    "inline, every core": {},
    "default": {},
}
DEFAULT_FROM = dict(issuer_module.INLINE_EVERY_CORE_FROM)


def _calls(w: nt.World, xs: list[np.ndarray], calls: int, per_rank: bool) -> None:
    if per_rank:

        def body(comm: nt.Comm) -> None:
            for _ in range(calls):
                comm.all_reduce(xs[comm.rank])

        w.run(body)
    else:
        for _ in range(calls):
            w.all_reduce(xs)


def measure(n: int, reps: int, per_rank: bool = False) -> dict[tuple[str, str, int], float]:
    times: dict[tuple[str, str, int], list[float]] = {}
    with open_devices(f"cpu:{n}") as devs:
        worlds = {
            (alg, mode): nt.World(devs, algorithm=alg, **kw)
            for alg in ("tree", "ring", "direct")
            for mode, kw in MODES.items()
        }
        try:
            for size in SIZES:
                xs = [np.ones(size // 4, np.float32) for _ in range(n)]
                calls = max(1, (16 << 20) // size)
                for w in worlds.values():
                    w.all_reduce(xs)
                for _ in range(reps):
                    for (alg, mode), w in worlds.items():
                        every = mode == "inline, every core"
                        issuer_module.INLINE_EVERY_CORE_FROM.update(
                            {False: 0, True: 0} if every else DEFAULT_FROM
                        )
                        t0 = time.perf_counter()
                        _calls(w, xs, calls, per_rank)
                        dt = (time.perf_counter() - t0) / calls * 1e6
                        times.setdefault((alg, mode, size), []).append(dt)
        finally:
            issuer_module.INLINE_EVERY_CORE_FROM.update(DEFAULT_FROM)
            for w in worlds.values():
                w.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--per-rank", action="store_true", help="calls made by the ranks' threads")
    a = p.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"calls: {'per-rank (World.run)' if a.per_rank else 'driver-side'}")
    print(
        "| ranks | size | algorithm | streams (µs) | inline, 1 thread (µs) | "
        "inline, every core (µs) | default (µs) | streams / default |"
    )
    print("| ---: | ---: | :--- | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(x) for x in a.ranks.split(",")):
        med = measure(n, a.reps, a.per_rank)
        for size in SIZES:
            for alg in ("tree", "ring", "direct"):
                st, one, every, default = (med[(alg, m, size)] for m in MODES)
                label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
                print(
                    f"| {n} | {label} | {alg} | {st:.0f} | {one:.0f} | {every:.0f} | "
                    f"{default:.0f} | {st / default:.2f} |"
                )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
