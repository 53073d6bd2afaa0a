"""Read rates of a database: a bare LMDB cursor loop and a ``DataReader`` serving ranks.

Both return ``{"records", "bytes", "seconds", "records_per_s", "mb_per_s"}`` (MB = 1e6
bytes of record values). A trainer compares ``reader_rate`` with the rate at which it
consumes records to see how much head-room the data pipeline has.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .lmdb_io import close_env, open_env
from .reader import DataReader


def _result(records: int, nbytes: int, seconds: float) -> dict[str, Any]:
    seconds = max(seconds, 1e-9)
    return {
        "records": records,
        "bytes": nbytes,
        "seconds": seconds,
        "records_per_s": records / seconds,
        "mb_per_s": nbytes / seconds / 1e6,
    }


def cursor_rate(path: str | os.PathLike, passes: int = 3) -> dict[str, Any]:
    """Rate of ``for v in cursor.iternext(keys=False)`` over the whole database.

    One untimed pass first brings the file into the page cache, as it is for the reader.
    """
    env = open_env(path)
    try:
        nbytes = records = 0
        elapsed = 0.0
        for p in range(passes + 1):
            with env.begin() as txn:
                t0 = time.perf_counter()
                n = b = 0
                for v in txn.cursor().iternext(keys=False):
                    n += 1
                    b += len(v)
                dt = time.perf_counter() - t0
            if p:  # pass 0 warms the cache
                records, nbytes, elapsed = records + n, nbytes + b, elapsed + dt
        return _result(records, nbytes, elapsed)
    finally:
        close_env(env)


def reader_rate(
    path: str | os.PathLike,
    batch_size: int,
    ranks: int = 1,
    passes: float = 3,
    **reader_kwargs: Any,
) -> dict[str, Any]:
    """Rate at which a ``DataReader`` hands out records, batch assembly included.

    One consumer takes a batch of every rank in turn and releases it at once, for
    ``passes`` times the database (after one untimed pass that warms the cache and
    fills the prefetch buffers). Bytes count the record values read (header included
    for nccltree records), so MB/s compares directly with ``cursor_rate``.
    """
    with DataReader(path, batch_size, ranks, **reader_kwargs) as reader:
        n = len(reader)
        value_bytes = _value_bytes(path)
        warm_rounds = max(1, -(-n // reader.round_size))
        rounds = max(1, int(passes * n / reader.round_size))
        for _ in range(warm_rounds):
            for r in range(ranks):
                reader.next_batch(r).release()
        records = 0
        t0 = time.perf_counter()
        for _ in range(rounds):
            for r in range(ranks):
                b = reader.next_batch(r)
                records += len(b)
                b.release()
        dt = time.perf_counter() - t0
    return _result(records, int(records * value_bytes), dt)


def _value_bytes(path: str | os.PathLike) -> float:
    """Mean size of a record value (from the first one; records are all alike)."""
    env = open_env(path)
    try:
        with env.begin() as txn:
            cur = txn.cursor()
            cur.first()
            return float(len(cur.value()))
    finally:
        close_env(env)
