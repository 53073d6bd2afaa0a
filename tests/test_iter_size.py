"""Caffe's iter_size (gradient accumulation) and clip_gradients in the driver and the solver.

iter_size k with batch b must train as batch k*b (within floating-point summation order),
on one rank and over several, with the data position where the larger batch leaves it;
clip_gradients must be Caffe's rule, on the sum of the iter_size passes' gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

import nccltree as nt
from nccltree.data import DataReader, write_lmdb
from nccltree.models import build_model
from nccltree.parallel import DataParallel
from nccltree.solver import SGD

ITERS = 5
SGD_ARGS = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}
# float32 parameters after a few steps: summation order changes the last bits only
RTOL, ATOL = 2e-5, 2e-6


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    x, y = nt.data.synthetic(256, shape=(16,), classes=4, seed=3)
    path = str(tmp_path_factory.mktemp("iter_size") / "db")
    write_lmdb(path, x, y)
    return path


def _train(
    db: str, devices: str, batch: int, iter_size: int, **sgd: float
) -> tuple[dict, list, int]:
    model = build_model("mlp", (16,), 4, hidden=(12,))
    with DataParallel(model, devices, iter_size=iter_size, **{**SGD_ARGS, **sgd}) as dp:
        with DataReader(db, batch, len(dp.devices)) as reader:
            result = dp.fit(reader, ITERS)
        return dp.state_dict(), result.losses, int(dp.position or 0)


@pytest.mark.parametrize(("devices", "batch", "k"), [("cpu:1", 4, 4), ("cpu:2", 4, 2)])
def test_iter_size_k_with_batch_b_is_batch_k_times_b(db, devices, batch, k):
    ref, ref_losses, ref_pos = _train(db, "cpu:1", batch * k * (2 if devices == "cpu:2" else 1), 1)
    got, losses, pos = _train(db, devices, batch, k)
    assert pos == ref_pos == ITERS * batch * k * (2 if devices == "cpu:2" else 1)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # and it is not the same as not accumulating: the test can fail
    plain, _, _ = _train(db, devices, batch, 1)
    assert any(not np.allclose(plain[n], ref[n], rtol=RTOL, atol=ATOL) for n in ref)


def test_iter_size_with_gradient_buckets_is_bitwise_the_same(db):
    model = build_model("mlp", (16,), 4, hidden=(12,))
    states = []
    for bucket in (0, 256):
        with DataParallel(model, "cpu:2", iter_size=2, bucket_bytes=bucket, **SGD_ARGS) as dp:
            with DataReader(db, 4, 2) as reader:
                dp.fit(reader, ITERS)
            states.append(dp.state_dict())
    for name in states[0]:
        assert np.array_equal(states[0][name], states[1][name]), name


def _params(values: np.ndarray) -> nt.FlatParams:
    p = nt.FlatParams({"w": values.shape}, dtype=np.float32)
    p.views["w"][...] = values
    return p


@pytest.mark.parametrize(("clip", "scaled"), [(5.0, True), (50.0, False)])
def test_clip_gradients_is_caffes_rule(clip, scaled):
    w = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    g = np.array([6.0, -8.0, 0.0, 0.0], np.float32)  # L2 norm 10
    p = _params(w)
    p.grad[...] = g
    SGD(p, lr=0.5, clip_gradients=clip).step()
    applied = g * (clip / 10.0) if scaled else g
    np.testing.assert_allclose(p.data, w - 0.5 * applied, rtol=1e-6)


def test_clip_gradients_with_iter_size_clips_the_sum_of_the_passes(db):
    # Caffe compares the norm of the iter_size passes' summed gradient with the threshold:
    # iter_size 2 with clip c trains as the doubled batch with clip c / 2 (its mean
    # gradient is half the sum)
    clip = 0.05
    ref, _, _ = _train(db, "cpu:1", 8, 1, clip_gradients=clip / 2)
    got, _, _ = _train(db, "cpu:1", 4, 2, clip_gradients=clip)
    unclipped, _, _ = _train(db, "cpu:1", 8, 1)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)
    assert any(not np.allclose(unclipped[n], ref[n], rtol=RTOL, atol=ATOL) for n in ref)


def test_iter_size_and_clip_are_checked():
    model = build_model("mlp", (16,), 4, hidden=(12,))
    with pytest.raises(ValueError, match="iter_size must be >= 1"):
        DataParallel(model, "cpu:1", iter_size=0, lr=0.1)
    p = _params(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="clip_gradients must be >= 0"):
        SGD(p, lr=0.1, clip_gradients=-1.0)
