"""SGD: the update rule and every LR policy against an independent reference, state,
callbacks and argument checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import to_np

import nccltree as nt
from nccltree.solver import Callback, SolverCallback

SHAPES = {"w": (4, 3), "b": (3,)}
STEPS = 20


# -- an independent reference: plain Python floats, one element at a time ----------------


def ref_rate(it: int, base: float, policy: str, cfg: dict) -> float:
    """Caffe's SGDSolver::GetLearningRate, transcribed."""
    if policy == "fixed":
        return base
    if policy == "step":
        return base * math.pow(cfg["gamma"], math.floor(it / cfg["stepsize"]))
    if policy == "exp":
        return base * math.pow(cfg["gamma"], it)
    if policy == "inv":
        return base * math.pow(1 + cfg["gamma"] * it, -cfg["power"])
    if policy == "multistep":
        current = 0
        for v in cfg["stepvalue"]:
            if it >= v:
                current += 1
        return base * math.pow(cfg["gamma"], current)
    if policy == "poly":
        return base * math.pow(1.0 - it / cfg["max_iter"], cfg["power"])
    if policy == "sigmoid":
        return base * (1.0 / (1.0 + math.exp(-cfg["gamma"] * (it - cfg["stepsize"]))))
    raise AssertionError(policy)


def ref_sgd(w, grads, base, momentum, wd, policy, cfg):
    """Caffe's Regularize (L2) + ComputeUpdateValue + Net::Update over lists of floats."""
    w = list(w)
    v = [0.0] * len(w)
    for it, g in enumerate(grads):
        rate = ref_rate(it, base, policy, cfg)
        for i in range(len(w)):
            gi = g[i] + wd * w[i]
            v[i] = momentum * v[i] + rate * gi
            w[i] = w[i] - v[i]
    return w, v


POLICIES = {
    "fixed": {},
    "step": {"gamma": 0.5, "stepsize": 6},
    "exp": {"gamma": 0.97},
    "inv": {"gamma": 0.1, "power": 0.75},
    "multistep": {"gamma": 0.3, "stepvalue": [3, 8, 15]},
    "poly": {"power": 2.0, "max_iter": STEPS},
    "sigmoid": {"gamma": -0.4, "stepsize": 10},
}


def _random_params(device, dtype=np.float64, seed=0):
    p = nt.FlatParams(SHAPES, dtype=dtype, device=device)
    rng = np.random.default_rng(seed)
    p.load({n: rng.standard_normal(s) for n, s in p.shapes.items()})
    return p


def _grad_sequence(p, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [{n: rng.standard_normal(s) for n, s in p.shapes.items()} for _ in range(steps)]


def _set_grads(p, grads):
    for n, g in grads.items():
        p.grad_views[n][...] = p.xp.asarray(g, dtype=p.dtype)


def _flat_params(p, state):
    return [float(x) for n in p.names for x in np.asarray(state[n]).reshape(-1)]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_sgd_matches_reference(any_device, policy):
    cfg = POLICIES[policy]
    p = _random_params(any_device)
    grads = _grad_sequence(p, STEPS)
    w0 = _flat_params(p, p.state_dict())
    sgd = nt.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, lr_policy=policy, **cfg)
    for it, g in enumerate(grads):
        assert sgd.iter == it
        assert sgd.learning_rate() == pytest.approx(ref_rate(it, 0.05, policy, cfg), rel=1e-13)
        _set_grads(p, g)
        sgd.step()
    assert sgd.iter == STEPS
    flat_grads = [[float(x) for n in p.names for x in g[n].reshape(-1)] for g in grads]
    w_ref, v_ref = ref_sgd(w0, flat_grads, 0.05, 0.9, 0.01, policy, cfg)
    np.testing.assert_allclose(_flat_params(p, p.state_dict()), w_ref, rtol=1e-12, atol=1e-14)
    # The momentum history lives in the flat layout: compare it parameter by parameter.
    hist = sgd.state_dict()["history"]
    v_got = [float(x) for n in p.names for x in hist[p.offsets[n] : p.offsets[n] + p.views[n].size]]
    np.testing.assert_allclose(v_got, v_ref, rtol=1e-12, atol=1e-14)


