"""LMDB environments: opening with clear errors, writing records, inspecting a database."""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .._validate import check_int
from .datum import _decode as _decode_datum
from .datum import encode_datum, looks_like_datum
from .errors import DataError
from .format import LABEL_OFFSET, encode_record, is_record, keyname
from .format import _decode as _decode_record

FORMATS = ("auto", "nccltree", "datum")
_MiB = 1 << 20


def _lmdb() -> ModuleType:
    import lmdb  # a dependency, but imported here so that `import nccltree` stays cheap

    return lmdb


# py-lmdb refuses to open one environment twice in a process (and LMDB advises against
# it), yet a training and an evaluation reader may well read the same database: open
# environments are shared, counted, and closed with their last user.
_envs: dict[tuple[str, bool], list] = {}
_envs_lock = threading.Lock()


def open_env(path: str | os.PathLike) -> Any:
    """Open an existing LMDB environment read-only; give it back with ``close_env``.

    ``path`` is the environment directory (holding ``data.mdb``) or the data file itself.
    FileNotFoundError if nothing is there; DataError if it is not an LMDB environment.
    No lock file is used, so a database on a read-only file system can be read; the
    database must not be written while it is open for reading.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "no LMDB database at this path", str(p))
    subdir = p.is_dir()
    if subdir and not (p / "data.mdb").is_file():
        raise DataError(f"{str(p)!r} is a directory without data.mdb: not an LMDB environment")
    key = (os.path.realpath(p), subdir)
    lmdb = _lmdb()
    with _envs_lock:
        entry = _envs.get(key)
        if entry is None:
            try:
                env = lmdb.open(key[0], readonly=True, lock=False, subdir=subdir, max_readers=126)
            except lmdb.Error as e:
                raise DataError(f"{str(p)!r} is not a readable LMDB environment: {e}") from None
            entry = _envs[key] = [env, 0]
        entry[1] += 1
        return entry[0]


def close_env(env: Any) -> None:
    """Give back an environment from ``open_env``; the last user closes it."""
    with _envs_lock:
        for key, entry in _envs.items():
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _envs[key]
                    env.close()
                return
    raise ValueError("close_env() takes an environment that open_env() returned")


def check_format(format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
    return format


def detect_format(value: bytes | memoryview, key: bytes | memoryview) -> str:
    """``"nccltree"`` or ``"datum"`` from a database's first record."""
    if is_record(value):
        return "nccltree"
    if looks_like_datum(value):
        return "datum"
    raise DataError(
        f"record {keyname(key)} is neither an nccltree record nor a Caffe Datum; "
        "is this a database of another kind?"
    )


def decoder(format: str) -> Callable[[bytes | memoryview], tuple[np.ndarray, int]]:
    """The single-record decode function ``buf -> (array, label)`` of a format."""
    return _decode_record if format == "nccltree" else _decode_datum


def decode_one(
    format: str, value: bytes | memoryview, key: bytes | memoryview
) -> tuple[np.ndarray, int]:
    try:
        return decoder(format)(value)
    except ValueError as e:
        raise DataError(f"record {keyname(key)}: {e}") from None


class Database:
    """A read-only view of a record database (nccltree records or Caffe Datums).

    ``len(db)``, ``db.format``, ``db.shape``, ``db.dtype`` (taken from the first record),
    ``iter(db)`` yields ``(key, x, y)`` with ``x`` a fresh array; ``db.labels()`` reads all
    labels. A context manager; ``close()`` releases the environment.
    """

    def __init__(self, path: str | os.PathLike, format: str = "auto") -> None:
        check_format(format)
        self.path = str(path)
        self.env = open_env(path)
        try:
            with self.env.begin(buffers=True) as txn:
                self.entries = txn.stat()["entries"]
                if self.entries == 0:
                    raise DataError(f"the database at {self.path!r} is empty")
                cur = txn.cursor()
                cur.first()
                key, value = bytes(cur.key()), cur.value()
                self.format = detect_format(value, key) if format == "auto" else format
                x, _ = decode_one(self.format, value, key)
                self.first_key = key
                self.shape: tuple[int, ...] = tuple(x.shape)
                self.dtype: np.dtype = x.dtype.newbyteorder("=")
        except BaseException:
            close_env(self.env)
            raise

    def __len__(self) -> int:
        return self.entries

    def __iter__(self) -> Iterator[tuple[bytes, np.ndarray, int]]:
        decode = decoder(self.format)
        with self.env.begin(buffers=True) as txn:
            for key, value in txn.cursor().iternext():
                try:
                    x, y = decode(value)
                except ValueError as e:
                    raise DataError(f"record {keyname(key)}: {e}") from None
                yield bytes(key), np.array(x, dtype=x.dtype.newbyteorder("=")), int(y)

    def labels(self) -> np.ndarray:
        """All labels, in key order (int64)."""
        out = np.empty(self.entries, np.int64)
        with self.env.begin(buffers=True) as txn:
            it = txn.cursor().iternext(keys=False)
            if self.format == "nccltree":
                unpack = struct.Struct("<q").unpack_from
                for i, value in enumerate(it):
                    out[i] = unpack(value, LABEL_OFFSET)[0]
            else:
                for i, (_, y) in enumerate(map(_decode_datum, it)):
                    out[i] = y
        return out

    def size_bytes(self) -> int:
        """Bytes the environment's files take on disk."""
        p = Path(self.path)
        files = [p / "data.mdb"] if p.is_dir() else [p]
        return sum(os.stat(f).st_blocks * 512 for f in files if f.exists())

    def close(self) -> None:
        """Release the environment (idempotent)."""
        if self.env is not None:
            env, self.env = self.env, None
            close_env(env)

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<Database {self.path!r}: {self.entries} {self.format} records, "
            f"shape {self.shape}, {self.dtype.name}>"
        )


