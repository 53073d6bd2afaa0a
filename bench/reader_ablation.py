"""What each part of the DataReader's fast path is worth, measured side by side.

Usage:
    python bench/reader_ablation.py [--sizes 3072,65536] [--ranks 1,4] [--repeat 5]

Four variants of the reader, run interleaved with the bare cursor loop over the same
database (as in reader_table.py) so that a busy moment hurts all of them alike:

- ``grouped + extension``: the shipped reader.
- ``grouped + numpy``: small records assembled by the numpy join path instead of the
  ``nccltree._records`` extension (what a build without Python headers gets).
- ``per-round + extension``: the reader publishes every round as soon as it is read
  instead of reading groups of rounds.
- ``per-round + numpy``: both switched off.

The switches are monkeypatches of this process only. Prints, per record size and rank
count, the median ratio of the reader's record rate to the bare loop's over ``--repeat``
runs, with the range.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from contextlib import ExitStack, contextmanager
from unittest import mock

from reader_table import BATCH_SIZE, DB_BYTES, make_db

from nccltree.cli._common import human_bytes, markdown_table
from nccltree.data import decode, pipeline
from nccltree.data.throughput import cursor_rate, reader_rate


def _one_round(self: pipeline.Pipeline, i: int) -> list:
    """``Pipeline._group_slots`` without the grouping: one round at a time."""
    if self.deal.round_length(i) == 0:
        return []
    return [[self._free_slot(r) for r in range(self.deal.ranks)]]


@contextmanager
def variant(grouped: bool, extension: bool):
    with ExitStack() as stack:
        if not grouped:
            stack.enter_context(mock.patch.object(pipeline.Pipeline, "_group_slots", _one_round))
        if not extension:
            stack.enter_context(mock.patch.object(decode, "_records_gather", lambda: None))
        yield


VARIANTS = [
    ("grouped + extension", True, True),
    ("grouped + numpy", True, False),
    ("per-round + extension", False, True),
    ("per-round + numpy", False, False),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3072,65536", help="record sizes in bytes")
    ap.add_argument("--ranks", default="1,4", help="rank counts (default 1,4)")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved runs (default 5)")
    ap.add_argument("--db-mb", type=int, default=DB_BYTES >> 20, help="database size in MiB")
    args = ap.parse_args()
    ranks_list = [int(r) for r in args.ranks.split(",")]
    header = ["record", "ranks", *(v[0] for v in VARIANTS)]
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="nccltree-bench-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            path = make_db(tmp, size, args.db_mb << 20)
            bs = BATCH_SIZE.get(size, 64)
            ratios: dict[tuple[int, str], list[float]] = {}
            for _ in range(args.repeat):
                bare = cursor_rate(path, passes=2)["records_per_s"]
                for ranks in ranks_list:
                    for name, grouped, ext in VARIANTS:
                        with variant(grouped, ext):
                            r = reader_rate(path, bs, ranks, passes=2)["records_per_s"]
                        ratios.setdefault((ranks, name), []).append(r / bare)
            for ranks in ranks_list:
                cells = []
                for name, _, _ in VARIANTS:
                    xs = ratios[(ranks, name)]
                    cells.append(
                        f"{100 * statistics.median(xs):.0f}% "
                        f"({100 * min(xs):.0f}–{100 * max(xs):.0f})"
                    )
                rows.append([human_bytes(size), ranks, *cells])
    print("\n".join(markdown_table(header, rows, "r" * len(header))))


if __name__ == "__main__":
    main()
