"""The CUDA path of the engine on real GPUs, most of it on ONE GPU.

- NCCL with one rank (``gpu:0``; ``initAll([0])`` is valid), every collective, op, dtype
  and placement, and ``auto`` at 1 MiB on ``gpu:0`` (where it takes NCCL);
- tree, ring and direct on four logical ranks sharing GPU 0 (``gpu:0,0,0,0``), every
  collective, op, dtype and placement, including messages of several GPU chunks;
- allocation and stream ordering under ``cupy.cuda.Stream`` jitter: many small collectives
  back to back on user streams, random kernels in between, every result checked;
- NCCL and peer copies on several distinct GPUs (``multi_gpu``).

Skipped without a GPU (``gpu`` / ``multi_gpu`` markers). The logical-rank grid also runs on
the host backend (``cpu:4``), so the checking code itself runs on every machine and cannot
rot between GPU runs.

Every engine returns once the caller's stream is ordered after its work (it does not
block the host), so results are read only after the caller's stream is synchronised --
the caller's stream, not the whole device, because that is the promise to check.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from test_collectives import DTYPES, OPS, assert_close, expected, make_inputs

import nccltree as nt
from nccltree.comm._ops import reference

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
# one element, an odd count (misaligned slices and tails), and a message of several GPU
# chunks (1 MiB and a ragged tail: 256 KiB chunks under the GPU chunk policy)
SMALL_COUNTS = (1, 1001)
CHUNKED_COUNT = (1 << 18) + 3


def _cupy() -> Any:
    import cupy

    return cupy


class Buffers:
    """Where a test's arrays live: numpy on the host backend, CuPy on a rank's GPU.

    ``put`` copies host data to rank ``r``; ``full`` makes a filled buffer there; ``sync``
    waits for the caller's stream of every device; ``get`` returns a host copy.
    """

    def __init__(self, devices: Sequence[nt.Device]) -> None:
        self.devices = list(devices)
        self.cuda = self.devices[0].backend == "cuda"

    def put(self, r: int, host: np.ndarray) -> Any:
        if not self.cuda:
            return np.array(host)
        cp = _cupy()
        with cp.cuda.Device(self.devices[r].physical_id):
            return cp.asarray(host)  # enqueued on the caller's (current) stream

    def full(self, r: int, count: int, dtype: Any, value: float) -> Any:
        if not self.cuda:
            return np.full(count, value, dtype)
        cp = _cupy()
        with cp.cuda.Device(self.devices[r].physical_id):
            return cp.full(count, value, dtype)

    def sync(self) -> None:
        """Wait for the caller's (current) stream of every GPU the ranks use."""
        if not self.cuda:
            return  # host calls without a `with stream:` are complete on return
        cp = _cupy()
        for pid in sorted({d.physical_id for d in self.devices}):
            with cp.cuda.Device(pid):
                cp.cuda.get_current_stream().synchronize()

    def get(self, a: Any) -> np.ndarray:
        return np.asarray(a) if not self.cuda else _cupy().asnumpy(a)


