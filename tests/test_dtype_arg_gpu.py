"""bfloat16 collectives on GPU Worlds: ``uint16`` CuPy arrays named ``dtype="bfloat16"``.

CuPy has no bfloat16 dtype, so a GPU buffer of bfloat16 is a ``uint16`` array of its
bits and every collective that reduces it is told what it holds: the plans' reductions
launch the ``_bf16`` kernels and NCCL gets ``ncclBfloat16``.

Two kinds of test here:

* on the fake of CuPy (``fake_cupy``): **wiring only**. The fake runs the kernels'
  operations with numpy and NCCL's reductions in float32; passing there says that the
  right kernels, dtypes and NCCL datatypes reach the calls, not that a GPU computes the
  right values;
* ``gpu``-marked: on a real GPU (skipped cleanly without one), bfloat16 all_reduce over
  tree, ring, direct and NCCL against the numpy reference (``ml_dtypes``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import gpu_count

import nccltree as nt
from nccltree.backends.base import BFLOAT16
from nccltree.comm._ops import reference

ALGS = ("tree", "ring", "direct")


def bf16_inputs(n: int, size: int, seed: int) -> list[np.ndarray]:
    """bfloat16 values of mixed magnitudes: their sum depends on the order."""
    rng = np.random.default_rng(seed)
    vals = rng.uniform(-1, 1, (n, size)) * 2.0 ** rng.integers(-20, 21, (n, size))
    return [vals[r].astype(BFLOAT16) for r in range(n)]


def exact_inputs(n: int, size: int, seed: int) -> list[np.ndarray]:
    """Small integers in bfloat16: every partial sum of up to 8 ranks is exact, so any
    order (NCCL's own included) gives the one right answer."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-16, 17, size).astype(BFLOAT16) for _ in range(n)]


def host_result(topology: nt.Topology, alg: str, coll: str, full, op: str, **kw):
    """The host World's answer on the same topology (so the same tree): the host kernels
    are bitwise the CUDA kernels (tests/test_cuda_dtypes.py)."""
    n = len(full)
    with nt.World(f"cpu:{n}", algorithm=alg, topology=topology) as w:
        xs = [f.copy() for f in full]
        if coll == "all_reduce":
            w.all_reduce(xs, op=op)
            return xs
        if coll == "reduce":
            outs = [np.zeros(full[0].size, BFLOAT16) for _ in range(n)]
            w.reduce(xs, outs=outs, op=op, **kw)
            return outs
        count = full[0].size // n
        outs = [np.zeros(count, BFLOAT16) for _ in range(n)]
        w.reduce_scatter(xs, outs, op=op)
        return outs


def on_gpus(devs, host: list[np.ndarray]) -> list[Any]:
    return [d.from_host(h.view(np.uint16)) for d, h in zip(devs, host, strict=True)]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


# ---- on the fake of CuPy: wiring, not GPU verification ----


@pytest.mark.parametrize("spec", ["gpu:0,1,2", "gpu:0,0,0"], ids=["3gpus", "shared"])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_fake_world_reductions_launch_the_bf16_kernels(fake_cupy: Any, alg: str, spec: str):
    """Every reducing collective on uint16 CuPy arrays named bfloat16: only ``_bf16``
    reduce kernels are launched, and the values are the host World's bitwise (the fake
    runs the kernels' operations with numpy: a wiring check, not GPU verification)."""
    devs = nt.devices(spec)
    n = len(devs)
    try:
        with nt.World(devs, algorithm=alg, chunk_bytes=256) as world:
            for op in ("sum", "mean", "max"):
                full = bf16_inputs(n, 300, seed=len(op))
                first = len(fake_cupy.launches)
                xs = on_gpus(devs, full)
                world.all_reduce(xs, op=op, dtype="bfloat16")
                want = host_result(world.topology, alg, "all_reduce", full, op)
                for r in range(n):
                    assert xs[r].dtype == np.uint16
                    np.testing.assert_array_equal(xs[r].get(), bits(want[r]), err_msg=op)
                names = {k.name for k in fake_cupy.launches[first:]}
                assert names and all(name.endswith("_bf16") for name in names), names
                outs = [d.zeros(300, np.uint16) for d in devs]
                world.reduce(on_gpus(devs, full), root=1, outs=outs, op=op, dtype="bfloat16")
                want = host_result(world.topology, alg, "reduce", full, op, root=1)
                np.testing.assert_array_equal(outs[1].get(), bits(want[1]))
                outs = [d.zeros(100, np.uint16) for d in devs]
                world.reduce_scatter(on_gpus(devs, full), outs, op=op, dtype="bfloat16")
                want = host_result(world.topology, alg, "reduce_scatter", full, op)
                for r in range(n):
                    np.testing.assert_array_equal(outs[r].get(), bits(want[r]))
            # the plan cache keys the dtype the arrays carry, and its programs name it
            assert world._programs.programs
            assert all(k[-1] == BFLOAT16.str for k in world._programs.programs)
            assert all(p.dtype == BFLOAT16 for p in world._programs.programs.values())
            # float16 arrays of the same size: programs of their own, naming no dtype
            world.all_reduce([d.zeros(300, np.float16) for d in devs])
            assert any(
                k[-1] is None and p.dtype is None for k, p in world._programs.programs.items()
            )
    finally:
        devs[0].runtime.shutdown()


def test_fake_world_per_rank_and_data_movement(fake_cupy: Any):
    """Per-rank calls carry the dtype to the launch; broadcast and all_gather move uint16
    buffers named bfloat16 as they are (wiring check)."""
    devs = nt.devices("gpu:0,1")
    try:
        with nt.World(devs, algorithm="ring") as world:
            full = bf16_inputs(2, 64, seed=1)
            xs = on_gpus(devs, full)

            def body(comm):
                comm.all_reduce(xs[comm.rank], dtype="bfloat16")
                out = comm.device.zeros(128, np.uint16)
                comm.all_gather(xs[comm.rank], out, dtype="bfloat16")
                return out

            outs = world.run(body)
            world.barrier()
            want = host_result(world.topology, "ring", "all_reduce", full, "sum")
            for r in range(2):
                np.testing.assert_array_equal(xs[r].get(), bits(want[r]))
                np.testing.assert_array_equal(
                    outs[r].get(), np.concatenate([bits(w) for w in want])
                )
            ys = on_gpus(devs, full)
            world.broadcast(ys, root=1, dtype="bfloat16")
            np.testing.assert_array_equal(ys[0].get(), bits(full[1]))
    finally:
        devs[0].runtime.shutdown()


def test_fake_world_refuses_bad_combinations(fake_cupy: Any):
    devs = nt.devices("gpu:0,1")
    try:
        with nt.World(devs, algorithm="tree") as world:
            us = [d.zeros(8, np.uint16) for d in devs]
            with pytest.raises(TypeError, match='dtype="bfloat16"'):
                world.all_reduce(us)  # a carrier needs its dtype named
            fs = [d.zeros(8, np.float16) for d in devs]
            with pytest.raises(TypeError, match="dtype=bfloat16 takes"):
                world.all_reduce(fs, dtype="bfloat16")
            with pytest.raises(TypeError, match="dtype=float16 differs"):
                world.all_reduce(us, dtype="float16")
            with pytest.raises(ValueError, match="is not a dtype"):
                world.all_reduce(us, dtype="brainfloat")
    finally:
        devs[0].runtime.shutdown()


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 3}], indirect=True)
def test_fake_nccl_gets_ncclbfloat16(fake_cupy: Any):
    """algorithm="nccl": the uint16 buffers go to NCCL as ncclBfloat16 in every reducing
    collective, the fake reducing in float32 and rounding once; what NCCL only moves
    (broadcast) goes as bytes, ncclUint8 and twice the count (wiring check)."""
    from cupy.cuda import nccl

    devs = nt.devices("gpu:0,1,2")
    try:
        with nt.World(devs, algorithm="nccl") as world:
            full = exact_inputs(3, 96, seed=2)
            xs = on_gpus(devs, full)
            world.all_reduce(xs, dtype="bfloat16")
            world.barrier()
            want = reference("sum", full, rounding="kernel")
            for x in xs:
                np.testing.assert_array_equal(x.get(), bits(want))
            outs = [d.zeros(32, np.uint16) for d in devs]
            world.reduce_scatter(on_gpus(devs, full), outs, op="max", dtype="bfloat16")
            outs = [d.zeros(96, np.uint16) for d in devs]
            world.reduce(on_gpus(devs, full), root=2, outs=outs, dtype="bfloat16")
            world.broadcast(on_gpus(devs, full), root=0, dtype="bfloat16")
            world.barrier()
            np.testing.assert_array_equal(outs[2].get(), bits(want))
            calls = [c for c in fake_cupy.nccl.calls
                     if c.method in ("allReduce", "reduceScatter", "reduce", "broadcast")]  # fmt: skip
            assert {c.method for c in calls} == {"allReduce", "reduceScatter", "reduce",
                                                 "broadcast"}  # fmt: skip
            reducing = [c for c in calls if c.method != "broadcast"]
            assert all(c.datatype == nccl.NCCL_BFLOAT16 for c in reducing), calls
            moved = {(c.datatype, c.count) for c in calls if c.method == "broadcast"}
            assert moved == {(nccl.NCCL_UINT8, 2 * 96)}, calls
    finally:
        devs[0].runtime.shutdown()


