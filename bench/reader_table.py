"""DataReader throughput against a bare LMDB cursor loop over the same database.

Usage:
    python bench/reader_table.py [--sizes 3072,65536] [--ranks 1,2,4] [--repeat 3]
    python bench/reader_table.py --db PATH --batch-size 32 --ranks 4   # an existing database

Builds one database per record size in a temporary directory (512 MiB each), then
measures, in the same run, ``for v in cursor.iternext(keys=False)`` (the bare loop: every
value read, nothing assembled) and a DataReader serving 1, 2 and 4 ranks (one consumer
takes each rank's batch in turn and releases it: batch assembly into the reused buffers,
queues and hand-off included). Each figure is the best of ``--repeat`` runs of 2 passes
over the database after a warm-up pass, the bare loop and the reader interleaved, so a
busy moment on a shared machine hurts both alike. Prints a Markdown table; MB = 1e6 bytes
of record values.

The case definitions are shared with bench_reader.py (pytest-benchmark).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from nccltree.cli._common import human_bytes, markdown_table
from nccltree.data import write_lmdb
from nccltree.data.format import RecordLayout
from nccltree.data.throughput import cursor_rate, reader_rate

# Larger than this machine's last-level cache, as a training set is: a database that
# fits in cache flatters the bare loop, which copies each value into the same hot buffer,
# while a reader must write every record to a distinct batch buffer.
DB_BYTES = 512 << 20
BATCH_SIZE = {3072: 64, 65536: 64}


def make_db(directory: str | Path, record_bytes: int, total_bytes: int = DB_BYTES) -> Path:
    """A database of uint8 records whose LMDB values are exactly ``record_bytes`` long."""
    header = RecordLayout((1,), np.dtype(np.uint8)).header_size
    n = max(64, total_bytes // record_bytes)
    rng = np.random.default_rng(0)
    X = rng.integers(0, 256, (n, record_bytes - header), dtype=np.uint8)
    path = Path(directory) / f"records_{record_bytes}"
    write_lmdb(path, X, np.arange(n) % 10, overwrite=True)
    return path


def measure(path: Path, batch_size: int, ranks_list: list[int], repeat: int) -> list[dict]:
    best_bare: dict | None = None
    best: dict[int, dict] = {}
    for _ in range(repeat):
        bare = cursor_rate(path, passes=2)
        if best_bare is None or bare["records_per_s"] > best_bare["records_per_s"]:
            best_bare = bare
        for ranks in ranks_list:
            r = reader_rate(path, batch_size, ranks, passes=2)
            if ranks not in best or r["records_per_s"] > best[ranks]["records_per_s"]:
                best[ranks] = r
    assert best_bare is not None
    rows = []
    for ranks in ranks_list:
        r = best[ranks]
        rows.append(
            {
                "record_bytes": round(r["bytes"] / r["records"]),
                "batch_size": batch_size,
                "ranks": ranks,
                "bare_records_per_s": best_bare["records_per_s"],
                "bare_mb_per_s": best_bare["mb_per_s"],
                "reader_records_per_s": r["records_per_s"],
                "reader_mb_per_s": r["mb_per_s"],
                "record_ratio": r["records_per_s"] / best_bare["records_per_s"],
                "byte_ratio": r["mb_per_s"] / best_bare["mb_per_s"],
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    header = [
        "record",
        "batch",
        "ranks",
        "bare loop rec/s",
        "bare MB/s",
        "reader rec/s",
        "reader MB/s",
        "records vs bare",
        "bytes vs bare",
    ]
    cells = [
        [
            human_bytes(r["record_bytes"]),
            r["batch_size"],
            r["ranks"],
            f"{r['bare_records_per_s']:,.0f}",
            f"{r['bare_mb_per_s']:,.0f}",
            f"{r['reader_records_per_s']:,.0f}",
            f"{r['reader_mb_per_s']:,.0f}",
            f"{100 * r['record_ratio']:.0f}%",
            f"{100 * r['byte_ratio']:.0f}%",
        ]
        for r in rows
    ]
    return "\n".join(markdown_table(header, cells, "r" * len(header)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", default="3072,65536", help="record sizes in bytes (default 3072,65536)"
    )
    ap.add_argument("--ranks", default="1,2,4", help="rank counts to serve (default 1,2,4)")
    ap.add_argument(
        "--db-mb",
        type=int,
        default=DB_BYTES >> 20,
        help=f"size of each test database in MiB (default {DB_BYTES >> 20})",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure, best kept (default 3)")
    ap.add_argument(
        "--batch-size", type=int, default=None, help="records per batch and rank (default: 64)"
    )
    ap.add_argument(
        "--db",
        default=None,
        help="measure this existing database instead of building test databases",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    if args.db:
        rows += measure(Path(args.db), args.batch_size or 64, ranks, args.repeat)
    else:
        with tempfile.TemporaryDirectory(prefix="nccltree-bench-") as tmp:
            for size in (int(s) for s in args.sizes.split(",")):
                path = make_db(tmp, size, args.db_mb << 20)
                bs = args.batch_size or BATCH_SIZE.get(size, 64)
                rows += measure(path, bs, ranks, args.repeat)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