def run_one(
    world: nt.World,
    bufs: Buffers,
    coll: str,
    inputs: list[np.ndarray],
    op: str,
    root: int,
    in_place: bool,
) -> tuple[list[Any], list[Any]]:
    """One driver-side call on device copies of ``inputs``; returns (the input buffers,
    the buffers holding each rank's result). Outputs start as 7s, a value no result of
    the data here has, so an element a collective forgets to write shows up."""
    n = world.size
    c = inputs[0].size
    dtype = inputs[0].dtype
    if coll == "all_gather" and in_place:
        # rank r's input is block r of its output (NCCL's in-place layout)
        bufs_ = []
        for r in range(n):
            host = np.full(n * c, 7, dtype)
            host[r * c : (r + 1) * c] = inputs[r]
            bufs_.append(bufs.put(r, host))
        ins = [bufs_[r][r * c : (r + 1) * c] for r in range(n)]
        world.all_gather(ins, bufs_)
        return ins, bufs_
    if coll == "reduce_scatter" and in_place:
        ins = [bufs.put(r, inputs[r]) for r in range(n)]
        k = c // n
        blocks = [ins[r][r * k : (r + 1) * k] for r in range(n)]
        world.reduce_scatter(ins, blocks, op=op)
        return ins, blocks
    ins = [bufs.put(r, inputs[r]) for r in range(n)]
    out_count = {"all_gather": n * c, "reduce_scatter": c // n}.get(coll, c)
    outs: list[Any] | None = None
    if not in_place:
        outs = [bufs.full(r, out_count, dtype, 7) for r in range(n)]
    if coll == "all_reduce":
        res = world.all_reduce(ins, op=op, outs=outs)
    elif coll == "reduce":
        res = world.reduce(ins, root=root, op=op, outs=outs)
    elif coll == "broadcast":
        res = world.broadcast(ins, root=root, outs=outs)
    else:
        assert outs is not None  # in place was handled above
        if coll == "all_gather":
            res = world.all_gather(ins, outs)
        else:
            res = world.reduce_scatter(ins, outs, op=op)
    return ins, list(res)


def cases(
    n: int,
    counts: Sequence[int],
    colls: Sequence[str] = COLLECTIVES,
    dtypes: Sequence[str] = DTYPES,
    ops: Sequence[str] = OPS,
) -> Iterator[tuple[str, str, str, int, bool, int]]:
    """(collective, dtype, op, count, in place, root) of a grid, invalid mixes left out."""
    for coll, dtype, op, count, in_place in itertools.product(
        colls, dtypes, ops, counts, (False, True)
    ):
        if op == "mean" and np.dtype(dtype).kind != "f":
            continue  # mean is refused on integers
        if coll in ("broadcast", "all_gather") and op != "sum":
            continue  # no reduction: the op does not apply
        roots = sorted({0, n - 1}) if coll in ("reduce", "broadcast") else [0]
        total = count * n if coll == "reduce_scatter" else count
        for root in roots:
            yield coll, dtype, op, total, in_place, root


def check_grid(world: nt.World, counts: Sequence[int], **grid: Sequence[str]) -> int:
    """Run every case of the grid on ``world`` and check each rank's result against numpy
    in float64; returns how many calls were checked."""
    n = world.size
    bufs = Buffers(world.devices)
    checked = 0
    for seed, (coll, dtype, op, count, in_place, root) in enumerate(cases(n, counts, **grid)):
        inputs = make_inputs(n, count, dtype, op, seed)
        ins, res = run_one(world, bufs, coll, inputs, op, root, in_place)
        bufs.sync()
        what = (
            f"{world.algorithm} {coll} {op} {dtype} n={n} count={count} root={root} "
            f"in_place={in_place}"
        )
        for r in range(n):
            want = expected(coll, inputs, op, root, r)
            if want is None:
                # reduce leaves every non-root input unchanged
                np.testing.assert_array_equal(bufs.get(ins[r]), inputs[r], err_msg=what)
                continue
            assert_close(bufs.get(res[r]).reshape(-1), want, dtype, f"{what} rank {r}")
        checked += 1
    return checked


@pytest.fixture
def logical_world(backend: str, request: pytest.FixtureRequest) -> Iterator[nt.World]:
    """Four logical ranks: ``gpu:0,0,0,0`` on CUDA, ``cpu:4`` on the host backend."""
    devs = nt.devices("gpu:0,0,0,0" if backend == "cuda" else "cpu:4")
    try:
        with nt.World(devs, algorithm=request.param, timeout=60) as w:
            yield w
    finally:
        devs[0].runtime.shutdown()


@pytest.mark.parametrize("logical_world", ["tree", "ring", "direct"], indirect=True)
@pytest.mark.slow
def test_logical_ranks_every_collective(logical_world: nt.World) -> None:
    checked = check_grid(logical_world, SMALL_COUNTS)
    assert checked > 200  # the grid really ran (every collective x op x dtype x placement)


@pytest.mark.gpu
@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_logical_ranks_several_chunks(alg: str) -> None:
    # GPU only: the host backend's chunk is 16 MiB, so this size would be one chunk there
    devs = nt.devices("gpu:0,0,0,0")
    try:
        with nt.World(devs, algorithm=alg, timeout=60) as w:
            check_grid(
                w, (CHUNKED_COUNT,), dtypes=("float16", "float32", "int64"), ops=("sum", "max")
            )
    finally:
        devs[0].runtime.shutdown()


@pytest.fixture
def one_gpu_world(request: pytest.FixtureRequest) -> Iterator[nt.World]:
    """A one-rank World on GPU 0 running ``request.param``."""
    devs = nt.devices("gpu:0")
    try:
        with nt.World(devs, algorithm=request.param, timeout=60) as w:
            yield w
    finally:
        devs[0].runtime.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("one_gpu_world", ["nccl"], indirect=True)
def test_nccl_one_rank_every_collective(one_gpu_world: nt.World) -> None:
    # one rank: each result is the rank's own input (mean: divided by one); what this
    # checks is NCCL's wiring -- pointers, counts, dtypes, ops, roots, in-place layouts
    # and stream order -- on a real communicator of initAll([0])
    checked = check_grid(one_gpu_world, (*SMALL_COUNTS, CHUNKED_COUNT))
    assert checked > 200


@pytest.mark.gpu
@pytest.mark.parametrize("one_gpu_world", ["auto"], indirect=True)
def test_auto_takes_nccl_at_1mib_on_one_gpu(one_gpu_world: nt.World) -> None:
    w = one_gpu_world
    count = (1 << 20) // 4
    # NCCL has no inspectable plan: asking auto's plan at 1 MiB names it
    with pytest.raises(ValueError, match="nccl"):
        w.plan("all_reduce", count, dtype=np.float32)
    # below the NCCL threshold auto keeps a hand-built plan
    assert w.plan("all_reduce", 16, dtype=np.float32).steps
    check_grid(w, (count,), dtypes=("float32", "float64"), ops=("sum", "mean", "max"))


@pytest.mark.gpu
@pytest.mark.parametrize("alg", ["tree", "ring", "direct", "nccl"])
def test_stream_order_under_user_stream_jitter(alg: str) -> None:
    """Many small all_reduces back to back, each issued under one of three
    ``cupy.cuda.Stream``s with random kernels before and after it: inputs are allocated
    and filled on the user stream (CuPy's pool keeps an arena per stream, so freed blocks
    come back on the next iterations), the collective must wait for the fill, and the
    kernel that reads the result right after it on the same stream must see it."""
    cp = _cupy()
    rng = np.random.default_rng(20240601)
    devs = nt.devices("gpu:0" if alg == "nccl" else "gpu:0,0,0,0")
    n = len(devs)
    try:
        with nt.World(devs, algorithm=alg, timeout=60) as w, cp.cuda.Device(0):
            streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
            noise = cp.zeros(1 << 22, cp.float32)  # busy work that delays a stream
            snapshots = []
            for i in range(150):
                s = streams[int(rng.integers(len(streams)))]
                count = int(rng.integers(1, 5000))
                base = float(i % 11)
                with s:
                    for _ in range(int(rng.integers(0, 3))):
                        k = int(rng.integers(1, noise.size))
                        noise[:k] = cp.sin(noise[:k]) + 1
                    xs = [cp.arange(count, dtype=cp.float32) + (r + 1) * base for r in range(n)]
                    outs = None if i % 2 else [cp.empty(count, cp.float32) for _ in range(n)]
                    if i % 5 == 4:
                        work = w.all_reduce(xs, outs=outs, async_op=True)
                        work.wait()  # the current stream (s) waits; the host does not
                        res = work.result() if i % 10 == 9 else (outs or xs)
                    else:
                        res = w.all_reduce(xs, outs=outs)
                    # read on s right behind the collective, then drop the buffers: their
                    # blocks return to s's arena and are reused by later iterations
                    snapshots.append((count, base, [y * 2 for y in res]))
                    del xs, outs, res
                    if rng.integers(2):
                        k = int(rng.integers(1, noise.size))
                        noise[:k] = cp.cos(noise[:k])
            for s in streams:
                s.synchronize()
            for j, (count, base, ys) in enumerate(snapshots):
                want = 2 * (n * np.arange(count, dtype=np.float64) + base * n * (n + 1) / 2)
                for r, y in enumerate(ys):
                    np.testing.assert_array_equal(
                        cp.asnumpy(y), want.astype(np.float32), err_msg=f"{alg} call {j} rank {r}"
                    )
    finally:
        devs[0].runtime.shutdown()


def _gpu_world(n: int, alg: str, distinct: bool = False) -> nt.World:
    from nccltree.backends import gpu_count

    count = gpu_count()
    ids = list(range(n)) if distinct else [i % count for i in range(n)]
    return nt.World(nt.devices("gpu:" + ",".join(map(str, ids))), algorithm=alg, timeout=60)


@pytest.mark.gpu
@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_logical_ranks_on_gpus(alg: str, dtype: str) -> None:
    cp = _cupy()
    n = 4
    with _gpu_world(n, alg) as w:
        bufs = Buffers(w.devices)
        for count in (0, 1, 1001, (1 << 20) + 3):
            rng = np.random.default_rng(count)
            host = [rng.integers(-50, 50, count).astype(dtype) for _ in range(n)]
            xs = []
            for r, h in enumerate(host):
                with cp.cuda.Device(w.devices[r].physical_id):
                    xs.append(cp.asarray(h))
            w.all_reduce(xs)
            bufs.sync()
            want = reference("sum", host)
            for x in xs:
                np.testing.assert_allclose(
                    cp.asnumpy(x).astype(np.float64),
                    want,
                    rtol=1e-2 if dtype == "float16" else 1e-6,
                )
            outs = []
            for r in range(n):
                with cp.cuda.Device(w.devices[r].physical_id):
                    outs.append(cp.empty(n * count, dtype))
            w.all_gather(xs, outs)
            bufs.sync()
            for o in outs:
                np.testing.assert_array_equal(cp.asnumpy(o), np.tile(cp.asnumpy(xs[0]), n))


@pytest.mark.gpu
def test_per_rank_calls_on_gpu_with_async_work() -> None:
    cp = _cupy()
    n = 2
    with _gpu_world(n, "tree") as w:

        def body(comm: nt.Comm) -> np.ndarray:
            with cp.cuda.Device(comm.device.physical_id):
                x = cp.arange(1 << 16, dtype=cp.float32) * (comm.rank + 1)
                work = comm.all_reduce(x, async_op=True)
                work.wait()  # the current stream waits; the host does not block
                y = (x * 2).get()  # on the current stream, after the collective
                return y

        results = w.run(body)
    want = np.arange(1 << 16, dtype=np.float32) * 3 * 2
    for y in results:
        np.testing.assert_allclose(y, want)


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize(
    "coll", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"]
)
def test_nccl_engine(coll: str) -> None:
    cp = _cupy()
    from nccltree.backends import gpu_count

    n = gpu_count()
    with _gpu_world(n, "nccl", distinct=True) as w:
        bufs = Buffers(w.devices)
        count = 4096 * n
        xs, outs = [], []
        for r in range(n):
            with cp.cuda.Device(r):
                xs.append(cp.arange(count, dtype=cp.float32) + r)
                size = {"all_gather": count * n, "reduce_scatter": count // n}.get(coll, count)
                outs.append(cp.zeros(size, cp.float32))
        host = [cp.asnumpy(x) for x in xs]
        want: list[np.ndarray | None]
        if coll == "all_reduce":
            w.all_reduce(xs, outs=outs)
            want = [reference("sum", host)] * n
        elif coll == "broadcast":
            w.broadcast(xs, root=1, outs=outs)
            want = [host[1]] * n
        elif coll == "reduce":
            w.reduce(xs, root=0, outs=outs)
            want = [reference("sum", host)] + [None] * (n - 1)
        elif coll == "all_gather":
            w.all_gather(xs, outs)
            want = [np.concatenate(host)] * n
        else:
            w.reduce_scatter(xs, outs)
            full = reference("sum", host)
            want = [full[r * (count // n) : (r + 1) * (count // n)] for r in range(n)]
        bufs.sync()
        for r, want_r in enumerate(want):
            if want_r is not None:
                np.testing.assert_allclose(cp.asnumpy(outs[r]), want_r, rtol=1e-6)


@pytest.mark.multi_gpu(2)
def test_nccl_distinct_gpus_every_collective() -> None:
    from nccltree.backends import gpu_count

    with _gpu_world(gpu_count(), "nccl", distinct=True) as w:
        check_grid(w, SMALL_COUNTS)


@pytest.mark.gpu
def test_nccl_refuses_shared_gpus() -> None:
    with pytest.raises(ValueError, match="distinct GPU"):
        nt.World(nt.devices("gpu:0,0"), algorithm="nccl")