def test_float32_update_close_to_reference():
    p = _random_params(None, dtype=np.float32)
    grads = _grad_sequence(p, 5)
    w0 = _flat_params(p, p.state_dict())
    sgd = nt.SGD(p, lr=0.1, momentum=0.5, weight_decay=0.001)
    for g in grads:
        _set_grads(p, g)
        sgd.step()
    flat_grads = [[float(np.float32(x)) for n in p.names for x in g[n].reshape(-1)] for g in grads]
    w_ref, _ = ref_sgd(w0, flat_grads, 0.1, 0.5, 0.001, "fixed", {})
    np.testing.assert_allclose(_flat_params(p, p.state_dict()), w_ref, rtol=1e-5, atol=1e-6)


def test_padding_stays_zero():
    p = nt.FlatParams({"a": (3,), "b": (3,)}, dtype=np.float64)
    assert p.size > p.count
    p.data[...] = 0.0
    p.views["a"][...] = 1.0
    p.views["b"][...] = 1.0
    sgd = nt.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        p.zero_grad()
        p.grad_views["a"][...] = 1.0
        p.grad_views["b"][...] = 1.0
        sgd.step()
    assert p.data.sum() == pytest.approx(p.views["a"].sum() + p.views["b"].sum())
    assert p.views["a"][0] < 1.0


@pytest.mark.parametrize(
    ("policy", "cfg", "expected"),
    [
        ("step", {"gamma": 0.1, "stepsize": 3}, [1, 1, 1, 0.1, 0.1, 0.1, 0.01]),
        ("multistep", {"gamma": 0.5, "stepvalue": [1, 4]}, [1, 0.5, 0.5, 0.5, 0.25, 0.25]),
        ("exp", {"gamma": 0.5}, [1, 0.5, 0.25, 0.125]),
        ("inv", {"gamma": 1.0, "power": 1.0}, [1, 0.5, 1 / 3, 0.25]),
        ("poly", {"power": 1.0, "max_iter": 4}, [1, 0.75, 0.5, 0.25, 0.0, 0.0]),
        ("sigmoid", {"gamma": 1.0, "stepsize": 2}, [1 / (1 + math.e**2), 1 / (1 + math.e), 0.5]),
    ],
)
def test_learning_rate_values(policy, cfg, expected):
    sgd = nt.SGD(nt.FlatParams({"a": (1,)}), lr=1.0, lr_policy=policy, **cfg)
    got = []
    for _ in expected:
        got.append(sgd.learning_rate())
        sgd.iter += 1
    np.testing.assert_allclose(got, expected, rtol=1e-15)


def test_state_round_trip_bitwise(any_device):
    def run(p, sgd, grads):
        for g in grads:
            _set_grads(p, g)
            sgd.step()

    cfg = dict(lr=0.05, momentum=0.9, weight_decay=0.01, lr_policy="inv", gamma=0.1, power=0.5)
    p = _random_params(any_device, dtype=np.float32)
    grads = _grad_sequence(p, 20)
    sgd = nt.SGD(p, **cfg)
    run(p, sgd, grads[:10])
    params_state, solver_state = p.state_dict(), sgd.state_dict()
    run(p, sgd, grads[10:])

    q = nt.FlatParams(SHAPES, dtype=np.float32, device=any_device)
    q.load(params_state)
    resumed = nt.SGD(q, **cfg)
    resumed.load_state_dict(solver_state)
    assert resumed.iter == 10
    run(q, resumed, grads[10:])
    assert to_np(q.data).tobytes() == to_np(p.data).tobytes()
    assert resumed.state_dict()["history"].tobytes() == sgd.state_dict()["history"].tobytes()


def test_load_state_dict_checks():
    p = nt.FlatParams(SHAPES)
    sgd = nt.SGD(p, lr=0.1, momentum=0.9)
    good = sgd.state_dict()
    with pytest.raises(ValueError, match="'iter' and 'history'"):
        sgd.load_state_dict({"iter": 3})
    with pytest.raises(ValueError, match="shape"):
        sgd.load_state_dict({"iter": 3, "history": np.zeros(p.size + 1, np.float32)})
    with pytest.raises(ValueError, match="float32"):
        sgd.load_state_dict({"iter": 3, "history": np.zeros(p.size, np.float64)})
    with pytest.raises(ValueError, match=">= 0"):
        sgd.load_state_dict({"iter": -1, "history": good["history"]})
    assert sgd.iter == 0


class Recorder(Callback):
    def __init__(self, tag, log, p, sgd_ref):
        self.tag, self.log, self.p, self.sgd_ref = tag, log, p, sgd_ref

    def on_start(self):
        self.log.append((self.tag, "start", self.sgd_ref[0].iter))

    def on_gradients_ready(self):
        # Called before the update: the parameters still hold their old values.
        self.log.append((self.tag, "ready", self.sgd_ref[0].iter, float(self.p.data[0])))


