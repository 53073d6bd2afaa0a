"""GPU interop on the fake of CuPy (``tests/fakecupy``): wiring only, never GPU
verification. Foreign streams (CuPy's, a torch-like ``cuda_stream`` handle, a raw
``cudaStream_t``) become the stream a call orders against; arrays that expose only
``__cuda_array_interface__`` or only DLPack (as torch's and JAX's do) are viewed without a
copy, the results written into their memory and the caller's objects returned; the object
collectives and the v-collectives run on GPU buffers."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends.cuda import CudaStream
from nccltree.comm.interop import as_stream


@pytest.fixture
def gpu_world(fake_cupy: Any) -> Any:
    devs = nt.devices("gpu:0,1")
    w = nt.World(devs, algorithm="direct", timeout=20)
    yield w
    w.close()
    devs[0].runtime.shutdown()


class _CaiOnly:
    """A foreign GPU array that speaks only the CUDA array interface (as a torch CUDA
    tensor's does, or Numba's)."""

    def __init__(self, arr: Any) -> None:
        self._arr = arr
        self.__cuda_array_interface__ = arr.__cuda_array_interface__


class _DlpackOnly:
    """A foreign GPU array that speaks only DLPack (as a JAX array may)."""

    def __init__(self, arr: Any) -> None:
        self._arr = arr

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._arr.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, int(self._arr.device.id))


def _stream_kinds(cp: Any, owned: list[Any]) -> list[tuple[str, Any, int]]:
    """Each kind, over streams ``owned`` keeps alive (a raw handle does not)."""
    s1, s2, s3 = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    owned += [s1, s2, s3]
    ext = cp.cuda.ExternalStream(s3.ptr)
    return [
        ("cupy stream", s1, s1.ptr),
        ("torch-like stream", types.SimpleNamespace(cuda_stream=s2.ptr), s2.ptr),
        ("raw cudaStream_t", s3.ptr, s3.ptr),
        ("cupy external stream", ext, s3.ptr),
    ]


def test_every_stream_kind_is_the_one_the_call_orders_against(gpu_world: Any, fake_cupy: Any):
    """Wiring: the World records the caller's stream before its work and makes it wait
    for the end, on exactly the stream handle given."""
    import cupy as cp

    dev = gpu_world.devices[0]
    owned: list[Any] = []
    with cp.cuda.Device(0):
        kinds = _stream_kinds(cp, owned)
    for what, stream, ptr in kinds:
        wrapped = as_stream(dev, stream)
        assert isinstance(wrapped, CudaStream) and wrapped.cupy_stream.ptr == ptr, what
        xs = [dev.from_host(np.full(4, 1.0, np.float32)) for dev in gpu_world.devices]
        with cp.cuda.Device(1):
            other = cp.cuda.Stream(non_blocking=True)
        fake_cupy.ops.clear()
        gpu_world.all_reduce(xs, streams=[stream, other])
        records = {op.stream for op in fake_cupy.ops_of("event_record")}
        waits = {op.stream for op in fake_cupy.ops_of("wait_event")}
        assert ptr in records and ptr in waits, what
        for d, x in zip(gpu_world.devices, xs, strict=True):
            assert d.to_host(x).tolist() == [2.0] * 4, what


def test_per_rank_calls_take_foreign_streams(gpu_world: Any, fake_cupy: Any):
    import cupy as cp

    def fn(comm: Any) -> Any:
        with cp.cuda.Device(comm.device.physical_id):
            s = cp.cuda.Stream(non_blocking=True)
            x = comm.device.from_host(np.arange(3, dtype=np.float32))
            comm.all_reduce(x, stream=s.ptr)  # a raw cudaStream_t
            s.synchronize()
            return comm.device.to_host(x).tolist()

    assert gpu_world.run(fn) == [[0.0, 2.0, 4.0]] * 2


def test_a_stream_of_another_gpu_or_of_no_kind_is_refused(gpu_world: Any):
    import cupy as cp

    with cp.cuda.Device(1):
        s1 = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(ValueError, match="belongs to GPU 1"):
        as_stream(gpu_world.devices[0], s1)
    with pytest.raises(TypeError, match="stream= takes"):
        as_stream(gpu_world.devices[0], "stream")


@pytest.mark.parametrize("wrap", [_CaiOnly, _DlpackOnly])
def test_foreign_gpu_arrays_are_viewed_and_written_in_place(gpu_world: Any, wrap: Any):
    raw = [d.from_host(np.full(5, r + 1.0, np.float32)) for r, d in enumerate(gpu_world.devices)]
    foreign = [wrap(a) for a in raw]
    got = gpu_world.all_reduce(foreign, op="sum")
    assert got[0] is foreign[0] and got[1] is foreign[1]  # the caller's objects
    for d, a in zip(gpu_world.devices, raw, strict=True):
        assert d.to_host(a).tolist() == [3.0] * 5  # written into the wrapped memory

    def fn(comm: Any) -> Any:
        out = comm.all_reduce(foreign[comm.rank], op="max")
        return out is foreign[comm.rank]

    assert gpu_world.run(fn) == [True, True]


def test_object_and_v_collectives_on_gpu_buffers(gpu_world: Any):
    assert gpu_world.all_gather_object([{"a": 1}, [2]]) == [[{"a": 1}, [2]]] * 2

    def fn(comm: Any) -> Any:
        dev = comm.device
        got = comm.broadcast_object({"cfg": "x"} if comm.rank == 0 else None, 0)
        x = dev.from_host(np.arange(comm.rank + 1, dtype=np.float32))
        out = dev.zeros(3, np.float32)
        comm.all_gather_v(x, out, [1, 2])
        y = dev.from_host(np.arange(3, dtype=np.float32) + comm.rank)
        red = dev.zeros(comm.rank + 1, np.float32)
        comm.reduce_scatter_v(y, red, [1, 2])
        dev.synchronize()
        return got, dev.to_host(out).tolist(), dev.to_host(red).tolist()

    r0, r1 = gpu_world.run(fn)
    assert r0[0] == r1[0] == {"cfg": "x"}
    assert r0[1] == r1[1] == [0.0, 0.0, 1.0]
    assert r0[2] == [1.0] and r1[2] == [3.0, 5.0]
    xs = [d.from_host(np.arange(3, dtype=np.float32)) for d in gpu_world.devices]
    outs = [d.zeros(c, np.float32) for d, c in zip(gpu_world.devices, (2, 1), strict=True)]
    gpu_world.reduce_scatter_v(xs, outs, [2, 1])
    assert gpu_world.devices[1].to_host(outs[1]).tolist() == [4.0]
