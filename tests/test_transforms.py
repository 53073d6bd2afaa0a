"""Caffe's transform_param in the DataReader: mean, crop, mirror and scale."""

from __future__ import annotations

import numpy as np
import pytest

from nccltree.data import DataReader, EndOfData, write_lmdb
from nccltree.data.decode import Transform, crop_choices


def image_db(path, n: int, shape=(3, 6, 7), seed: int = 0):
    """``n`` random uint8 records of ``shape``; record i has label i."""
    x = np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)
    write_lmdb(path, x, np.arange(n))
    return x


def reference(x, positions, *, crop, mirror, train, seed, mean=None, scale=None):
    """Caffe's DataTransformer on records ``x`` at sequence ``positions``, in numpy."""
    _, _, height, width = x.shape
    c = crop or height
    cw = crop or width
    out = []
    for rec, g in zip(x, positions):
        if train:
            h, w, f = (int(v[0]) for v in crop_choices(seed, [g], height - c + 1, width - cw + 1))
            f = f and mirror
        else:
            h, w, f = (height - c) // 2, (width - cw) // 2, False
        v = rec.astype(np.float32)
        if mean is not None:
            m = np.asarray(mean, np.float32)
            v = v - (m.reshape(-1, 1, 1) if m.ndim == 1 else m)
        v = v[:, h : h + c, w : w + cw]  # the mean is subtracted before cropping
        if f:
            v = v[..., ::-1]
        if scale is not None:
            v = v * np.float32(scale)
        out.append(v)
    return np.stack(out)


def collect(reader: DataReader) -> dict[int, np.ndarray]:
    """Every record's transformed data over one epoch, by label, from all ranks."""
    got: dict[int, np.ndarray] = {}
    while True:
        for r in range(reader.ranks):
            try:
                b = reader.next_batch(r, timeout=10)
            except EndOfData:
                return got
            with b:
                for xi, yi in zip(b.x_host, b.y_host):
                    got[int(yi)] = np.array(xi)


@pytest.mark.parametrize("shape", [(3, 6, 7), (3, 110, 100)])  # small and large records
def test_matches_numpy_reference(tmp_path, shape):
    n = 9
    x = image_db(tmp_path / "db", n, shape)
    mean = np.random.default_rng(1).uniform(0, 255, shape).astype(np.float32)
    with DataReader(
        tmp_path / "db", 4, 1, epochs=1, crop=5, mirror=True, seed=3, mean=mean, scale=0.5
    ) as r:
        assert r.shape == (3, 5, 5) and r.record_shape == shape
        got = collect(r)
    want = reference(x, range(n), crop=5, mirror=True, train=True, seed=3, mean=mean, scale=0.5)
    np.testing.assert_array_equal(np.stack([got[i] for i in range(n)]), want)


def test_random_choices_vary_and_are_pure():
    h, w, f = crop_choices(7, np.arange(4000), 5, 3)
    assert set(h.tolist()) == set(range(5)) and set(w.tolist()) == set(range(3))
    assert 0.45 < f.mean() < 0.55
    h2, w2, f2 = crop_choices(7, np.arange(4000)[::-1], 5, 3)
    assert (h2[::-1] == h).all() and (w2[::-1] == w).all() and (f2[::-1] == f).all()
    assert not (crop_choices(8, np.arange(4000), 5, 3)[0] == h).all()  # the seed matters


def test_per_channel_mean_and_uint8_crop(tmp_path):
    x = image_db(tmp_path / "db", 6)
    with DataReader(tmp_path / "db", 6, epochs=1, crop=4, mean=[10, 20, 30]) as r:
        got = collect(r)
    want = reference(x, range(6), crop=4, mirror=False, train=True, seed=0, mean=[10, 20, 30])
    np.testing.assert_array_equal(np.stack([got[i] for i in range(6)]), want)
    with DataReader(tmp_path / "db", 6, epochs=1, crop=4, mirror=True) as r:
        assert r.dtype == np.uint8  # no mean or scale: the records' own type
        got = collect(r)
    want = reference(x, range(6), crop=4, mirror=True, train=True, seed=0)
    np.testing.assert_array_equal(np.stack([got[i] for i in range(6)]).astype(np.float32), want)


