"""Reference models: gradients against central finite differences, init, registry."""

from __future__ import annotations

import math

import numpy as np
import pytest

import nccltree as nt
from nccltree.models import MLP, ConvNet, SoftmaxRegression, build_model


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """A virtual host device or a GPU; shut down afterwards."""
    devs = nt.devices("cpu:1" if request.param == "host" else "gpu:0")
    yield devs[0]
    devs[0].runtime.shutdown()


def to_np(a):
    """A numpy view or copy of a numpy or CuPy array."""
    return a if isinstance(a, np.ndarray) else a.get()


def _batch(shape, classes, n=5, seed=3):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)), rng.integers(0, classes, size=n)


CASES = {
    "softmax": (lambda: SoftmaxRegression(6, classes=4), (6,)),
    "mlp": (lambda: MLP(6, hidden=[5, 4], classes=3), (2, 3)),
    "cnn-max": (lambda: ConvNet((2, 7, 6), classes=3, channels=(3, 4), pool="max"), (2, 7, 6)),
    "cnn-avg": (
        lambda: ConvNet((1, 5, 5), classes=3, channels=(2,), kernel=5, pool="avg"),
        (1, 5, 5),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_finite_differences(case):
    make, in_shape = CASES[case]
    model = make()
    p = model.make_params(dtype=np.float64)
    model.init(p, seed=11)
    rng = np.random.default_rng(5)
    # Non-zero biases so every ReLU sees both signs and the checks cover bias gradients.
    for name in p.names:
        if name.endswith(".bias"):
            p.views[name][...] = 0.1 * rng.standard_normal(p.shapes[name])
    x, y = _batch(in_shape, model.classes)
    loss = model.loss_and_grad(p, x, y)
    assert math.isfinite(loss) and loss > 0
    analytic = p.grad.copy()

    eps = 1e-6
    numeric = np.zeros_like(analytic)
    for name in p.names:
        off, size = p.offsets[name], p.views[name].size
        for i in range(off, off + size):
            saved = p.data[i]
            p.data[i] = saved + eps
            plus = model.loss_and_grad(p, x, y)
            p.data[i] = saved - eps
            minus = model.loss_and_grad(p, x, y)
            p.data[i] = saved
            numeric[i] = (plus - minus) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)
    assert np.abs(analytic).max() > 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_written_into_grad_views(case):
    make, in_shape = CASES[case]
    model = make()
    p = model.make_params(dtype=np.float32)
    model.init(p, seed=0)
    grad_buffer = p.grad
    for view in p.grad_views.values():
        view[...] = np.nan
    x, y = _batch(in_shape, model.classes)
    model.loss_and_grad(p, x, y)
    assert p.grad is grad_buffer
    for name, view in p.grad_views.items():
        assert np.shares_memory(view, p.grad)
        assert np.all(np.isfinite(view)), name
    # A second call overwrites (it does not accumulate).
    first = p.grad.copy()
    model.loss_and_grad(p, x, y)
    np.testing.assert_array_equal(p.grad, first)


def test_loss_is_mean_cross_entropy_and_stable():
    model = SoftmaxRegression(3, classes=3)
    p = model.make_params(dtype=np.float64)
    x = np.eye(3)
    y = np.array([0, 1, 2])
    # Zero weights: uniform softmax, loss log(3).
    assert model.loss_and_grad(p, x, y) == pytest.approx(math.log(3), rel=1e-12)
    # Huge logits must not overflow: the correct class wins by 1e4, the loss is ~0.
    p.views["fc0.weight"][...] = 1e4 * np.eye(3)
    loss = model.loss_and_grad(p, x, y)
    assert math.isfinite(loss) and loss < 1e-12
    assert np.all(np.isfinite(p.grad))
    # Wrong by a margin of 1e4: the loss is the margin (averaged over the batch).
    loss = model.loss_and_grad(p, x, np.array([1, 2, 0]))
    assert loss == pytest.approx(1e4, rel=1e-9)


@pytest.mark.parametrize("name", ["softmax", "mlp", "cnn"])
def test_init_is_seeded(name):
    model = build_model(name, (1, 8, 8), 10)
    a, b, c = (model.make_params() for _ in range(3))
    model.init(a, seed=42)
    model.init(b, seed=42)
    model.init(c, seed=43)
    assert a.data.tobytes() == b.data.tobytes()
    assert a.data.tobytes() != c.data.tobytes()
    for pname, v in a.views.items():
        if pname.endswith(".bias"):
            assert not v.any()
        else:
            assert v.std() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_device_matches_numpy(device, case):
    """Same init bitwise on every device; same loss, gradients and predictions."""
    make, in_shape = CASES[case]
    model = make()
    ref, on_dev = model.make_params(np.float64), model.make_params(np.float64, device)
    model.init(ref, seed=7)
    model.init(on_dev, seed=7)
    assert to_np(on_dev.data).tobytes() == ref.data.tobytes()
    x, y = _batch(in_shape, model.classes)
    loss = model.loss_and_grad(on_dev, x, y)
    assert loss == pytest.approx(model.loss_and_grad(ref, x, y), rel=1e-12)
    np.testing.assert_allclose(to_np(on_dev.grad), ref.grad, rtol=1e-10, atol=1e-13)
    np.testing.assert_array_equal(to_np(model.predict(on_dev, x)), model.predict(ref, x))


def test_he_and_xavier_scales():
    model = MLP(400, hidden=[300], classes=10)
    p = model.make_params(dtype=np.float64)
    model.init(p, seed=0)
    # He normal for the ReLU layer: std sqrt(2 / fan_in); Xavier uniform for the last.
    assert p.views["fc0.weight"].std() == pytest.approx(math.sqrt(2 / 400), rel=0.02)
    assert np.abs(p.views["fc1.weight"]).max() <= math.sqrt(6 / 310)
    assert p.views["fc1.weight"].std() == pytest.approx(math.sqrt(6 / 310) / math.sqrt(3), rel=0.05)


@pytest.mark.parametrize("name", ["softmax", "mlp", "cnn"])
@pytest.mark.slow
def test_predict_and_training_reduces_loss(name):
    # A learnable task: the class is which quadrant of the image is brightest.
    rng = np.random.default_rng(0)
    n = 64
    x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32) * 0.3
    y = rng.integers(0, 4, size=n)
    for i, label in enumerate(y):
        r, c = divmod(int(label), 2)
        x[i, 0, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.0
    model = build_model(name, (1, 8, 8), 4, **({"hidden": [32]} if name == "mlp" else {}))
    p = model.make_params()
    model.init(p, seed=0)
    sgd = nt.SGD(p, lr=0.1, momentum=0.9)
    first = model.loss_and_grad(p, x, y)
    sgd.step()
    for _ in range(30):
        loss = sgd.iteration(lambda: model.loss_and_grad(p, x, y))
    assert loss < 0.5 * first
    pred = model.predict(p, x)
    assert pred.shape == (n,) and pred.dtype.kind in "iu"
    assert (pred == y).mean() > 0.9


def test_inputs_are_flattened_or_reshaped():
    model = build_model("cnn", (2, 4, 4), 3, channels=[2])
    p = model.make_params()
    model.init(p, seed=1)
    x = np.random.default_rng(0).standard_normal((3, 2, 4, 4))
    np.testing.assert_array_equal(model.forward(p, x), model.forward(p, x.reshape(3, -1)))
    mlp = build_model("mlp", (2, 4, 4), 3, hidden=[5])
    q = mlp.make_params()
    mlp.init(q, seed=1)
    np.testing.assert_array_equal(mlp.forward(q, x), mlp.forward(q, x.reshape(3, -1)))
    assert mlp.forward(q, x).shape == (3, 3)


def test_registry_and_shapes():
    m = build_model("mlp", (1, 28, 28), 10, hidden=[64, 32])
    assert isinstance(m, MLP) and m.sizes == (784, 64, 32, 10)
    assert list(m.shapes()) == [
        "fc0.weight",
        "fc0.bias",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    assert m.shapes()["fc1.weight"] == (32, 64)
    s = build_model("softmax", 20, 5)
    assert isinstance(s, SoftmaxRegression) and s.shapes() == {
        "fc0.weight": (5, 20),
        "fc0.bias": (5,),
    }
    c = build_model("cnn", (3, 9, 9), 10, channels=[4, 6])
    assert c.shapes() == {
        "conv0.weight": (4, 3, 3, 3),
        "conv0.bias": (4,),
        "conv1.weight": (6, 4, 3, 3),
        "conv1.bias": (6,),
        "fc.weight": (10, 6 * 2 * 2),
        "fc.bias": (10,),
    }


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: build_model("resnet", (4,), 2), ValueError, "softmax, mlp, cnn"),
        (lambda: build_model("cnn", (16,), 2), ValueError, "\\(C, H, W\\)"),
        (lambda: build_model("cnn", (1, 3, 3), 2, channels=[2, 2]), ValueError, "too small"),
        (lambda: build_model("cnn", (1, 8, 8), 2, pool="median"), ValueError, "'max' or 'avg'"),
        (lambda: build_model("cnn", (1, 8, 8), 2, kernel=4), ValueError, "odd"),
        (lambda: build_model("mlp", (4,), 1), ValueError, "classes must be >= 2"),
        (lambda: build_model("mlp", (4,), 3, hidden=[0]), ValueError, "hidden"),
        (lambda: MLP(0), ValueError, "in_features must be >= 1, got 0"),
        (lambda: MLP(True), TypeError, "in_features must be an integer"),
        (lambda: MLP(4.0), TypeError, "in_features must be an integer"),
        (lambda: MLP(4, hidden=[8, 2.5]), TypeError, r"hidden\[1\] must be an integer"),
        (lambda: MLP(4, classes=np.bool_(True)), TypeError, "classes must be an integer"),
        (lambda: build_model("cnn", (1, 8, 8), 2, kernel=3.0), TypeError, "kernel"),
        (lambda: build_model("cnn", (1, 8, 8), 2, channels=[]), ValueError, "at least one"),
        (lambda: build_model("mlp", (4, -1), 2), ValueError, r"input_shape\[1\] must be >= 1"),
    ],
)
def test_argument_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_numpy_integer_sizes():
    m = MLP(np.int64(4), hidden=np.array([8, 3]), classes=np.int32(2))
    assert m.sizes == (4, 8, 3, 2) and all(type(d) is int for d in m.sizes)
    assert build_model("mlp", np.int64(4), np.int64(2), hidden=np.int64(8)).sizes == (4, 8, 2)
    cnn = build_model("cnn", (np.int64(1), 8, 8), 3, channels=np.int64(4), kernel=np.int64(3))
    assert cnn.input_shape == (1, 8, 8) and cnn.channels == (4,) and cnn.kernel == 3
    assert cnn.shapes() == build_model("cnn", (1, 8, 8), 3, channels=4, kernel=3).shapes()


def test_batch_errors():
    model = MLP(4, hidden=[3], classes=2)
    p = model.make_params()
    with pytest.raises(ValueError, match="takes 4 input features"):
        model.loss_and_grad(p, np.zeros((2, 5)), np.array([0, 1]))
    with pytest.raises(ValueError, match="integer labels of shape \\(2,\\)"):
        model.loss_and_grad(p, np.zeros((2, 4)), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="integer labels"):
        model.loss_and_grad(p, np.zeros((2, 4)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="non-empty batch"):
        model.loss_and_grad(p, np.zeros((0, 4)), np.zeros(0, dtype=int))
