"""The CUDA kernels of bfloat16, int8 and uint8: the wrappers' arguments against the
compiled PTX, their wiring on the fake of CuPy (which runs each kernel's operations with
numpy), and, on a GPU, bitwise against the numpy reference and the host kernels.

CuPy has no bfloat16 dtype: bfloat16 arrays are ``uint16`` CuPy arrays and the calls say
``dtype="bfloat16"``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_cuda_kernels import (  # noqa: F401 - fixtures
    OFFSETS,
    FakeArray,
    _arg_size,
    assert_guards,
    guarded_dst,
    kernel_cache,
    kernel_origin,
    launch_recorder,
    ptx_params,
)
from test_native import assert_bitwise, reference

import nccltree as nt
from nccltree import _cuda_kernels as ck
from nccltree import _native as nat
from nccltree.backends.base import BFLOAT16

BF = "bfloat16"


def bf16_sources(k: int, n: int, seed: int, op: str = "sum") -> list[np.ndarray]:
    """bfloat16 data of mixed magnitudes (so that rounding once differs from rounding
    after each source), subnormals, and a few NaNs and infinities."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        if op == "prod":
            a = rng.uniform(0.5, 2.0, n)
        else:
            a = rng.standard_normal(n) * 2.0 ** rng.integers(-20, 21, n)
            a[rng.random(n) < 0.05] = np.ldexp(rng.uniform(-1, 1), -130)  # subnormal
        a[rng.random(n) < 0.01] = rng.choice([np.nan, np.inf, -np.inf])
        out.append(a.astype(BFLOAT16))
    return out


def int_sources(dtype: type, k: int, n: int, seed: int) -> list[np.ndarray]:
    info = np.iinfo(dtype)
    rng = np.random.default_rng(seed)
    return [rng.integers(info.min, info.max, n, endpoint=True).astype(dtype) for _ in range(k)]


# ---- anywhere (with nvcc): the wrappers' arguments are the kernels' parameters ----


@pytest.mark.subprocess
@pytest.mark.slow
def test_bfloat16_wrapper_arguments_match_the_kernel_signatures(
    launch_recorder,  # noqa: F811
    ptx_params,  # noqa: F811
) -> None:
    n = 1000
    arrays = [FakeArray(np.zeros(n, np.uint16)) for _ in range(4)]
    dst = arrays[0]
    ck.reduce_n(dst, arrays[1:], "max", dtype=BF)
    ck.sum_into(dst, arrays[1], dtype=BF)
    ck.scale(dst, 0.5, dtype=BF)
    ck.sgd_update(*arrays[:3], 0.1, 0.9, 1e-4, dtype=BF)
    ck.reduce_n(dst, arrays[1:], alpha=0.25, dtype=BF)
    names = [name for name, _, _, _ in launch_recorder]
    assert names == [
        "nt_reduce_n_max_bf16",
        "nt_sum_into_bf16",
        "nt_scale_bf16",
        "nt_sgd_update_bf16",
        "nt_reduce_n_scaled_sum_bf16",
    ]
    for name, grid, block, args in launch_recorder:
        assert [_arg_size(a) for a in args] == ptx_params[name], name
        assert grid[0] * block[0] * 8 >= n
    assert launch_recorder[-1][3][4].dtype == np.float32  # alpha in the compute type


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.subprocess
def test_8bit_wrapper_arguments_match_the_kernel_signatures(
    launch_recorder,  # noqa: F811
    ptx_params,  # noqa: F811
    dtype: type,
) -> None:
    n = 1000
    arrays = [FakeArray(np.zeros(n, dtype)) for _ in range(4)]
    ck.reduce_n(arrays[0], arrays[1:], "prod")
    ck.sum_into(arrays[0], arrays[1])
    sfx = "i8" if dtype == np.int8 else "u8"
    assert [x[0] for x in launch_recorder] == [f"nt_reduce_n_prod_{sfx}", f"nt_sum_into_{sfx}"]
    for name, grid, block, args in launch_recorder:
        assert [_arg_size(a) for a in args] == ptx_params[name], name
        assert grid[0] * block[0] * 16 >= n  # 16 elements per 16-byte vector
    for call in (
        lambda: ck.reduce_n(arrays[0], arrays[1:], alpha=0.5),
        lambda: ck.scale(arrays[0], 2.0),
        lambda: ck.sgd_update(*arrays[:3], 0.1, 0.9, 0.0),
    ):
        with pytest.raises(TypeError, match="accepted: float16, float32, float64, bfloat16$"):
            call()


