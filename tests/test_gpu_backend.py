"""The CUDA backend on one GPU: failed ops reported at once, page-locked memory that is
released, long reduces into one of their sources, host buffers of any shape, and
allocations ordered by the stream that uses them, under jitter.

Every test needs a GPU (skipped without one); none needs a second GPU.
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.memory import PinnedPool, size_class

pytestmark = pytest.mark.gpu

_HOST = 1  # cudaMemoryTypeHost: page-locked host memory

# spins one thread for a number of clock cycles: delays a stream without any host wait
_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _cupy() -> Any:
    import cupy

    return cupy


def _memory_type(ptr: int) -> int:
    rt = _cupy().cuda.runtime
    try:
        return int(rt.pointerGetAttributes(ptr).type)
    except rt.CUDARuntimeError:
        return 0  # older drivers refuse pointers CUDA does not know: not page-locked


@pytest.fixture
def gpu0() -> Iterator[nt.Device]:
    (dev,) = nt.devices("gpu:0")
    yield dev
    dev.runtime.shutdown()


@functools.cache
def _spin_kernel() -> Any:
    return _cupy().RawKernel(_SPIN, "spin")


def _spin(stream: Any, cycles: int) -> None:
    with _cupy().cuda.Device(stream.device.physical_id):
        _spin_kernel()((1,), (1,), (np.int64(cycles),), stream=stream.cupy_stream)


def test_pinned_memory_is_page_locked_and_trim_unpins_it() -> None:
    a = nt.pinned_empty((3, 1000), np.float64)
    assert _memory_type(a.ctypes.data) == _HOST
    assert _memory_type(a.ctypes.data + a.nbytes - 1) == _HOST
    pool = PinnedPool(max_bytes=64 << 20)  # page-locked: a GPU is usable
    b = pool.alloc(5 << 20, np.uint8)
    ptr = b.ctypes.data
    assert _memory_type(ptr) == _HOST
    pool.free(b)
    del b
    assert _memory_type(ptr) == _HOST  # cached for reuse: still locked
    assert pool.trim() == size_class(5 << 20)
    gc.collect()
    assert _memory_type(ptr) != _HOST  # unpinned and freed, not kept by a CuPy pool


_TRAP = r"""
import os
import sys

import cupy

import nccltree as nt

(dev,) = nt.devices("gpu:0")
s = dev.new_stream()
spin = cupy.RawKernel(sys.argv[1], "spin")
trap = cupy.RawKernel('extern "C" __global__ void f() { __trap(); }', "f")
with cupy.cuda.Device(dev.physical_id):
    # the spin keeps the stream busy, so the event is recorded before the trap runs
    spin((1,), (1,), (cupy.int64(100_000_000),), stream=s.cupy_stream)
    trap((1,), (1,), (), stream=s.cupy_stream)
ev = s.record()
try:
    s.synchronize(timeout=30)
except nt.CommError as exc:
    status = getattr(exc, "status", None)
    print("raised", type(exc).__name__, isinstance(exc, nt.CommTimeout), status, flush=True)
    try:
        s.query()
    except nt.CommError as again:
        print("sticky", again is exc, flush=True)
    try:
        ev.synchronize(timeout=30)
    except nt.CommError as from_event:
        print("event", type(from_event).__name__, flush=True)
else:
    print("no error", flush=True)
