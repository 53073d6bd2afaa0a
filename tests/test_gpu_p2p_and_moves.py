"""What only a GPU can show of two paths that had no GPU test: point-to-point between the
ranks of one process (logical ranks sharing GPU 0: ``send``/``recv``/``sendrecv`` and
batches, the copies on CUDA streams), and gather, scatter, all_to_all and sendrecv through
NCCL with one rank (``gpu:0``: NCCL's send/receive groups, moved as bytes).

Each body runs twice: on a real GPU (``gpu``-marked, skipped without one: the
verification) and on the fake of CuPy's layer (``tests/fakecupy``: wiring only, never GPU
verification), so the checking code runs on every machine and cannot rot between GPU runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.faces import driver_method

MOVES = ("gather", "scatter", "all_to_all", "sendrecv")
# one element, an odd count, and more than a GPU chunk with a ragged tail
COUNTS = (1, 1001, (1 << 18) + 3)


def _nccl_moves() -> int:
    """Every data-moving collective NCCL runs as send/receive groups, through one rank's
    communicator, in and out of place, three dtypes: results against numpy, exactly.
    Returns the number of results checked."""
    devs = nt.devices("gpu:0")
    checked = 0
    try:
        with nt.World(devs, algorithm="nccl", timeout=60) as w:
            d = devs[0]
            n = 1
            for coll in MOVES:
                c = COLLECTIVES[coll]
                for dtype in ("float32", "float16", "int8"):
                    for count in COUNTS:
                        rng = np.random.default_rng(count)
                        full = [rng.integers(-100, 100, c.in_count(count, n)).astype(dtype)]
                        for in_place in (False, True) if c.in_place_ok else (False,):
                            xs = [d.from_host(full[0])]
                            if in_place:
                                outs = [xs[0][: c.out_count(count, n)]]
                            else:
                                outs = [d.zeros(c.out_count(count, n), dtype)]
                            kw: dict[str, Any] = {"root": 0} if c.rooted else {}
                            getattr(w, driver_method(coll))(xs, outs, **kw)
                            d.synchronize()
                            for r, (which, want) in enumerate(c.expected(full, "sum", 0)):
                                got = (xs[r] if which == "in" else outs[r]).get().reshape(-1)
                                np.testing.assert_array_equal(
                                    got, want, err_msg=f"{coll} {dtype} {count} {in_place}"
                                )
                                checked += 1
    finally:
        devs[0].runtime.shutdown()
    return checked


def _p2p_logical_ranks() -> None:
    """Point-to-point between four logical ranks of GPU 0 (one process): a ring shift by
    ``sendrecv``, a pipeline of lone sends and receives, and a batch with every rank,
    CuPy arrays, results against numpy."""
    n = 4
    devs = nt.devices("gpu:" + ",".join(["0"] * n))
    try:
        with nt.World(devs, timeout=60) as w:

            def body(comm: nt.Comm) -> dict[str, Any]:
                r, dev = comm.rank, comm.device
                got: dict[str, Any] = {}
                mine = dev.from_host((np.arange(70001) * (r + 1) % 251).astype(np.float32))
                out = dev.zeros(70001, np.float32)
                comm.sendrecv(mine, (r + 1) % n, out, (r - 1) % n)
                got["ring"] = out
                stages = []
                for micro in range(3):  # down the pipeline, each stage adding 100
                    x = dev.from_host(np.full(1001, float(micro), np.float32))
                    if r > 0:
                        comm.recv(x, r - 1)
                    x += 100
                    if r < n - 1:
                        comm.send(x, r + 1)
                    stages.append(x)
                got["pipeline"] = stages
                outs = [dev.zeros(3, np.int64) for _ in range(n)]
                with comm.batch():
                    for q in range(n):
                        comm.send(dev.from_host(np.full(3, 10 * r + q, np.int64)), q)
                    for q in range(n):
                        comm.recv(outs[q], q)
                got["batch"] = outs
                dev.current_stream().synchronize(60)
                return {k: ([a.get() for a in v] if isinstance(v, list) else v.get())
                        for k, v in got.items()}  # fmt: skip

            res = w.run(body)
        for r in range(n):
            src = (r - 1) % n
            want = (np.arange(70001) * (src + 1) % 251).astype(np.float32)
            np.testing.assert_array_equal(res[r]["ring"], want)
            for micro, x in enumerate(res[r]["pipeline"]):
                np.testing.assert_array_equal(x, np.full(1001, micro + 100.0 * (r + 1)))
            assert [int(o[0]) for o in res[r]["batch"]] == [10 * q + r for q in range(n)]
    finally:
        devs[0].runtime.shutdown()


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.gpu_seconds(3)
def test_gpu_gather_scatter_all_to_all_sendrecv_through_one_rank_nccl() -> None:
    assert _nccl_moves() > 50


@pytest.mark.gpu
@pytest.mark.gpu_seconds(2)
def test_gpu_point_to_point_between_logical_ranks_of_one_gpu() -> None:
    _p2p_logical_ranks()


# -- on the fake (wiring only, not GPU verification) ---------------------------------------------


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1}], indirect=True)
def test_on_the_fake_gather_scatter_all_to_all_sendrecv_through_one_rank_nccl(
    fake_cupy: Any,
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): the same body, and NCCL
    calls are made, as bytes."""
    import cupy

    assert _nccl_moves() > 50
    calls = fake_cupy.nccl.calls
    assert {k.method for k in calls} == {"send", "recv"}
    assert {k.datatype for k in calls} == {cupy.cuda.nccl.NCCL_UINT8}


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1}], indirect=True)
def test_on_the_fake_point_to_point_between_logical_ranks_of_one_gpu(fake_cupy: Any) -> None:
    """Wiring check on tests/fakecupy (not GPU verification)."""
    _p2p_logical_ranks()