def test_fake_stream_reduce_names_the_dtype(fake_cupy: Any):
    """``Stream.reduce``/``scale`` on CUDA pass ``dtype="bfloat16"`` to the kernels."""
    devs = nt.devices("gpu:0")
    try:
        d = devs[0]
        a, b = bf16_inputs(2, 100, seed=3)
        dst = d.zeros(100, np.uint16)
        st = d.new_stream()
        st.reduce(dst, [d.from_host(bits(a)), d.from_host(bits(b))], dtype="bfloat16")
        st.scale(dst, 0.5, dtype="bfloat16")
        st.synchronize()
        assert [k.name for k in fake_cupy.launches[-2:]] == [
            "nt_reduce_n_sum_bf16",
            "nt_scale_bf16",
        ]
        want = reference("sum", [a, b], rounding="kernel", alpha=0.5)
        np.testing.assert_array_equal(dst.get(), bits(want))
    finally:
        devs[0].runtime.shutdown()


# ---- on a GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("alg", ALGS)
def test_gpu_bf16_all_reduce_matches_numpy(alg: str, ranks: int):
    """tree, ring, direct on GPUs (ranks sharing a GPU where there are fewer): uint16
    CuPy arrays named bfloat16 give bitwise the host kernels' answer on the same plan,
    and exact sums where every order is exact."""
    n_gpu = gpu_count()
    spec = "gpu:" + ",".join(str(i % n_gpu) for i in range(ranks))
    devs = nt.devices(spec)
    try:
        with nt.World(devs, algorithm=alg) as world:
            for op in ("sum", "mean", "max"):
                full = bf16_inputs(ranks, 100_003, seed=ranks + len(op))
                xs = on_gpus(devs, full)
                world.all_reduce(xs, op=op, dtype="bfloat16")
                want = host_result(world.topology, alg, "all_reduce", full, op)
                for r in range(ranks):
                    got = devs[r].to_host(xs[r])
                    np.testing.assert_array_equal(got, bits(want[r]), err_msg=f"{op} {r}")
                wide = reference(op, full)
                close = devs[0].to_host(xs[0]).view(BFLOAT16).astype(np.float64)
                np.testing.assert_allclose(close, wide, rtol=2**-6, atol=2**-20)
            full = exact_inputs(ranks, 65_537, seed=7)
            xs = on_gpus(devs, full)
            world.all_reduce(xs, dtype="bfloat16")
            want = reference("sum", full, rounding="kernel")
            for r in range(ranks):
                np.testing.assert_array_equal(devs[r].to_host(xs[r]), bits(want))
    finally:
        devs[0].runtime.shutdown()


