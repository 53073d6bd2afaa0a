"""Caffe ``BlobProto`` files (``mean.binaryproto``), read and written from the wire format.

From caffe.proto::

    message BlobShape { repeated int64 dim = 1 [packed = true]; }
    message BlobProto {
      optional BlobShape shape = 7;
      repeated float data = 5 [packed = true];     repeated float diff = 6 [packed = true];
      repeated double double_data = 8 [packed = true];
      repeated double double_diff = 9 [packed = true];
      // 4D dimensions -- deprecated.  Use "shape" instead.
      optional int32 num = 1; optional int32 channels = 2;
      optional int32 height = 3; optional int32 width = 4;
    }

The shape is Caffe's ``Blob::FromProto``'s: the legacy ``num/channels/height/width`` when
any of them is set, else ``shape.dim``; the values are ``double_data`` when present, else
``data``. Repeated numbers are accepted packed or not, as protobuf requires of a reader.
No protobuf package is needed.
"""

from __future__ import annotations

import os

import numpy as np

from .datum import _int32, _put_varint, _varint, read_field

_F32, _F64 = np.dtype("<f4"), np.dtype("<f8")


def _int64(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def _dims(mv: memoryview) -> list[int]:
    """The ``dim`` values of a BlobShape message."""
    dims: list[int] = []
    pos = 0
    while pos < len(mv):
        field, wire, value, pos = read_field(mv, pos, len(mv), "a BlobShape")
        if wire == 0:
            if field == 1:
                dims.append(_int64(value))
        elif wire == 2:
            end = pos + value
            while field == 1 and pos < end:
                value, pos = _varint(mv, pos)
                dims.append(_int64(value))
            pos = end
        else:
            pos += 4 if wire == 5 else 8
    return dims


def decode_blobproto(buf: bytes | memoryview) -> np.ndarray:
    """A serialized ``BlobProto`` as a float32 array of its shape (float64 values from
    ``double_data`` are rounded to float32); ValueError if malformed or if the number of
    values does not match the shape."""
    mv = memoryview(buf).cast("B")
    legacy: dict[int, int] = {}
    shape: list[int] | None = None
    floats: list[np.ndarray] = []
    doubles: list[np.ndarray] = []
    pos, end = 0, len(mv)
    try:
        while pos < end:
            field, wire, value, pos = read_field(mv, pos, end, "the file")
            if wire == 0:
                if 1 <= field <= 4:
                    legacy[field] = _int32(value)
            elif wire == 2:
                if field == 7:
                    shape = _dims(mv[pos : pos + value])
                elif field in (5, 8):
                    item = 4 if field == 5 else 8
                    if value % item:
                        raise ValueError(f"packed field {field} is not a multiple of {item} bytes")
                    arr = np.frombuffer(mv, _F32 if field == 5 else _F64, value // item, pos)
                    (floats if field == 5 else doubles).append(arr)
                pos += value
            elif wire == 5:
                if field == 5:
                    floats.append(np.frombuffer(mv, _F32, 1, pos))
                pos += 4
            else:  # fixed64
                if field == 8:
                    doubles.append(np.frombuffer(mv, _F64, 1, pos))
                pos += 8
            if pos > end:
                raise ValueError("truncated")
    except (ValueError, IndexError) as e:
        raise ValueError(f"not a valid Caffe BlobProto: {e}") from None
    if legacy:
        dims = [legacy.get(f, 0) for f in (1, 2, 3, 4)]
    elif shape is not None:
        dims = shape
    else:
        raise ValueError(
            "a BlobProto without a shape (neither num/channels/height/width nor shape)"
        )
    if any(d < 0 for d in dims):
        raise ValueError(f"a BlobProto of negative shape {tuple(dims)}")
    values = doubles or floats
    data = np.concatenate(values).astype(np.float32) if values else np.empty(0, np.float32)
    count = int(np.prod(dims, dtype=np.int64))
    if data.size != count:
        raise ValueError(
            f"a BlobProto of shape {tuple(dims)} needs {count} values, it holds {data.size}"
        )
    return data.reshape(dims)


def encode_blobproto(array: np.ndarray, *, legacy: bool = True) -> bytes:
    """``array`` (float32) as a serialized ``BlobProto``: with ``legacy`` (as Caffe's
    ``compute_image_mean`` writes a mean) the 4-D ``num/channels/height/width`` fields,
    a C x H x W array taken as 1 x C x H x W; else the ``shape`` message."""
    a = np.asarray(array, dtype=_F32)
    out = bytearray()
    if legacy:
        dims = (1, *a.shape) if a.ndim == 3 else a.shape
        if len(dims) != 4:
            raise ValueError(f"the legacy BlobProto fields hold 4-D shapes, got {a.shape}")
        for field, d in zip((1, 2, 3, 4), dims, strict=True):
            out.append(field << 3)
            _put_varint(out, int(d))
    else:
        inner = bytearray()
        for d in a.shape:
            _put_varint(inner, int(d))
        shape = bytearray([1 << 3 | 2])
        _put_varint(shape, len(inner))
        shape += inner
        out.append(7 << 3 | 2)
        _put_varint(out, len(shape))
        out += shape
    raw = np.ascontiguousarray(a).ravel().tobytes()
    out.append(5 << 3 | 2)
    _put_varint(out, len(raw))
    out += raw
    return bytes(out)


def read_blobproto(path: str | os.PathLike[str]) -> np.ndarray:
    """The array of a ``.binaryproto`` file (see :func:`decode_blobproto`)."""
    with open(path, "rb") as f:
        return decode_blobproto(f.read())


def write_blobproto(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` as a legacy 4-D ``BlobProto``, atomically (a temporary file renamed)."""
    data = encode_blobproto(array)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
