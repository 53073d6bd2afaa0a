"""LMDB environments: opening with clear errors, writing records, inspecting a database."""

from __future__ import annotations

import abc
import errno
import os
import re
import secrets
import shutil
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict, TypeVar

import numpy as np

from .._validate import check_int
from .datum import _decode as _decode_datum
from .datum import (
    channels_hint,
    check_label,
    encode_datum,
    image_mode,
    looks_like_datum,
    parse_datum,
)
from .errors import DataError
from .format import DTYPE_CODES, LABEL_OFFSET, encode_record, is_record, keyname
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
        raise FileNotFoundError(f"no LMDB database at {str(p)!r}")
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


def decoder(
    format: str, mode: str = "native"
) -> Callable[[bytes | memoryview], tuple[np.ndarray, int]]:
    """The single-record decode function ``buf -> (array, label)`` of a format (``mode``:
    how encoded Datum images are decoded, see ``datum.IMAGE_MODES``)."""
    if format == "nccltree":
        return _decode_record
    return lambda buf: _decode_datum(buf, mode)


def decode_one(
    format: str, value: bytes | memoryview, key: bytes | memoryview, mode: str = "native"
) -> tuple[np.ndarray, int]:
    try:
        return decoder(format, mode)(value)
    except ValueError as e:
        raise DataError(f"record {keyname(key)}: {e}") from None


_Holder = TypeVar("_Holder", bound="HoldsEnv")


