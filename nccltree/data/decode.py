"""Batch decoders: many LMDB values into one batch slot, with Caffe's data transforms.

A decoder's ``fill(values, x, y, transform)`` writes ``len(values)`` records into the
first rows of ``x`` (and labels into ``y``). A record that does not fit raises
``BadRecord(i, reason)``; the reader turns ``i`` into the record's key.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from functools import cache
from math import prod
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .._errors import BackendUnavailable
from .._validate import check_int, check_real
from . import datum
from .format import LABEL_OFFSET, RecordLayout, record_layout

# Large records are copied into the batch by the native gather kernel, split over the
# machine's cores: one reader thread alone copies into cold batch buffers at about half
# the memory bandwidth. Without the native library they are copied one by one.
GATHER_THREADS = (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
)


@cache
def _native_gather() -> Callable[[np.ndarray, list, int], np.ndarray] | None:
    try:
        from .._native import gather, library

        library()
    except BackendUnavailable:
        return None
    return gather


@cache
def _records_gather() -> Callable[..., int] | None:
    try:
        from .. import _records
    except ImportError:  # built without Python headers: the numpy path below
        return None
    return _records.gather


# Records up to this size are checked and copied by one call of the ``_records``
# extension (or, without it, gathered with one C-level join and checked/split with
# vectorised numpy); larger ones are copied straight into the batch by the gather kernel.
SMALL_RECORD = 32 << 10


def _unlike(shape: tuple, dtype: np.dtype, want_shape: tuple, want_dtype: np.dtype) -> str:
    return (
        f"shape {shape} / dtype {dtype.name} differs from the database's "
        f"shape {want_shape} / dtype {want_dtype.name} (records must all be alike)"
    )


class BadRecord(Exception):
    """Record ``index`` (position in the values passed to ``fill``) cannot be used."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(index, reason)
        self.index = index
        self.reason = reason


