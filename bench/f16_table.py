"""float16 host kernels: F16C against the portable conversions and numpy, side by side.

Usage: python bench/f16_table.py [--mib 64] [--repeat 9]

On 64 MiB float16 arrays: a 2-way sum into a separate array, a 4-way sum, a scale in
place and an SGD step, each with the F16C code and with the portable code (switched with
``nccltree._native.use_f16c``) on 1 and 2 threads, interleaved round by round, and numpy
doing the same job once per round. Prints a Markdown table of medians; GB/s counts the
bytes the operation must read and write (as in kernels_table.py), GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from kernels_table import LR, MOMENTUM, WEIGHT_DECAY, numpy_sgd, numpy_sum4

from nccltree import _native as nat
from nccltree.cli._common import markdown_table


def jobs(mib: int) -> dict[str, tuple[int, Callable[[int], None], Callable[[], None]]]:
    """name -> (bytes read + written, kernel(nthreads), numpy version)."""
    n = mib * 2**20 // 2
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.standard_normal(n).astype(np.float16) for _ in range(4))
    dst = np.empty(n, np.float16)
    x = a.copy()
    w, g, v = a.copy(), b.copy(), np.zeros(n, np.float16)
    tmp = np.empty(n, np.float16)
    size = a.nbytes

    def numpy_scale() -> None:
        np.multiply(x, np.float16(0.999), out=x)

    return {
        "sum2": (
            3 * size,
            lambda t: nat.reduce_n(dst, [a, b], "sum", t),
            lambda: np.add(a, b, out=dst),
        ),
        "sum4": (
            5 * size,
            lambda t: nat.reduce_n(dst, [a, b, c, d], "sum", t),
            lambda: numpy_sum4(dst, a, b, c, d),
        ),
        "scale": (2 * size, lambda t: nat.scale(x, 0.999, t), numpy_scale),
        "sgd": (
            6 * size,
            lambda t: nat.sgd_update(w, g, v, LR, MOMENTUM, WEIGHT_DECAY, t),
            lambda: numpy_sgd(w, g, v, tmp),
        ),
    }


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB per array (default 64)")
    ap.add_argument("--repeat", type=int, default=9, help="rounds, median kept (default 9)")
    args = ap.parse_args()
    before = nat.use_f16c()
    if not nat.use_f16c(True):
        raise SystemExit("this CPU has no F16C: there is only the portable code to measure")
    variants = [
        ("F16C", True, 2),
        ("F16C", True, 1),
        ("portable", False, 2),
        ("portable", False, 1),
    ]
    times: dict[tuple[str, str], list[float]] = {}
    nbytes: dict[str, int] = {}
    try:
        for name, (size, kernel, numpy_fn) in jobs(args.mib).items():
            nbytes[name] = size
            for _ in range(args.repeat):
                for label, on, threads in variants:
                    nat.use_f16c(on)
                    t = timed(lambda: kernel(threads))  # noqa: B023 -- called at once
                    times.setdefault(
                        (name, f"{label}, {threads} thread" + ("s" if threads > 1 else "")), []
                    ).append(t)
                times.setdefault((name, "numpy"), []).append(timed(numpy_fn))
    finally:
        nat.use_f16c(before)
    print(
        f"float16, {args.mib} MiB per array, median of {args.repeat}; "
        "GB/s = (bytes read + written) / time"
    )
    print()
    rows = []
    for (name, label), ts in times.items():
        med = statistics.median(ts)
        ref = statistics.median(times[(name, "numpy")])
        gbs = nbytes[name] / med / 1e9
        speedup = ""
        if label.startswith("F16C"):
            portable = statistics.median(times[(name, label.replace("F16C", "portable"))])
            speedup = f"{portable / med:.1f}x"
        rows.append([name, label, f"{med * 1e3:.2f}", f"{gbs:.2f}", f"{ref / med:.1f}x", speedup])
    header = ["case", "code", "median ms", "GB/s", "vs numpy", "F16C vs portable"]
    print("\n".join(markdown_table(header, rows, "llrrrr")))


if __name__ == "__main__":
    main()