class HoldsEnv(abc.ABC):
    """What holds an LMDB environment open (a :class:`Database`, a ``DataReader``): a
    context manager that closes it on exit."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give the environment back (idempotent)."""

    def __enter__(self: _Holder) -> _Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Database(HoldsEnv):
    """A read-only view of the record database at ``path`` (nccltree records or Caffe
    Datums; ``format``: ``"auto"`` tells them apart).

    ``len(db)``, ``db.format``, ``db.shape``, ``db.dtype`` (taken from the first record),
    ``iter(db)`` yields ``(key, x, y)`` with ``x`` a fresh array; ``db.labels()`` reads all
    labels. ``force_color`` / ``force_gray``: how
    encoded Datum images are decoded (see :func:`~nccltree.data.decode_datum`). A context
    manager; ``close()`` releases the environment.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        format: str = "auto",
        *,
        force_color: bool = False,
        force_gray: bool = False,
    ) -> None:
        check_format(format)
        self.mode = image_mode(force_color, force_gray)
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
                x, _ = decode_one(self.format, value, key, self.mode)
                self.first_key = key
                self.shape: tuple[int, ...] = tuple(x.shape)
                self.dtype: np.dtype = x.dtype.newbyteorder("=")
        except BaseException:
            close_env(self.env)
            raise

    def __len__(self) -> int:
        return self.entries

    def __iter__(self) -> Iterator[tuple[bytes, np.ndarray, int]]:
        decode = decoder(self.format, self.mode)
        with self.env.begin(buffers=True) as txn:
            for i, (key, value) in enumerate(txn.cursor().iternext()):
                try:
                    x, y = decode(value)
                except ValueError as e:
                    raise DataError(
                        f"record {keyname(key)} (number {i} in key order): {e}"
                    ) from None
                yield bytes(key), np.array(x, dtype=x.dtype.newbyteorder("=")), int(y)

    def labels(self) -> np.ndarray:
        """All labels, in key order (int64); images are not decoded for them."""
        out = np.empty(self.entries, np.int64)
        with self.env.begin(buffers=True) as txn:
            i = 0
            it = txn.cursor().iternext()
            try:
                if self.format == "nccltree":
                    unpack = struct.Struct("<q").unpack_from
                    for i, (_, value) in enumerate(it):
                        if len(value) < LABEL_OFFSET + 8:
                            raise ValueError("not an nccltree record (too short)")
                        out[i] = unpack(value, LABEL_OFFSET)[0]
                else:
                    for i, (_, value) in enumerate(it):
                        out[i] = parse_datum(value).label
            except ValueError as e:
                with self.env.begin() as t2:  # the key of record i, for the message
                    key = next(islice(t2.cursor().iternext(values=False), i, None), b"?")
                raise DataError(f"record {keyname(key)} (number {i} in key order): {e}") from None
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

    def __repr__(self) -> str:
        return (
            f"<Database {self.path!r}: {self.entries} {self.format} records, "
            f"shape {self.shape}, {self.dtype.name}>"
        )


#: open a record database read-only: ``open_db(path, format="auto", *, force_color=False,
#: force_gray=False)``, the :class:`Database`
open_db = Database


def db_info(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    force_color: bool = False,
    force_gray: bool = False,
) -> dict[str, Any]:
    """Summary of the database at ``path``: records, format, shape, dtype, label range,
    size on disk. ``format``, ``force_color`` and ``force_gray`` as for :class:`Database`.

    Reads every label (one sequential pass), so it takes a moment on a large database.
    """
    with open_db(path, format, force_color=force_color, force_gray=force_gray) as db:
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


class BadEntry(TypedDict):
    """One record ``verify_db`` found bad: its number in key order, key and reason."""

    number: int
    key: str
    reason: str


class VerifyReport(TypedDict):
    """What ``verify_db`` returns."""

    path: str
    records: int
    format: str | None
    shape: list[int] | None
    dtype: str | None
    bad: list[BadEntry]


def verify_db(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    force_color: bool = False,
    force_gray: bool = False,
) -> VerifyReport:
    """Read and decode every record of a database, as the reader would; report the bad ones.

    Returns ``records``, ``format``, ``shape`` and ``dtype`` (those of the first record
    that decodes, which the reader takes as the database's) and ``bad``: one
    ``{"number", "key", "reason"}`` per record that does not decode or differs from that
    shape and dtype, in key order (the first record itself when it does not decode: the
    reader then refuses the database).
    """
    check_format(format)
    mode = image_mode(force_color, force_gray)
    env = open_env(path)
    bad: list[BadEntry] = []
    want: tuple[tuple[int, ...], np.dtype] | None = None
    fmt = None if format == "auto" else format
    try:
        with env.begin(buffers=True) as txn:
            n = int(txn.stat()["entries"])
            for i, (key, value) in enumerate(txn.cursor().iternext()):
                k = bytes(key)
                try:
                    if fmt is None:
                        fmt = detect_format(value, k)
                    x, label = decoder(fmt, mode)(value)
                    if label < 0:  # training refuses it: a class index is >= 0
                        raise ValueError(f"label {label} is negative (a class index is >= 0)")
                except (ValueError, DataError) as e:
                    reason = str(e)
                    prefix = f"record {keyname(k)} "
                    reason = reason[len(prefix) :] if reason.startswith(prefix) else reason
                    bad.append({"number": i, "key": keyname(k), "reason": reason})
                    continue
                got = (tuple(x.shape), x.dtype.newbyteorder("="))
                if want is None:
                    want = got
                elif got != want:
                    reason = (
                        f"shape {got[0]} / dtype {got[1].name} differs from the database's "
                        f"shape {want[0]} / dtype {want[1].name}"
                    )
                    if fmt == "datum" and mode == "native" and got[0][1:] == want[0][1:]:
                        if parse_datum(value).encoded:
                            reason += "; " + channels_hint(want[0][0])
                    bad.append({"number": i, "key": keyname(k), "reason": reason})
    finally:
        close_env(env)
    return {
        "path": str(path),
        "records": n,
        "format": fmt,
        "shape": None if want is None else list(want[0]),
        "dtype": None if want is None else want[1].name,
        "bad": bad,
    }


def check_arrays(X: np.ndarray, y: np.ndarray, format: str = "nccltree") -> None:
    """The checks ``write_lmdb`` makes of its arguments before it writes anything:
    ValueError or TypeError saying what is wrong (naming the record for a bad label)."""
    if format not in ("nccltree", "datum"):
        raise ValueError(f"format must be 'nccltree' or 'datum'; got {format!r}")
    if X.ndim < 1 or len(X) == 0:
        raise ValueError(f"X must hold at least one record (shape (N, ...)); got shape {X.shape}")
    if y.shape != (len(X),):
        raise ValueError(f"y must have shape ({len(X)},) to match X; got {y.shape}")
    if y.dtype.kind not in "iub":
        raise TypeError(f"labels must be integers; got dtype {y.dtype}")
    if format == "datum":
        if X.dtype not in (np.uint8, np.float32):
            raise TypeError(f"Datum records hold uint8 or float32 data; got {X.dtype}")
        _check_datum_labels(y)
    elif X.dtype.name not in DTYPE_CODES:
        raise TypeError(
            f"record dtype {X.dtype} is not supported; accepted: {', '.join(DTYPE_CODES)}"
        )


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
    float32, C×H×W or H×W records, int32 labels). Records are written in transactions of
    about ``commit_bytes``; the map size starts at an estimate (or ``map_size``) and
    doubles whenever it fills. An existing non-empty database is an error unless
    ``overwrite``.

    All or nothing: the database is written into a temporary directory next to ``path``
    (``.NAME.tmp-HOST-PID-...``) and renamed to ``path`` once complete, so a killed
    writer leaves no partial database behind. A temporary directory left by a killed
    writer on this host is removed by the next ``write_lmdb`` to the same path.
    """
    X = np.asarray(X)
    y = np.asarray(y)
    check_arrays(X, y, format)
    commit_bytes = check_int(commit_bytes, "commit_bytes", min=1)
    if map_size is not None:
        map_size = check_int(map_size, "map_size", min=1)
    encode = encode_record if format == "nccltree" else encode_datum
    sample = encode(X[0], int(y[0]))
    width = max(8, len(str(len(X) - 1)))
    if map_size is None:
        map_size = max(16 * _MiB, int(len(X) * (len(sample) + width + 64) * 1.25))
    items = ((b"%0*d" % (width, j), encode(X[j], int(y[j]))) for j in range(len(X)))
    return write_records(
        path, items, overwrite=overwrite, map_size=map_size, commit_bytes=commit_bytes
    )


def write_records(
    path: str | os.PathLike,
    items: Iterable[tuple[bytes, bytes]],
    *,
    overwrite: bool = False,
    map_size: int | None = None,
    commit_bytes: int = 64 * _MiB,
) -> int:
    """Write ``(key, value)`` records, as they come, into a new database at ``path``;
    returns the number written. The writer of :func:`write_lmdb` (which describes the
    rules: all or nothing through a temporary directory renamed at the end, a killed
    writer's leftovers removed by the next one, ``overwrite``); ``items`` may be a
    generator computing each record (an exception from it writes nothing). Keys in
    increasing byte order are appended (LMDB's fast path); others are inserted.
    """
    commit_bytes = check_int(commit_bytes, "commit_bytes", min=1)
    if map_size is not None:
        map_size = check_int(map_size, "map_size", min=1)
    target = Path(path)
    check_target(target, overwrite)
    remove_stale_temporaries(target)
    tmp = _temporary(target, "tmp")
    try:
        env = _lmdb().open(str(tmp), map_size=map_size or 64 * _MiB, subdir=True, max_dbs=0)
        try:
            n = _put_all(env, items, commit_bytes)
        finally:
            env.close()
        _install(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return n


def _check_datum_labels(y: np.ndarray) -> None:
    lo, hi = int(y.min()), int(y.max())
    for bad in (lo, hi):
        try:
            check_label(bad)
        except ValueError as e:
            i = int(np.flatnonzero(y == bad)[0])
            raise ValueError(f"record {i}: {e}") from None


def _put_all(env: Any, items: Iterable[tuple[bytes, bytes]], commit_bytes: int) -> int:
    lmdb = _lmdb()
    n = 0
    last = b""
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    append = True

    def commit() -> None:
        while True:
            try:
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti(batch, append=append)
                return
            except lmdb.MapFullError:
                # Grow geometrically so a badly underestimated size costs O(log) retries.
                env.set_mapsize(env.info()["map_size"] * 2)

    for key, value in items:
        if n and key <= last:
            if key == last:
                raise ValueError(f"record {keyname(key)} is written twice")
            append = False  # out of order from here: inserted, not appended
        last = key
        batch.append((key, value))
        size += len(key) + len(value)
        n += 1
        if size >= commit_bytes:
            commit()
            batch, size = [], 0
    if batch:
        commit()
    return n


def _entries(p: Path) -> int:
    """Records in the LMDB environment directory ``p`` (read-only, no lock file)."""
    lmdb = _lmdb()
    try:
        env = lmdb.open(str(p), readonly=True, lock=False, subdir=True)
    except lmdb.Error as e:
        raise FileExistsError(
            f"{str(p)!r} holds a data.mdb that is not a readable LMDB environment ({e})"
        ) from None
    try:
        with env.begin() as txn:
            return int(txn.stat()["entries"])
    finally:
        env.close()


def check_target(
    path: str | os.PathLike, overwrite: bool = False, flag: str = "overwrite=True"
) -> None:
    """Check that a database can be written at ``path``, before anything is written.

    FileExistsError if a file is there, or a non-empty directory that is not an LMDB
    environment, or (unless ``overwrite``) a database with records (the message says that
    ``flag`` replaces it); NotADirectoryError if a parent of ``path`` is a file.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise FileExistsError(f"{str(p)!r} exists and is not a directory")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(
                    f"cannot create a database at {str(p)!r}: {str(parent)!r} is a file, "
                    "not a directory"
                )
            break
    if not p.is_dir() or not any(p.iterdir()):
        return
    if not (p / "data.mdb").is_file():
        raise FileExistsError(
            f"{str(p)!r} is a non-empty directory that is not an LMDB environment"
        )
    n = _entries(p)
    if n and not overwrite:
        raise FileExistsError(
            f"{str(p)!r} already holds a database of {n} records ({flag} replaces it)"
        )


# Temporary directories: .NAME.tmp-HOST-PID-RANDOM (being written) and .NAME.old-HOST-PID-
# RANDOM (a replaced database being removed), next to the target, so that the final rename
# stays on one file system. HOST and PID say whose they are: a later writer on this host
# removes those whose process is gone (a killed writer's), never a live one's, nor another
# host's on a shared file system.
def _temporary(target: Path, kind: str) -> Path:
    parent = target.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = parent / f".{target.name}.{kind}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()  # the umask's permissions, as the database itself gets them
            return tmp
        except FileExistsError:
            continue


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories that writers of the database at ``path`` killed on
    this host left behind (their process is gone); returns the ones removed."""
    target = Path(path).absolute()
    parent = target.parent
    if not parent.is_dir():
        return []
    pattern = re.compile(
        rf"\.{re.escape(target.name)}\.(?:tmp|old)-{re.escape(_host())}-(\d+)-[^/]*\Z"
    )
    removed = []
    for entry in parent.iterdir():
        m = pattern.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _install(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the complete database ``tmp`` to ``target``, replacing an existing one only
    when ``overwrite`` (it is moved aside first, then removed)."""
    try:
        os.rename(tmp, target)  # succeeds when target is missing or an empty directory
        return
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    check_target(target, overwrite)  # raced with another writer: the same rules again
    old = _temporary(target, "old")
    os.rename(target, old / "db")
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old / "db", target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