@pytest.mark.parametrize("shuffle", [None, 5])
def test_same_records_whatever_the_ranks_and_prefetch(tmp_path, shuffle):
    image_db(tmp_path / "db", 30)
    runs = []
    for ranks, prefetch in [(1, 4), (2, 0), (3, 2), (3, 7)]:
        with DataReader(
            tmp_path / "db",
            2,
            ranks,
            prefetch,
            epochs=1,
            crop=3,
            mirror=True,
            seed=11,
            shuffle=shuffle,
        ) as r:
            runs.append(collect(r))
    for other in runs[1:]:
        assert other.keys() == runs[0].keys() and len(other) == 30
        for k in other:
            np.testing.assert_array_equal(other[k], runs[0][k])


def test_evaluation_takes_the_center_and_never_mirrors(tmp_path):
    x = image_db(tmp_path / "db", 5, (2, 7, 8))
    with DataReader(tmp_path / "db", 5, epochs=1, crop=4, mirror=True, train=False) as r:
        got = collect(r)
    for i in range(5):
        np.testing.assert_array_equal(got[i], x[i, :, 1:5, 2:6])
    with DataReader(tmp_path / "db", 5, epochs=1, mirror=True, train=False) as r:
        got = collect(r)  # mirror alone in evaluation: the records as stored
    np.testing.assert_array_equal(np.stack([got[i] for i in range(5)]), x)


def test_mirror_without_crop_flips_some_records(tmp_path):
    x = image_db(tmp_path / "db", 40, (1, 2, 5))
    with DataReader(tmp_path / "db", 8, epochs=1, mirror=True, seed=2) as r:
        got = collect(r)
    flipped = [i for i in range(40) if not (got[i] == x[i]).all()]
    assert 5 < len(flipped) < 35
    for i in range(40):
        assert (got[i] == x[i]).all() or (got[i] == x[i, ..., ::-1]).all()


def test_default_stays_the_identity_fast_path():
    t = Transform((3, 4, 4), np.dtype(np.uint8))
    assert t.identity and not t.spatial and t.out_shape == (3, 4, 4)
    assert Transform((3, 4, 4), np.dtype(np.uint8), mirror=True, train=False).identity
    assert not Transform((3, 4, 4), np.dtype(np.uint8), crop=4).identity


@pytest.mark.parametrize(
    "kwargs, shape, match",
    [
        ({"crop": 8}, (3, 6, 7), r"crop=8 is larger than the records' height x width 6 x 7"),
        ({"crop": 7}, (3, 6, 7), r"crop=7 is larger"),
        ({"crop": 2}, (12,), r"crop needs records of shape \(C, H, W\); they have shape \(12,\)"),
        ({"mirror": True}, (3, 4), r"mirror needs records of shape \(C, H, W\)"),
        ({"crop": 0}, (3, 6, 7), r"crop"),
        ({"crop": 2, "mean": np.zeros((3, 2, 2))}, (3, 6, 7), r"mean must be"),
    ],
)
def test_bad_inputs(tmp_path, kwargs, shape, match):
    image_db(tmp_path / "db", 3, shape)
    with pytest.raises(ValueError, match=match):
        DataReader(tmp_path / "db", 2, **kwargs)


def test_resumed_reader_draws_the_same(tmp_path):
    image_db(tmp_path / "db", 12)
    kw = {"epochs": 1, "crop": 3, "mirror": True, "seed": 4}
    with DataReader(tmp_path / "db", 3, 2, **kw) as r:
        whole = collect(r)
    with DataReader(tmp_path / "db", 3, 2, start=6, **kw) as r:
        rest = collect(r)
    assert sorted(rest) == list(range(6, 12))
    for k in rest:
        np.testing.assert_array_equal(rest[k], whole[k])
