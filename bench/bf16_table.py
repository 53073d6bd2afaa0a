"""bfloat16 host kernels against float16 and float32 on the same element counts.

Usage: python bench/bf16_table.py [--melems 8] [--repeat 7]

On arrays of the same number of elements (8 Mi by default: 16 MiB in bfloat16 and
float16, 32 MiB in float32): a 2-way sum into a separate array, a 4-way sum, a scale in
place and an SGD step, in each dtype (float16 with the code the CPU runs by default, F16C
where it has it) on 1 and 2 threads, interleaved round by round. Prints a Markdown table
of medians; GB/s counts the bytes the operation must read and write (as in
kernels_table.py), GB = 1e9 bytes; the ratio columns divide the float16 and float32
times by the bfloat16 time (above 1: bfloat16 is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from kernels_table import LR, MOMENTUM, WEIGHT_DECAY

from nccltree import _native as nat
from nccltree.backends.base import BFLOAT16
from nccltree.cli._common import markdown_table

DTYPES = {"bfloat16": BFLOAT16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def jobs(n: int, dtype: np.dtype) -> dict[str, tuple[int, Callable[[int], None]]]:
    """name -> (bytes read + written, kernel(nthreads)) on ``n`` elements of ``dtype``."""
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.standard_normal(n).astype(dtype) for _ in range(4))
    dst = np.empty(n, dtype)
    x = a.copy()
    w, g, v = a.copy(), b.copy(), np.zeros(n, dtype)
    size = a.nbytes
    return {
        "sum2": (3 * size, lambda t: nat.reduce_n(dst, [a, b], "sum", t)),
        "sum4": (5 * size, lambda t: nat.reduce_n(dst, [a, b, c, d], "sum", t)),
        "scale": (2 * size, lambda t: nat.scale(x, 0.999, t)),
        "sgd": (6 * size, lambda t: nat.sgd_update(w, g, v, LR, MOMENTUM, WEIGHT_DECAY, t)),
    }


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def table(melems: int, repeat: int) -> list[str]:
    n = melems * 2**20
    per_dtype = {name: jobs(n, dt) for name, dt in DTYPES.items()}
    times: dict[tuple[str, int, str], list[float]] = {}
    for case in per_dtype["bfloat16"]:
        for _ in range(repeat):
            for threads in (2, 1):
                for name in DTYPES:
                    kernel = per_dtype[name][case][1]
                    t = timed(lambda: kernel(threads))  # noqa: B023 -- called at once
                    times.setdefault((case, threads, name), []).append(t)
    rows = []
    for case in per_dtype["bfloat16"]:
        for threads in (2, 1):
            med = {name: statistics.median(times[(case, threads, name)]) for name in DTYPES}
            gbs = [per_dtype[name][case][0] / med[name] / 1e9 for name in DTYPES]
            rows.append(
                [
                    case,
                    f"{threads} thread" + ("s" if threads > 1 else ""),
                    *(f"{med[name] * 1e3:.2f}" for name in DTYPES),
                    *(f"{x:.2f}" for x in gbs),
                    f"{med['float16'] / med['bfloat16']:.2f}x",
                    f"{med['float32'] / med['bfloat16']:.2f}x",
                ]
            )
    header = [
        "case",
        "threads",
        "bf16 ms",
        "f16 ms",
        "f32 ms",
        "bf16 GB/s",
        "f16 GB/s",
        "f32 GB/s",
        "f16 / bf16",
        "f32 / bf16",
    ]
    title = (
        f"{melems} Mi elements per array, median of {repeat}; float16 code: "
        f"{'F16C' if nat.use_f16c() else 'portable'}; GB/s = (bytes read + written) / time"
    )
    return [title, "", *markdown_table(header, rows, "llrrrrrrrr")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--melems", type=int, default=8, help="Mi elements per array (default 8)")
    ap.add_argument("--repeat", type=int, default=7, help="rounds, median kept (default 7)")
    args = ap.parse_args()
    print("\n".join(table(args.melems, args.repeat)))


if __name__ == "__main__":
    main()
