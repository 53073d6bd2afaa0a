"""The ``nccltree._records`` extension: batch assembly of small nccltree records."""

from __future__ import annotations

import numpy as np
import pytest

from nccltree.data.format import LABEL_OFFSET, RecordLayout, encode_record

_records = pytest.importorskip(
    "nccltree._records", reason="built without Python headers: no nccltree._records"
)


def records(n: int, shape=(3, 5), dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, *shape)).astype(dtype)
    y = rng.integers(-(2**62), 2**62, n)
    return X, y, [memoryview(encode_record(X[i], int(y[i]))) for i in range(n)]


def gather(values, layout: RecordLayout, x=None, y=None):
    n = len(values)
    x = np.empty((n, *layout.shape), layout.dtype) if x is None else x
    y = np.empty(n, np.int64) if y is None else y
    return _records.gather(values, layout.header(), LABEL_OFFSET, x, y), x, y


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((7,), np.uint8), ((), np.int64)])
def test_payloads_and_labels(shape, dtype):
    X, y, values = records(9, shape, dtype)
    bad, x, got = gather(values, RecordLayout(shape, np.dtype(dtype)))
    assert bad == -1
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(got, y)  # negative and large labels too


def test_large_batch_copies_without_the_lock_and_the_same_bytes():
    X, y, values = records(40, shape=(64, 128))  # 1.3 MB of payload: the lock is released
    bad, x, got = gather(values, RecordLayout((64, 128), np.dtype(np.float32)))
    assert bad == -1
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(got, y)


@pytest.mark.parametrize(
    "where", [0, 4, 6, 16, -1], ids=["magic", "dtype", "reserved", "dims", "payload-size"]
)
def test_first_bad_record_is_reported(where):
    layout = RecordLayout((3, 5), np.dtype(np.float32))
    _, _, values = records(6)
    raw = bytearray(values[4])
    if where < 0:
        raw = raw[:-4]  # a record of another size
    else:
        raw[where] ^= 0xFF
    values[4] = memoryview(bytes(raw))
    values[5] = values[4]
    assert gather(values, layout)[0] == 4


def test_labels_may_differ_but_nothing_else_of_the_header():
    layout = RecordLayout((2,), np.dtype(np.float32))
    values = [encode_record(np.zeros(2, np.float32), lab) for lab in (5, -1, 2**63 - 1)]
    bad, _, y = gather(values, layout)  # bytes objects are buffers too
    assert bad == -1 and y.tolist() == [5, -1, 2**63 - 1]


def test_bad_arguments():
    layout = RecordLayout((3, 5), np.dtype(np.float32))
    header = layout.header()
    _, _, values = records(4)
    x, y = np.empty((4, 3, 5), np.float32), np.empty(4, np.int64)
    assert _records.gather(iter(values), header, LABEL_OFFSET, x, y) == -1  # any iterable
    with pytest.raises(TypeError, match="sequence of buffers"):
        _records.gather(5, header, LABEL_OFFSET, x, y)
    with pytest.raises(TypeError):
        _records.gather([*values[:3], 7], header, LABEL_OFFSET, x, y)
    with pytest.raises(ValueError, match="multiple"):
        _records.gather(values, header, LABEL_OFFSET, x.view(np.uint8).reshape(-1)[:-1], y)
    with pytest.raises(ValueError, match="int64"):
        _records.gather(values, header, LABEL_OFFSET, x, y[:3])
    with pytest.raises(ValueError, match="label_offset"):
        _records.gather(values, header, len(header) - 4, x, y)
    with pytest.raises(TypeError, match="read-write bytes-like"):  # not contiguous
        _records.gather(values[:2], header, LABEL_OFFSET, x[::2], y)
    with pytest.raises(TypeError):  # read-only output
        _records.gather(values, header, LABEL_OFFSET, b"\0" * x.nbytes, y)
    assert _records.gather([], header, LABEL_OFFSET, x[:0], y) == -1
