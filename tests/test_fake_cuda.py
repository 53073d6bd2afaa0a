"""Wiring tests of nccltree's CUDA backend and kernels on a fake of CuPy's layer.

These run nccltree's own, unmodified CUDA code (``backends/cuda.py``, ``_cuda_kernels.py``,
``memory.py``, ``World``) on ``tests/fakecupy``: they check that CuPy, the CUDA runtime and
NVRTC are called with the right names, pointers, sizes, devices and streams, and that the
results are bitwise those of numpy. They check wiring only: they are not GPU verification
and never count as such.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree import _cuda_kernels as kernels
from nccltree.backends.cuda import CudaError

two_gpus_no_peer = pytest.mark.parametrize(
    "fake_cupy", [{"n_gpus": 2, "peer": False}], indirect=True
)


@pytest.fixture
def gpus(fake_cupy: Any) -> Any:
    """``gpus(spec)`` -> CUDA devices on the fake, shut down after the test."""
    made = []

    def make(spec: str) -> list[nt.Device]:
        devs = nt.devices(spec)
        made.append(devs[0].runtime)
        return devs

    yield make
    for rt in made:
        rt.shutdown()


def _data(n: int, dtype: Any, seed: int) -> np.ndarray:
    # small integers: every sum below is exact, so any order of summation agrees bitwise
    return np.random.default_rng(seed).integers(-8, 9, n).astype(dtype)


# -- the fake itself is strict -------------------------------------------------------------


def test_fake_rejects_wrong_arity_and_non_int_pointers(fake_cupy: Any) -> None:
    """The fake keeps CuPy's exact signatures (wiring check, not GPU verification)."""
    import cupy as cp

    rt = cp.cuda.runtime
    a = cp.zeros(4, np.float32)
    b = cp.zeros(4, np.float32)
    with pytest.raises(TypeError):
        rt.memcpyAsync(a.data.ptr, b.data.ptr, 16, 4)  # no stream argument
    with pytest.raises(TypeError):
        rt.memcpyAsync(a.data.ptr, b.data.ptr, 16, 4, 0, 0)
    with pytest.raises(TypeError):
        rt.memcpyAsync(a.data, b.data.ptr, 16, 4, 0)  # a MemoryPointer, not an int
    with pytest.raises(TypeError):
        rt.memcpyAsync(float(a.data.ptr), b.data.ptr, 16, 4, 0)
    with pytest.raises(TypeError):
        rt.streamQuery(cp.cuda.Stream(non_blocking=True))  # the Stream, not its ptr
    with pytest.raises(TypeError):
        cp.RawModule(code="", options=["-O3"])  # options must be a tuple
    with pytest.raises(TypeError):
        cp.cuda.get_current_stream(None)  # CuPy 14.2: an int device id, -1 for current


def test_fake_rejects_pointers_outside_allocations(fake_cupy: Any) -> None:
    """Copies past an allocation, to freed memory or through a handle fail as on CUDA."""
    import cupy as cp

    rt = cp.cuda.runtime
    a = cp.zeros(4, np.float32)
    b = cp.zeros(8, np.float32)
    with pytest.raises(rt.CUDARuntimeError) as err:
        rt.memcpyAsync(a.data.ptr, b.data.ptr, b.nbytes, 4, 0)  # 32 bytes into 16
    assert err.value.status == 1
    s = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(rt.CUDARuntimeError):
        rt.memcpyAsync(a.data.ptr, s.ptr, 16, 4, 0)  # a stream handle is no memory
    stale = b.data.ptr
    del b
    gc.collect()
    with pytest.raises(rt.CUDARuntimeError):
        rt.memcpyAsync(a.data.ptr, stale, 16, 4, 0)
    with pytest.raises(rt.CUDARuntimeError) as err:
        rt.memcpyPeerAsync(a.data.ptr, 1, a.data.ptr, 0, 16, 0)  # a is on GPU 0, not 1
    assert err.value.status == 1