def test_callbacks_order():
    p = nt.FlatParams({"a": (2,)}, dtype=np.float64)
    p.data[...] = 1.0
    log: list = []
    sgd_ref: list = []
    first = Recorder("A", log, p, sgd_ref)
    sgd = nt.SGD(p, lr=0.5, callbacks=[first])
    sgd_ref.append(sgd)
    sgd.add_callback(Recorder("B", log, p, sgd_ref))
    assert isinstance(first, SolverCallback) and len(sgd.callbacks) == 2

    def compute():
        log.append(("grads", sgd.iter))
        p.grad[...] = 1.0
        return 7.5

    assert sgd.iteration(compute) == 7.5
    assert sgd.iteration(compute) == 7.5
    assert log == [
        ("A", "start", 0),
        ("B", "start", 0),
        ("grads", 0),
        ("A", "ready", 0, 1.0),
        ("B", "ready", 0, 1.0),
        ("A", "start", 1),
        ("B", "start", 1),
        ("grads", 1),
        ("A", "ready", 1, 0.5),
        ("B", "ready", 1, 0.5),
    ]
    assert sgd.iter == 2 and p.data[0] == 0.0


def test_callback_must_have_both_methods():
    sgd = nt.SGD(nt.FlatParams({"a": (1,)}), lr=0.1)

    class OnlyStart:
        def on_start(self):
            pass

    with pytest.raises(TypeError, match="on_gradients_ready"):
        sgd.add_callback(OnlyStart())


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"lr": -0.1}, ValueError, "lr must be >= 0"),
        ({"lr": float("nan")}, ValueError, "lr must be a number, got NaN"),
        ({"lr": float("inf")}, ValueError, "lr must be finite"),
        ({"lr": True}, TypeError, "lr must be a real number"),
        ({"lr": 0.1, "momentum": float("nan")}, ValueError, "momentum must be a number"),
        ({"lr": 0.1, "weight_decay": float("-inf")}, ValueError, "weight_decay must be finite"),
        ({"lr": 0.1, "gamma": float("nan")}, ValueError, "gamma must be a number"),
        ({"lr": 0.1, "lr_policy": "step", "gamma": 0.1, "stepsize": True}, TypeError, "stepsize"),
        ({"lr": 0.1, "lr_policy": "step", "gamma": 0.1, "stepsize": 2.0}, TypeError, "stepsize"),
        (
            {"lr": 0.1, "lr_policy": "multistep", "gamma": 0.1, "stepvalue": [1, 2.5]},
            TypeError,
            r"stepvalue\[1\] must be an integer",
        ),
        ({"lr": "0.1"}, TypeError, "real number"),
        ({"lr": 0.1, "momentum": 1.0}, ValueError, "momentum"),
        ({"lr": 0.1, "weight_decay": -1e-4}, ValueError, "weight_decay"),
        ({"lr": 0.1, "lr_policy": "cosine"}, ValueError, "fixed, step, exp, inv, multistep"),
        ({"lr": 0.1, "lr_policy": "step"}, ValueError, "needs gamma and stepsize"),
        ({"lr": 0.1, "lr_policy": "step", "gamma": 0.1}, ValueError, "needs stepsize"),
        ({"lr": 0.1, "lr_policy": "exp"}, ValueError, "needs gamma"),
        ({"lr": 0.1, "lr_policy": "inv", "gamma": 0.1}, ValueError, "needs power"),
        ({"lr": 0.1, "lr_policy": "multistep", "gamma": 0.1}, ValueError, "needs stepvalue"),
        ({"lr": 0.1, "lr_policy": "poly", "power": 1.0}, ValueError, "needs max_iter"),
        ({"lr": 0.1, "lr_policy": "sigmoid", "gamma": -0.1}, ValueError, "needs stepsize"),
        (
            {"lr": 0.1, "lr_policy": "multistep", "gamma": 0.1, "stepvalue": [5, 5]},
            ValueError,
            "increasing",
        ),
        (
            {"lr": 0.1, "lr_policy": "multistep", "gamma": 0.1, "stepvalue": []},
            ValueError,
            "non-empty",
        ),
        ({"lr": 0.1, "lr_policy": "step", "gamma": 0.1, "stepsize": 0}, ValueError, "stepsize"),
        (
            {"lr": 0.1, "lr_policy": "exp", "gamma": -0.5},
            ValueError,
            "gamma for lr_policy 'exp' must be >= 0",
        ),
        ({"lr": 0.1, "lr_policy": "poly", "power": -1, "max_iter": 5}, ValueError, "power"),
        ({"lr": 0.1, "callbacks": [object()]}, TypeError, "on_start"),
    ],
)
def test_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nt.SGD(nt.FlatParams({"a": (1,)}), **kwargs)


