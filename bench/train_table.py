"""Weak scaling of the data-parallel trainer on virtual CPU devices, as a Markdown table.

Usage: python bench/train_table.py [--iters 30] [--warmup 5] [--repeat 3] [--batch 128]

An MLP (512 -> 1024 -> 1024 -> 10, 1.6 M parameters, 6.3 MB of gradients) sized so one
training step is more than 10 ms of BLAS work on one core, on cpu:1 and cpu:2, weak scaling
(batch per rank fixed), one BLAS thread per rank. Every configuration runs with
communication on and, as the control, off (each rank steps on its own gradient); the runs
are interleaved and repeated, and the median is reported. Batches come from memory, so the
table measures compute and communication only.

Columns: examples/s; efficiency = examples/s / (ranks x the 1-rank examples/s of the same
kind); comm = time inside collectives / step time (averaged over ranks).

A second table compares the rate at which the reference trainer (``nccltree-train``'s
defaults, cpu:2) consumes records from a DataReader with the rate the DataReader alone
serves them (``nccltree.data.throughput.reader_rate``, same batch and ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import nccltree as nt
from nccltree.cli._common import markdown_table
from nccltree.cli._training import DriverConfig, SolverConfig, Training, build_training
from nccltree.data import MemorySource

FEATURES, HIDDEN, CLASSES = 512, (1024, 1024), 10
SOLVER = SolverConfig(lr=0.01, momentum=0.9, weight_decay=5e-4)


def memory_data(ranks: int, batch: int, distinct: int = 4, seed: int = 0) -> MemorySource:
    """``distinct`` random batches per rank held in memory, cycled: feeds the driver with
    no I/O at all."""
    rng = np.random.default_rng(seed)
    return MemorySource(
        [
            [
                (
                    rng.standard_normal((batch, FEATURES), dtype=np.float32),
                    rng.integers(0, CLASSES, batch),
                )
                for _ in range(distinct)
            ]
            for _ in range(ranks)
        ]
    )


@dataclass
class Case:
    ranks: int
    comm: bool
    blas_threads: int | None = 1

    @property
    def name(self) -> str:
        blas = "" if self.blas_threads == 1 else f", BLAS {self.blas_threads or 'auto'}"
        return f"cpu:{self.ranks}, comm {'on' if self.comm else 'off'}{blas}"


@contextlib.contextmanager
def training(case: Case, batch: int, algorithm: str = "tree") -> Iterator[Training]:
    """The MLP's driver on ``cpu:{case.ranks}``, ``batch`` per rank (fed by memory_data)."""
    cfg = DriverConfig(
        devices=f"cpu:{case.ranks}",
        model="mlp",
        batch_size=batch,
        hidden=HIDDEN,
        comm=case.comm,
        algorithm=algorithm,
        blas_threads=case.blas_threads,
        solver=SOLVER,
    )
    with build_training(cfg, (FEATURES,), CLASSES) as t:
        yield t


def measure(case: Case, batch: int, iters: int, warmup: int, algorithm: str = "tree") -> dict:
    """One run: examples/s and the communication fraction over ``iters`` timed steps."""
    with training(case, batch, algorithm) as t:
        data = memory_data(case.ranks, batch)
        t.driver.fit(data, warmup)
        res = t.driver.fit(data, warmup + iters)
    return {
        "examples_per_s": res.examples_per_s,
        "comm_fraction": res.comm_fraction,
        "step_ms": 1e3 * statistics.median(res.step_times),
    }


