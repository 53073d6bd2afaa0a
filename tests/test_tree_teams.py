"""Tree plans whose children help their parent sum (ranks sharing one memory).

A parent's fused pass over a large chunk is cut into pieces, one per team member, each
summed from the same sources in the same order: results must be bitwise those of the
parent summing alone, the plans race-free, the bytes between memories unchanged, and the
work per rank about even.
"""

from __future__ import annotations

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm.algorithms import build_plan
from nccltree.comm.builders import tree as tree_builder
from nccltree.comm.plan import Plan, check_races
from nccltree.topology import LinkKind


def _host_topology(n: int) -> nt.Topology:
    with nt.World(nt.devices(f"cpu:{n}")) as w:
        return w.tree(0).topology


def _trees(topo: nt.Topology):
    cache: dict[int, nt.Tree] = {}

    def get(root: int) -> nt.Tree:
        if root not in cache:
            cache[root] = nt.build_tree(topo, root=root)
        return cache[root]

    return get


def _helped_steps(plan: Plan) -> list:
    """Sums a rank runs into another rank's buffer: a child helping its parent."""
    return [s for s in plan.steps if s.kind == "reduce" and s.dst.rank != s.rank]


def _work_per_rank(plan: Plan, itemsize: int) -> list[int]:
    """Bytes each rank's own steps read and write (a copy onto itself moves nothing)."""
    work = [0] * plan.size
    for s in plan.data_steps():
        if s.kind == "copy":
            if s.srcs[0] != s.dst:
                work[s.rank] += 2 * s.dst.count * itemsize
        elif s.kind == "reduce":
            work[s.rank] += (len(s.srcs) + 1) * s.dst.count * itemsize
        else:
            work[s.rank] += 2 * s.dst.count * itemsize
    return work


@pytest.fixture
def small_pieces(monkeypatch):
    """Share chunks from 4 KiB, in pieces from 512 B, so small arrays exercise teams."""
    monkeypatch.setattr(tree_builder, "SHARE_MIN_BYTES", 4096)
    monkeypatch.setattr(tree_builder, "MIN_PIECE_BYTES", 512)


def test_water_filling_evens_out_the_work():
    # 2 ranks: the root sums 3 bytes per byte (own and child read, result written), the
    # child copies the result down (2): the child takes 1/6 of the sum, 2.5 each
    t2 = nt.build_tree(_host_topology(2))
    teams = tree_builder._shares(t2, lambda r: 0.0 if r == t2.root else 2.0)
    assert teams == {0: [(0, pytest.approx(5 / 6)), (1, pytest.approx(1 / 6))]}
    # no SAME_DEVICE links: nobody helps
    dgx = nt.build_tree(nt.Topology.preset("dgx1"))
    assert tree_builder._shares(dgx, lambda r: 0.0) == {}


@pytest.mark.parametrize("align", [1, 64])
def test_pieces_are_aligned_and_cover_the_chunk(align):
    team = [(0, 0.5), (3, 0.3), (1, 0.2)]
    for c in (0, 1, 63, 64 * 100 + 7, 1 << 20):
        pieces = tree_builder._pieces(team, c, align, 4)
        assert sum(cnt for _, _, cnt in pieces) == c
        off = 0
        for _, o, cnt in pieces:
            assert o == off and o % align == 0 and cnt > 0
            off += cnt
    # a member whose piece would be under MIN_PIECE_BYTES gets none; the parent takes it
    tiny = tree_builder._pieces([(0, 0.99), (1, 0.01)], 1000, 1, 4)
    assert tiny == [(0, 0, 1000)]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.slow
