"""Every face of the collectives takes the same arguments in the same places.

The per-rank faces (``Comm``, ``GroupComm``, ``ProcessGroup``) declare each collective
alike, and the driver-side ``World`` declares it with a list per rank (``xs`` for ``x``,
``outs`` for ``out``, ``streams`` for ``stream``) but otherwise the same: names, kinds,
defaults and order (nccltree/comm/faces.py).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm import Comm, World
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.faces import (
    OBJECT_COLLECTIVES,
    POINT_TO_POINT,
    RANK_COLLECTIVES,
    driver_method,
)
from nccltree.comm.group import ProcessGroup
from nccltree.comm.group.local import GroupComm

PER_RANK = (Comm, GroupComm, ProcessGroup)
DRIVER_NAMES = {"x": "xs", "out": "outs", "stream": "streams"}


def _shape(fn: Any, rename: dict[str, str] | None = None) -> list[tuple[str, Any, Any]]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # without self
    return [((rename or {}).get(p.name, p.name), p.kind, p.default) for p in params]


def test_every_table_collective_has_a_per_rank_and_a_driver_method():
    assert set(RANK_COLLECTIVES) | {"sendrecv"} == set(COLLECTIVES)
    for name in COLLECTIVES:
        assert callable(getattr(World, driver_method(name)))
    assert driver_method("sendrecv") == "shift"


@pytest.mark.parametrize("name", [*RANK_COLLECTIVES, "barrier", *OBJECT_COLLECTIVES])
def test_per_rank_faces_declare_each_collective_alike(name: str) -> None:
    shapes = {face.__name__: _shape(getattr(face, name)) for face in PER_RANK}
    assert len({repr(s) for s in shapes.values()}) == 1, shapes


@pytest.mark.parametrize("name", POINT_TO_POINT)
def test_point_to_point_is_alike_where_a_face_has_it(name: str) -> None:
    faces = [f for f in PER_RANK if hasattr(f, name)]
    assert {f.__name__ for f in faces} == {"Comm", "ProcessGroup"}
    shapes = {f.__name__: _shape(getattr(f, name)) for f in faces}
    assert len({repr(s) for s in shapes.values()}) == 1, shapes


@pytest.mark.parametrize("name", RANK_COLLECTIVES)
def test_the_driver_side_takes_a_list_per_rank_in_the_same_places(name: str) -> None:
    per_rank = _shape(getattr(Comm, name), DRIVER_NAMES)
    assert _shape(getattr(World, name)) == per_rank


def test_root_op_dtype_stream_async_op_sit_alike_on_every_face():
    reduce = inspect.signature(Comm.reduce).parameters
    assert reduce["root"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert reduce["root"].default == 0
    for p in ("out", "op", "stream", "async_op", "dtype"):
        assert reduce[p].kind is inspect.Parameter.KEYWORD_ONLY
    gather = list(inspect.signature(ProcessGroup.gather).parameters)
    assert gather[:4] == ["self", "x", "out", "root"]


def test_the_ring_shift_is_world_shift_and_sendrecv_names_it():
    world = nt.World(nt.devices("cpu:3"))
    try:
        xs = [np.full(2, r, np.float32) for r in range(3)]
        outs = [np.zeros(2, np.float32) for _ in range(3)]
        world.shift(xs, outs)
        assert [float(o[0]) for o in outs] == [2.0, 0.0, 1.0]
        with pytest.raises(TypeError, match=r"World\.shift"):
            world.sendrecv(xs, outs)
        # root positional on every face (a World's rank here)
        got = world.run(lambda c: c.reduce(np.full(2, c.rank + 1.0), 1))
        assert float(got[1][0]) == 6.0
    finally:
        world.close()


@pytest.mark.parametrize("name", ["all_to_all_v", "all_gather_v", "reduce_scatter_v"])
def test_the_v_collectives_driver_side_add_only_async_op(name: str) -> None:
    """Per rank a v-collective is a batch of sends and receives (synchronous); the World
    runs it as one plan, which may also be asynchronous. Otherwise the same parameters in
    the same places (the World's all_to_all_v takes the whole count matrix)."""
    per_rank = _shape(getattr(Comm, name), DRIVER_NAMES)
    driver = [p for p in _shape(getattr(World, name)) if p[0] != "async_op"]
    if name == "all_to_all_v":
        per_rank = [p for p in per_rank if p[0] != "recv_counts"]
        per_rank = [("counts", *p[1:]) if p[0] == "send_counts" else p for p in per_rank]
    assert driver == per_rank


@pytest.mark.parametrize("name", OBJECT_COLLECTIVES)
def test_the_object_collectives_driver_side_take_an_object_per_rank(name: str) -> None:
    per_rank = _shape(getattr(Comm, name), {"obj": "objs"})
    assert _shape(getattr(World, name)) == per_rank
