"""DataReader against a bare LMDB cursor loop, 3 KB and 64 KB records (pytest-benchmark).

    pytest bench/bench_reader.py --benchmark-only

One pass over a 64 MiB database per round: the bare ``iternext(keys=False)`` loop, and a
DataReader serving 1, 2 and 4 ranks (a batch of every rank in turn, released at once).
The GB/s summary line counts the record values read. reader_table.py runs the same
comparison on larger databases and prints it as a Markdown table with the ratios.
"""

from __future__ import annotations

import tempfile

import pytest
from reader_table import BATCH_SIZE, make_db

from nccltree.data import DataReader
from nccltree.data.lmdb_io import close_env, open_env

SIZES = (3072, 65536)


@pytest.fixture(scope="module")
def dbs():
    with tempfile.TemporaryDirectory(prefix="nccltree-bench-") as tmp:
        yield {size: make_db(tmp, size, 64 << 20) for size in SIZES}


def _records(path) -> int:
    env = open_env(path)
    try:
        with env.begin() as txn:
            return txn.stat()["entries"]
    finally:
        close_env(env)


@pytest.mark.parametrize("size", SIZES)
def test_bare_cursor(benchmark, dbs, size: int) -> None:
    path = dbs[size]
    env = open_env(path)

    def one_pass() -> int:
        with env.begin() as txn:
            n = 0
            for _ in txn.cursor().iternext(keys=False):
                n += 1
            return n

    benchmark.group = f"{size} B records"
    benchmark.extra_info["bytes"] = _records(path) * size
    try:
        benchmark.pedantic(one_pass, rounds=5, warmup_rounds=1)
    finally:
        close_env(env)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("size", SIZES)
def test_reader(benchmark, dbs, size: int, ranks: int) -> None:
    path = dbs[size]
    n = _records(path)
    with DataReader(path, BATCH_SIZE[size], ranks) as reader:
        rounds = n // reader.round_size

        def one_pass() -> None:
            for _ in range(rounds):
                for r in range(ranks):
                    reader.next_batch(r).release()

        benchmark.group = f"{size} B records"
        benchmark.extra_info["bytes"] = rounds * reader.round_size * size
        benchmark.pedantic(one_pass, rounds=5, warmup_rounds=1)