def test_fake_status_queries_never_raise(fake_cupy: Any) -> None:
    """CuPy's trap: done compares with 0, queries return the status, sync raises."""
    import cupy as cp

    rt = cp.cuda.runtime
    s = cp.cuda.Stream(non_blocking=True)
    ev = s.record()
    assert s.done and ev.done
    fake_cupy.fail_stream(s, 700)
    assert rt.streamQuery(s.ptr) == 700
    assert not s.done  # looks pending forever: never raises
    assert ev.done  # recorded before the failure
    ev2 = s.record()
    assert rt.eventQuery(ev2.ptr) == 700 and not ev2.done
    with pytest.raises(rt.CUDARuntimeError) as err:
        s.synchronize()
    assert err.value.status == 700
    t = cp.cuda.Stream(non_blocking=True)
    token = fake_cupy.hang_stream(t)
    ev3 = t.record()
    assert rt.eventQuery(ev3.ptr) == 600
    u = cp.cuda.Stream(non_blocking=True)
    u.wait_event(ev3)
    assert rt.streamQuery(u.ptr) == 600  # waiting on pending work makes it pending
    token.release()
    assert rt.streamQuery(u.ptr) == 0 and ev3.done


def test_fake_stream_rules(fake_cupy: Any) -> None:
    """A stream becomes current only on its own GPU; kernels need a stream of the current
    GPU; events record only on their own GPU (wiring check, not GPU verification)."""
    import cupy as cp

    with cp.cuda.Device(1):
        s1 = cp.cuda.Stream(non_blocking=True)
        ev1 = cp.cuda.Event()
    with pytest.raises(RuntimeError):
        with s1:
            pass
    s0 = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
        ev1.record(s0)
    with cp.cuda.Device(1), s1:
        assert cp.cuda.get_current_stream() == s1
    assert cp.cuda.get_current_stream(1) == cp.cuda.Stream.null


