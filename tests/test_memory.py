"""pinned_empty, PinnedPool and SyncedMemory's head state machine."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import nccltree as nt
from nccltree.memory import PinnedPool, size_class

# -- pinned_empty ---------------------------------------------------------------------------


def test_pinned_empty_shape_dtype_alignment():
    a = nt.pinned_empty((3, 5), np.float64)
    assert a.shape == (3, 5) and a.dtype == np.float64 and a.flags.c_contiguous
    assert a.ctypes.data % 64 == 0
    a[...] = 1.5  # writable
    assert nt.pinned_empty(0, np.float32).size == 0
    b = nt.pinned_empty(10, np.int32, pinned=False)
    assert b.ctypes.data % 64 == 0


@pytest.mark.gpu
def test_pinned_empty_is_page_locked_on_gpu_machines():
    import cupy

    a = nt.pinned_empty(1 << 16, np.float32)
    attrs = cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    assert attrs.type == 1  # cudaMemoryTypeHost: page-locked host memory
    pool = PinnedPool(max_bytes=1 << 20)
    b = pool.alloc(1000, np.float32)
    assert cupy.cuda.runtime.pointerGetAttributes(b.ctypes.data).type == 1


class _FakeHostRuntime:
    """``cudaHostAlloc``/``cudaFreeHost`` as CuPy 14's runtime module spells them, backed by
    plain numpy buffers: checks what nccltree asks of the runtime, not page-locking (the
    ``gpu`` tests check that)."""

    def __init__(self) -> None:
        self.live: dict[int, np.ndarray] = {}
        self.calls: list[tuple] = []

    def hostAlloc(self, size: int, flags: int) -> int:
        buf = np.empty(size, np.uint8)
        self.live[buf.ctypes.data] = buf
        self.calls.append(("hostAlloc", size, flags))
        return buf.ctypes.data

    def freeHost(self, ptr: int) -> None:
        del self.live[ptr]
        self.calls.append(("freeHost", ptr))


@pytest.fixture
def fake_host_runtime(monkeypatch):
    from types import SimpleNamespace

    from nccltree.backends import cuda

    rt = _FakeHostRuntime()
    monkeypatch.setattr(cuda, "_cupy", lambda: SimpleNamespace(cuda=SimpleNamespace(runtime=rt)))
    return rt


def test_cuda_pinned_memory_is_exact_and_freed_with_its_last_view(fake_host_runtime):
    from nccltree.backends.cuda import pinned_empty as cuda_pinned_empty

    rt = fake_host_runtime
    a = cuda_pinned_empty((600, 1000), np.float32)  # CuPy's pool would lock 4 MiB
    assert a.shape == (600, 1000) and a.dtype == np.float32 and a.flags.c_contiguous
    assert rt.calls == [("hostAlloc", 2_400_000, 1)]  # exact size, portable
    ptr = a.ctypes.data
    a[...] = 7
    view = a[10:20].reshape(-1)
    del a
    gc.collect()
    assert ptr in rt.live  # a view keeps the block
    assert (view == 7).all()
    del view
    assert rt.calls[-1] == ("freeHost", ptr) and not rt.live
    assert cuda_pinned_empty(0, np.float64).size == 0  # an empty array still owns a byte


def test_pool_trim_frees_pinned_blocks(fake_host_runtime, monkeypatch):
    from nccltree import memory

    monkeypatch.setattr(memory, "_use_cuda_pinned", lambda: True)
    rt = fake_host_runtime
    pool = PinnedPool(max_bytes=240_000)  # locked bytes: blocks in use plus cached
    a, b = pool.alloc(1000, np.float32), pool.alloc(50_000, np.uint8)
    assert sorted(c[1] for c in rt.calls) == sorted([size_class(4000), size_class(50_000)])
    pool.free(a)
    pool.free(b)
    del a, b
    assert len(rt.live) == 2  # cached blocks stay allocated for reuse
    c = pool.alloc(200_000, np.uint8)  # room for it: the larger cached block is freed
    assert len(rt.live) == 2 and pool.stats().cached_bytes == size_class(4000)
    assert pool.trim() == size_class(4000)
    assert len(rt.live) == 1  # the trimmed block was freed
    pool.free(c)
    del c
    pool.trim()
    assert not rt.live


# -- PinnedPool -----------------------------------------------------------------------------


def test_size_classes_are_fine_grained():
    assert size_class(0) == 64 and size_class(1) == 64 and size_class(65) == 128
    for n in [513, 1000, 4097, 10**6, 3 * 2**20 + 1, 2**30 - 5]:
        c = size_class(n)
        assert n <= c <= n * 1.125 + 64, n  # at most 1/8 waste
        assert size_class(c) == c  # a class is its own class
    assert size_class(1 << 20) == 1 << 20


def test_pool_reuses_freed_blocks_and_counts():
    pool = PinnedPool(max_bytes=1 << 20, pinned=False)
    a = pool.alloc((100,), np.float32)
    assert a.shape == (100,) and a.dtype == np.float32
    st = pool.stats()
    assert (st.hits, st.misses, st.in_use_bytes, st.cached_bytes) == (0, 1, 448, 0)
    ptr = a.ctypes.data
    pool.free(a)
    assert pool.stats().cached_bytes == 448
    b = pool.alloc((10, 11), np.float32)  # 440 bytes: same class, same block
    assert b.ctypes.data == ptr and b.shape == (10, 11)
    st = pool.stats()
    assert (st.hits, st.misses, st.in_use_bytes, st.cached_bytes) == (1, 1, 448, 0)
    c = pool.alloc(1000, np.float64)  # another class: a new block
    assert c.ctypes.data != ptr
    assert pool.stats().peak_bytes == 448 + size_class(8000)
    pool.free(b)
    pool.free(c)
    assert pool.stats().in_use_bytes == 0
    assert pool.trim() == 448 + size_class(8000)
    assert pool.stats().cached_bytes == 0


def test_pool_refuses_to_grow_past_max_bytes():
    pool = PinnedPool(max_bytes=10_000, pinned=False)
    a = pool.alloc(1000, np.float64)  # 8000 bytes: an 8192-byte block
    with pytest.raises(MemoryError, match="max_bytes=10000"):
        pool.alloc(500, np.float64)
    assert pool.stats().in_use_bytes == 8192  # the failed request took nothing
    pool.free(a)
    b = pool.alloc(240, np.float64)  # 1920 B: the cached 8192-byte block makes room
    st = pool.stats()
    assert st.cached_bytes == 0 and st.in_use_bytes == 1920
    pool.free(b)


def test_pool_free_checks_its_argument():
    pool = PinnedPool(max_bytes=1 << 16, pinned=False)
    a = pool.alloc(8)
    with pytest.raises(ValueError, match="alloc"):
        pool.free(np.zeros(8, np.float32))
    pool.free(a)
    with pytest.raises(ValueError, match="alloc"):
        pool.free(a)  # a second free
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        PinnedPool(max_bytes=0)


def test_pool_arguments_follow_the_one_rule():
    # numpy integers are integers; bool and floats are not
    pool = PinnedPool(max_bytes=np.int64(1 << 16), pinned=False)
    assert pool.max_bytes == 1 << 16 and type(pool.max_bytes) is int
    with pool.borrow(np.int64(8)) as a:
        assert a.shape == (8,)
    with pool.borrow((np.int32(2), np.uint8(3)), np.float64) as a:
        assert a.shape == (2, 3)
    for bad in (True, 1.5e6, np.bool_(True)):
        with pytest.raises(TypeError, match="max_bytes must be an integer"):
            PinnedPool(max_bytes=bad)
    with pytest.raises(TypeError, match=r"shape\[0\] must be an integer, got 2.5"):
        pool.alloc((2.5,))
    with pytest.raises(TypeError, match="shape must be an integer or a sequence"):
        pool.alloc(None)
    with pytest.raises(
        TypeError, match="shape must be an integer or a sequence of integers, got True"
    ):
        pool.alloc(True)
    with pytest.raises(ValueError, match=r"shape\[1\] must be >= 0, got -1"):
        pool.alloc((2, -1))
    assert size_class(np.int64(100)) == size_class(100)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        size_class(-1)
    assert pool.stats().in_use_bytes == 0


def test_pool_borrow():
    pool = PinnedPool(max_bytes=1 << 16, pinned=False)
    with pool.borrow((4, 4), np.float64) as a:
        a[...] = 1
        assert pool.stats().in_use_bytes == 128
    assert pool.stats().in_use_bytes == 0


def test_pool_under_many_threads():
    pool = PinnedPool(max_bytes=1 << 22, pinned=False)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                n = int(rng.integers(1, 2000))
                a = pool.alloc(n, np.float32)
                a[...] = seed  # blocks are not shared between live allocations
                assert (a == seed).all()
                pool.free(a)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = pool.stats()
    assert st.in_use_bytes == 0 and st.hits + st.misses == 1600 and st.hits > 0


# -- SyncedMemory ---------------------------------------------------------------------------


def _sm(dev, shape=(3, 4)):
    return nt.SyncedMemory(shape, np.float32, dev)


def _dev_values(dev, arr):
    return dev.to_host(arr)


def test_lazy_zero_filled_allocation(dev):
    m = _sm(dev)
    assert m.head == "uninitialized" and m.nbytes == 48
    np.testing.assert_array_equal(m.host(), np.zeros((3, 4)))
    assert m.head == "host"
    m2 = _sm(dev)
    np.testing.assert_array_equal(_dev_values(dev, m2.device_array()), np.zeros((3, 4)))
    assert m2.head == "device"


@pytest.mark.parametrize("first", ["mutable_host", "mutable_device_array"])
def test_uninitialized_to_mutable(dev, first):
    m = _sm(dev)
    getattr(m, first)()
    assert m.head == ("host" if first == "mutable_host" else "device")


def test_host_to_synced_to_device_to_synced(dev):
    m = _sm(dev)
    m.mutable_host()[...] = 7
    assert m.head == "host"
    d = m.device_array()  # host -> synced: copied to the device
    assert m.head == "synced"
    np.testing.assert_array_equal(_dev_values(dev, d), np.full((3, 4), 7))
    m.host()  # synced stays synced on reads
    m.device_array()
    assert m.head == "synced"
    md = m.mutable_device_array()  # synced -> device: no copy
    assert m.head == "device"
    md[...] = 3
    h = m.host()  # device -> synced: copied back
    assert m.head == "synced"
    np.testing.assert_array_equal(h, np.full((3, 4), 3))


def test_host_to_device_with_mutable_device_array(dev):
    m = _sm(dev)
    m.mutable_host()[...] = 5
    d = m.mutable_device_array()
    assert m.head == "device"
    np.testing.assert_array_equal(_dev_values(dev, d), np.full((3, 4), 5))


def test_device_to_host_with_mutable_host(dev):
    m = _sm(dev)
    m.mutable_device_array()[...] = 2
    h = m.mutable_host()
    assert m.head == "host"
    np.testing.assert_array_equal(h, np.full((3, 4), 2))
    h[...] = 9
    np.testing.assert_array_equal(_dev_values(dev, m.device_array()), np.full((3, 4), 9))
    assert m.head == "synced"


def test_synced_to_host_with_mutable_host(dev):
    m = _sm(dev)
    m.mutable_host()[...] = 1
    m.device_array()
    assert m.head == "synced"
    m.mutable_host()[...] = 4
    assert m.head == "host"
    np.testing.assert_array_equal(_dev_values(dev, m.device_array()), np.full((3, 4), 4))


def test_copies_happen_only_when_the_other_side_is_fresh(host_devs):
    # on the host backend the device copy is a separate numpy buffer, so a write that
    # bypasses the state machine shows whether a copy took place
    (d,) = host_devs(1)
    m = _sm(d)
    m.mutable_host()[...] = 1
    dev_arr = m.mutable_device_array()  # copies, head -> device
    assert not np.shares_memory(dev_arr, m._host)
    m.host()  # device -> synced: copies
    dev_arr[...] = 8  # behind the state machine's back
    np.testing.assert_array_equal(m.host(), np.full((3, 4), 1))  # synced: no copy
    m._host[...] = 6
    np.testing.assert_array_equal(m.device_array(), np.full((3, 4), 8))  # synced: no copy


def test_read_only_views(dev):
    m = _sm(dev)
    with pytest.raises(ValueError):
        m.host()[0, 0] = 1
    if dev.backend == "host":
        with pytest.raises(ValueError):
            m.device_array()[0, 0] = 1


def test_set_host_adopts_the_array(dev):
    m = _sm(dev)
    m.mutable_device_array()
    a = np.full((3, 4), 11, np.float32)
    m.set_host(a)
    assert m.head == "host"
    a[0, 0] = 12  # adopted, not copied
    np.testing.assert_array_equal(_dev_values(dev, m.device_array())[0, 0], 12)
    with pytest.raises(ValueError, match="float32"):
        m.set_host(np.zeros((4, 3), np.float32))
    with pytest.raises(TypeError):
        m.set_host(np.zeros((4, 6), np.float32)[:, ::2])


def test_async_device_push(dev):
    m = _sm(dev)
    m.mutable_host()[...] = 13
    s = dev.new_stream()
    m.async_device_push(s)
    assert m.head == "synced"
    s.synchronize()
    np.testing.assert_array_equal(_dev_values(dev, m.device_array()), np.full((3, 4), 13))
    with pytest.raises(ValueError, match="head 'host'"):
        m.async_device_push(s)  # head is synced


def test_device_copy_is_allocated_for_the_stream_that_writes_it(host_devs, monkeypatch):
    # a GPU pool hands out blocks in the order of the stream they were allocated for; the
    # host backend cannot race, so check that SyncedMemory names the stream it writes on
    (d,) = host_devs(1)
    asked = []
    real_empty = d.empty

    def empty(shape, dtype="float32", *, stream=None):
        asked.append(stream)
        return real_empty(shape, dtype, stream=stream)

    monkeypatch.setattr(d, "empty", empty)
    s = d.new_stream()
    pushed = _sm(d)
    pushed.mutable_host()[...] = 1
    pushed.async_device_push(s)
    assert asked == [s]
    pulled = _sm(d)
    pulled.mutable_host()[...] = 2
    with s:
        dev_copy = pulled.device_array()
    assert asked == [s, s]
    s.synchronize()
    np.testing.assert_array_equal(d.to_host(dev_copy), np.full((3, 4), 2))


def test_async_device_push_needs_a_stream_of_its_device(devs):
    m = nt.SyncedMemory(4, np.float64, devs[0])
    m.mutable_host()
    with pytest.raises(ValueError, match="not on"):
        m.async_device_push(devs[1].new_stream())


def test_remembers_its_device_across_threads(devs):
    d0, d1 = devs
    m = nt.SyncedMemory(8, np.float32, d1)
    m.mutable_host()[...] = 2
    result = []

    def other_thread():
        with d0.activate():  # another current device in this thread
            result.append(m.device_array())

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    d1.check_array(result[0])
    np.testing.assert_array_equal(d1.to_host(result[0]), np.full(8, 2))


def test_synced_shape_follows_the_one_rule(host_devs):
    (d,) = host_devs(1)
    m = nt.SyncedMemory((np.int64(2), 3), np.float32, d)
    assert m.shape == (2, 3) and all(type(s) is int for s in m.shape)
    assert nt.SyncedMemory(np.uint8(5), np.float32, d).shape == (5,)
    with pytest.raises(TypeError, match=r"shape\[0\] must be an integer"):
        nt.SyncedMemory((2.0, 3), np.float32, d)
    with pytest.raises(ValueError, match=r"shape\[1\] must be >= 0"):
        nt.SyncedMemory((2, -3), np.float32, d)
