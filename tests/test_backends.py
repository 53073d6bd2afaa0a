"""devices(spec), the Device interface, copies, kernels and transfer recording."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends import host
from nccltree.backends.base import MAX_FUSED, fold_schedule
from nccltree.backends.host import Transfer, record_transfers

# -- devices(spec) --------------------------------------------------------------------------


def test_cpu_spec_gives_n_devices_sharing_one_backend():
    devs = nt.devices("cpu:3")
    try:
        assert [d.index for d in devs] == [0, 1, 2]
        assert [d.physical_id for d in devs] == [0, 1, 2]
        assert {d.backend for d in devs} == {"host"}
        assert len({id(d.runtime) for d in devs}) == 1
        assert all(d.xp is np for d in devs)
        assert devs[1].name == "cpu:1"
        assert all(isinstance(d, nt.Device) for d in devs)
    finally:
        devs[0].runtime.shutdown()


def test_cpu_spec_is_lenient_about_case_and_spaces():
    devs = nt.devices(" CPU:2 ")
    assert len(devs) == 2
    devs[0].runtime.shutdown()


def test_host_threads_split_the_cores_and_are_settable():
    n = 3
    devs = nt.devices(f"cpu:{n}")
    assert devs[0].threads == max(1, (os.cpu_count() or 1) // n)
    devs[0].threads = 5
    assert devs[0].threads == 5
    with pytest.raises(ValueError, match=">= 1"):
        devs[0].threads = 0
    devs[0].runtime.shutdown()


@pytest.mark.parametrize(
    "spec",
    ["", "cpu", "cpu:", "cpu:0", "cpu:-1", "cpu:x", "gpu", "gpu:", "gpu:0,", "tpu:1", "gpu:a"],
)
def test_malformed_spec_is_a_value_error_listing_accepted_forms(spec):
    with pytest.raises(ValueError, match="accepted forms") as info:
        nt.devices(spec)
    for form in ("cpu:N", "gpu:0,1", "gpu:all", "auto"):
        assert form in str(info.value)


def test_spec_must_be_a_string():
    with pytest.raises(TypeError, match="accepted forms"):
        nt.devices(4)


def test_gpu_spec_without_cupy_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(nt.BackendUnavailable, match="CuPy"):
        nt.devices("gpu:0")
    with pytest.raises(nt.BackendUnavailable, match="CuPy"):
        nt.devices("gpu:all")


def test_auto_falls_back_to_two_host_devices_without_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    devs = nt.devices("auto")
    assert [d.backend for d in devs] == ["host", "host"]
    devs[0].runtime.shutdown()


@pytest.mark.gpu
def test_gpu_specs():
    from nccltree.backends import gpu_count

    n = gpu_count()
    devs = nt.devices("gpu:0,0")
    assert [d.physical_id for d in devs] == [0, 0]
    assert [d.index for d in devs] == [0, 1]
    assert devs[0].runtime is devs[1].runtime
    assert len(nt.devices("gpu:all")) == n
    assert nt.devices("auto")[0].backend == "cuda"
    with pytest.raises(ValueError, match=f"GPU {n} does not exist"):
        nt.devices(f"gpu:0,{n}")


# -- the Device interface (every backend) ---------------------------------------------------


def test_allocation(dev):
    a = dev.zeros((3, 4), "float64")
    assert a.shape == (3, 4) and a.dtype == np.float64
    assert a.flags.c_contiguous
    np.testing.assert_array_equal(dev.to_host(a), np.zeros((3, 4)))
    e = dev.empty(7, np.int32)
    assert e.shape == (7,) and e.dtype == np.int32
    dev.check_array(a)
    assert dev.empty(0).size == 0


def test_host_arrays_are_64_byte_aligned(host_devs):
    (d,) = host_devs(1)
    for n in (1, 3, 17, 1000):
        assert d.empty(n, np.float32).ctypes.data % 64 == 0
        assert d.zeros((n, 3), np.float64).ctypes.data % 64 == 0


def test_round_trip_host_device_host(dev):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    d = dev.from_host(x)
    x[...] = -1  # the device array is a copy
    back = dev.to_host(d)
    np.testing.assert_array_equal(back, np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    out = np.empty((2, 3, 4), np.float32)
    assert dev.to_host(d, out=out) is out
    np.testing.assert_array_equal(out, back)


def test_round_trip_on_a_stream(dev):
    s = dev.new_stream()
    x = np.arange(1000, dtype=np.float64)
    d = dev.from_host(x, stream=s)
    out = np.empty_like(x)
    dev.to_host(d, out=out, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(out, x)


def test_check_array_rejects_foreign_and_strided(dev):
    with pytest.raises(TypeError):
        dev.check_array([1.0, 2.0])
    strided = dev.zeros((4, 4))[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        dev.check_array(strided)


def test_asarray_is_zero_copy_on_host(host_devs):
    (d,) = host_devs(1)
    x = np.ones(5)
    assert d.asarray(x) is x
    buf = bytearray(16)
    view = d.asarray(buf)
    view[0] = 7
    assert buf[0] == 7

    class FakeGpuArray:
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False)}

    with pytest.raises(TypeError, match="GPU memory"):
        d.asarray(FakeGpuArray())


def test_immediate_kernels_in_caller_order(dev):
    x = dev.from_host(np.full(100, 2.0, np.float32))
    dev.scale(x, 3.0)
    dev.sum_into(x, dev.from_host(np.ones(100, np.float32)))
    np.testing.assert_array_equal(dev.to_host(x), np.full(100, 7.0, np.float32))

    w0 = np.linspace(-1, 1, 50)
    g0 = np.linspace(0.5, -0.5, 50)
    v0 = np.full(50, 0.1)
    w, g, v = dev.from_host(w0), dev.from_host(g0), dev.from_host(v0)
    lr, mom, wd = 0.1, 0.9, 0.01
    dev.sgd_update(w, g, v, lr, mom, wd)
    g_ref = g0 + wd * w0
    v_ref = mom * v0 + lr * g_ref
    np.testing.assert_allclose(dev.to_host(g), g_ref, rtol=1e-12)
    np.testing.assert_allclose(dev.to_host(v), v_ref, rtol=1e-12)
    np.testing.assert_allclose(dev.to_host(w), w0 - v_ref, rtol=1e-12)


def test_stream_kernels(dev):
    s = dev.new_stream()
    x = dev.from_host(np.arange(10, dtype=np.float64))
    s.scale(x, 0.5)
    w, g, v = (dev.from_host(np.ones(10)) for _ in range(3))
    s.sgd_update(w, g, v, 0.5, 0.0, 0.0)
    s.synchronize()
    np.testing.assert_array_equal(dev.to_host(x), np.arange(10) * 0.5)
    np.testing.assert_array_equal(dev.to_host(w), np.full(10, 0.5))


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("k", [1, 2, 8, 11])
def test_reduce_ops_and_many_sources(dev, op, k):
    rng = np.random.default_rng(k)
    xs = [rng.integers(-5, 6, 33).astype(np.float64) for _ in range(k)]
    srcs = [dev.from_host(x) for x in xs]
    dst = dev.empty(33, np.float64)
    s = dev.new_stream()
    s.reduce(dst, srcs, op)
    s.synchronize()
    ref = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](xs, axis=0)
    np.testing.assert_array_equal(dev.to_host(dst), ref)


def test_reduce_in_place_into_a_source(dev):
    a, b = dev.from_host(np.ones(8, np.float32)), dev.from_host(np.full(8, 2, np.float32))
    s = dev.default_stream
    s.reduce(a, [a, b, b])
    s.synchronize()
    np.testing.assert_array_equal(dev.to_host(a), np.full(8, 5, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 2, 8, 11])
@pytest.mark.parametrize("n", [33, 10_000])  # host: below and above the numpy path's limit
def test_scaled_reduce_is_bitwise_reduce_then_scale(dev, dtype, k, n):
    rng = np.random.default_rng(k)
    srcs = [dev.from_host(rng.standard_normal(n).astype(dtype)) for _ in range(k)]
    got, want = dev.empty(n, dtype), dev.empty(n, dtype)
    s = dev.new_stream()
    s.reduce(got, srcs, alpha=1 / 3)
    s.reduce(want, srcs)
    s.scale(want, 1 / 3)
    s.synchronize()
    assert dev.to_host(got).tobytes() == dev.to_host(want).tobytes()


# the host backend's native path starts above SMALL_BYTES of passes; float16 always takes it
@pytest.mark.parametrize(
    ("dtype", "n"), [(np.float32, 5000), (np.float32, 33), (np.float16, 300), (np.int32, 5000)]
)
@pytest.mark.slow
def test_reduce_into_any_source_of_more_than_one_kernel_takes(dev, dtype, n):
    # dst = srcs[k] with k past the first pass must not be read after that pass wrote it
    rng = np.random.default_rng(n)
    s = dev.new_stream()
    for k in range(9, 21):
        xs = [(rng.standard_normal(n) * 100).astype(dtype) for _ in range(k)]
        fresh = dev.empty(n, dtype)
        s.reduce(fresh, [dev.from_host(x) for x in xs])
        s.synchronize()
        want = dev.to_host(fresh)
        if dtype != np.float16:  # float16 is summed in float32 within a kernel pass
            ref = xs[0].copy()
            for x in xs[1:]:
                ref += x  # left to right, rounded to the dtype at each step
            assert want.tobytes() == ref.tobytes()
        for i in range(k):
            srcs = [dev.from_host(x) for x in xs]
            s.reduce(srcs[i], srcs)
            s.synchronize()
            assert dev.to_host(srcs[i]).tobytes() == want.tobytes(), (k, i)
            if dtype == np.int32:
                continue
            srcs = [dev.from_host(x) for x in xs]
            s.reduce(srcs[i], srcs, alpha=0.5)  # the scale still follows the whole sum
            s.synchronize()
            got, scaled = dev.to_host(srcs[i]), (want * dtype(0.5)).astype(dtype)
            if dtype != np.float16:  # float16 scales before its one rounding
                assert got.tobytes() == scaled.tobytes(), (k, i)
            else:
                np.testing.assert_allclose(got, scaled, rtol=2e-3, err_msg=f"{k=} {i=}")


def test_fold_schedule_keeps_the_order_and_spares_an_aliased_dst():
    for n in range(1, 30):
        for aliases in ([], [0], [n - 1], list(range(n))):
            passes = fold_schedule(n, aliases)
            assert [i for p in passes for i in p.sources] == list(range(n))
            assert all(len(p.sources) + p.accumulate <= MAX_FUSED for p in passes)
            assert [p.accumulate for p in passes] == [False] + [True] * (len(passes) - 1)
            assert [p.last for p in passes] == [False] * (len(passes) - 1) + [True]
            assert not passes[-1].into_scratch
            late = any(a >= MAX_FUSED for a in aliases) and len(passes) > 1
            # a dst read after the first pass: every pass but the last writes scratch
            assert [p.into_scratch for p in passes[:-1]] == [late] * (len(passes) - 1)
    with pytest.raises(ValueError, match="at least one"):
        fold_schedule(0)


def test_to_host_out_takes_any_contiguous_buffer_of_the_size(dev):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    d = dev.from_host(x)
    for stream in (None, dev.new_stream()):
        out = np.zeros((8, 3), np.int32)  # same 96 bytes, another shape and dtype
        assert dev.to_host(d, out=out, stream=stream) is out
        if stream is not None:
            stream.synchronize()
        assert out.tobytes() == x.tobytes()
        for bad in (np.zeros(23, np.float32), np.zeros((4, 12), np.float32)[:, ::2]):
            with pytest.raises(ValueError, match="C-contiguous numpy array of 96 bytes"):
                dev.to_host(d, out=bad, stream=stream)


def test_allocation_for_a_stream(dev):
    s = dev.new_stream()
    z = dev.zeros((3, 5), np.float64, stream=s)
    e = dev.empty(7, np.int32, stream=s)
    s.copy(e, np.arange(7, dtype=np.int32))
    s.synchronize()
    assert z.shape == (3, 5) and e.shape == (7,)
    np.testing.assert_array_equal(dev.to_host(z), np.zeros((3, 5)))
    np.testing.assert_array_equal(dev.to_host(e), np.arange(7))
    with s:  # the stream of an enclosing `with stream:` by default
        y = dev.zeros(4, np.float32)
        s.reduce(y, [y, dev.from_host(np.ones(4, np.float32), stream=s)])
    s.synchronize()
    np.testing.assert_array_equal(dev.to_host(y), np.ones(4))


def test_scaled_reduce_argument_errors_at_enqueue(dev):
    s = dev.new_stream()
    a = dev.zeros(4, np.float32)
    with pytest.raises(ValueError, match="op='sum'"):
        s.reduce(a, [a, a], "max", alpha=0.5)
    with pytest.raises(TypeError, match="alpha"):
        s.reduce(a, [a, a], alpha="0.5")
    i = dev.zeros(4, np.int32)
    with pytest.raises(TypeError):
        s.reduce(i, [i, i], alpha=0.5)
    s.reduce(i, [i, i], alpha=1.0)  # alpha 1 is the plain reduce, integers included
    s.synchronize()
    np.testing.assert_array_equal(dev.to_host(a), 0)


def test_scaled_reduce_now_with_peers_and_float16(host_devs):
    d0, d1 = host_devs(2)
    rng = np.random.default_rng(3)
    x0, x1 = (rng.standard_normal(20_000).astype(np.float32) for _ in range(2))
    y0 = np.empty_like(x0)
    with record_transfers() as log:
        d0.reduce_now(y0, [x0, x1], src_devices=[None, d1], alpha=0.5)
    assert log == [Transfer(1, 0, x1.nbytes, "peer_read")]
    assert y0.tobytes() == ((x0 + x1) * np.float32(0.5)).tobytes()
    h0, h1 = x0.astype(np.float16), x1.astype(np.float16)
    z = np.empty_like(h0)
    d0.reduce_now(z, [h0, h1], alpha=1 / 3)
    want = ((h0.astype(np.float32) + h1.astype(np.float32)) * np.float32(1 / 3)).astype(np.float16)
    assert z.tobytes() == want.tobytes()  # summed and scaled in float32, rounded once


def test_peer_copy_and_peer_reduce(devs):
    d0, d1 = devs
    x1 = d1.from_host(np.arange(64, dtype=np.float32))
    y0 = d0.zeros(64, np.float32)
    s0 = d0.new_stream()
    s0.copy(y0, x1, src_device=d1)
    acc = d0.from_host(np.ones(64, np.float32))
    s0.reduce(acc, [acc, x1], src_devices=[None, d1])
    s0.synchronize()
    np.testing.assert_array_equal(d0.to_host(y0), np.arange(64))
    np.testing.assert_array_equal(d0.to_host(acc), np.arange(64) + 1)


def test_argument_errors_are_raised_at_enqueue(dev):
    s = dev.new_stream()
    a = dev.zeros(4, np.float32)
    with pytest.raises(ValueError, match="equal sizes"):
        s.copy(a, dev.zeros(5, np.float32))
    with pytest.raises(ValueError, match="op must be one of"):
        s.reduce(a, [a], op="mean")
    with pytest.raises(ValueError, match="at least one"):
        s.reduce(a, [])
    with pytest.raises(ValueError, match="srcs\\[1\\]"):
        s.reduce(a, [a, dev.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="src_devices"):
        s.reduce(a, [a], src_devices=[None, None])
    with pytest.raises(TypeError):
        s.call(42)
    s.synchronize()  # nothing was enqueued by the failed calls; the stream is healthy
    assert s.query()


def test_host_kernel_dtype_errors_at_enqueue(host_devs):
    (d,) = host_devs(1)
    s = d.new_stream()
    with pytest.raises(TypeError, match="accepted"):
        s.scale(np.zeros(3, np.int32), 2.0)
    with pytest.raises(TypeError, match="accepted"):
        s.reduce(np.zeros(3, np.uint16), [np.zeros(3, np.uint16)])


def test_copy_moves_bytes_between_dtypes(host_devs):
    (d,) = host_devs(1)
    src = np.arange(4, dtype=np.float32)
    dst = np.zeros(2, np.float64)
    s = d.new_stream()
    s.copy(dst, src)
    s.synchronize()
    assert dst.tobytes() == src.tobytes()


# -- transfer recording (host) --------------------------------------------------------------


def test_record_transfers_sees_cross_device_copies_and_peer_reads(host_devs):
    d0, d1, d2 = host_devs(3)
    a = [d.from_host(np.full(16, i, np.float32)) for i, d in enumerate((d0, d1, d2))]
    s0 = d0.new_stream()
    with record_transfers() as log:
        s0.copy(a[0], a[1], src_device=d1)
        s0.copy(a[0], a[0])  # same device: not a transfer
        s0.copy(a[0], np.zeros(16, np.float32))  # host memory: not a transfer
        s0.reduce(a[0], [a[0], a[1], a[2]], src_devices=[d0, d1, d2])
        s0.synchronize()
    assert log == [
        Transfer(1, 0, 64, "copy"),
        Transfer(1, 0, 64, "peer_read"),
        Transfer(2, 0, 64, "peer_read"),
    ]


def test_record_transfers_records_when_the_op_runs(host_devs):
    d0, d1 = host_devs(2)
    s0 = d0.new_stream()
    gate = threading.Event()
    s0.call(gate.wait, 10)
    x = np.zeros(4, np.float32)
    with record_transfers() as log:
        s0.copy(x, np.ones(4, np.float32), src_device=d1)
        assert log == []  # enqueued, not run
        gate.set()
        s0.synchronize()
        assert log == [Transfer(1, 0, 16, "copy")]
    s0.copy(x, x, src_device=d1)
    s0.synchronize()
    assert len(log) == 1  # closed recorders receive nothing


def test_nested_and_concurrent_recorders(host_devs):
    devs = host_devs(4)
    streams = [d.new_stream() for d in devs]
    bufs = [d.zeros(8, np.float64) for d in devs]
    with record_transfers() as outer:
        with record_transfers() as inner:
            for _ in range(50):
                for i, s in enumerate(streams):
                    j = (i + 1) % 4
                    s.copy(bufs[i], bufs[j], src_device=devs[j])
            for s in streams:
                s.synchronize()
    assert len(inner) == len(outer) == 200
    assert sorted(inner) == sorted(outer)
    assert {(t.src, t.dst) for t in inner} == {(1, 0), (2, 1), (3, 2), (0, 3)}
    assert not host._recorders


def test_push_copy_and_remote_reduce_with_dst_device(devs):
    # work issued on d0's stream that writes into d1's memory
    d0, d1 = devs
    s0 = d0.new_stream()
    x0 = d0.from_host(np.arange(32, dtype=np.float32))
    y1 = d1.zeros(32, np.float32)
    s0.copy(y1, x0, src_device=d0, dst_device=d1)
    z1 = d1.from_host(np.ones(32, np.float32))
    s0.reduce(z1, [z1, x0], src_devices=[d1, d0], dst_device=d1)
    s0.synchronize()
    np.testing.assert_array_equal(d1.to_host(y1), np.arange(32))
    np.testing.assert_array_equal(d1.to_host(z1), np.arange(32) + 1)


def test_dst_device_transfers_are_recorded_as_data_flow(host_devs):
    d0, d1, d2 = host_devs(3)
    s0 = d0.new_stream()
    a = [np.full(8, i, np.float64) for i in range(3)]
    with record_transfers() as log:
        s0.copy(a[1], a[0], src_device=d0, dst_device=d1)  # d0 pushes to d1
        s0.copy(a[2], a[0], dst_device=d2)  # src None: host memory, not recorded
        s0.reduce(a[2], [a[2], a[1]], src_devices=[None, d1], dst_device=d2)
        s0.synchronize()
    assert log == [Transfer(0, 1, 64, "copy"), Transfer(1, 2, 64, "peer_read")]
    np.testing.assert_array_equal(a[2], np.zeros(8))


def test_now_variants_run_in_the_calling_thread_and_record(host_devs):
    d0, d1 = host_devs(2)
    x1 = np.arange(10, dtype=np.float32)
    y0 = np.zeros(10, np.float32)
    gate = threading.Event()
    d0.default_stream.call(gate.wait, 10)  # a busy stream does not delay *_now work
    with record_transfers() as log:
        d0.copy_now(y0, x1, src_device=d1)
        np.testing.assert_array_equal(y0, x1)
        d0.reduce_now(y0, [y0, x1, x1], "max", src_devices=[None, d1, d1])
        np.testing.assert_array_equal(y0, x1)
    gate.set()
    assert log == [
        Transfer(1, 0, 40, "copy"),
        Transfer(1, 0, 40, "peer_read"),
        Transfer(1, 0, 40, "peer_read"),
    ]
    with pytest.raises(ValueError, match="equal sizes"):
        d0.copy_now(y0, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="host device"):
        d0.reduce_now(y0, [y0], src_devices=["cpu:1"])