def test_numpy_numbers_accepted():
    # the one argument rule: numpy integers and reals are numbers, stored as Python ones
    sgd = nt.SGD(
        nt.FlatParams({"a": (1,)}),
        lr=np.float32(0.5),
        momentum=np.float64(0.9),
        weight_decay=np.int64(0),
        lr_policy="multistep",
        gamma=np.float64(0.1),
        stepvalue=np.array([2, 4]),
    )
    assert sgd.base_lr == 0.5 and type(sgd.base_lr) is float
    assert sgd.stepvalue == (2, 4) and all(type(v) is int for v in sgd.stepvalue)
    step = nt.SGD(
        nt.FlatParams({"a": (1,)}), lr=1, lr_policy="step", gamma=0.5, stepsize=np.int64(3)
    )
    step.iter = 3
    assert step.stepsize == 3 and step.learning_rate() == 0.5


def test_params_must_be_flat_params():
    with pytest.raises(TypeError, match="FlatParams"):
        nt.SGD(np.zeros(3), lr=0.1)


def test_unused_policy_parameters_are_ignored():
    sgd = nt.SGD(nt.FlatParams({"a": (1,)}), lr=0.1, gamma=0.5, stepsize=3, power=2.0)
    sgd.iter = 10
    assert sgd.learning_rate() == 0.1


def test_iteration_without_update_only_counts():
    p = nt.FlatParams({"a": (3,)}, dtype=np.float32)
    p.data[...] = 1.0
    sgd = nt.SGD(p, lr=0.5, momentum=0.9)
    log: list = []
    sgd.add_callback(Recorder("A", log, p, [sgd]))

    def compute():
        p.grad[...] = 2.0
        return 1.0

    assert sgd.iteration(compute, update=False) == 1.0
    assert sgd.iter == 1 and np.all(p.data == 1.0) and not np.any(sgd.history)
    assert [entry[1] for entry in log] == ["start", "ready"]  # the hooks still run
    sgd.iteration(compute)
    assert sgd.iter == 2 and np.all(p.data == 0.0)


def test_remove_callback():
    sgd = nt.SGD(nt.FlatParams({"a": (1,)}), lr=0.1)
    a, b = Callback(), Callback()
    sgd.add_callback(a)
    sgd.add_callback(b)
    sgd.remove_callback(a)
    assert sgd.callbacks == (b,)
    with pytest.raises(ValueError, match="is not a callback of this solver"):
        sgd.remove_callback(a)


def test_the_solver_times_its_callbacks():
    import time

    p = nt.FlatParams({"a": (1,)})
    sgd = nt.SGD(p, lr=0.1)
    sgd.iteration(lambda: 0.0)
    assert sgd.callback_s == 0.0  # no callbacks, nothing measured

    class Slow(Callback):
        def on_start(self):
            time.sleep(0.02)

        def on_gradients_ready(self):
            time.sleep(0.03)
            raise RuntimeError("hook failed")

    sgd.add_callback(Slow())
    with pytest.raises(RuntimeError, match="hook failed"):
        sgd.iteration(lambda: 0.0)
    assert sgd.callback_s >= 0.05  # both hooks, the failing one included
    assert sgd.iter == 1  # no update after a failed hook


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_loss_or_gradient_stops_before_the_update(where):
    from nccltree.solver import Diverged

    p = nt.FlatParams({"w": (4,)}, np.float32)
    p.data[:] = 1.0
    sgd = nt.SGD(p, lr=0.1, momentum=0.9)
    seen = []

    class Hook(Callback):
        def on_gradients_ready(self) -> None:
            seen.append("ready")

    sgd.add_callback(Hook())

    def grads() -> float:
        p.grad[:] = [1.0, np.inf if where == "gradient" else 1.0, 1.0, 1.0]
        return math.nan if where == "loss" else 0.5

    with pytest.raises(Diverged, match=f"training diverged at iteration 1: the {where}"):
        sgd.iteration(grads)
    assert np.array_equal(p.data, np.ones(4, np.float32)) and sgd.iter == 0
    assert not to_np(sgd.history).any()
    assert seen == ([] if where == "loss" else ["ready"])  # a NaN loss is never communicated
    off = nt.SGD(p, lr=0.1, check_finite=False)
    off.iteration(grads)
    assert off.iter == 1