def test_bfloat16_needs_its_uint16_carrier(launch_recorder) -> None:  # noqa: F811
    f32 = FakeArray(np.zeros(8, np.float32))
    u16 = FakeArray(np.zeros(8, np.uint16))
    with pytest.raises(TypeError, match="needs dst to be a uint16 array .*CuPy has no bfloat16"):
        ck.reduce_n(f32, [f32], dtype=BF)
    with pytest.raises(TypeError, match="needs x to be a uint16 array"):
        ck.scale(FakeArray(np.zeros(8, np.int16)), 2.0, dtype=BF)
    with pytest.raises(TypeError, match="dtype=int16 is not one of the kernels'"):
        ck.reduce_n(u16, [u16], dtype="int16")
    with pytest.raises(TypeError, match="accepted"):
        ck.reduce_n(u16, [u16])  # uint16 alone is no kernel dtype
    with pytest.raises(TypeError, match="has dtype float32 but dst has uint16"):
        ck.reduce_n(u16, [u16, f32], dtype=BF)
    ck.reduce_n(f32, [f32], dtype="float32")  # naming an array's own dtype is allowed
    assert [x[0] for x in launch_recorder] == ["nt_reduce_n_sum_f32"]


# ---- on the fake of CuPy: wiring, not GPU verification ----


def test_bfloat16_kernels_on_the_fake(fake_cupy: Any) -> None:
    """The wrappers launch the bf16 kernels on uint16 arrays and the fake, which runs the
    .cu's operations with numpy, gives the numpy reference bitwise."""
    import cupy as cp

    n = 1001
    for k in (1, 3, 8):
        host = bf16_sources(k, n, seed=k)
        srcs = [cp.asarray(h.view(np.uint16)) for h in host]
        for op in ("sum", "prod", "max", "min"):
            dst = cp.empty(n, np.uint16)
            ck.reduce_n(dst, srcs, op, dtype=BF)
            assert_bitwise(dst.get().view(BFLOAT16), reference(op, host))
            assert fake_cupy.launches[-1].name == f"nt_reduce_n_{op}_bf16"
        dst = cp.empty(n, np.uint16)
        ck.reduce_n(dst, srcs, alpha=1 / 3, dtype=BF)
        assert_bitwise(dst.get().view(BFLOAT16), reference("sum", host, alpha=1 / 3))
    w, g, v = bf16_sources(3, n, seed=9)
    dw, dg, dv = (cp.asarray(a.view(np.uint16)) for a in (w, g, v))
    ck.sgd_update(dw, dg, dv, 0.05, 0.9, 5e-4, dtype=BF)
    want_w = np.empty_like(w)
    wc, gc, vc = w.copy(), g.copy(), v.copy()
    nat.sgd_update(wc, gc, vc, 0.05, 0.9, 5e-4)
    for got, want in ((dw, wc), (dg, gc), (dv, vc)):
        assert_bitwise(got.get().view(BFLOAT16), want)
    del want_w
    ck.scale(dw, 0.125, dtype=BF)
    assert_bitwise(dw.get().view(BFLOAT16), nat.scale(wc, 0.125))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_8bit_kernels_on_the_fake(fake_cupy: Any, dtype: type) -> None:
    import cupy as cp

    host = int_sources(dtype, 5, 777, seed=3)
    srcs = [cp.asarray(h) for h in host]
    for op in ("sum", "prod", "max", "min"):
        dst = cp.empty(777, dtype)
        ck.reduce_n(dst, srcs, op)
        np.testing.assert_array_equal(dst.get(), reference(op, host))
    a = srcs[0].copy()
    ck.sum_into(a, srcs[1])
    np.testing.assert_array_equal(a.get(), reference("sum", host[:2]))