def scaling_table(
    batch: int,
    iters: int,
    warmup: int,
    repeat: int,
    algorithm: str = "tree",
    blas_check: bool = True,
) -> list[dict[str, Any]]:
    cases = [Case(1, True), Case(1, False), Case(2, True), Case(2, False)]
    if blas_check and (os.cpu_count() or 1) > 1:
        # BLAS left at every core per rank: the oversubscription the limit avoids
        cases.append(Case(2, True, blas_threads=os.cpu_count()))
    runs: dict[str, list[dict]] = {c.name: [] for c in cases}
    for _ in range(repeat):  # interleaved, so a noisy moment hits every case alike
        for c in cases:
            runs[c.name].append(measure(c, batch, iters, warmup, algorithm))
    rows = []
    base = {}
    for c in cases:
        rate = statistics.median(r["examples_per_s"] for r in runs[c.name])
        if c.ranks == 1:
            base[c.comm] = rate
        rows.append(
            {
                "case": c.name,
                "ranks": c.ranks,
                "batch_per_rank": batch,
                "effective_batch": batch * c.ranks,
                "examples_per_s": rate,
                "efficiency": rate / (c.ranks * base[c.comm]) if c.comm in base else None,
                "comm_fraction": statistics.median(r["comm_fraction"] for r in runs[c.name]),
                "step_ms": statistics.median(r["step_ms"] for r in runs[c.name]),
            }
        )
    return rows


def consumption_table(iters: int = 400) -> list[dict[str, Any]]:
    """The default trainer's record consumption vs the DataReader's serving rate."""
    from nccltree.cli.train import SYNTHETIC_CLASSES, SYNTHETIC_FEATURES, TrainConfig
    from nccltree.data.throughput import reader_rate

    ranks = 2
    cfg = dataclasses.replace(TrainConfig(), devices=f"cpu:{ranks}")
    batch = cfg.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train")
        x, y = nt.data.synthetic(
            cfg.synthetic, shape=(SYNTHETIC_FEATURES,), classes=SYNTHETIC_CLASSES
        )
        nt.data.write_lmdb(path, x, y)
        with build_training(cfg.driver(), (SYNTHETIC_FEATURES,), SYNTHETIC_CLASSES, data=path) as t:
            assert t.reader is not None
            t.driver.fit(t.reader, 50)
            res = t.driver.fit(t.reader, 50 + iters)
        served = reader_rate(path, batch, ranks, passes=3, log_on_wait=None)
    trainer = res.examples_per_s
    return [
        {
            "trainer_records_per_s": trainer,
            "reader_records_per_s": served["records_per_s"],
            "ratio": served["records_per_s"] / trainer,
            "batch_per_rank": batch,
            "ranks": ranks,
        }
    ]


def _markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``rows`` as a Markdown table; a column is (header, key, format spec), right-aligned
    when it has a format; None shows as a dash."""
    cells = [
        [
            "–" if r[key] is None else format(r[key], fmt) if fmt else str(r[key])
            for _, key, fmt in columns
        ]
        for r in rows
    ]
    align = "".join("r" if fmt else "l" for _, _, fmt in columns)
    return "\n".join(markdown_table([h for h, _, _ in columns], cells, align))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (median)")
    ap.add_argument("--batch", type=int, default=256, help="batch per rank")
    ap.add_argument("--algorithm", default="tree")
    ap.add_argument("--no-consumption", action="store_true", help="skip the reader table")
    args = ap.parse_args(argv)
    rows = scaling_table(args.batch, args.iters, args.warmup, args.repeat, args.algorithm)
    print(
        f"MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}, weak scaling, "
        f"algorithm {args.algorithm}, {os.cpu_count()} cores, median of {args.repeat} runs "
        f"of {args.iters} steps\n"
    )
    print(
        _markdown(
            rows,
            [
                ("devices", "case", ""),
                ("batch/rank", "batch_per_rank", "d"),
                ("effective batch", "effective_batch", "d"),
                ("step (ms)", "step_ms", ".1f"),
                ("examples/s", "examples_per_s", ",.0f"),
                ("efficiency", "efficiency", ".0%"),
                ("comm", "comm_fraction", ".1%"),
            ],
        )
    )
    if not args.no_consumption:
        print("\nReference trainer (nccltree-train defaults, cpu:2) vs DataReader alone\n")
        print(
            _markdown(
                consumption_table(),
                [
                    ("trainer consumes (records/s)", "trainer_records_per_s", ",.0f"),
                    ("DataReader serves (records/s)", "reader_records_per_s", ",.0f"),
                    ("head-room", "ratio", ".1f"),
                ],
            )
        )


if __name__ == "__main__":
    main()