sys.stdout.flush()
os._exit(0)  # skip CuPy's teardown in a context the trap has broken
"""


def test_a_faulting_kernel_raises_at_once() -> None:
    # in a subprocess: a trap leaves the process's CUDA context unusable
    proc = subprocess.run(
        [sys.executable, "-c", _TRAP, _SPIN], capture_output=True, text=True, timeout=180
    )
    out = proc.stdout.split()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a CudaError with a CUDA status, not a CommTimeout after 30 s of a "pending" stream
    assert out[:3] == ["raised", "CudaError", "False"], proc.stdout + proc.stderr
    assert out[3] not in ("0", "600", "None")  # a CUDA error status
    assert "sticky True" in proc.stdout
    assert "event CudaError" in proc.stdout


def test_query_is_false_while_work_is_pending(gpu0: nt.Device) -> None:
    s = gpu0.new_stream()
    _spin(s, 500_000_000)  # 0.2 s or more of work on SMs clocked up to 2.5 GHz
    ev = s.record()
    assert not s.query()
    assert not ev.query()
    s.synchronize(timeout=60)
    assert s.query() and ev.query()


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_reduce_into_a_source_past_the_first_kernel_pass(gpu0: nt.Device, dtype: Any) -> None:
    rng = np.random.default_rng(11)
    s = gpu0.new_stream()
    for k in range(9, 13):
        xs = [rng.integers(-1000, 1000, 4099).astype(dtype) for _ in range(k)]
        want = np.sum(xs, axis=0, dtype=dtype)  # exact: small integers
        for i in range(8, k):
            srcs = [gpu0.from_host(x) for x in xs]
            s.reduce(srcs[i], srcs)
            s.synchronize(timeout=60)
            np.testing.assert_array_equal(gpu0.to_host(srcs[i]), want, err_msg=f"{k=} {i=}")


def test_to_host_into_a_buffer_of_another_shape(gpu0: nt.Device) -> None:
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    g = gpu0.from_host(x)
    out = np.zeros((8, 8, 64), np.int32)
    assert gpu0.to_host(g, out=out) is out
    assert out.tobytes() == x.tobytes()
    pinned = nt.pinned_empty(x.nbytes, np.uint8)
    s = gpu0.new_stream()
    assert gpu0.to_host(g, out=pinned, stream=s) is pinned
    s.synchronize(timeout=60)
    assert pinned.tobytes() == x.tobytes()


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_stream_allocations_and_collectives_back_to_back_under_jitter(alg: str) -> None:
    # Two logical ranks share GPU 0, so a block one rank frees could be handed to the
    # other while work on the first rank's streams still uses it, unless every allocation
    # is made for the stream that uses it. Random spins keep that work pending.
    devs = nt.devices("gpu:0,0")
    rng = np.random.default_rng(len(alg))
    streams = [d.new_stream() for d in devs]
    checks = []
    try:
        with nt.World(devs, algorithm=alg, timeout=60) as world:
            for it in range(60):
                n = int(rng.integers(1, 5000))
                hosts = [rng.integers(-1000, 1000, n).astype(np.float32) for _ in devs]
                for s in streams:
                    _spin(s, int(rng.integers(0, 200_000)))
                xs = [d.from_host(h, stream=s) for d, h, s in zip(devs, hosts, streams)]
                if it % 2:
                    outs = [d.empty(n, np.float32, stream=s) for d, s in zip(devs, streams)]
                    world.all_reduce(xs, outs=outs, streams=streams)
                else:
                    outs = xs
                    world.all_reduce(xs, streams=streams)
                got = [d.to_host(o, stream=s) for d, o, s in zip(devs, outs, streams)]
                checks.append((hosts, got))
                del xs, outs  # back to the pool while the streams may still use them
            for s in streams:
                s.synchronize(timeout=60)
    finally:
        devs[0].runtime.shutdown()
    for it, (hosts, got) in enumerate(checks):
        for r, g in enumerate(got):
            np.testing.assert_array_equal(g, hosts[0] + hosts[1], err_msg=f"{it=} {r=}")


# -- topology detection (here, not in test_topology.py: that module needs hypothesis,
# which a GPU machine may lack) --


@pytest.mark.gpu
def test_detect_real_gpu_shared_by_two_ranks():
    devs = nt.devices("gpu:0,0")
    try:
        topo = nt.Topology.detect(devs)
    finally:
        devs[0].runtime.shutdown()
    assert topo.link(0, 1) == nt.Link(nt.LinkKind.SAME_DEVICE)


@pytest.mark.multi_gpu(2)
def test_detect_real_gpus():
    devs = nt.devices("gpu:all")
    try:
        topo = nt.Topology.detect(devs)
    finally:
        devs[0].runtime.shutdown()
    assert topo.n == len(devs)
    for i in range(topo.n):
        for j in range(topo.n):
            assert (topo.link(i, j).kind == nt.LinkKind.SELF) == (i == j)
