"""The nccltree record format: one (array, label) pair per LMDB value.

Layout (all integers little-endian)::

    offset  size      field
    0       4         magic  b"NTR1"  (nccltree record, version 1)
    4       1         dtype code (see DTYPE_CODES)
    5       1         ndim (0 .. 32)
    6       2         reserved, zero
    8       8         label, int64
    16      4 * ndim  shape, uint32 each
    ...     0 .. 4    zero padding, so the header length H is a multiple of 8
    H       nbytes    the array, C order, little-endian; nbytes = prod(shape) * itemsize

Every byte of a header except the label is the same for all records of a database of
one shape and dtype, which is what lets the reader check a whole batch of headers and
pull out its labels with a few vectorised numpy operations instead of per-record Python.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod

import numpy as np

from .errors import DataError

MAGIC = b"NTR1"
LABEL_OFFSET = 8
LABEL_DTYPE = np.dtype("<i8")
MAX_NDIM = 32

# One byte per dtype; the codes are part of the on-disk format, never renumber them.
DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "int8": 2,
    "uint16": 3,
    "int16": 4,
    "uint32": 5,
    "int32": 6,
    "uint64": 7,
    "int64": 8,
    "float16": 9,
    "float32": 10,
    "float64": 11,
    "bool": 12,
}
_CODE_DTYPES = {code: np.dtype(name).newbyteorder("<") for name, code in DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sBBHq")


def _dtype_code(dtype: np.dtype) -> int:
    code = DTYPE_CODES.get(np.dtype(dtype).name)
    if code is None:
        raise TypeError(
            f"record dtype {np.dtype(dtype)} is not supported; accepted: {', '.join(DTYPE_CODES)}"
        )
    return code


@dataclass(frozen=True)
class RecordLayout:
    """``shape`` and ``dtype`` shared by all records of a database, and their header
    bytes."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def header_size(self) -> int:
        """Bytes of one record's header (8-byte aligned)."""
        return _header_size(len(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of the array part of one record."""
        return prod(self.shape) * self.dtype.itemsize

    @property
    def record_size(self) -> int:
        """Bytes of one whole record: header and array."""
        return self.header_size + self.nbytes

    def header(self, label: int = 0) -> bytes:
        """The header of a record with this layout and ``label``."""
        return _pack_header(self.shape, self.dtype, label)


def _header_size(ndim: int) -> int:
    return (16 + 4 * ndim + 7) // 8 * 8


def _pack_header(shape: tuple[int, ...], dtype: np.dtype, label: int) -> bytes:
    head = _FIXED.pack(MAGIC, _dtype_code(dtype), len(shape), 0, label)
    dims = struct.pack(f"<{len(shape)}I", *shape)
    return (head + dims).ljust(_header_size(len(shape)), b"\0")


def encode_record(x: np.ndarray, label: int) -> bytes:
    """Encode one array ``x`` and its integer ``label`` as a record."""
    x = np.asarray(x)
    if x.ndim > MAX_NDIM:
        raise ValueError(f"records have at most {MAX_NDIM} dimensions, got {x.ndim}")
    if any(d >= 2**32 for d in x.shape):
        raise ValueError(f"record dimensions must be < 2**32, got shape {x.shape}")
    label = int(label)
    if not -(2**63) <= label < 2**63:
        raise ValueError(f"label {label} does not fit in int64")
    data = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).tobytes()
    return _pack_header(tuple(x.shape), x.dtype, label) + data


def is_record(buf: bytes | memoryview) -> bool:
    """True when ``buf`` starts like an nccltree record."""
    return bytes(buf[:4]) == MAGIC


def record_layout(buf: bytes | memoryview) -> RecordLayout:
    """Read the layout of a record from its header, checking the record's length.

    Raises ValueError with the reason (without the key; callers add it).
    """
    if len(buf) < 16 or bytes(buf[:4]) != MAGIC:
        raise ValueError("not an nccltree record (bad magic or too short)")
    _, code, ndim, _, _ = _FIXED.unpack_from(buf, 0)
    dtype = _CODE_DTYPES.get(code)
    if dtype is None:
        raise ValueError(f"unknown dtype code {code}")
    if ndim > MAX_NDIM or len(buf) < _header_size(ndim):
        raise ValueError(f"truncated header (ndim {ndim})")
    shape = struct.unpack_from(f"<{ndim}I", buf, 16)
    layout = RecordLayout(tuple(shape), dtype)
    if len(buf) != layout.record_size:
        raise ValueError(
            f"{len(buf)} bytes, but its header (shape {layout.shape}, dtype {dtype.name}) "
            f"needs {layout.record_size}"
        )
    return layout


def _decode(buf: bytes | memoryview) -> tuple[np.ndarray, int]:
    layout = record_layout(buf)
    (label,) = struct.unpack_from("<q", buf, LABEL_OFFSET)
    x = np.frombuffer(buf, dtype=layout.dtype, count=prod(layout.shape), offset=layout.header_size)
    return x.reshape(layout.shape), label


def decode_record(buf: bytes | memoryview, key: bytes | str = b"?") -> tuple[np.ndarray, int]:
    """Decode one record into ``(array, label)``; the array is a read-only view of ``buf``.

    A record that does not decode raises DataError naming ``key``.
    """
    try:
        return _decode(buf)
    except ValueError as e:
        raise DataError(f"record {keyname(key)}: {e}") from None


def keyname(key: bytes | str | memoryview) -> str:
    """A key as error messages show it."""
    if isinstance(key, memoryview):
        key = bytes(key)
    if isinstance(key, bytes):
        return repr(key.decode("utf-8", "backslashreplace"))
    return repr(key)
