"""The data-parallel driver: N-device training is 1-device training with an N-times
larger batch, in both update modes and with every algorithm; runs are reproducible,
resumable bitwise, and a failing rank ends the run with its error."""

from __future__ import annotations

import numpy as np
import pytest

import nccltree as nt
from nccltree.data import BatchSource, MemorySource
from nccltree.models import build_model
from nccltree.parallel import (
    AllReduceSync,
    DataParallel,
    RankFailure,
    RootSync,
    evaluate,
    load_snapshot,
    per_rank_batch,
)
from nccltree.solver import Callback

FEATURES, CLASSES, HIDDEN = 16, 4, (24,)
ITERS = 24
SOLVER = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
# float32 rounding level: the summation order of the gradients differs between 1 and N
# ranks (N per-rank means averaged vs one mean); after ITERS steps that stays ~1e-7
# relative, orders of magnitude below any real difference.
RTOL = 1e-5


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    x, y = nt.data.synthetic(1024, shape=(FEATURES,), classes=CLASSES, seed=3)
    path = str(tmp_path_factory.mktemp("parallel") / "train")
    nt.data.write_lmdb(path, x, y)
    return path


def model():
    return build_model("mlp", (FEATURES,), CLASSES, hidden=HIDDEN)


def train(host_devs, db, ranks, batch, iters=ITERS, **kw):
    """Train on ``ranks`` host devices with per-rank ``batch``; returns (driver, result)."""
    dp = DataParallel(model(), host_devs(ranks), **SOLVER, **kw)
    with dp, nt.DataReader(db, batch, ranks, start=dp.position or 0) as reader:
        result = dp.fit(reader, iters)
    return dp, result


def flat(params: dict) -> np.ndarray:
    return np.concatenate([v.ravel() for v in params.values()]).astype(np.float64)


def rel_diff(a: dict, b: dict) -> float:
    fa, fb = flat(a), flat(b)
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


def assert_falling(losses: list[float]) -> None:
    assert len(losses) >= 20
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < 0.6 * first, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"


def assert_replicas_equal(dp: DataParallel) -> None:
    ref = dp.params[0].data
    for p in dp.params[1:]:
        assert np.array_equal(p.data, ref)


@pytest.fixture(scope="module")
def reference(db, tmp_path_factory):
    """The 1-device run with batch 32."""
    devs = nt.devices("cpu:1")
    try:
        dp, result = train(lambda n: devs, db, 1, 32)
    finally:
        devs[0].runtime.shutdown()
    assert_falling(result.losses)
    return dp.state_dict(), result.losses


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.parametrize("algorithm", ["tree", "ring", "direct"])
@pytest.mark.slow
def test_weak_scaling_equals_one_device(host_devs, db, reference, algorithm, update_mode):
    dp, result = train(host_devs, db, 4, 8, algorithm=algorithm, update_mode=update_mode)
    assert_falling(result.losses)
    assert result.iter == ITERS and result.examples == ITERS * 32
    assert rel_diff(dp.state_dict(), reference[0]) < RTOL
    np.testing.assert_allclose(result.losses, reference[1], rtol=1e-4)
    assert_replicas_equal(dp)


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
def test_strong_scaling_equals_one_device(host_devs, db, reference, update_mode):
    per_rank = per_rank_batch(32, 4, "strong")
    assert per_rank == 8
    dp, result = train(host_devs, db, 4, per_rank, update_mode=update_mode)
    assert_falling(result.losses)
    assert rel_diff(dp.state_dict(), reference[0]) < RTOL
    assert_replicas_equal(dp)


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
def test_negative_control_rank_left_out_fails_tolerance(host_devs, db, reference, update_mode):
    def leave_out_rank3(rank, it, params):
        if rank == 3:
            params.grad.fill(0)  # rank 3 contributes nothing to the reduction

    dp, _ = train(host_devs, db, 4, 8, update_mode=update_mode, grad_hook=leave_out_rank3)
    assert rel_diff(dp.state_dict(), reference[0]) > RTOL


def test_update_modes_agree(host_devs, db):
    a, _ = train(host_devs, db, 2, 16, update_mode="allreduce")
    b, _ = train(host_devs, db, 2, 16, update_mode="root")
    assert rel_diff(a.state_dict(), b.state_dict()) < RTOL