@pytest.mark.parametrize("algorithm", ["tree", "ring", "direct"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_world_8bit_collectives_on_fake_gpus(fake_cupy: Any, algorithm: str, dtype: type) -> None:
    """int8/uint8 are CuPy's own dtypes, so Worlds of CUDA devices take them as they are:
    sums and products wrap, bitwise the numpy reference whatever the order (wiring check,
    not GPU verification)."""
    devs = nt.devices("gpu:0,1,2")
    try:
        with nt.World(devs, algorithm=algorithm) as world:
            for op in ("sum", "prod", "max", "min"):
                host = int_sources(dtype, 3, 300, seed=len(op))
                xs = [d.from_host(h) for d, h in zip(devs, host, strict=True)]
                world.all_reduce(xs, op=op)
                for x in xs:
                    np.testing.assert_array_equal(x.get(), reference(op, host))
            with pytest.raises(TypeError, match="op 'mean' needs a floating-point dtype"):
                world.all_reduce([d.from_host(np.ones(4, dtype)) for d in devs], op="mean")
    finally:
        devs[0].runtime.shutdown()
    assert any(
        launch.name.endswith("_i8" if dtype == np.int8 else "_u8") for launch in fake_cupy.launches
    )


# ---- on a GPU ----


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.mark.gpu
def test_bfloat16_kernels_match_numpy_on_a_gpu(cp) -> None:
    for k in range(1, ck.MAX_SOURCES + 1):
        for n in (1, 7, 8, 1023, 4099, 300_001):
            for op in ("sum", "prod", "max", "min"):
                host = bf16_sources(k, n, seed=k * 7 + n, op=op)
                dst = cp.empty(n, np.uint16)
                ck.reduce_n(dst, [cp.asarray(h.view(np.uint16)) for h in host], op, dtype=BF)
                assert_bitwise(cp.asnumpy(dst).view(BFLOAT16), reference(op, host))
            dst = cp.empty(n, np.uint16)
            ck.reduce_n(dst, [cp.asarray(h.view(np.uint16)) for h in host], alpha=0.25, dtype=BF)
            assert_bitwise(cp.asnumpy(dst).view(BFLOAT16), reference("sum", host, alpha=0.25))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_8bit_kernels_match_numpy_on_a_gpu(cp, dtype: type) -> None:
    for k in range(1, ck.MAX_SOURCES + 1):
        for n in (1, 15, 16, 17, 4099, 300_001):
            host = int_sources(dtype, k, n, seed=k + n)
            for op in ("sum", "prod", "max", "min"):
                dst = cp.empty(n, dtype)
                ck.reduce_n(dst, [cp.asarray(h) for h in host], op)
                np.testing.assert_array_equal(cp.asnumpy(dst), reference(op, host))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BFLOAT16, np.dtype(np.int8), np.dtype(np.uint8)], ids=str)
def test_new_dtypes_bitwise_against_the_host_kernels_at_every_alignment(
    cp,
    kernel_origin,  # noqa: F811
    dtype: np.dtype,
) -> None:
    carrier = np.dtype(np.uint16) if dtype == BFLOAT16 else dtype
    kw = {"dtype": BF} if dtype == BFLOAT16 else {}
    for op in ck.OPS:
        for k in (1, 3, 8):
            for n in (1, 17, 4099, 65_537):
                host = (
                    bf16_sources(k, n + 8, seed=n, op=op)
                    if dtype == BFLOAT16
                    else int_sources(dtype.type, k, n + 8, seed=n)
                )
                dev = [cp.asarray(h.view(carrier)) for h in host]
                for doff, soffs in OFFSETS:
                    views = [h[o : o + n] for h, o in zip(host, soffs, strict=False)]
                    want = nat.reduce_n(np.empty(n, dtype), views, op)
                    base, dst = guarded_dst(cp, n, doff, carrier)
                    ck.reduce_n(
                        dst, [d[o : o + n] for d, o in zip(dev, soffs, strict=False)], op, **kw
                    )
                    what = (kernel_origin, str(dtype), op, k, n, doff, soffs)
                    assert_bitwise(cp.asnumpy(dst).view(dtype), want, what)
                    assert_guards(cp, base, n, doff)


@pytest.mark.gpu
def test_bfloat16_scale_and_sgd_on_a_gpu(cp) -> None:
    for n in (1, 1023, 300_001):
        w, g, v = bf16_sources(3, n, seed=n)
        x = cp.asarray(w.view(np.uint16))
        ck.scale(x, 1 / 3, dtype=BF)
        assert_bitwise(cp.asnumpy(x).view(BFLOAT16), nat.scale(w.copy(), 1 / 3))
        dw, dg, dv = (cp.asarray(a.view(np.uint16)) for a in (w, g, v))
        ck.sgd_update(dw, dg, dv, 0.05, 0.9, 5e-4, dtype=BF)
        wc, gc, vc = w.copy(), g.copy(), v.copy()
        nat.sgd_update(wc, gc, vc, 0.05, 0.9, 5e-4)
        for got, want in ((dw, wc), (dg, gc), (dv, vc)):
            assert_bitwise(cp.asnumpy(got).view(BFLOAT16), want)


def test_nccl_has_a_datatype_for_every_kernel_dtype(fake_cupy: Any) -> None:
    """Every dtype of the kernels maps to NCCL's own datatype: bfloat16 to ncclBfloat16
    (NCCL reduces it itself), int8/uint8 to ncclInt8/ncclUint8."""
    from cupy.cuda import nccl

    from nccltree.backends.base import DTYPES
    from nccltree.comm import nccl as nccl_engine

    for dt in DTYPES:
        assert hasattr(nccl, nccl_engine._DTYPES[dt.name]), dt
    assert getattr(nccl, nccl_engine._DTYPES["bfloat16"]) == nccl.NCCL_BFLOAT16
    assert getattr(nccl, nccl_engine._DTYPES["int8"]) == nccl.NCCL_INT8
    assert getattr(nccl, nccl_engine._DTYPES["uint8"]) == nccl.NCCL_UINT8