def open_db(path: str | os.PathLike, format: str = "auto") -> Database:
    """Open a record database read-only (see :class:`Database`)."""
    return Database(path, format)


def db_info(path: str | os.PathLike, format: str = "auto") -> dict[str, Any]:
    """Summary of a database: records, format, shape, dtype, label range, size on disk.

    Reads every label (one sequential pass), so it takes a moment on a large database.
    """
    with open_db(path, format) as db:
        labels = db.labels()
        return {
            "path": db.path,
            "records": len(db),
            "format": db.format,
            "shape": list(db.shape),
            "dtype": db.dtype.name,
            "record_bytes": int(np.prod(db.shape, dtype=np.int64)) * db.dtype.itemsize,
            "label_min": int(labels.min()),
            "label_max": int(labels.max()),
            "classes": int(np.unique(labels).size),
            "first_key": db.first_key.decode("utf-8", "backslashreplace"),
            "size_bytes": db.size_bytes(),
        }


def write_lmdb(
    path: str | os.PathLike,
    X: np.ndarray,
    y: np.ndarray,
    *,
    format: str = "nccltree",
    overwrite: bool = False,
    map_size: int | None = None,
    commit_bytes: int = 64 * _MiB,
) -> int:
    """Write ``X[i]`` with label ``y[i]`` as record ``i``; returns the number written.

    Keys are the zero-padded record numbers (``00000000``, ``00000001``, ...; wider when
    there are more than 10**8 records), so key order is insertion order. ``format`` is
    ``"nccltree"`` (any shape, any numeric dtype) or ``"datum"`` (Caffe Datum: uint8 or
    float32, C×H×W or H×W records). Records are written in transactions of about
    ``commit_bytes``; the map size starts at an estimate (or ``map_size``) and doubles
    whenever it fills. An existing non-empty database is an error unless ``overwrite``.
    """
    if format not in ("nccltree", "datum"):
        raise ValueError(f"format must be 'nccltree' or 'datum'; got {format!r}")
    X = np.asarray(X)
    y = np.asarray(y)
    if X.ndim < 1 or len(X) == 0:
        raise ValueError(f"X must hold at least one record (shape (N, ...)); got shape {X.shape}")
    if y.shape != (len(X),):
        raise ValueError(f"y must have shape ({len(X)},) to match X; got {y.shape}")
    if y.dtype.kind not in "iub":
        raise TypeError(f"labels must be integers; got dtype {y.dtype}")
    if format == "datum" and X.dtype not in (np.uint8, np.float32):
        raise TypeError(f"Datum records hold uint8 or float32 data; got {X.dtype}")
    commit_bytes = check_int(commit_bytes, "commit_bytes", min=1)
    if map_size is not None:
        map_size = check_int(map_size, "map_size", min=1)
    encode = encode_record if format == "nccltree" else encode_datum
    sample = encode(X[0], int(y[0]))
    width = max(8, len(str(len(X) - 1)))
    per_txn = max(1, commit_bytes // len(sample))
    if map_size is None:
        map_size = max(16 * _MiB, int(len(X) * (len(sample) + width + 64) * 1.25))
    env = _create_env(Path(path), map_size, overwrite)
    lmdb = _lmdb()
    try:
        i = 0
        while i < len(X):
            stop = min(len(X), i + per_txn)
            items = [(b"%0*d" % (width, j), encode(X[j], int(y[j]))) for j in range(i, stop)]
            while True:
                try:
                    with env.begin(write=True) as txn:
                        txn.cursor().putmulti(items, append=True)
                    break
                except lmdb.MapFullError:
                    # Grow geometrically so a badly underestimated size costs O(log) retries.
                    env.set_mapsize(env.info()["map_size"] * 2)
            i = stop
    finally:
        env.close()
    return len(X)


def _create_env(p: Path, map_size: int, overwrite: bool) -> Any:
    lmdb = _lmdb()
    if p.exists() and not p.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a directory", str(p))
    if p.is_dir() and any(p.iterdir()) and not (p / "data.mdb").is_file():
        raise FileExistsError(
            errno.EEXIST, "is a non-empty directory that is not an LMDB environment", str(p)
        )
    env = lmdb.open(str(p), map_size=map_size, subdir=True, max_dbs=0)
    with env.begin(write=True) as txn:
        if txn.stat()["entries"]:
            if not overwrite:
                env.close()
                raise FileExistsError(
                    errno.EEXIST, "already holds a database (pass overwrite=True)", str(p)
                )
            txn.drop(env.open_db(txn=txn), delete=False)
    return env