class Transform:
    """Caffe's data-layer transform (``DataTransformer``): mean, crop, mirror and scale.

    Each record becomes ``(x - mean) * scale``, computed in ``dtype``. ``mean`` is a
    scalar, one value per channel (axis 0 of a record, Caffe's ``mean_value``) or an
    array of the record's shape (Caffe's ``mean_file``). With a mean or a scale the
    output is float32 unless ``dtype`` says another float type.

    On records ``(C, H, W)``, ``crop=N`` keeps an ``N x N`` window of every channel and
    ``mirror`` flips records horizontally (the last axis), as Caffe's ``crop_size`` and
    ``mirror``: in training (``train=True``) the window's offsets and the flip are drawn
    at random, in evaluation the window is the center one (offsets ``(H - N) // 2`` and
    ``(W - N) // 2``) and nothing is flipped. A full-shape mean is subtracted at the
    record's own pixels, i.e. before cropping and flipping, as Caffe does. The random
    choices of record ``g`` of the endless sequence are a pure function of ``(seed,
    g)`` (:func:`crop_choices`), so they do not depend on the rank count or on prefetch.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        in_dtype: np.dtype,
        dtype: DTypeLike | None = None,
        scale: float | None = None,
        mean: object = None,
        *,
        crop: int | None = None,
        mirror: bool = False,
        train: bool = True,
        seed: int = 0,
    ) -> None:
        dt: np.dtype[Any] | None
        if dtype is not None:
            dt = np.dtype(dtype)
            if dt.kind != "f":
                raise ValueError(f"dtype must be a float type (e.g. 'float32') or None; got {dt}")
        else:
            dt = None
        if scale is not None:
            scale = check_real(scale, "scale")
        if crop is not None:
            crop = check_int(crop, "crop", min=1)
        self.seed = check_int(seed, "seed", min=0)
        self.train = bool(train)
        self.crop, self.mirror = crop, bool(mirror)
        if crop is not None or self.mirror:
            what = "crop" if crop is not None else "mirror"
            if len(shape) != 3:
                raise ValueError(
                    f"{what} needs records of shape (C, H, W); they have shape {shape}"
                )
            if crop is not None and (crop > shape[1] or crop > shape[2]):
                raise ValueError(
                    f"crop={crop} is larger than the records' height x width "
                    f"{shape[1]} x {shape[2]} (shape {shape})"
                )
        self.in_shape = shape
        self.out_shape: tuple[int, ...] = shape if crop is None else (shape[0], crop, crop)
        # Anything but a plain elementwise transform (a crop, or a flip that may happen).
        self.spatial = crop is not None or (self.mirror and self.train)
        self.out_dtype: np.dtype[Any] = dt or (
            np.dtype(np.float32) if scale is not None or mean is not None else in_dtype
        )
        # a scalar of the output dtype, so the product is computed in it
        self.scale = None if scale is None else np.asarray(scale, self.out_dtype)[()]
        self.mean = None if mean is None else _mean_array(mean, shape, self.out_dtype)
        self.identity = (
            self.out_dtype == in_dtype
            and self.scale is None
            and self.mean is None
            and not self.spatial
        )

    def at(self, positions: np.ndarray) -> Transform:
        """This transform for records at sequence ``positions`` (random crops and flips
        are drawn per position): a shallow copy that knows them."""
        t = copy.copy(self)
        t.positions = positions
        return t

    positions: np.ndarray | None = None

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Transform the records ``src`` (in the record shape) into ``dst`` (the output
        shape); those made by :meth:`at` know their sequence positions, others are taken
        to be at positions ``0, 1, ...``."""
        if not self.spatial:
            self._apply(src, self.mean, dst)
            return
        n = len(src)
        h, w, flip = self.choices(np.arange(n) if self.positions is None else self.positions)
        c = self.out_shape[1] if self.crop is not None else self.in_shape[1]
        cw = self.out_shape[2] if self.crop is not None else self.in_shape[2]
        mean = self.mean
        full_mean = mean is not None and mean.ndim == 3 and mean.shape[1:] != (1, 1)
        for i in range(n):
            hi, wi = int(h[i]), int(w[i])
            s = src[i, :, hi : hi + c, wi : wi + cw]
            m = mean[:, hi : hi + c, wi : wi + cw] if full_mean and mean is not None else mean
            if flip[i]:
                s = s[..., ::-1]
                if full_mean and m is not None:
                    m = m[..., ::-1]
            self._apply(s, m, dst[i])

    def choices(self, positions: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row and column offsets of the window and the flips of the records at
        ``positions``: random (:func:`crop_choices`) in training, else the center window
        and no flip."""
        g = np.asarray(positions, np.int64)
        _, height, width = self.in_shape
        c = self.crop if self.crop is not None else height
        cw = self.crop if self.crop is not None else width
        if self.train:
            h, w, flip = crop_choices(self.seed, g, height - c + 1, width - cw + 1)
            return h, w, flip & self.mirror
        zero = np.zeros(len(g), np.int64)
        return zero + (height - c) // 2, zero + (width - cw) // 2, zero.astype(bool)

    def _apply(self, src: np.ndarray, mean: np.ndarray | None, dst: np.ndarray) -> None:
        if mean is not None:
            np.subtract(src, mean, out=dst, casting="unsafe")
            if self.scale is not None:
                np.multiply(dst, self.scale, out=dst)
        elif self.scale is not None:
            np.multiply(src, self.scale, out=dst, casting="unsafe")
        else:
            np.copyto(dst, src, casting="unsafe")


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _M64


def crop_choices(
    seed: int, positions: np.ndarray, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The random crop offsets (in ``[0, rows)`` and ``[0, cols)``) and flips of the
    records at sequence ``positions`` under ``seed``: SplitMix64 hashes of ``(seed, g)``,
    a pure function of the two (the same on every run, rank count and prefetch)."""
    g = np.asarray(positions, np.int64).astype(np.uint64)
    r1 = _mix64(g ^ _mix64(np.full(g.shape, seed, np.uint64)))
    r2 = _mix64(r1)
    r3 = _mix64(r2)
    h = (r1 % np.uint64(rows)).astype(np.int64)
    w = (r2 % np.uint64(cols)).astype(np.int64)
    return h, w, (r3 & np.uint64(1)).astype(bool)


def _mean_array(mean: object, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    m = np.asarray(mean, dtype=dtype)
    if m.ndim == 0:
        return m
    if shape and m.shape == (shape[0],):
        return m.reshape((shape[0],) + (1,) * (len(shape) - 1))
    if m.shape == shape:
        return m
    per_channel = f"{shape[0]} values (one per channel), " if shape else ""
    raise ValueError(
        f"mean must be a scalar, {per_channel}or an array of the record shape {shape}; "
        f"got shape {m.shape}"
    )


class _Staging:
    """A reused buffer for records that still need a transform (reader thread only)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.buf = np.empty((0, *shape), dtype)

    def __call__(self, n: int) -> np.ndarray:
        if len(self.buf) < n:
            self.buf = np.empty((n, *self.shape), self.dtype)
        return self.buf[:n]


class RecordDecoder:
    """nccltree records of one layout."""

    def __init__(self, layout: RecordLayout) -> None:
        self.layout = layout
        self.shape, self.dtype = layout.shape, layout.dtype
        self._size = layout.record_size
        self._hsize = layout.header_size
        self._nbytes = layout.nbytes
        # Header as little-endian words: word 1 is the label, every other word is fixed
        # for the database, so one compare per batch checks all headers.
        self._header = layout.header()
        self._words = np.frombuffer(self._header, "<i8")
        inner, step = [], self.dtype.itemsize
        for d in reversed(self.shape):
            inner.append(step)
            step *= d
        self._strides = (self._size, *reversed(inner))  # of the payloads in a joined batch
        self._staging = _Staging(self.shape, self.dtype)
        self._gather = _native_gather() if self._size > SMALL_RECORD else None
        self._records = _records_gather() if self._size <= SMALL_RECORD else None

    def _reason(self, value: memoryview) -> str:
        try:
            other = record_layout(value)
        except ValueError as e:
            return str(e)
        return _unlike(other.shape, other.dtype, self.shape, self.dtype)

    def fill(
        self, values: Sequence[memoryview], x: np.ndarray, y: np.ndarray, transform: Transform
    ) -> None:
        """Decode ``values`` (one or more records) into the first rows of ``x`` and
        ``y``, through ``transform``; ``BadRecord`` names the first one that does not fit."""
        n = len(values)
        if self._records is not None:  # checks the sizes and headers itself
            dst = x[:n] if transform.identity else self._staging(n)
            bad = self._records(values, self._header, LABEL_OFFSET, dst, y[:n])
            if bad >= 0:
                raise BadRecord(bad, self._reason(values[bad]))
            if not transform.identity:
                transform(dst, x[:n])
            return
        if sum(map(len, values)) != n * self._size:
            for i, v in enumerate(values):
                if len(v) != self._size:
                    raise BadRecord(i, self._reason(v))
        if self._size <= SMALL_RECORD:
            self._fill_small(values, x[:n], y[:n], transform)
        else:
            self._fill_large(values, x[:n], y[:n], transform)

    def _check_headers(
        self, values: Sequence[memoryview], buf: bytes, stride: int, y: np.ndarray
    ) -> None:
        """Check the headers in ``buf`` (one every ``stride`` bytes) and copy the labels."""
        hw = np.ndarray((len(values), len(self._words)), "<i8", buf, 0, (stride, 8))
        same = hw == self._words
        same[:, 1] = True  # word 1 is the label
        if not same.all():
            i = int(np.argmin(same.all(1)))
            raise BadRecord(i, self._reason(values[i]))
        np.copyto(y, hw[:, 1])

    def _fill_small(
        self, values: Sequence[memoryview], x: np.ndarray, y: np.ndarray, transform: Transform
    ) -> None:
        n, size, h = len(values), self._size, self._hsize
        joined = b"".join(values)
        self._check_headers(values, joined, size, y)
        payload = np.ndarray((n, *self.shape), self.dtype, joined, h, self._strides)
        if transform.identity:
            np.copyto(x, payload)
        else:
            transform(payload, x)

    def _fill_large(
        self, values: Sequence[memoryview], x: np.ndarray, y: np.ndarray, transform: Transform
    ) -> None:
        n, h, nb = len(values), self._hsize, self._nbytes
        self._check_headers(values, b"".join([v[:h] for v in values]), h, y)
        dst = x if transform.identity else self._staging(n)
        flat = dst.reshape(-1).view(np.uint8)
        if self._gather is not None:
            self._gather(flat, [v[h:] for v in values], GATHER_THREADS)
        else:
            out = flat.data  # a memoryview of the bytes
            o = 0
            for v in values:
                out[o : o + nb] = v[h:]
                o += nb
        if not transform.identity:
            transform(dst, x)


class DatumDecoder:
    """Caffe Datum records of one shape and dtype (uint8 data, float_data or encoded);
    ``mode`` says how encoded images are decoded (see ``datum.IMAGE_MODES``)."""

    def __init__(self, first: memoryview | bytes, mode: str = "native") -> None:
        self.mode = mode
        arr, _ = datum._decode(first, mode)
        self.shape, self.dtype = tuple(arr.shape), arr.dtype.newbyteorder("=")
        f = datum.parse_datum(first)
        self.encoded = f.encoded
        self._prefix = _fast_prefix(first, f)
        self._count = prod(self.shape)
        self._staging = _Staging(self.shape, self.dtype)

    def _decode(self, i: int, v: memoryview) -> tuple[np.ndarray, int]:
        try:
            arr, label = datum._decode(v, self.mode)
        except ValueError as e:
            raise BadRecord(i, str(e)) from None
        if arr.shape != self.shape or arr.dtype != self.dtype:
            reason = _unlike(arr.shape, arr.dtype, self.shape, self.dtype)
            if self.encoded and self.mode == "native" and arr.shape[1:] == self.shape[1:]:
                reason += "; " + datum.channels_hint(self.shape[0])
            raise BadRecord(i, reason)
        return arr, label

    def fill(
        self, values: Sequence[memoryview], x: np.ndarray, y: np.ndarray, transform: Transform
    ) -> None:
        """As :meth:`RecordDecoder.fill`."""
        n = len(values)
        # The first n rows: a short batch (the end of an epoch) fills only part of x.
        dst = x[:n] if transform.identity else self._staging(n)
        prefix = self._prefix
        off = len(prefix) if prefix is not None else 0
        end = off + self._count
        flat = dst.reshape(n, -1)
        for i, v in enumerate(values):
            if prefix is not None and len(v) >= end and v[:off] == prefix:
                label = _tail_label(v[end:])
                if label is not None:
                    flat[i] = np.frombuffer(v, np.uint8, self._count, off)
                    y[i] = label
                    continue
            arr, label = self._decode(i, v)
            dst[i] = arr
            y[i] = label
        if not transform.identity:
            transform(dst, x[:n])


def _fast_prefix(first: memoryview | bytes, f: datum.DatumFields) -> bytes | None:
    """The bytes before the data of an unencoded uint8 Datum, when they hold nothing but
    the dimensions and the data's tag and length (Caffe's field order); else None.

    Then every record that starts with the same bytes has the same shape, and its label is
    in the fields after its data: one compare checks a record, and ``_tail_label`` reads
    its label. A record whose label (or anything else) comes before its data goes through
    the full decoder, which reads the fields by tag in any order.
    """
    if f.encoded or f.data is None or not len(f.data):
        return None
    mv = memoryview(first)
    prefix = bytes(mv[: f.data_offset])
    pos = 0
    try:
        while True:
            tag, pos = datum._varint(mv, pos)
            if tag == datum._TAG_DATA:
                _, pos = datum._varint(mv, pos)
                return prefix if pos == f.data_offset else None
            if tag not in (1 << 3, 2 << 3, 3 << 3):  # channels, height, width (varints)
                return None
            _, pos = datum._varint(mv, pos)
    except (ValueError, IndexError):
        return None


def _tail_label(tail: memoryview) -> int | None:
    """The label from the fields after a Datum's data when they are label fields (the last
    one wins, as in protobuf; none: 0) and ``encoded = false`` (convert_imageset writes
    it) only, or None if the tail holds anything else (then the record goes through the
    full decoder, which reports any problem)."""
    label, pos, end = 0, 0, len(tail)
    try:
        while pos < end:
            tag = tail[pos]
            value, pos = datum._varint(tail, pos + 1)
            if tag == 5 << 3:  # label, a varint
                label = datum._int32(value)
            elif tag != 7 << 3 or value:  # anything but encoded = false
                return None
    except (ValueError, IndexError):
        return None
    return label if pos == end else None