def test_same_seed_twice_is_bitwise_identical(host_devs, db):
    a, ra = train(host_devs, db, 4, 8, algorithm="ring")
    b, rb = train(host_devs, db, 4, 8, algorithm="ring")
    for name, value in a.state_dict().items():
        assert np.array_equal(value.view(np.uint32), b.state_dict()[name].view(np.uint32))
    assert ra.losses == rb.losses
    c, _ = train(host_devs, db, 4, 8, algorithm="ring", seed=1)
    assert rel_diff(c.state_dict(), a.state_dict()) > RTOL


def test_strong_scaling_uneven_split_is_an_error():
    with pytest.raises(ValueError, match="does not split evenly across 4 ranks"):
        per_rank_batch(30, 4, "strong")
    assert per_rank_batch(30, 4, "weak") == 30
    with pytest.raises(ValueError, match="weak, strong"):
        per_rank_batch(8, 2, "linear")


def test_per_rank_batch_follows_the_one_rule():
    assert per_rank_batch(np.int64(32), np.int64(4), "strong") == 8
    assert type(per_rank_batch(np.int32(32), 4)) is int
    for bad in (True, 32.0, "32"):
        with pytest.raises(TypeError, match="batch_size must be an integer"):
            per_rank_batch(bad, 4)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        per_rank_batch(0, 4)
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        per_rank_batch(8, 0, "strong")


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
def test_snapshot_resume_is_bitwise(host_devs, db, tmp_path, update_mode):
    path = str(tmp_path / "snap.npz")
    full, _ = train(host_devs, db, 2, 8, update_mode=update_mode)

    # interrupted: snapshot at iteration 10, then the run "dies" (stop)
    first = DataParallel(model(), host_devs(2), update_mode=update_mode, **SOLVER)

    def on_step(info):
        if info.iter == 10:
            first.snapshot(path, {"note": "half"})
            first.stop()

    with first, nt.DataReader(db, 8, 2) as reader:
        res = first.fit(reader, ITERS, on_step=on_step)
    assert res.stopped and 10 <= first.iter < ITERS

    snap = load_snapshot(path)
    assert snap.iter == 10 and snap.position == 10 * 16 and snap.config == {"note": "half"}
    resumed = DataParallel(model(), host_devs(2), update_mode=update_mode, **SOLVER, seed=5)
    resumed.restore(path)
    with resumed, nt.DataReader(db, 8, 2, start=snap.position) as reader:
        res = resumed.fit(reader, ITERS)
    assert res.start_iter == 10 and res.iter == ITERS
    for name, value in full.state_dict().items():
        assert np.array_equal(value, resumed.state_dict()[name]), name
    assert np.array_equal(full.solvers[0].history, resumed.solvers[0].history)


def test_restore_checks_the_reader_position(host_devs, db, tmp_path):
    dp, _ = train(host_devs, db, 2, 8, iters=4)
    path = str(tmp_path / "s.npz")
    dp.snapshot(path)
    again = DataParallel(model(), host_devs(2), **SOLVER)
    again.restore(path)
    with again, nt.DataReader(db, 8, 2) as reader:
        with pytest.raises(ValueError, match="start=64"):
            again.fit(reader, 8)
    other = DataParallel(
        build_model("mlp", (FEATURES,), CLASSES, hidden=(7,)), host_devs(1), lr=0.1
    )
    with pytest.raises(ValueError, match="shape"):
        other.restore(path)


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
def test_a_failing_rank_ends_the_run_with_its_error(host_devs, db, update_mode):
    seen = []

    def fail_rank2(rank, it, params):
        seen.append((rank, it))
        if rank == 2 and it == 5:
            raise RuntimeError("injected fault")

    with pytest.raises(
        RankFailure, match=r"rank 2 of 4 failed: RuntimeError: injected fault"
    ) as ei:
        train(host_devs, db, 4, 8, update_mode=update_mode, grad_hook=fail_rank2, timeout=20)
    assert ei.value.rank == 2
    assert isinstance(ei.value.__cause__, RuntimeError)
    # no rank got past the failed iteration's collective
    assert max(it for _, it in seen) <= 6


def test_stop_ends_every_rank_promptly(host_devs, db):
    dp = DataParallel(model(), host_devs(3), **SOLVER)
    with dp, nt.DataReader(db, 8, 3) as reader:
        res = dp.fit(reader, 10_000, on_step=lambda info: info.iter == 7 and dp.stop())
    assert res.stopped and 7 <= res.iter <= 9