def test_shared_sums_are_race_free(small_pieces, n, coll, in_place):
    topo = _host_topology(n)
    tree_for = _trees(topo)
    for count in (1000, 4096 + 3, 20_000):
        for root in sorted({0, n - 1}) if coll == "reduce" else [0]:
            plan = build_plan(
                "tree",
                coll,
                size=n,
                count=count,
                op="mean",
                root=root,
                in_place=in_place,
                chunk=3000,
                tree_for=tree_for,
                itemsize=4,
            )
            assert check_races(plan) == [], (coll, count, in_place, root)
            if n > 1 and count >= 4096:
                assert _helped_steps(plan), "no child helped: the test checks nothing"


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.slow
def test_shared_sums_are_bitwise_those_of_the_parent_alone(monkeypatch, n, coll, op):
    rng = np.random.default_rng(n)
    count = 12_000 if coll != "reduce_scatter" else 4_000
    total = count * (n if coll == "reduce_scatter" else 1)
    # magnitudes over many binades, so the order of a sum changes its rounding
    data = [
        (rng.standard_normal(total) * 10.0 ** rng.integers(-6, 7, total)).astype(np.float32)
        for _ in range(n)
    ]

    def run(share_from: int) -> tuple[list[np.ndarray], Plan]:
        monkeypatch.setattr(tree_builder, "SHARE_MIN_BYTES", share_from)
        monkeypatch.setattr(tree_builder, "MIN_PIECE_BYTES", 512)
        with nt.World(
            nt.devices(f"cpu:{n}"), algorithm="tree", chunk_bytes=8192, inline_bytes=0
        ) as w:
            xs = [d.copy() for d in data]
            if coll == "all_reduce":
                w.all_reduce(xs, op=op)
                out = xs
            elif coll == "reduce":
                w.reduce(xs, op=op, root=0)
                out = xs[:1]
            else:
                out = [np.empty(count, np.float32) for _ in range(n)]
                w.reduce_scatter(xs, op=op, outs=out)
            plan = w.plan(coll, count, op=op, in_place=coll != "reduce_scatter", dtype=np.float32)
        return out, plan

    alone, plan_alone = run(1 << 60)
    shared, plan_shared = run(4096)
    assert not _helped_steps(plan_alone)
    assert _helped_steps(plan_shared), "no child helped: the test checks nothing"
    for a, s in zip(alone, shared, strict=True):
        assert a.tobytes() == s.tobytes()
    # the data is order-sensitive: summing the ranks in reverse order rounds differently
    fwd = data[0].copy()
    for d in data[1:]:
        fwd += d
    rev = data[-1].copy()
    for d in reversed(data[:-1]):
        rev += d
    assert fwd.tobytes() != rev.tobytes()


@pytest.mark.parametrize("n", [2, 4])
def test_teams_even_out_the_work_without_moving_more_bytes(monkeypatch, n):
    topo = _host_topology(n)
    count = (64 << 20) // 4

    def plan(share_from: int) -> Plan:
        monkeypatch.setattr(tree_builder, "SHARE_MIN_BYTES", share_from)
        return build_plan(
            "tree",
            "all_reduce",
            size=n,
            count=count,
            in_place=True,
            chunk=(4 << 20) // 4,
            tree_for=_trees(topo),
            itemsize=4,
        )

    alone, shared = plan(1 << 60), plan(1 << 20)
    assert shared.bytes_moved(4) == alone.bytes_moved(4)

    def between_memories(p: Plan) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for src, dst, cnt in p.transfers():
            out[(src, dst)] = out.get((src, dst), 0) + cnt
        return out

    # who runs a piece changes; which memory is read into which does not
    assert between_memories(shared) == between_memories(alone)

    def imbalance(p: Plan) -> float:
        work = _work_per_rank(p, 4)
        return max(work) / (sum(work) / len(work))

    assert imbalance(alone) > 1.15  # the parent alone does the most: the check can fail
    assert imbalance(shared) < 1.1


def test_ranks_without_shared_memory_do_not_help():
    topo = nt.Topology.preset("dgx1")
    assert all(
        topo.link(i, j).kind != LinkKind.SAME_DEVICE for i in range(topo.n) for j in range(topo.n)
    )
    plan = build_plan(
        "tree",
        "all_reduce",
        size=topo.n,
        count=(64 << 20) // 4,
        chunk=(4 << 20) // 4,
        tree_for=_trees(topo),
        itemsize=4,
    )
    assert not _helped_steps(plan)


@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "all_gather"])
def test_ranks_in_one_memory_pull_from_the_root(coll):
    # several chunks over shared memory: every rank copies the data from the root itself,
    # once the root has it, instead of waiting for the levels in between
    n = 5
    with nt.World(nt.devices(f"cpu:{n}"), algorithm="tree", chunk_bytes=256) as w:
        plan = w.plan(coll, 200)
        tree = w.tree(0)
        assert tree.depth >= 2  # some rank is not a child of the root: the check can fail
        owners = plan.event_owners()
        waited: dict[int, set[int]] = {r: set() for r in range(n)}
        givers: dict[int, set[int]] = {r: set() for r in range(n)}
        for st in plan.steps:
            if st.kind == "wait":
                waited[st.rank].add(owners[st.event])
            if st.kind == "copy" and st.srcs[0].rank != st.dst.rank:
                if coll != "all_gather" or st.rank == st.dst.rank:
                    givers[st.dst.rank].add(st.srcs[0].rank)
        for k in range(1, n):
            if coll == "all_gather":
                assert 0 in givers[k], k
            else:
                assert givers[k] == {0}, (k, givers[k])
            assert 0 in waited[k]
        xs = [np.full(200, float(r)) for r in range(n)]
        if coll == "broadcast":
            w.broadcast(xs, root=0)
            assert all(np.all(x == 0.0) for x in xs)
        elif coll == "all_reduce":
            w.all_reduce(xs)
            assert all(np.all(x == sum(range(n))) for x in xs)
