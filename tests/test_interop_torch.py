"""Torch CPU tensors through nccltree, for real (torch is in the ``test`` extra, a CPU
build): zero-copy in and out of the collectives and sends, the object collectives, and
the torch training example against one-process training on the full batch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccltree as nt

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "torch_dataparallel.py"


@pytest.fixture
def world() -> Any:
    w = nt.World(nt.devices("cpu:2"), timeout=20)
    yield w
    w.close()


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("torch_dataparallel_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_collectives_write_into_the_callers_tensors_and_return_them(world: Any):
    ts = [torch.full((6,), float(r + 1)) for r in range(2)]
    ptrs = [t.data_ptr() for t in ts]
    res = world.all_reduce(ts, op="mean")
    assert res[0] is ts[0] and res[1] is ts[1]  # the caller's objects, in place
    assert [t.data_ptr() for t in ts] == ptrs
    assert ts[1].tolist() == [1.5] * 6
    outs = [torch.zeros(12, dtype=torch.float32) for _ in range(2)]
    got = world.all_gather(ts, outs)
    assert got[1] is outs[1] and outs[0][:6].tolist() == [1.5] * 6


def test_per_rank_calls_take_tensors_and_p2p_fills_them(world: Any):
    def fn(comm: Any) -> Any:
        x = torch.arange(4, dtype=torch.float64) * (comm.rank + 1)
        out = comm.all_reduce(x)
        assert out is x
        buf = torch.zeros(4, dtype=torch.float64)
        peer = 1 - comm.rank
        with comm.batch():
            comm.send(x, peer)
            comm.recv(buf, peer)
        w = comm.irecv(torch.zeros(2), peer) if comm.rank == 0 else comm.isend(torch.ones(2), 0)
        w.wait()
        return x.tolist(), buf.tolist(), w.result().tolist()

    (x0, b0, r0), (x1, b1, _) = world.run(fn)
    assert x0 == x1 == [0.0, 3.0, 6.0, 9.0] and b0 == b1 == x0
    assert r0 == [1.0, 1.0]


def test_bfloat16_tensors_go_as_their_bits(world: Any):
    """numpy has no DLPack bfloat16: such a tensor travels as its uint16 bits, named."""
    ts = [torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16) * (r + 1) for r in range(2)]
    world.all_reduce([t.view(torch.uint16) for t in ts], dtype="bfloat16")
    assert ts[0].tolist() == [4.5, -6.0, 9.75] == ts[1].tolist()


def test_a_tensor_that_cannot_be_viewed_is_refused_with_the_reason(world: Any):
    ts = [torch.ones(3, requires_grad=True) for _ in range(2)]
    with pytest.raises(TypeError, match="rank 0: input: cannot view Tensor"):
        world.all_reduce(ts)
    world.all_reduce([t.detach() for t in ts])  # the World goes on; detach is the way
    assert ts[0].tolist() == [2.0] * 3


def test_object_collectives_carry_tensors(world: Any):
    got = world.all_gather_object([{"w": torch.arange(3)}, {"w": torch.ones(2)}])
    assert torch.equal(got[0][0]["w"], torch.arange(3))
    assert torch.equal(got[1][1]["w"], torch.ones(2))


def test_data_parallel_refuses_a_model_outside_the_protocol():
    with pytest.raises(TypeError, match="model protocol"):
        nt.DataParallel(torch.nn.Linear(2, 2), "cpu:2")


@pytest.mark.parametrize("bucket_bytes", [0, 256])
def test_the_torch_example_trains_to_the_single_process_loss(bucket_bytes: int):
    """Both ways of the example (a framework author's all_reduce loop, DataParallel over
    the TorchModel adapter) follow the one-process full-batch training: the mean of the
    ranks' mean losses is the full batch's mean loss, equal up to float32 summation order
    (tolerance 1e-4 relative, per step, over 20 SGD steps; measured about 1e-7)."""
    ex = _example()
    torch.set_num_threads(1)
    steps, batch, lr = 20, 8, 0.2
    x, y = ex.make_data(batch * 2 * 8)
    single = ex.train_single(steps, batch * 2, lr, x, y)
    looped = ex.train_with_all_reduce("cpu:2", steps, batch, lr, x, y)
    dp = ex.train_with_data_parallel("cpu:2", steps, batch, lr, x, y, bucket_bytes=bucket_bytes)
    assert single[-1] < single[0]  # it trains
    assert ex.max_relative_difference(looped, single) < 1e-4
    assert ex.max_relative_difference(dp, single) < 1e-4
    assert np.isfinite(dp).all()