def test_without_communication_replicas_diverge(host_devs, db):
    dp, res = train(host_devs, db, 2, 8, comm=False)
    assert res.comm_fraction == 0.0 and res.iter == ITERS
    assert not np.array_equal(dp.params[0].data, dp.params[1].data)
    ref, ref_res = train(host_devs, db, 2, 8)
    assert ref_res.comm_fraction > 0.0
    assert rel_diff(dp.state_dict(), ref.state_dict()) > RTOL


def test_evaluate_and_argument_checks(host_devs, db):
    dp, _ = train(host_devs, db, 2, 16, iters=60)
    x, y = nt.data.synthetic(512, shape=(FEATURES,), classes=CLASSES, seed=3, split="test")
    acc, loss = evaluate(dp.model, dp.params[0], x, y, batch_size=100)
    assert acc > 0.6 and loss < 1.0
    untrained = DataParallel(model(), host_devs(1), lr=0.1)
    acc0, loss0 = evaluate(untrained.model, untrained.params[0], x, y)
    assert acc0 < acc and loss0 > loss
    with pytest.raises(ValueError, match="update_mode"):
        DataParallel(model(), host_devs(1), lr=0.1, update_mode="mean")
    with pytest.raises(ValueError, match="algorithm"):
        DataParallel(model(), host_devs(1), lr=0.1, algorithm="butterfly")
    with pytest.raises(TypeError, match="Model"):
        DataParallel(object(), host_devs(1), lr=0.1)
    with nt.DataReader(db, 8, 3) as reader, pytest.raises(ValueError, match="3 ranks"):
        DataParallel(model(), host_devs(2), lr=0.1).fit(reader, 5)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        evaluate(dp.model, dp.params[0], x, y, batch_size=0)
    assert evaluate(dp.model, dp.params[0], x, y, batch_size=np.int64(100)) == (acc, loss)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"timeout": float("nan")}, ValueError, "timeout must be a number, got NaN"),
        ({"timeout": float("inf")}, ValueError, "timeout must be finite"),
        ({"timeout": 0}, ValueError, "timeout must be > 0"),
        ({"timeout": True}, TypeError, "timeout must be a real number"),
        ({"blas_threads": 0}, ValueError, "blas_threads must be >= 1"),
        ({"blas_threads": 2.0}, TypeError, "blas_threads must be an integer"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"seed": True}, TypeError, "seed must be an integer"),
        ({"lr": float("nan")}, ValueError, "lr must be a number"),
    ],
)
def test_driver_arguments_follow_the_one_rule(host_devs, kwargs, exc, match):
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(exc, match=match):
        DataParallel(model(), host_devs(1), **kwargs)


def test_driver_takes_numpy_numbers(host_devs, db):
    dp = DataParallel(
        model(),
        host_devs(2),
        lr=np.float32(0.1),
        seed=np.int64(0),
        timeout=np.float64(30),
        blas_threads=np.int64(1),
    )
    assert dp.blas_threads == 1 and dp.timeout == 30.0 and dp.seed == 0
    with dp, nt.DataReader(db, 8, 2) as reader:
        with pytest.raises(TypeError, match="iters must be an integer"):
            dp.fit(reader, 2.0)
        with pytest.raises(ValueError, match="iters must be >= 0"):
            dp.fit(reader, -1)
        assert len(dp.fit(reader, np.int64(2)).losses) == 2


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.slow
def test_equivalence_with_gradients_on_the_streams(host_devs, db, update_mode):
    # 75k parameters (300 KB), with the World's inline limit at 0, so the collectives run
    # on the devices' communication streams rather than in the calling thread
    def big():
        return build_model("mlp", (FEATURES,), CLASSES, hidden=(512, 128))

    results = []
    for ranks, batch in ((1, 32), (4, 8)):
        dp = DataParallel(big(), host_devs(ranks), update_mode=update_mode, **SOLVER)
        dp.world().inline_bytes = 0
        with dp, nt.DataReader(db, batch, ranks) as reader:
            res = dp.fit(reader, 20)
        assert_falling(res.losses)
        assert_replicas_equal(dp)
        results.append(dp.state_dict())
    assert rel_diff(results[1], results[0]) < RTOL


class Counter(Callback):
    """Counts the solver's hooks and checks their order."""

    def __init__(self) -> None:
        self.starts = self.readies = 0

    def on_start(self) -> None:
        assert self.starts == self.readies
        self.starts += 1

    def on_gradients_ready(self) -> None:
        self.readies += 1
        assert self.starts == self.readies


