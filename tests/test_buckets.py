"""Gradient buckets communicated during the backward pass.

The models announce each gradient as backward writes it; DataParallel(bucket_bytes=...)
starts each bucket's collective as soon as it is complete and waits for all of them before
the update. With the tree (and direct) algorithm the trained parameters are bitwise those
of the unbucketed run for every bucket size, at 3 and 4 ranks (at 2 ranks a + b = b + a,
so equality there would prove nothing); with ring they agree within rounding. Under the
host backend's jitter mode the results stay bitwise, and a deliberately missing wait is
caught; a rank failing during backward or during a bucket's collective ends the run with
RankFailure naming it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import nccltree as nt
from nccltree import parallel
from nccltree.backends import host
from nccltree.models import MLP, build_model
from nccltree.parallel import (
    AllReduceSync,
    BucketSync,
    DataParallel,
    RankFailure,
    make_buckets,
)
from nccltree.params import FlatParams
from nccltree.solver import SGD, Callback

FEATURES, CLASSES, HIDDEN = 16, 4, (24, 12)
ITERS = 16
SOLVER = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
# bucket sizes in bytes: every parameter alone (4), a few parameters, most of the buffer,
# and more than the whole buffer (one bucket, started as soon as backward ends)
BUCKETS = (4, 256, 1200, 1 << 20)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    x, y = nt.data.synthetic(1024, shape=(FEATURES,), classes=CLASSES, seed=3)
    path = str(tmp_path_factory.mktemp("buckets") / "train")
    nt.data.write_lmdb(path, x, y)
    return path


def model() -> MLP:
    return MLP(FEATURES, HIDDEN, CLASSES)


def train(host_devs, db, ranks, iters=ITERS, streams=False, **kw):
    """Train on ``ranks`` host devices, batch 8 each; returns (root's data, driver).
    ``streams``: every collective on the communication streams (none in the calling
    thread), where the jitter mode delays each operation."""
    dp = DataParallel(model(), host_devs(ranks), **SOLVER, timeout=20, **kw)
    if streams:
        dp.world().inline_bytes = 0
    with dp, nt.DataReader(db, 8, ranks) as reader:
        dp.fit(reader, iters)
    for p in dp.params[1:]:
        assert np.array_equal(p.data, dp.params[0].data)
    return dp.params[0].data.copy(), dp


# -- buckets -------------------------------------------------------------------------------


def test_buckets_cover_the_gradient_in_backward_order():
    p = model().make_params()
    assert make_buckets(p, 0) == [parallel.Bucket(0, p.size, p.names[::-1])]
    for size in (1, 100, 1200, 5000, 1 << 20):
        buckets = make_buckets(p, size)
        # contiguous, from the end of the flat buffer to its start, every parameter once
        assert buckets[0].stop == p.size and buckets[-1].start == 0
        for a, b in zip(buckets, buckets[1:]):
            assert a.start == b.stop
        names = [n for b in buckets for n in b.names]
        assert sorted(names) == sorted(p.names) and len(names) == len(p.names)
        for b in buckets:
            for n in b.names:
                assert b.start <= p.offsets[n] < b.stop
        # every bucket but the last (the first layer's) holds at least `size` bytes, and
        # would hold less without its last parameter
        for b in buckets[:-1]:
            assert (b.stop - b.start) * 4 >= size
            assert (b.stop - p.offsets[b.names[-2]]) * 4 < size if len(b.names) > 1 else True
    assert len(make_buckets(p, 1)) == len(p.names)
    assert len(make_buckets(p, 1 << 20)) == 1
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        make_buckets(p, -1)


@pytest.mark.parametrize(
    "net",
    [
        build_model("mlp", (12,), 3, hidden=(8, 6)),
        build_model("softmax", (12,), 3),
        build_model("cnn", (1, 8, 8), 3, channels=(2, 3)),
    ],
    ids=["mlp", "softmax", "cnn"],
)
def test_backward_announces_each_gradient_once_it_is_final(net):
    p = net.make_params(dtype=np.float64)
    net.init(p, seed=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64 if net.name == "cnn" else 12))
    y = rng.integers(0, 3, 5)
    seen: list[tuple[str, np.ndarray]] = []
    loss = net.loss_and_grad(p, x, y, ready=lambda n: seen.append((n, p.grad_views[n].copy())))
    assert [n for n, _ in seen] == list(net.gradient_order())
    assert sorted(net.gradient_order()) == sorted(p.names)
    for name, at_announcement in seen:  # backward never wrote it again
        assert np.array_equal(at_announcement, p.grad_views[name]), name
    # the same loss and gradients as without listening
    q = net.make_params(dtype=np.float64)
    net.init(q, seed=1)
    assert net.loss_and_grad(q, x, y) == loss
    assert np.array_equal(q.grad, p.grad)


def test_the_solver_passes_gradients_to_the_callbacks_that_take_them():
    p = FlatParams({"w": (3,), "b": (2,)})
    sgd = SGD(p, lr=0.1)
    assert not sgd.takes_gradients

    class Takes(Callback):
        def __init__(self) -> None:
            self.names: list[str] = []

        def on_gradient_ready(self, name: str) -> None:
            self.names.append(name)

    plain, takes = Callback(), Takes()
    sgd.add_callback(plain)
    assert not sgd.takes_gradients
    sgd.add_callback(takes)
    assert sgd.takes_gradients

    def grads() -> float:
        p.grad[...] = 1.0
        sgd.gradient_ready("b")
        sgd.gradient_ready("w")
        return 0.5

    assert sgd.iteration(grads) == 0.5
    assert takes.names == ["b", "w"]
    assert sgd.callback_s >= sgd.gradients_ready_s >= 0.0
    sgd.remove_callback(takes)
    assert not sgd.takes_gradients
    sgd.gradient_ready("w")  # nobody takes it: nothing happens
    assert takes.names == ["b", "w"]


# -- results -------------------------------------------------------------------------------


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.parametrize(("algorithm", "ranks"), [("tree", 3), ("tree", 4), ("direct", 3)])
@pytest.mark.slow
def test_bucketed_is_bitwise_the_unbucketed_run(host_devs, db, algorithm, ranks, update_mode):
    ref, _ = train(host_devs, db, ranks, algorithm=algorithm, update_mode=update_mode)
    for size in BUCKETS:
        got, dp = train(
            host_devs, db, ranks, algorithm=algorithm, update_mode=update_mode, bucket_bytes=size
        )
        assert len(dp.buckets) == len(make_buckets(dp.params[0], size))
        assert np.array_equal(got, ref), (size, float(np.abs(got - ref).max()))


@pytest.mark.slow
def test_ring_buckets_agree_within_rounding(host_devs, db):
    ref, _ = train(host_devs, db, 3, algorithm="ring")
    for size in BUCKETS:
        got, _ = train(host_devs, db, 3, algorithm="ring", bucket_bytes=size)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_zero_is_the_unbucketed_sync(host_devs, db):
    seen = []

    class Spy(Callback):
        def on_start(self) -> None:
            seen.extend(type(cb) for cb in dp.solvers[0].callbacks)

    for size, kind in ((0, AllReduceSync), (64, BucketSync)):
        dp = DataParallel(model(), host_devs(2), **SOLVER, bucket_bytes=size)
        dp.solvers[0].add_callback(Spy())
        seen.clear()
        with dp, nt.DataReader(db, 8, 2) as reader:
            dp.fit(reader, 1)
        assert kind in seen


def test_one_device_has_nothing_to_overlap(host_devs, db):
    ref, _ = train(host_devs, db, 1)
    got, dp = train(host_devs, db, 1, bucket_bytes=64)
    assert not dp._bucketed and np.array_equal(got, ref)


def test_bad_bucket_arguments_are_rejected(host_devs):
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        DataParallel(model(), host_devs(1), lr=0.1, bucket_bytes=-1)
    with pytest.raises(TypeError, match="bucket_bytes must be an integer"):
        DataParallel(model(), host_devs(1), lr=0.1, bucket_bytes=1.5)
    with pytest.raises(ValueError, match="comm_hook must be None or one of float16"):
        DataParallel(model(), host_devs(1), lr=0.1, comm_hook="int8")


# -- ordering: jitter and a negative control ------------------------------------------------


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.slow
def test_bitwise_under_jitter(host_devs, db, monkeypatch, update_mode):
    ref, _ = train(host_devs, db, 3, update_mode=update_mode)
    monkeypatch.setenv(host.JITTER_ENV, "7:300")
    for size in (4, 1200):
        got, dp = train(host_devs, db, 3, streams=True, update_mode=update_mode, bucket_bytes=size)
        assert dp.devices[0].new_stream()._core.jitter_max == pytest.approx(300e-6)
        assert np.array_equal(got, ref), size


def test_negative_control_a_missing_wait_is_caught(host_devs, db, monkeypatch):
    """The same jittered run with the wait for the buckets left out: the update reads
    gradients whose collective has not run (or not finished), which the bitwise check
    catches (so the check above can fail)."""
    ref, _ = train(host_devs, db, 3)
    monkeypatch.setenv(host.JITTER_ENV, "7:300")
    monkeypatch.setattr(parallel._Board, "wait", lambda self, m, rank: None)
    dp = DataParallel(model(), host_devs(3), **SOLVER, timeout=20, bucket_bytes=256)
    dp.world().inline_bytes = 0
    with dp, nt.DataReader(db, 8, 3) as reader:
        dp.fit(reader, ITERS)
    assert not np.array_equal(dp.params[0].data, ref)


# -- faults ---------------------------------------------------------------------------------


class _FailingMLP(MLP):
    """Raises on one rank in the middle of backward, after its first buckets started."""

    def __init__(self, rank: int, at: int) -> None:
        super().__init__(FEATURES, HIDDEN, CLASSES)
        self.rank, self.at, self.calls = rank, at, 0

    def loss_and_grad(self, params, x, y, ready=None):
        if params.device.index != self.rank or ready is None:
            return super().loss_and_grad(params, x, y, ready)
        self.calls += 1
        if self.calls < self.at:
            return super().loss_and_grad(params, x, y, ready)

        def failing(name: str) -> None:
            ready(name)
            if name == "fc1.bias":
                raise RuntimeError("injected fault in backward")

        return super().loss_and_grad(params, x, y, failing)


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
def test_a_rank_failing_during_backward_is_named(host_devs, db, update_mode):
    dp = DataParallel(
        _FailingMLP(2, 4), host_devs(4), **SOLVER, timeout=20, update_mode=update_mode,
        bucket_bytes=4,
    )  # fmt: skip
    with dp, nt.DataReader(db, 8, 4) as reader:
        with pytest.raises(RankFailure, match="rank 2 of 4 failed: RuntimeError: injected") as ei:
            dp.fit(reader, ITERS)
    assert ei.value.rank == 2
    assert dp.iter <= 4


def test_a_failing_bucket_collective_is_named(host_devs, db, monkeypatch):
    """A bucket's collective fails (in the rank that runs it for all, the last to
    complete the bucket): every rank stops, and RankFailure names that rank."""
    dp = DataParallel(model(), host_devs(3), **SOLVER, timeout=20, bucket_bytes=256)
    world = dp.world()
    original = world.all_reduce
    runs: list[str] = []

    def all_reduce(xs, *args, **kw):
        runs.append(threading.current_thread().name)
        if len(runs) == 7:
            raise RuntimeError("injected: a bucket's all-reduce failed")
        return original(xs, *args, **kw)

    monkeypatch.setattr(world, "all_reduce", all_reduce)
    with dp, nt.DataReader(db, 8, 3) as reader:
        with pytest.raises(RankFailure, match="injected: a bucket's all-reduce failed") as ei:
            dp.fit(reader, ITERS)
    assert runs[-1] == f"nccltree-rank{ei.value.rank}"
    assert dp.iter < ITERS


# -- the float16 hook -----------------------------------------------------------------------


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.parametrize("size", [0, 256])
@pytest.mark.slow
def test_float16_hook_trains_and_stays_close(host_devs, db, size, update_mode):
    ref, _ = train(host_devs, db, 3, iters=30, update_mode=update_mode)
    got, dp = train(
        host_devs, db, 3, iters=30, bucket_bytes=size, comm_hook="float16",
        update_mode=update_mode,
    )  # fmt: skip
    assert dp.params[0].dtype == np.float32  # the update stays float32
    assert dp._wires[0].dtype == np.float16
    assert not np.array_equal(got, ref)  # the gradients did travel as float16
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, rel
