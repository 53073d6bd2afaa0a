"""The CUDA path of the engine: logical ranks sharing a GPU, peer copies, NCCL.

Skipped without a GPU (the ``gpu`` / ``multi_gpu`` markers).
"""

from __future__ import annotations

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm._ops import numpy_reduce


def _cupy():
    import cupy

    return cupy


def _gpu_world(n: int, alg: str, distinct: bool = False):
    from nccltree.backends import gpu_count

    count = gpu_count()
    ids = list(range(n)) if distinct else [i % count for i in range(n)]
    return nt.World(nt.devices("gpu:" + ",".join(map(str, ids))), algorithm=alg, timeout=60)


@pytest.mark.gpu
@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_logical_ranks_on_gpus(alg, dtype):
    cp = _cupy()
    n = 4
    with _gpu_world(n, alg) as w:
        for count in (0, 1, 1001, (1 << 20) + 3):
            rng = np.random.default_rng(count)
            host = [rng.integers(-50, 50, count).astype(dtype) for _ in range(n)]
            xs = []
            for r, h in enumerate(host):
                with cp.cuda.Device(w.devices[r].physical_id):
                    xs.append(cp.asarray(h))
            w.all_reduce(xs)
            for d in w.devices:
                d.synchronize()
            want = numpy_reduce("sum", host)
            for x in xs:
                np.testing.assert_allclose(cp.asnumpy(x).astype(np.float64), want,
                                           rtol=1e-2 if dtype == "float16" else 1e-6)
            outs = []
            for r in range(n):
                with cp.cuda.Device(w.devices[r].physical_id):
                    outs.append(cp.empty(n * count, dtype))
            w.all_gather(xs, outs)
            for d in w.devices:
                d.synchronize()
            for o in outs:
                np.testing.assert_array_equal(cp.asnumpy(o), np.tile(cp.asnumpy(xs[0]), n))


@pytest.mark.gpu
def test_per_rank_calls_on_gpu_with_async_work():
    cp = _cupy()
    n = 2
    with _gpu_world(n, "tree") as w:

        def body(comm):
            with cp.cuda.Device(comm.device.physical_id):
                x = cp.arange(1 << 16, dtype=cp.float32) * (comm.rank + 1)
                work = comm.all_reduce(x, async_op=True)
                work.wait()  # the current stream waits; the host does not block
                y = (x * 2).get()
                return y

        results = w.run(body)
    want = np.arange(1 << 16, dtype=np.float32) * 3 * 2
    for y in results:
        np.testing.assert_allclose(y, want)


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "reduce", "all_gather",
                                  "reduce_scatter"])
def test_nccl_engine(coll):
    cp = _cupy()
    from nccltree.backends import gpu_count

    n = gpu_count()
    with _gpu_world(n, "nccl", distinct=True) as w:
        count = 4096 * n
        xs, outs = [], []
        for r in range(n):
            with cp.cuda.Device(r):
                xs.append(cp.arange(count, dtype=cp.float32) + r)
                size = {"all_gather": count * n, "reduce_scatter": count // n}.get(coll, count)
                outs.append(cp.zeros(size, cp.float32))
        host = [cp.asnumpy(x) for x in xs]
        if coll == "all_reduce":
            w.all_reduce(xs, outs=outs)
            want = [numpy_reduce("sum", host)] * n
        elif coll == "broadcast":
            w.broadcast(xs, root=1, outs=outs)
            want = [host[1]] * n
        elif coll == "reduce":
            w.reduce(xs, root=0, outs=outs)
            want = [numpy_reduce("sum", host)] + [None] * (n - 1)
        elif coll == "all_gather":
            w.all_gather(xs, outs)
            want = [np.concatenate(host)] * n
        else:
            w.reduce_scatter(xs, outs)
            full = numpy_reduce("sum", host)
            want = [full[r * (count // n) : (r + 1) * (count // n)] for r in range(n)]
        for r in range(n):
            if want[r] is not None:
                np.testing.assert_allclose(cp.asnumpy(outs[r]), want[r], rtol=1e-6)


@pytest.mark.gpu
def test_nccl_refuses_shared_gpus():
    with pytest.raises(ValueError, match="distinct GPU"):
        nt.World(nt.devices("gpu:0,0"), algorithm="nccl")