@pytest.mark.parametrize(
    ("update_mode", "comm", "sync"),
    [("allreduce", True, AllReduceSync), ("root", True, RootSync), ("allreduce", False, None)],
)
def test_the_driver_registers_its_sync_with_each_solver(host_devs, db, update_mode, comm, sync):
    seen: dict[int, list[tuple[type, ...]]] = {}

    def look(rank, it, params):  # runs inside the solver's iteration, before the sync
        seen.setdefault(rank, []).append(tuple(type(c) for c in dp.solvers[rank].callbacks))

    dp = DataParallel(
        model(), host_devs(3), update_mode=update_mode, comm=comm, grad_hook=look, **SOLVER
    )
    counters = [Counter() for _ in dp.solvers]
    for solver, counter in zip(dp.solvers, counters):
        solver.add_callback(counter)
    with dp, nt.DataReader(db, 8, 3) as reader:
        result = dp.fit(reader, 6)
    expected = (Counter,) if sync is None else (Counter, sync)
    assert seen == {r: [expected] * 6 for r in range(3)}
    # the user's callbacks ran in the same loop, once per iteration on every rank
    assert [(c.starts, c.readies) for c in counters] == [(6, 6)] * 3
    # the sync is registered for the fit only; the driver's timing is the solvers'
    assert [s.callbacks for s in dp.solvers] == [(c,) for c in counters]
    assert result.rank_comm_s == pytest.approx([s.callback_s for s in dp.solvers])
    assert sum(result.comm_times) == pytest.approx(dp.solvers[0].callback_s)


def test_root_mode_updates_on_the_root_only(host_devs, db):
    dp, _ = train(host_devs, db, 3, 8, iters=5, update_mode="root")
    assert np.any(dp.solvers[0].history != 0)
    for solver in dp.solvers[1:]:  # the others only count iterations
        assert solver.iter == 5 and not np.any(solver.history)
    assert_replicas_equal(dp)


def round_robin_batches(ranks: int, batch: int, rounds: int) -> list[list[tuple]]:
    """The DataReader's deal of the test database, held in memory: rank r's batch i is
    records i*N*B + r, + N, + 2N, ... (N ranks, B per rank)."""
    x, y = nt.data.synthetic(1024, shape=(FEATURES,), classes=CLASSES, seed=3)
    out: list[list[tuple]] = [[] for _ in range(ranks)]
    for i in range(rounds):
        for r in range(ranks):
            idx = i * ranks * batch + r + ranks * np.arange(batch)
            out[r].append((x[idx], y[idx]))
    return out


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
def test_a_memory_source_trains_as_the_reader_does(host_devs, db, update_mode):
    """Any BatchSource drives fit: batches held in memory in the reader's order give
    bitwise the reader's result (the source is not positioned, so no position)."""
    by_reader, ref = train(host_devs, db, 2, 8, iters=6, update_mode=update_mode)
    source = MemorySource(round_robin_batches(2, 8, 6))
    assert isinstance(source, BatchSource) and source.ranks == 2 and source.round_size == 16
    dp = DataParallel(model(), host_devs(2), update_mode=update_mode, **SOLVER)
    with dp:
        result = dp.fit(source, 6)
    assert result.losses == ref.losses and result.examples == ref.examples
    for name, value in by_reader.state_dict().items():
        assert np.array_equal(value, dp.state_dict()[name]), name
    assert result.position is None and ref.position == 6 * 16


def test_fit_takes_a_batch_source(host_devs, db):
    with nt.DataReader(db, 8, 2) as reader:
        assert isinstance(reader, BatchSource)

    class NoStart:  # what a hand-written source without the whole protocol looks like
        ranks, round_size = 2, 16

        def next_batch(self, rank=0, timeout=None):
            raise AssertionError("not reached")

    dp = DataParallel(model(), host_devs(2), **SOLVER)
    with dp, pytest.raises(TypeError, match=r"BatchSource \(ranks, start, round_size"):
        dp.fit(NoStart(), 2)
    with pytest.raises(ValueError, match="at least one batch for every rank"):
        MemorySource([[]])
    source = MemorySource(round_robin_batches(2, 4, 1))
    assert source.next_batch(1) is source.next_batch(1)  # one batch, cycled
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        source.next_batch(2)
