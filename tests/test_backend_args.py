"""One rule for the backends' arguments: ``Stream`` checks them once for every backend (the
host backend and, on the fake of CuPy, the CUDA backend refuse a bad call alike, before
anything is enqueued), with ``nccltree._validate``'s rule (numpy integers accepted, bool
refused, NaN and infinities refused where a finite number is meant); and one fan-in limit,
``backends.base.MAX_FUSED``, that the C and CUDA sources are checked against."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree import _cuda_kernels as ck
from nccltree import _native as nat
from nccltree.backends import base
from nccltree.backends.base import DTYPES, FLOAT_DTYPES, MAX_FUSED
from nccltree.backends.host import HostRuntime, aligned_empty, record_transfers

CSRC = Path(__file__).resolve().parent.parent / "csrc"
BAD_REALS = [math.nan, math.inf, -math.inf]


@pytest.fixture(params=["host", "fake-cuda"])
def devs(request: pytest.FixtureRequest) -> Any:
    """Two devices of the host backend, or of the CUDA backend on the fake of CuPy."""
    if request.param == "host":
        made = nt.devices("cpu:2")
    else:
        request.getfixturevalue("fake_cupy")
        made = nt.devices("gpu:0,1")
    yield made
    made[0].runtime.shutdown()


def _arr(dev: nt.Device, n: int = 4, dtype: Any = np.float32) -> Any:
    return dev.from_host(np.arange(n, dtype=dtype))


def _refused(call: Any, exc: type[Exception], match: str) -> str:
    with pytest.raises(exc, match=match) as info:
        call()
    return str(info.value)


# -- the same checks, the same messages, on both backends -----------------------------------


def test_reduce_argument_errors_are_the_same_on_every_backend(devs: Any) -> None:
    d0, d1 = devs
    s = d0.new_stream()
    a, b = _arr(d0), _arr(d0)
    i = _arr(d0, dtype=np.int32)
    bad = {
        "op": (lambda: s.reduce(a, [a, b], "mean"), ValueError, "op must be one of"),
        "empty": (lambda: s.reduce(a, []), ValueError, "at least one source"),
        "alpha op": (lambda: s.reduce(a, [a], "max", alpha=0.5), ValueError, "op='sum'"),
        "alpha type": (lambda: s.reduce(a, [a], alpha="2"), TypeError, "alpha must be a real"),
        "alpha bool": (lambda: s.reduce(a, [a], alpha=True), TypeError, "alpha must be a real"),
        "alpha int dtype": (lambda: s.reduce(i, [i], alpha=0.5), TypeError, "accepted: float16"),
        "size": (lambda: s.reduce(a, [a, _arr(d0, 5)]), ValueError, r"srcs\[1\] is float32\[5\]"),
        "count": (lambda: s.reduce(a, [a], src_devices=[None, d1]), ValueError, "2 entries"),
        "device": (lambda: s.reduce(a, [a], src_devices=["x"]), TypeError, r"src_devices\[0\]"),
        "dst_device": (lambda: s.reduce(a, [a], dst_device=3), TypeError, "dst_device must be"),
    }
    for what, (call, exc, match) in bad.items():
        assert _refused(call, exc, match), what
    for alpha in BAD_REALS:
        with pytest.raises(ValueError, match="alpha must be"):
            s.reduce(a, [a, b], alpha=alpha)
    s.synchronize()  # nothing was enqueued by the failed calls
    assert s.query()
    np.testing.assert_array_equal(d0.to_host(a), np.arange(4))


def _messages(d: nt.Device) -> list[str]:
    """The messages of a set of bad calls on a stream of ``d``."""
    s, a, i = d.new_stream(), _arr(d), _arr(d, dtype=np.int32)
    out = []
    for call, args, kwargs, exc in [
        (s.reduce, (a, [a], "mean"), {}, ValueError),
        (s.reduce, (a, [a]), {"alpha": math.nan}, ValueError),
        (s.reduce, (i, [i]), {"alpha": 2.0}, TypeError),
        (s.reduce, (a, [a, _arr(d, 3)]), {}, ValueError),
        (s.scale, (a, math.inf), {}, ValueError),
        (s.scale, (i, 2.0), {}, TypeError),
        (s.sgd_update, (a, a, _arr(d, 3), 0.1, 0.9, 0.0), {}, ValueError),
        (s.synchronize, (-1,), {}, ValueError),
    ]:
        with pytest.raises(exc) as info:
            call(*args, **kwargs)
        out.append(str(info.value))
    return out


def test_reduce_messages_agree_between_backends(fake_cupy: Any) -> None:
    host_devs, gpu_devs = nt.devices("cpu:1"), nt.devices("gpu:0")
    try:
        assert _messages(host_devs[0]) == _messages(gpu_devs[0])
    finally:
        host_devs[0].runtime.shutdown()
        gpu_devs[0].runtime.shutdown()


def test_numpy_reals_and_integers_are_accepted(devs: Any) -> None:
    d0, d1 = devs
    s = d0.new_stream()
    x, y = _arr(d0), _arr(d0)
    s.reduce(y, [x, y], alpha=np.float32(0.5))
    s.reduce(y, [y], alpha=np.int64(1))
    s.scale(x, np.float64(2.0))
    s.scale(x, np.int32(1))
    w, g, v = _arr(d0), _arr(d0), d0.zeros(4, np.float32)
    s.sgd_update(w, g, v, np.float32(0.5), np.int64(0), 0)
    s.synchronize(np.int64(5))
    s.record().synchronize(np.float32(5.0))
    d0.synchronize(np.int64(5))
    np.testing.assert_array_equal(d0.to_host(y), np.arange(4))  # (x + y) / 2
    np.testing.assert_array_equal(d0.to_host(x), np.arange(4) * 2)
    np.testing.assert_array_equal(d0.to_host(w), np.arange(4) * 0.5)


@pytest.mark.parametrize("name", ["lr", "momentum", "weight_decay"])
def test_sgd_hyperparameters_must_be_finite_reals(devs: Any, name: str) -> None:
    d0 = devs[0]
    s = d0.new_stream()
    w, g, v = _arr(d0), _arr(d0), _arr(d0)
    good = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}
    for bad, exc in [(math.nan, ValueError), (math.inf, ValueError), (True, TypeError)]:
        with pytest.raises(exc, match=name):
            s.sgd_update(w, g, v, **{**good, name: bad})
        with pytest.raises(exc, match=name):
            d0.sgd_update(w, g, v, **{**good, name: bad})
    s.synchronize()
    np.testing.assert_array_equal(d0.to_host(w), np.arange(4))  # nothing ran


@pytest.mark.parametrize("bad", [*BAD_REALS, -1.0, True, "1"])
def test_timeouts_follow_the_one_rule_everywhere(devs: Any, bad: object) -> None:
    d0 = devs[0]
    s = d0.new_stream()
    ev = s.record()
    exc = TypeError if isinstance(bad, (bool, str)) else ValueError
    for wait in (s.synchronize, ev.synchronize, d0.synchronize):
        with pytest.raises(exc, match="timeout"):
            wait(bad)  # refused even though nothing is pending
    s.synchronize(None)
    s.synchronize(0)


def test_immediate_kernels_refuse_bad_scalars(devs: Any) -> None:
    d0 = devs[0]
    x = _arr(d0)
    for bad in BAD_REALS:
        with pytest.raises(ValueError, match="alpha"):
            d0.scale(x, bad)
    with pytest.raises(TypeError, match="alpha"):
        d0.scale(x, False)
    d0.scale(x, np.float16(2))
    d0.synchronize()
    np.testing.assert_array_equal(d0.to_host(x), np.arange(4) * 2)


def test_copy_checks_name_the_argument_and_the_device(devs: Any) -> None:
    d0, d1 = devs
    s = d0.new_stream()
    a = _arr(d0)
    with pytest.raises(ValueError, match="equal sizes"):
        s.copy(a, _arr(d0, 5))
    with pytest.raises(TypeError, match="src_device must be a"):
        s.copy(a, a, src_device="cpu:1")
    with pytest.raises(TypeError, match="dst"):
        s.copy([0.0] * 4, a)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dst.*writeable"):
        s.copy(ro, a)
    s.copy(a, np.ones(4, np.float32))  # host memory, no device named: accepted
    s.synchronize()
    np.testing.assert_array_equal(d0.to_host(a), np.ones(4))


def test_fake_cuda_operands_must_be_on_the_named_device(fake_cupy: Any) -> None:
    d0, d1 = nt.devices("gpu:0,1")
    try:
        s = d0.new_stream()
        a0, a1 = _arr(d0), _arr(d1)
        with pytest.raises(ValueError, match=r"srcs\[1\] is on GPU 1, not on gpu:0"):
            s.reduce(a0, [a0, a1])  # a1 is not where src_devices (None: dst's) says
        s.reduce(a0, [a0, a1], src_devices=[None, d1])
        with pytest.raises(ValueError, match="src is on GPU 0, not on gpu:1"):
            s.copy(a0, a0, src_device=d1)
        with pytest.raises(TypeError, match="src_device must be a cuda device"):
            s.copy(a0, a1, src_device=nt.devices("cpu:1")[0])
        s.synchronize()
        np.testing.assert_array_equal(d0.to_host(a0), np.arange(4) * 2)
    finally:
        d0.runtime.shutdown()


# -- integers: numpy accepted, bool refused -------------------------------------------------


def test_host_counts_and_shapes() -> None:
    rt = HostRuntime(np.int64(2))
    try:
        d = rt.devices[0]
        d.threads = np.int32(3)
        assert d.threads == 3 and type(d.threads) is int
        with pytest.raises(TypeError, match="threads"):
            d.threads = True
        with pytest.raises(TypeError, match="threads"):
            d.threads = 2.0
        assert d.empty(np.int64(3)).shape == (3,)
        assert d.zeros((np.uint8(2), 3)).shape == (2, 3)
        for bad, exc in [
            (2.0, TypeError),
            (True, TypeError),
            ((2, -1), ValueError),
            ("3", TypeError),
        ]:
            with pytest.raises(exc, match="shape"):
                d.empty(bad)
    finally:
        rt.shutdown()
    with pytest.raises(TypeError, match="number of host devices"):
        HostRuntime(True)
    with pytest.raises(ValueError, match="number of host devices"):
        HostRuntime(0)
    assert aligned_empty(np.int64(5), np.float64).ctypes.data % 64 == 0


def test_native_wrappers_follow_the_rule() -> None:
    x = np.ones(8, np.float32)
    nat.scale(x, 2, nthreads=np.int64(2))
    assert (x == 2).all()
    with pytest.raises(TypeError, match="nthreads"):
        nat.scale(x, 2.0, nthreads=True)
    with pytest.raises(ValueError, match="nthreads must be >= 1"):
        nat.reduce_n(x, [x], nthreads=0)
    for bad in BAD_REALS:
        with pytest.raises(ValueError, match="alpha"):
            nat.reduce_n(x, [x, x], alpha=bad)
        with pytest.raises(ValueError, match="lr"):
            nat.sgd_update(x, np.zeros(8, np.float32), np.zeros(8, np.float32), bad, 0.0, 0.0)
    assert (x == 2).all()


def test_cuda_kernel_wrappers_follow_the_rule(fake_cupy: Any) -> None:
    import cupy as cp

    x = cp.asarray(np.ones(8, np.float32))
    for bad in BAD_REALS:
        with pytest.raises(ValueError, match="alpha"):
            ck.reduce_n(x, [x, x], alpha=bad)
        with pytest.raises(ValueError, match="alpha"):
            ck.scale(x, bad)
        with pytest.raises(ValueError, match="momentum"):
            ck.sgd_update(x, cp.zeros(8, np.float32), cp.zeros(8, np.float32), 0.1, bad, 0.0)
    with pytest.raises(TypeError, match="alpha"):
        ck.scale(x, True)
    ck.scale(x, np.float32(3))
    assert (cp.asnumpy(x) == 3).all()


def test_gpu_ordinals_follow_the_rule(fake_cupy: Any) -> None:
    from nccltree.backends.cuda import CudaRuntime

    rt = CudaRuntime([np.int64(0), 1])
    assert [d.physical_id for d in rt.devices] == [0, 1]
    rt.shutdown()
    with pytest.raises(TypeError, match="GPU ordinal"):
        CudaRuntime([True])
    with pytest.raises(ValueError, match="GPU ordinal"):
        CudaRuntime([-1])


# -- the inline (``*_now``) path is checked and recorded as a stream is ---------------------


def test_now_variants_share_the_stream_checks() -> None:
    d0, d1 = nt.devices("cpu:2")
    try:
        a, b = np.ones(4, np.float32), np.full(4, 2, np.float32)
        with pytest.raises(ValueError, match="alpha must be a number"):
            d0.reduce_now(a, [a, b], alpha=math.nan)
        with pytest.raises(TypeError, match=r"src_devices\[1\] must be a host device"):
            d0.reduce_now(a, [a, b], src_devices=[None, "cpu:1"])
        with record_transfers() as log:
            d0.reduce_now(a, [a, b], src_devices=[None, d1], alpha=np.float32(0.5))
            d0.copy_now(b, a, src_device=d1)
        assert [t.kind for t in log] == ["peer_read", "copy"]
        assert (a == 1.5).all() and (b == 1.5).all()
        s = d0.inline_stream  # a whole stream: scale, sgd_update, events, all at once
        s.scale(a, 2)
        ev = s.record()
        s.wait_event(ev)
        s.synchronize(0)
        assert ev.query() and s.query() and (a == 3).all()
    finally:
        d0.runtime.shutdown()


# -- one fan-in limit, one dtype list -------------------------------------------------------


def _define(text: str) -> int:
    m = re.search(r"^\s*#\s*define\s+NT_MAX_SOURCES\s+(\d+)\b", text, re.MULTILINE)
    assert m is not None
    return int(m.group(1))


def test_every_fan_in_limit_is_max_fused() -> None:
    assert nat.MAX_SOURCES is MAX_FUSED and ck.MAX_SOURCES is MAX_FUSED
    assert nat.library().nt_max_sources() == MAX_FUSED  # the built host library
    assert _define((CSRC / "nccltree.h").read_text()) == MAX_FUSED
    cu = (CSRC / "nccltree_kernels.cu").read_text()
    assert _define(cu) == MAX_FUSED == ck.source_max_sources(cu)
    assert ck.source_max_sources(ck.source_text()) == MAX_FUSED  # the shipped copy
    assert ck._SRCS.itemsize == 8 * MAX_FUSED  # the by-value pointer struct


def test_a_library_that_disagrees_is_refused() -> None:
    with pytest.raises(nt.BackendUnavailable, match="takes 6 sources"):
        nat._check_max_sources(6, Path("libnccltree_host.so"))
    nat._check_max_sources(MAX_FUSED, Path("libnccltree_host.so"))


def test_a_cuda_source_that_disagrees_is_not_compiled(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = ck.source_text().replace(
        f"#define NT_MAX_SOURCES {MAX_FUSED}", f"#define NT_MAX_SOURCES {MAX_FUSED + 1}"
    )
    monkeypatch.setattr(ck, "source_text", lambda: text)
    with pytest.raises(nt.BackendUnavailable, match="sources per reduce"):
        ck.compile_source(0)
    with pytest.raises(nt.BackendUnavailable, match="does not define"):
        ck.source_max_sources("// nothing here")


def test_kernel_dtypes_are_listed_once() -> None:
    assert tuple(nat.DTYPES) == DTYPES
    assert tuple(ck._SUFFIX) == DTYPES
    assert nat.FLOAT_DTYPES is FLOAT_DTYPES
    assert tuple(ck._SCALAR) == FLOAT_DTYPES
    assert base.REDUCE_OPS == ck.OPS == tuple(nat.OPS)