def test_fake_nccl_group_error_launches_nothing(fake_cupy: Any) -> None:
    """NCCL group semantics (src/group.cc): an error inside the group is raised by the call
    and by groupEnd, and nothing of the group runs (wiring check, not GPU verification)."""
    import cupy as cp
    from cupy.cuda import nccl

    comms = nccl.NcclCommunicator.initAll([0, 1])
    xs = []
    for d in (0, 1):
        with cp.cuda.Device(d):
            xs.append(cp.asarray(np.full(4, d + 1, np.float32)))
    nccl.groupStart()
    comms[0].allReduce(xs[0].data.ptr, xs[0].data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    with pytest.raises(nccl.NcclError) as err:
        # rank 1 passes rank 0's buffer: not on its GPU
        comms[1].allReduce(xs[0].data.ptr, xs[1].data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    assert err.value.status == nccl.ncclInvalidArgument
    with pytest.raises(nccl.NcclError) as err:
        nccl.groupEnd()
    assert err.value.status == nccl.ncclInvalidArgument
    assert not any(c.executed for c in fake_cupy.nccl.calls)
    assert xs[0].get().tolist() == [1.0] * 4
    # the same group with correct arguments runs
    nccl.groupStart()
    for r in (0, 1):
        comms[r].allReduce(xs[r].data.ptr, xs[r].data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    nccl.groupEnd()
    assert xs[0].get().tolist() == xs[1].get().tolist() == [3.0] * 4
    with pytest.raises(TypeError):
        comms[0].allReduce(xs[0].data.ptr, xs[0].data.ptr, 4, nccl.NCCL_FLOAT32, 0)
    comms[0].abort()
    with pytest.raises(nccl.NcclError):
        comms[0].rank_id()


def test_fake_kernel_checks_arguments(fake_cupy: Any) -> None:
    """A kernel argument of the wrong C type, or a pointer of another GPU without peer
    access, is caught (wiring check, not GPU verification)."""
    import cupy as cp
    import fakecupy

    mod = kernels.module(0)
    fn = mod.get_function("nt_scale_f32")
    x = cp.zeros(4, np.float32)
    with pytest.raises(fakecupy.FakeMisuse):
        fn((1,), (256,), (x, 2.0, np.int64(4)))  # a double where the kernel reads a float
    fake_cupy.misuse.clear()
    with cp.cuda.Device(1):
        y = cp.zeros(4, np.float32)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as err:
        fn((1,), (256,), (y, np.float32(2), np.int64(4)))  # y is on GPU 1, no peer access
    assert err.value.status == 700


# -- the backend on the fake ----------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["tree", "ring", "direct"])
@pytest.mark.parametrize("spec", ["gpu:0,1", "gpu:0,1,2,3", "gpu:0,0,0,0"])
def test_world_all_reduce_bitwise(gpus: Any, fake_cupy: Any, spec: str, algorithm: str) -> None:
    """Hand-built algorithms on CUDA devices, distinct GPUs and logical ranks of one GPU:
    results bitwise numpy's (wiring check, not GPU verification)."""
    devs = gpus(spec)
    n = 1000
    host = [_data(n, np.float32, r) for r in range(len(devs))]
    xs = [d.from_host(h) for d, h in zip(devs, host, strict=True)]
    with nt.World(devs, algorithm=algorithm) as world:
        world.all_reduce(xs)
    want = np.sum(host, axis=0, dtype=np.float32)
    for d, x in zip(devs, xs, strict=True):
        assert x.device.id == d.physical_id
        np.testing.assert_array_equal(x.get(), want)
    assert fake_cupy.launches, "the reductions ran as kernels"
    for launch in fake_cupy.launches:
        assert launch.name.startswith(("nt_reduce_n_", "nt_sum_into_", "nt_scale_"))


@pytest.mark.parametrize(
    ("op", "dtype"),
    [(op, dt) for op in ("sum", "max", "min") for dt in (np.float16, np.float32, np.float64,
                                                         np.int32)]
    + [("mean", dt) for dt in (np.float16, np.float32, np.float64)],
)  # fmt: skip
def test_world_ops_and_dtypes(gpus: Any, op: str, dtype: Any) -> None:
    """Every op and dtype through the tree on two GPUs (wiring check, not GPU
    verification)."""
    devs = gpus("gpu:0,1")
    host = [_data(64, dtype, 10 + r) for r in range(2)]
    xs = [d.from_host(h) for d, h in zip(devs, host, strict=True)]
    with nt.World(devs, algorithm="tree") as world:
        world.all_reduce(xs, op=op)
    a, b = host
    acc = {"sum": a + b, "max": np.maximum(a, b), "min": np.minimum(a, b)}
    want = acc[op] if op != "mean" else ((a.astype(np.float32) + b) * 0.5).astype(dtype)
    for x in xs:
        np.testing.assert_array_equal(x.get(), want)


def test_stream_copy_between_gpus_uses_peer_copy(gpus: Any, fake_cupy: Any) -> None:
    """Stream.copy across GPUs: one cudaMemcpyPeerAsync with both pointers and GPUs right,
    on the stream's handle (wiring check, not GPU verification)."""
    d0, d1 = gpus("gpu:0,1")
    src = d0.from_host(np.arange(16, dtype=np.float32))
    dst = d1.zeros((16,), "float32")
    s = d1.new_stream()
    before = len(fake_cupy.ops)
    s.copy(dst, src, src_device=d0, dst_device=d1)
    s.synchronize()
    peer = [op for op in fake_cupy.ops[before:] if op.kind == "memcpy_peer"]
    assert len(peer) == 1
    op = peer[0]
    assert (op.dst, op.src, op.nbytes) == (dst.data.ptr, src.data.ptr, 64)
    assert op.detail.startswith("0->1")
    assert op.stream == s.cupy_stream.ptr and op.device == 1
    np.testing.assert_array_equal(dst.get(), np.arange(16, dtype=np.float32))


@two_gpus_no_peer
def test_reduce_without_peer_access_stages_sources(gpus: Any, fake_cupy: Any) -> None:
    """Without peer access, sources of another GPU are copied in before the kernel reads
    them (wiring check, not GPU verification)."""
    d0, d1 = gpus("gpu:0,1")
    a, b = _data(32, np.float32, 1), _data(32, np.float32, 2)
    xa, xb = d0.from_host(a), d1.from_host(b)
    s = d0.new_stream()
    s.reduce(xa, [xa, xb], src_devices=[d0, d1])
    s.synchronize()
    np.testing.assert_array_equal(xa.get(), a + b)
    assert fake_cupy.ops_of("memcpy_peer")


def test_reduce_n_bitwise_every_op_and_dtype(gpus: Any, fake_cupy: Any) -> None:
    """_cuda_kernels.reduce_n against numpy, every op and dtype, one launch each
    (wiring check, not GPU verification)."""
    (d0,) = gpus("gpu:0")
    import cupy as cp

    for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
        host = [_data(37, dtype, 20 + j) for j in range(3)]
        srcs = [d0.from_host(h) for h in host]
        for op, fn in (("sum", np.add), ("prod", np.multiply), ("max", np.maximum),
                       ("min", np.minimum)):  # fmt: skip
            out = cp.empty(37, dtype)
            kernels.reduce_n(out, srcs, op)
            want = fn(fn(host[0], host[1]), host[2])
            np.testing.assert_array_equal(out.get(), want)
    assert fake_cupy.launches[-1].args[2] == 3  # k
    assert fake_cupy.launches[-1].args[1][:3] == tuple(s.data.ptr for s in srcs)


def _subnormal_case() -> tuple[np.ndarray, np.ndarray]:
    tiny = np.finfo(np.float32).tiny
    a = np.array([tiny / 4, -tiny / 8, tiny, 1.0, tiny / 2], np.float32)
    b = np.array([tiny / 4, tiny / 16, -tiny / 2, 2.0, 0.0], np.float32)
    return a, b


@pytest.mark.parametrize("origin", ["fatbin", "source"])
def test_float32_subnormals_kept_on_both_module_origins(
    gpus: Any, fake_cupy: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, origin: str
) -> None:
    """The module from the fatbin and the one compiled at run time keep
    float32 subnormals (no -ftz=true); a fake fatbin is put on the package path for the
    first (wiring check, not GPU verification)."""
    import fakecupy

    if origin == "fatbin":
        fakecupy.write_fatbin(tmp_path / "pkg" / "_lib" / kernels.FATBIN, ["sm_90"])
        # first on the package path, before any fatbin of a real build
        monkeypatch.setattr(nt, "__path__", [str(tmp_path / "pkg"), *nt.__path__])
    (d0,) = gpus("gpu:0")
    a, b = _subnormal_case()
    xa, xb = d0.from_host(a), d0.from_host(b)
    kernels.sum_into(xa, xb)
    np.testing.assert_array_equal(xa.get(), a + b)
    assert kernels.origin(0) == origin
    assert not fake_cupy.launches[-1].ftz
    assert fake_cupy.launches[-1].origin == "path"  # loaded by path: a cubin or the fatbin


def test_fatbin_without_an_image_for_the_gpu_falls_back_to_source(
    gpus: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fatbin for other GPUs does not load; the source is compiled instead (wiring check,
    not GPU verification)."""
    import fakecupy

    fakecupy.write_fatbin(tmp_path / "pkg" / "_lib" / kernels.FATBIN, ["sm_80"])
    monkeypatch.setattr(nt, "__path__", [str(tmp_path / "pkg"), *nt.__path__])
    (d0,) = gpus("gpu:0")
    x = d0.from_host(np.ones(8, np.float32))
    d0.scale(x, 3.0)
    assert kernels.origin(0) == "source"
    np.testing.assert_array_equal(x.get(), np.full(8, 3, np.float32))


def test_raw_module_from_code_flushes_subnormals(fake_cupy: Any) -> None:
    """The trap the NVRTC call avoids: CuPy's RawModule(code=) appends -ftz=true (the fake
    reproduces it, so a regression to that path is caught)."""
    import cupy as cp

    mod = cp.RawModule(code=kernels.source_text(), options=kernels.NVRTC_OPTIONS)
    a, b = _subnormal_case()
    xa, xb = cp.asarray(a), cp.asarray(b)
    mod.get_function("nt_sum_into_f32")((1,), (256,), (xa, xb, np.int64(a.size)))
    got = xa.get()
    assert fake_cupy.launches[-1].ftz
    assert got[0] == 0.0 and (a + b)[0] != 0.0


# -- the CUDA paths' known traps, through the public API -------------------------------------


def test_failed_stream_raises_at_once(fake_cupy: Any) -> None:
    """A failed op raises its CUDA error at once, not a timeout (wiring
    check, not GPU verification). The device is not shut down: its failed stream would
    (rightly) raise there too."""
    (d0,) = nt.devices("gpu:0")
    s = d0.new_stream()
    fake_cupy.fail_stream(s, 700)
    with pytest.raises(CudaError) as err:
        s.synchronize(timeout=30)
    assert err.value.status == 700
    with pytest.raises(CudaError):
        s.query()
    ev = d0.new_event()
    ev.record(s)
    with pytest.raises(CudaError):
        ev.synchronize(timeout=30)


def test_from_host_allocates_on_the_stream_that_writes(gpus: Any, fake_cupy: Any) -> None:
    """Memory is allocated in the pool arena of the stream that writes it
    (wiring check, not GPU verification)."""
    (d0,) = gpus("gpu:0")
    s = d0.new_stream()
    x = d0.from_host(np.arange(8, dtype=np.float32), stream=s)
    s.synchronize()
    assert fake_cupy.allocation_of(x).stream == s.cupy_stream.ptr
    np.testing.assert_array_equal(x.get(), np.arange(8, dtype=np.float32))
    z = d0.zeros((8,), "float32", stream=s)
    memsets = [op for op in fake_cupy.ops_of("memset") if op.dst == z.data.ptr]
    assert memsets and all(op.stream == s.cupy_stream.ptr for op in memsets)
    assert fake_cupy.allocation_of(z).stream == s.cupy_stream.ptr


def test_synced_memory_on_a_gpu(gpus: Any, fake_cupy: Any) -> None:
    """SyncedMemory's head moves through host and device copies on the device given
    (wiring check, not GPU verification)."""
    _, d1 = gpus("gpu:0,1")
    m = nt.SyncedMemory((6,), "float32", d1)
    m.mutable_host()[...] = np.arange(6)
    dev = m.device_array()
    assert dev.device.id == 1 and m.head == "synced"
    np.testing.assert_array_equal(dev.get(), np.arange(6, dtype=np.float32))
    m.mutable_device_array().fill(0)
    np.testing.assert_array_equal(m.host(), np.zeros(6, np.float32))


def test_pinned_memory_is_page_locked_and_trim_unpins(gpus: Any, fake_cupy: Any) -> None:
    """Pinned buffers are exactly their size, page-locked through
    cudaHostAlloc, and PinnedPool.trim() unpins them (wiring check, not GPU
    verification)."""
    gpus("gpu:0")
    base = fake_cupy.pinned_bytes()
    a = nt.pinned_empty((600,), "uint8")
    assert fake_cupy.pinned_bytes() - base == 600  # not CuPy's power-of-two block
    block = fake_cupy.allocation_of(a)
    assert block.kind == "pinned" and block.size == 600
    del a
    gc.collect()
    assert fake_cupy.pinned_bytes() == base
    pool = nt.PinnedPool(max_bytes=1 << 20)
    arrs = [pool.alloc((1000,), "float32") for _ in range(3)]
    locked = fake_cupy.pinned_bytes() - base
    assert locked > 0
    for arr in arrs:
        pool.free(arr)
    del arrs, arr
    assert fake_cupy.pinned_bytes() - base == locked  # cached: still locked, reusable
    pool.trim()
    gc.collect()
    assert fake_cupy.pinned_bytes() == base


def test_reduce_into_peer_buffer_stores_directly(gpus: Any, fake_cupy: Any) -> None:
    """With peer access, reducing into a peer's buffer launches one
    kernel writing it, with no temporary and no copy (wiring check, not GPU
    verification)."""
    d0, d1 = gpus("gpu:0,1")
    a, b = _data(64, np.float32, 3), _data(64, np.float32, 4)
    xa, xb = d0.from_host(a), d1.from_host(b)
    s = d0.new_stream()
    n_alloc = len(fake_cupy.device_allocations())
    before = len(fake_cupy.ops)
    s.reduce(xb, [xa, xb], src_devices=[d0, d1], dst_device=d1)
    s.synchronize()
    new_ops = fake_cupy.ops[before:]
    np.testing.assert_array_equal(xb.get(), a + b)
    assert [op.kind for op in new_ops if op.kind.startswith("memcpy")] == []
    kernel_ops = [op for op in new_ops if op.kind == "kernel"]
    assert len(kernel_ops) == 1 and kernel_ops[0].dst == xb.data.ptr
    assert kernel_ops[0].device == 0  # runs on the stream's GPU, stores over peer access
    assert len(fake_cupy.device_allocations()) == n_alloc


@pytest.mark.parametrize(
    "fake_cupy", [{"n_gpus": 3, "peer": True}], indirect=True
)  # fmt: skip
def test_peer_access_error_means_no_peer_access(gpus: Any, fake_cupy: Any) -> None:
    """CudaErrorTooManyPeers records the pair as having no peer access
    instead of failing device creation (wiring check, not GPU verification)."""
    fake_cupy.set_peer_error(0, 2, 711)
    with pytest.warns(RuntimeWarning, match="peer access"):
        d0, d1, d2 = gpus("gpu:0,1,2")
    assert d0.can_access_peer(d1) and not d0.can_access_peer(d2)
    assert (0, 2) not in fake_cupy.peer_enabled
    x0, x2 = d0.from_host(np.ones(8, np.float32)), d2.from_host(np.ones(8, np.float32))
    s = d0.new_stream()
    s.reduce(x0, [x0, x2], src_devices=[d0, d2])
    s.synchronize()
    np.testing.assert_array_equal(x0.get(), np.full(8, 2, np.float32))


@pytest.mark.parametrize("k", [8, 9, 11])
def test_reduce_many_sources_into_a_late_source(gpus: Any, k: int) -> None:
    """More than 8 sources with dst == srcs[k], k >= 8 (wiring check,
    not GPU verification)."""
    (d0,) = gpus("gpu:0")
    host = [_data(40, np.float32, 30 + j) for j in range(12)]
    xs = [d0.from_host(h) for h in host]
    s = d0.new_stream()
    s.reduce(xs[k], xs)
    s.synchronize()
    np.testing.assert_array_equal(xs[k].get(), np.sum(host, axis=0, dtype=np.float32))


def test_to_host_out_of_any_shape_without_stream(gpus: Any) -> None:
    """To_host(out=) takes any writable buffer of the same size, with
    or without a stream (wiring check, not GPU verification)."""
    (d0,) = gpus("gpu:0")
    x = d0.from_host(np.arange(12, dtype=np.float32).reshape(3, 4))
    out = np.empty(48, np.uint8)
    res = d0.to_host(x, out=out)
    assert res is out
    np.testing.assert_array_equal(out.view(np.float32), np.arange(12, dtype=np.float32))
    out2 = np.empty((4, 3), np.float32)
    s = d0.new_stream()
    d0.to_host(x, out=out2, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(out2.ravel(), np.arange(12, dtype=np.float32))
