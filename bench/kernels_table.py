"""Host kernels side by side: copy baselines, 2-way sum out of place and in place, fused
4-way sum, fused SGD vs numpy.

Usage: python bench/kernels_table.py [--mib 64] [--threads 2] [--repeat 15]

Prints a Markdown table of medians.  Throughput counts the bytes the operation must read
and write (a 2-way sum reads 2 arrays and writes 1, whether or not dst is one of them; a
4-way sum reads 4 and writes 1; SGD reads and writes w, g and v), the same figure for the
fused kernel and for numpy, so GB/s compares time for the same job.  GB = 1e9 bytes.  The
case definitions are shared with bench_kernels.py (pytest-benchmark).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nccltree import _native as nat
from nccltree.cli._common import markdown_table

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 5e-4


@dataclass
class Case:
    group: str  # "copy", "sum2", "sum4" or "sgd"
    name: str
    fn: Callable[[], object]
    nbytes: int  # bytes read + written by one call


def numpy_sum4(dst: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> None:
    """numpy's 4-way sum: three pairwise passes."""
    np.add(a, b, out=dst)
    np.add(dst, c, out=dst)
    np.add(dst, d, out=dst)


def numpy_sgd(w: np.ndarray, g: np.ndarray, v: np.ndarray, tmp: np.ndarray) -> None:
    """Caffe's SGD step in numpy (six ufunc calls, no allocation)."""
    np.multiply(w, WEIGHT_DECAY, out=tmp)
    np.add(g, tmp, out=g)
    np.multiply(v, MOMENTUM, out=v)
    np.multiply(g, LR, out=tmp)
    np.add(v, tmp, out=v)
    np.subtract(w, v, out=w)


def make_cases(mib: int = 64, threads: int = 2) -> list[Case]:
    """The benchmark cases on float32 arrays of ``mib`` MiB each."""
    n = mib * 2**20 // 4
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.standard_normal(n, dtype=np.float32) for _ in range(4))
    dst = np.empty(n, np.float32)
    w, g, v = a.copy(), b.copy(), np.zeros(n, np.float32)
    tmp = np.empty(n, np.float32)
    acc = a.copy()  # in-place 2-way sum: acc += b (values drift; the time does not)
    size = a.nbytes

    t = f"{threads} threads"
    return [
        Case("copy", "np.copyto", lambda: np.copyto(dst, a), 2 * size),
        Case("copy", f"nt_copy, {t}", lambda: nat.copy(dst, a, nthreads=threads), 2 * size),
        Case("copy", "nt_copy, 1 thread", lambda: nat.copy(dst, a), 2 * size),
        # out of place (dst = a + b) streams its stores; in place (acc += b) needs not
        Case(
            "sum2",
            f"nt_reduce_n out of place, {t}",
            lambda: nat.reduce_n(dst, [a, b], nthreads=threads),
            3 * size,
        ),
        Case(
            "sum2",
            "nt_reduce_n out of place, 1 thread",
            lambda: nat.reduce_n(dst, [a, b]),
            3 * size,
        ),
        Case(
            "sum2",
            f"nt_reduce_n in place, {t}",
            lambda: nat.reduce_n(acc, [acc, b], nthreads=threads),
            3 * size,
        ),
        Case(
            "sum2", "nt_reduce_n in place, 1 thread", lambda: nat.reduce_n(acc, [acc, b]), 3 * size
        ),
        Case("sum2", "numpy np.add(a, b, out=dst)", lambda: np.add(a, b, out=dst), 3 * size),
        Case(
            "sum4",
            f"nt_reduce_n, {t}",
            lambda: nat.reduce_n(dst, [a, b, c, d], nthreads=threads),
            5 * size,
        ),
        Case("sum4", "nt_reduce_n, 1 thread", lambda: nat.reduce_n(dst, [a, b, c, d]), 5 * size),
        Case("sum4", "numpy pairwise np.add", lambda: numpy_sum4(dst, a, b, c, d), 5 * size),
        Case(
            "sgd",
            f"nt_sgd_update, {t}",
            lambda: nat.sgd_update(w, g, v, LR, MOMENTUM, WEIGHT_DECAY, nthreads=threads),
            6 * size,
        ),
        Case(
            "sgd",
            "nt_sgd_update, 1 thread",
            lambda: nat.sgd_update(w, g, v, LR, MOMENTUM, WEIGHT_DECAY),
            6 * size,
        ),
        Case("sgd", "numpy (6 ufunc calls)", lambda: numpy_sgd(w, g, v, tmp), 6 * size),
    ]


def table(mib: int = 64, threads: int = 2, repeat: int = 15) -> str:
    """Run every case and return the Markdown table."""
    cases = make_cases(mib, threads)
    # interleave the rounds so that noise from other processes hits every case alike
    samples: dict[str, list[float]] = {c.name: [] for c in cases}
    for c in cases:  # warm-up: page in the arrays, start the OpenMP threads
        c.fn()
        c.fn()
    for _ in range(repeat):
        for c in cases:
            t0 = time.perf_counter()
            c.fn()
            samples[c.name].append(time.perf_counter() - t0)
    gbs = {c.name: c.nbytes / statistics.median(samples[c.name]) / 1e9 for c in cases}
    copy_best = max(gbs[c.name] for c in cases if c.group == "copy")
    numpy_of = {c.group: gbs[c.name] for c in cases if not c.name.startswith(("nt_", "np.copyto"))}
    rows = []
    for c in cases:
        med = statistics.median(samples[c.name]) * 1e3
        vs_numpy = f"{gbs[c.name] / numpy_of[c.group]:.2f}x" if c.group in numpy_of else ""
        rows.append(
            [
                c.group,
                c.name,
                f"{med:.2f}",
                f"{gbs[c.name]:.2f}",
                f"{gbs[c.name] / copy_best:.0%}",
                vs_numpy,
            ]
        )
    header = ["case", "kernel", "median ms", "GB/s", "vs best copy", "vs numpy"]
    lines = [
        f"float32, {mib} MiB per array, median of {repeat}; GB/s = (bytes read + written) / time",
        "",
        *markdown_table(header, rows, "llrrrr"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="MiB per array (default 64)")
    p.add_argument("--threads", type=int, default=2, help="native kernel threads (default 2)")
    p.add_argument("--repeat", type=int, default=15, help="timed rounds per case (default 15)")
    args = p.parse_args(argv)
    print(table(args.mib, args.threads, args.repeat))


if __name__ == "__main__":
    main()