@pytest.mark.gpu
@pytest.mark.multi_gpu(2)
def test_gpu_bf16_all_reduce_nccl_matches_numpy():
    """NCCL with ncclBfloat16: exact sums (small integers) bitwise, and random data within
    bfloat16's rounding of the float64 reference (NCCL's order is its own)."""
    n = gpu_count()
    devs = nt.devices("gpu:all")
    try:
        with nt.World(devs, algorithm="nccl") as world:
            full = exact_inputs(n, 65_537, seed=5)
            xs = on_gpus(devs, full)
            world.all_reduce(xs, dtype="bfloat16")
            world.barrier()
            want = reference("sum", full, rounding="kernel")
            for r in range(n):
                np.testing.assert_array_equal(devs[r].to_host(xs[r]), bits(want))
            full = bf16_inputs(n, 100_003, seed=6)
            xs = on_gpus(devs, full)
            world.all_reduce(xs, op="max", dtype="bfloat16")
            world.barrier()
            want = reference("max", full, rounding="kernel")  # max is exact in any order
            for r in range(n):
                np.testing.assert_array_equal(devs[r].to_host(xs[r]), bits(want))
            full = [np.abs(f) for f in bf16_inputs(n, 100_003, seed=8)]
            xs = on_gpus(devs, full)
            world.all_reduce(xs, dtype="bfloat16")
            world.barrier()
            got = devs[0].to_host(xs[0]).view(BFLOAT16).astype(np.float64)
            np.testing.assert_allclose(got, reference("sum", full), rtol=n * 2**-8)
    finally:
        devs[0].runtime.shutdown()


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 3}], indirect=True)
@pytest.mark.slow
def test_fake_benchmark_bfloat16_on_gpus(fake_cupy: Any, capsys: pytest.CaptureFixture[str]):
    """``nccltree-bench collectives -d bfloat16`` on GPUs: uint16 CuPy buffers, every call
    naming ``dtype="bfloat16"``: no wrong element, bf16 kernels and ncclBfloat16 (wiring
    check on the fake, not GPU verification)."""
    from cupy.cuda import nccl

    from nccltree.cli import bench as cli
    from nccltree.comm import bench as drv

    colls = ["all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather"]
    with drv.Benchmark("gpu:0,1,2", algorithms=["tree", "ring", "direct", "nccl"],
                       collectives=colls, sizes=[96, 6144], dtype="bfloat16", op="mean",
                       iters=1, warmup=0) as bench:  # fmt: skip
        assert bench.carrier == np.dtype(np.uint16)
        data = bench._size_data(drv.COLLECTIVES["all_reduce"], 96)
        ins, _, outs = bench._buffers(drv.COLLECTIVES["all_reduce"], data, False)
        assert all(a.dtype == np.uint16 for a in (*ins, *outs))
        records = list(bench)
    assert records and all(r.wrong == 0 for r in records), [r for r in records if r.wrong]
    assert {r.dtype for r in records} == {"bfloat16"}
    assert any(k.name.endswith("_bf16") for k in fake_cupy.launches)
    reducing = [c for c in fake_cupy.nccl.calls if c.method in ("allReduce", "reduce",
                                                                "reduceScatter")]  # fmt: skip
    assert reducing and all(c.datatype == nccl.NCCL_BFLOAT16 for c in reducing)
    # the command line, the same way
    rc = cli.main(["collectives", "--devices", "gpu:0,1,2", "-d", "bfloat16", "-b", "64",
                   "-e", "64", "-n", "1", "-w", "0", "--algorithm", "tree,nccl"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "bfloat16" in out
