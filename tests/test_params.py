"""FlatParams: layout, aliasing views, export/import, copies, argument checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import to_np

import nccltree as nt
from nccltree.params import ALIGN_BYTES

SHAPES = {"w1": (3, 5), "b1": (5,), "scalar": (), "w2": (5, 2, 3), "b2": 7}


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_layout_and_views_alias_flat_buffers(host_device):
    p = nt.FlatParams(SHAPES, dtype=np.float32, device=host_device)
    assert p.names == ("w1", "b1", "scalar", "w2", "b2")
    assert p.shapes["b2"] == (7,) and p.shapes["scalar"] == ()
    assert p.count == 15 + 5 + 1 + 30 + 7
    assert p.data.shape == p.grad.shape == (p.size,)
    assert p.size >= p.count and p.nbytes == p.size * 4
    assert p.xp is np
    offsets = list(p.offsets.values())
    assert offsets == sorted(offsets)
    for name in p.names:
        for flat, view in ((p.data, p.views[name]), (p.grad, p.grad_views[name])):
            assert view.shape == p.shapes[name]
            assert np.shares_memory(view, flat)
            assert _addr(view) % ALIGN_BYTES == 0
    # Views do not overlap: writing one parameter changes only its own slice of data.
    p.views["w2"][...] = 2.0
    off = p.offsets["w2"]
    assert np.all(p.data[off : off + 30] == 2.0)
    assert p.data.sum() == 60.0
    p.grad_views["b1"][...] = 1.0
    assert p.grad.sum() == 5.0 and p.data.sum() == 60.0


def test_views_are_read_only_mappings():
    p = nt.FlatParams({"a": (2,)})
    with pytest.raises(TypeError):
        p.views["a"] = np.zeros(2, np.float32)


def test_zero_grad(any_device):
    p = nt.FlatParams(SHAPES, dtype=np.float64, device=any_device)
    p.grad[...] = 3.0
    p.zero_grad()
    assert not to_np(p.grad).any()
    assert not to_np(p.grad_views["w1"]).any()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_state_dict_load_round_trip_bitwise(any_device, dtype):
    rng = np.random.default_rng(1)
    p = nt.FlatParams(SHAPES, dtype=dtype, device=any_device)
    given = {n: rng.standard_normal(s).astype(dtype) for n, s in p.shapes.items()}
    p.load(given)
    state = p.state_dict()
    assert list(state) == list(p.names)
    for name, value in state.items():
        assert isinstance(value, np.ndarray) and value.dtype == dtype
        assert value.tobytes() == given[name].tobytes()
        assert not np.shares_memory(value, to_np(p.data))
    q = nt.FlatParams(SHAPES, dtype=dtype, device=any_device)
    q.load(state)
    assert to_np(q.data).tobytes() == to_np(p.data).tobytes()
    assert all(not g.any() for g in p.state_dict(grad=True).values())


def test_load_checks_before_writing():
    p = nt.FlatParams({"a": (2, 2), "b": (3,)})
    p.data[...] = 1.0
    before = p.data.copy()
    with pytest.raises(ValueError, match="missing \\['b'\\]"):
        p.load({"a": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="unexpected \\['c'\\]"):
        p.load({"a": np.zeros((2, 2)), "b": np.zeros(3), "c": np.zeros(1)})
    with pytest.raises(ValueError, match="'b' has shape \\(3,\\)"):
        p.load({"a": np.zeros((2, 2)), "b": np.zeros(4)})
    with pytest.raises(TypeError):
        p.load([np.zeros(4)])
    assert np.array_equal(p.data, before)


def test_copy_from(any_device):
    src = nt.FlatParams(SHAPES, dtype=np.float32)
    src.data[...] = np.arange(src.size, dtype=np.float32)
    src.grad[...] = -1.0
    dst = nt.FlatParams(SHAPES, dtype=np.float32, device=any_device)
    dst.copy_from(src)
    assert np.array_equal(to_np(dst.data), src.data) and not to_np(dst.grad).any()
    dst.copy_from(src, grad=True)
    assert np.array_equal(to_np(dst.grad), src.grad)
    assert not np.shares_memory(to_np(dst.data), src.data)
    # Same device both ways, and back to plain numpy.
    same = nt.FlatParams(SHAPES, dtype=np.float32, device=any_device)
    same.copy_from(dst, grad=True)
    back = nt.FlatParams(SHAPES, dtype=np.float32)
    back.copy_from(same, grad=True)
    assert back.data.tobytes() == src.data.tobytes()
    assert back.grad.tobytes() == src.grad.tobytes()


def test_copy_from_rejects_other_layouts():
    p = nt.FlatParams({"a": (2,), "b": (3,)})
    with pytest.raises(ValueError, match="same names, shapes and dtype"):
        p.copy_from(nt.FlatParams({"b": (3,), "a": (2,)}))
    with pytest.raises(ValueError, match="same names, shapes and dtype"):
        p.copy_from(nt.FlatParams({"a": (2,), "b": (3,)}, dtype=np.float64))
    with pytest.raises(TypeError, match="FlatParams"):
        p.copy_from({"a": np.zeros(2), "b": np.zeros(3)})


def test_alignment_padding_is_per_dtype():
    p = nt.FlatParams({"a": (3,), "b": (3,)}, dtype=np.float64)
    assert p.offsets == {"a": 0, "b": ALIGN_BYTES // 8}
    assert p.size == ALIGN_BYTES // 8 + 3 and p.count == 6
    h = nt.FlatParams({"a": (33,), "b": (1,)}, dtype=np.float16)
    assert h.offsets["b"] == 2 * ALIGN_BYTES // 2
    assert math.prod(h.views["a"].shape) == 33


@pytest.mark.parametrize(
    ("shapes", "dtype", "exc", "match"),
    [
        ({}, np.float32, ValueError, "at least one"),
        ([("a", (2,))], np.float32, TypeError, "dict"),
        ({"a": (2,)}, np.int32, ValueError, "float16, float32 or float64"),
        ({"a": (-1,)}, np.float32, ValueError, r"parameter 'a' shape\[0\] must be >= 0, got -1"),
        ({"a": (2.5,)}, np.float32, TypeError, r"parameter 'a' shape\[0\] must be an integer"),
        ({"a": (2, True)}, np.float32, TypeError, r"shape\[1\] must be an integer, got True"),
        ({"a": True}, np.float32, TypeError, "integer or a sequence of integers"),
        ({"a": None}, np.float32, TypeError, "integer or a sequence of integers"),
        ({"": (2,)}, np.float32, TypeError, "non-empty strings"),
    ],
)
def test_argument_errors(shapes, dtype, exc, match):
    with pytest.raises(exc, match=match):
        nt.FlatParams(shapes, dtype=dtype)


def test_numpy_integer_shapes():
    p = nt.FlatParams({"w": (np.int64(3), np.int32(4)), "b": np.uint8(4)})
    assert p.shapes == {"w": (3, 4), "b": (4,)}
    assert all(type(d) is int for dims in p.shapes.values() for d in dims)
    assert p.views["w"].shape == (3, 4)


def test_device_must_be_a_device():
    with pytest.raises(TypeError, match="nccltree.devices"):
        nt.FlatParams({"a": (2,)}, device="cpu:1")
