"""Data pipeline: record databases in LMDB and a one-cursor reader feeding N ranks.

``write_lmdb`` turns arrays into a database of nccltree records (``format.py``);
Caffe ``Datum`` databases are read too (``datum.py``). ``DataReader`` deals records
round-robin to ranks from one reader thread and one cursor, into reused batch buffers.
``BatchSource`` is what a training driver reads from (``source.py``): ``DataReader``
implements it, and so does ``MemorySource`` (batches held in memory).
"""

from __future__ import annotations

from .datasets import digits, synthetic
from .datum import decode_datum, encode_datum
from .errors import DataError, EndOfData, ReaderClosed
from .format import RecordLayout, decode_record, encode_record
from .lmdb_io import Database, db_info, open_db, write_lmdb
from .reader import Batch, DataReader
from .source import BatchSource, MemorySource, RankBatch

__all__ = [
    "Batch",
    "BatchSource",
    "DataError",
    "DataReader",
    "Database",
    "EndOfData",
    "MemorySource",
    "RankBatch",
    "ReaderClosed",
    "RecordLayout",
    "db_info",
    "decode_datum",
    "decode_record",
    "digits",
    "encode_datum",
    "encode_record",
    "open_db",
    "synthetic",
    "write_lmdb",
]
