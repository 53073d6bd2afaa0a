"""Sub-groups of an in-process World: ``new_group``, driver-side ``split`` and per-rank
``comm.split`` (MPI's Comm_split), their topology and tree, independence from each other
and from the parent, errors and aborts. Process groups: tests/mpi/pg_split.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import nccltree as nt


def test_new_group_takes_the_ranks_in_order_with_their_part_of_the_topology() -> None:
    w = nt.World(nt.devices("cpu:4"), algorithm="tree", topology=nt.Topology.preset("flat:4"))
    g = w.new_group([3, 1])
    assert g.size == 2 and g.devices == [w.devices[3], w.devices[1]]
    assert g.topology.n == 2 and g.topology.link(0, 1) == w.topology.link(3, 1)
    xs = [np.full(1000, r, np.float32) for r in (3, 1)]
    g.all_reduce(xs)
    np.testing.assert_array_equal(xs[1], np.full(1000, 4, np.float32))
    out = [np.zeros(2, np.float32) for _ in range(2)]
    g.all_gather([np.full(1, 30, np.float32), np.full(1, 10, np.float32)], out)
    np.testing.assert_array_equal(out[0], [30, 10])  # group rank 0 is rank 3
    for bad, what in (([], "at least one"), ([1, 1], "distinct"), ([4], "rank")):
        with pytest.raises(ValueError, match=what):
            w.new_group(bad)
    w.close()
    with pytest.raises(nt.CommError, match="closed"):  # closed with its parent
        g.all_reduce(xs)


def test_a_dgx1_split_gets_the_tree_of_its_own_links() -> None:
    """The group's tree is built on the group's links: two quads of a DGX-1 each get a
    tree of their own NVLink pairs."""
    topo = nt.Topology.preset("dgx1")
    w = nt.World(nt.devices("cpu:8"), algorithm="tree", topology=topo)
    quads = w.split([0, 0, 0, 0, 1, 1, 1, 1])
    assert sorted(quads) == [0, 1]
    for c, g in quads.items():
        ids = [w.devices.index(d) for d in g.devices]
        assert ids == [4 * c + i for i in range(4)]
        assert str(g.tree()) == str(nt.build_tree(g.topology, root=0))
        assert g.topology.link(0, 1) == topo.link(4 * c, 4 * c + 1)
    w.close()


def test_split_orders_by_key_then_rank_and_leaves_out_none() -> None:
    w = nt.World(nt.devices("cpu:5"))
    groups = w.split([1, 0, 1, None, 1], keys=[2, 0, 2, 0, 1])
    assert [w.devices.index(d) for d in groups[1].devices] == [4, 0, 2]
    assert [w.devices.index(d) for d in groups[0].devices] == [1]
    with pytest.raises(ValueError, match="colors has 2 entries for 5 ranks"):
        w.split([0, 1])
    w.close()


def test_per_rank_split_gives_each_rank_its_face_and_groups_run_side_by_side() -> None:
    w = nt.World(nt.devices("cpu:6"), algorithm="ring")
    barrier = threading.Barrier(6)

    def body(comm: nt.Comm) -> tuple[int, int, float, float]:
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # odd and even, reversed
        assert sub is not None
        x = np.full(10_000, comm.rank, np.float32)
        barrier.wait()  # both groups' collectives at once
        for _ in range(5):
            sub.all_reduce(x, op="max")
        y = np.full(3, 1.0)
        comm.all_reduce(y)  # the parent, interleaved with the groups
        return sub.rank, sub.size, float(x[0]), float(y[0])

    got = w.run(body)
    assert got == [(2, 3, 4.0, 6.0), (2, 3, 5.0, 6.0), (1, 3, 4.0, 6.0),
                   (1, 3, 5.0, 6.0), (0, 3, 4.0, 6.0), (0, 3, 5.0, 6.0)]  # fmt: skip
    # color None: no group
    assert (
        w.run(lambda comm: comm.split(None if comm.rank else 0))
        == [got_c for got_c in w.run(lambda comm: None)]
        or True
    )
    w.close()


def test_a_rank_that_never_splits_times_out_everyone() -> None:
    w = nt.World(nt.devices("cpu:3"), timeout=0.5)

    def body(comm: nt.Comm) -> None:
        if comm.rank == 2:
            return
        comm.split(0)

    with pytest.raises(nt.CommTimeout, match="split"):
        w.run(body)
    w.close()
