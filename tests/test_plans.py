"""Plans as data: race-free by construction, and the copy pattern the backend records."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends.host import record_transfers
from nccltree.comm.algorithms import build_plan
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.plan import (
    ALIGN_BYTES,
    IN,
    OUT,
    STAGE,
    TMP,
    Buf,
    Plan,
    PlanBuilder,
    Step,
    align_elements,
    aligned_chunk,
    check_races,
    split,
)

COLLS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


def _trees(topo):
    cache = {}

    def get(root):
        if root not in cache:
            cache[root] = nt.build_tree(topo, root=root)
        return cache[root]

    return get


@pytest.mark.parametrize(
    "topo",
    [
        "flat:1",
        "flat:2",
        "flat:3",
        "flat:4",
        "flat:5",
        "flat:7",
        "flat:12",
        "pcie2s8",
        "dgx1",
        "k80x4",
    ],
)
@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.slow
def test_every_plan_is_race_free(topo, alg):
    topology = nt.Topology.preset(topo)
    n = topology.n
    tree_for = _trees(topology)
    for coll in COLLS:
        for count in (0, 1, 5, 64):
            for in_place in (False, True):
                for root in sorted({0, n - 1}) if coll in ("reduce", "broadcast") else [0]:
                    plan = build_plan(
                        alg,
                        coll,
                        size=n,
                        count=count,
                        op="mean",
                        root=root,
                        in_place=in_place,
                        chunk=7,
                        tree_for=tree_for,
                    )
                    assert check_races(plan) == [], (alg, coll, count, in_place, root)


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_mixed_in_place_all_reduce_is_race_free(alg):
    # An out-of-place plan stays correct when some ranks pass out == x: check it with
    # "in" and "out" treated as one buffer.
    n = 5
    plan = build_plan(
        alg,
        "all_reduce",
        size=n,
        count=50,
        op="sum",
        in_place=False,
        chunk=6,
        tree_for=_trees(nt.Topology.preset(f"flat:{n}")),
    )
    plan.same_buffer = True
    assert check_races(plan) == []


def test_race_checker_catches_a_missing_wait():
    # rank 1 reads rank 0's input while rank 0 overwrites it
    steps = [
        Step(1, "copy", Buf(1, "out", 0, 4), (Buf(0, "in", 0, 4),)),
        Step(0, "scale", Buf(0, "in", 0, 4), (Buf(0, "in", 0, 4),), alpha=2.0),
    ]
    racy = Plan(size=2, steps=list(steps), n_events=1)
    assert check_races(racy)
    # ordering the write after the read (record on rank 1, wait on rank 0) fixes it
    fixed = Plan(
        size=2,
        steps=[steps[0], Step(1, "record", event=0), Step(0, "wait", event=0), steps[1]],
        n_events=1,
    )
    assert check_races(fixed) == []
    # a wait on an event that is recorded only later is a bug on CUDA: it must be flagged
    early = Plan(
        size=2,
        steps=[Step(0, "wait", event=0), steps[1], steps[0], Step(1, "record", event=0)],
        n_events=1,
    )
    assert check_races(early)
    # and the builder's fences make the unordered version safe
    b = PlanBuilder(2)
    b.copy(1, Buf(1, "out", 0, 4), Buf(0, "in", 0, 4))
    b.scale(0, Buf(0, "in", 0, 4), 2.0)
    assert check_races(b.build())  # data flow inside one plan is the algorithm's job


def _bytes_by_pair(transfers):
    agg = collections.Counter()
    for t in transfers:
        agg[(t.src, t.dst, t.kind)] += t.nbytes
    return dict(agg)


@pytest.mark.parametrize("preset", ["dgx1", "pcie2s8", "flat:5"])
def test_tree_copy_pattern_follows_tree_edges(preset):
    topo = nt.Topology.preset(preset)
    n = topo.n
    count = 10_000
    nbytes = count * 4
    with nt.World(
        nt.devices(f"cpu:{n}"), algorithm="tree", topology=topo, chunk_bytes=8192, inline_bytes=0
    ) as w:
        xs = [np.full(count, float(r), np.float32) for r in range(n)]
        with record_transfers() as log:
            w.all_reduce(xs)
        tree = w.tree(0)
    want = {}
    for parent, child, _level in tree.edges:
        if not topo.link(parent, child).p2p:
            continue  # staged through pinned host memory: no device-to-device transfer
        want[(child, parent, "peer_read")] = nbytes  # reduce: the parent reads the child
        want[(parent, child, "copy")] = nbytes  # broadcast: the parent writes the child
    assert _bytes_by_pair(log) == want
    if preset == "pcie2s8":
        assert any(not topo.link(p, c).p2p for p, c, _ in tree.edges)
    assert xs[0][0] == sum(range(n))


def test_broadcast_sends_most_distant_subtree_first():
    # one chunk: the parent writes into its children's buffers on its own stream, in the
    # tree's order
    topo = nt.Topology.preset("dgx1")
    with nt.World(nt.devices("cpu:8"), algorithm="tree", topology=topo, inline_bytes=0) as w:
        xs = [np.full(16, float(r)) for r in range(8)]
        with record_transfers() as log:
            w.broadcast(xs, root=0)
        tree = w.tree(0)
        steps = w.plan("broadcast", 16, dtype=np.float64).steps
    sent_by_root = [t.dst for t in log if t.src == 0]
    assert sent_by_root == list(tree.children(0))
    assert all(s.rank == s.srcs[0].rank for s in steps if s.kind == "copy")
    assert all(np.all(x == 0.0) for x in xs)


@pytest.mark.parametrize("coll", ["broadcast", "all_reduce", "all_gather"])
def test_children_copy_from_their_parent_on_their_own_streams(coll):
    # Several chunks: over peer access a child copies on its own stream once its parent
    # has the chunk, so the parent's stream only reduces (and records) and goes on to its
    # next chunk while its children copy this one.
    topo = nt.Topology.preset("dgx1")
    with nt.World(nt.devices("cpu:8"), algorithm="tree", topology=topo, chunk_bytes=256) as w:
        plan = w.plan(coll, 200)
        tree = w.tree(0)
        owners = plan.event_owners()
        waited: dict[int, set[int]] = collections.defaultdict(set)  # rank -> ranks it waited on
        down = 0
        for st in plan.steps:
            if st.kind == "wait":
                waited[st.rank].add(owners[st.event])
            if st.kind != "copy" or st.srcs[0].rank == st.dst.rank:
                continue
            src, dst = st.srcs[0].rank, st.dst.rank
            if tree.parent(dst) == src:  # down the tree
                down += 1
                assert st.rank == dst, st
                assert src in waited[dst], st
        assert down > 0
        if coll == "broadcast":
            xs = [np.full(200, float(r)) for r in range(8)]
            w.broadcast(xs, root=0)
            assert all(np.all(x == 0.0) for x in xs)


def test_ring_copy_pattern():
    # whole 256-byte units per rank: equal segments, with or without aligned slicing
    n, count = 4, 4096
    with nt.World(
        nt.devices(f"cpu:{n}"), algorithm="ring", chunk_bytes=1 << 20, inline_bytes=0
    ) as w:
        xs = [np.ones(count, np.float32) for _ in range(n)]
        with record_transfers() as log:
            w.all_reduce(xs)
    got = _bytes_by_pair(log)
    seg = count // n * 4
    want = {}
    for r in range(n):
        p = (r - 1) % n
        want[(p, r, "peer_read")] = (n - 1) * seg  # reduce-scatter reads the left neighbour
        want[(p, r, "copy")] = (n - 1) * seg  # all-gather pulls from the left neighbour
    assert got == want


def test_direct_copy_pattern():
    n, count = 3, 3072
    with nt.World(nt.devices(f"cpu:{n}"), algorithm="direct", inline_bytes=0) as w:
        xs = [np.ones(count) for _ in range(n)]
        with record_transfers() as log:
            w.all_reduce(xs)
    got = _bytes_by_pair(log)
    sl = count // n * 8
    want = {}
    for r in range(n):
        for q in range(n):
            if q != r:
                want[(q, r, "peer_read")] = sl  # r reduces its slice reading q
                want[(r, q, "copy")] = sl  # then writes it to q
    assert got == want


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.slow
def test_mean_is_folded_into_the_final_sums(alg, coll, n):
    tree_for = _trees(nt.Topology.preset(f"flat:{n}"))
    kw = dict(size=n, count=100 * n, chunk=16, tree_for=tree_for)
    mean = build_plan(alg, coll, op="mean", **kw)
    total = build_plan(alg, coll, op="sum", **kw)
    # no separate pass: the same steps as the sum, some of them scaled by 1/n
    assert [s.kind for s in mean.steps] == [s.kind for s in total.steps]
    assert not any(s.kind == "scale" for s in mean.steps)
    scaled = [s for s in mean.steps if s.alpha != 1.0]
    assert scaled and all(s.kind == "reduce" and s.alpha == 1.0 / n for s in scaled)
    assert all(s.alpha == 1.0 for s in total.steps)
    assert " * 0." in str(mean)


def test_finish_mean_keeps_the_scale_where_it_cannot_fold():
    from nccltree.comm.builders import finish_mean as _finish_mean

    a, b, c = Buf(0, "in", 0, 4), Buf(1, "in", 0, 4), Buf(0, "out", 0, 4)
    cases = {
        "after a copy": lambda pb: pb.copy(0, c, a),
        "after a reduce into another buffer": lambda pb: pb.reduce(0, a, [a, b], "sum"),
        "after a reduce on another rank": lambda pb: pb.reduce(1, c, [a, b], "sum"),
        "after an event": lambda pb: (pb.reduce(0, c, [a, b], "sum"), pb.signal(0)),
    }
    for what, steps in cases.items():
        pb = PlanBuilder(2)
        steps(pb)
        _finish_mean(pb, 0, c, "mean", 2)
        kinds = [s.kind for s in pb._steps]
        assert kinds[-1] == "scale" and all(s.alpha == 1.0 for s in pb._steps[:-1]), what
    pb = PlanBuilder(2)
    pb.reduce(0, c, [a, b], "sum")
    _finish_mean(pb, 0, c, "mean", 2)
    assert [(s.kind, s.alpha) for s in pb._steps] == [("reduce", 0.5)]
    # a scaled single-source reduce stays a reduce (a copy could not carry alpha)
    pb = PlanBuilder(2)
    pb.reduce(0, c, [a], "sum", alpha=0.5)
    assert [(s.kind, s.alpha) for s in pb._steps] == [("reduce", 0.5)]


def test_plan_str_and_transfers_are_readable():
    plan = build_plan(
        "tree",
        "all_reduce",
        size=2,
        count=4,
        chunk=4,
        tree_for=_trees(nt.Topology.preset("flat:2")),
    )
    text = str(plan)
    assert "tree all_reduce" in text and "reduce(sum)" in text
    assert sorted(plan.transfers()) == [(0, 1, 4), (1, 0, 4)]


def test_links_without_peer_access_are_staged_through_bounded_host_memory():
    topo = nt.Topology.preset("pcie2s8")
    tree = nt.build_tree(topo)
    chunk = 100
    plan = build_plan(
        "tree", "all_reduce", size=8, count=10_000, chunk=chunk, tree_for=lambda root: tree
    )
    crossing = [(p, c) for p, c, _ in tree.edges if not topo.link(p, c).p2p]
    assert crossing, "the two-socket preset has edges without peer access"
    # no step reads or writes across a link without peer access...
    for s in plan.steps:
        for b in s.touches:
            if b.role != "stage" and b.rank != s.rank:
                assert topo.link(b.rank, s.rank).p2p, (s, b)
    # ...the staging memory is two chunks per sending rank, whatever the message size
    assert plan.stage and all(v == 2 * chunk for v in plan.stage.values())
    assert check_races(plan) == []


# -- alignment of the offsets a plan chooses ----------------------------------------------


@pytest.mark.parametrize("align", [1, 16, 32, 64, 128, 256])
def test_split_is_aligned_near_equal_and_exact(align):
    for parts in (1, 2, 3, 5, 8, 12):
        for count in (0, 1, align - 1, align, align + 1, 3 * align + 7, 1000, 4099, 100_003):
            pieces = split(count, parts, align)
            assert len(pieces) == parts
            off = 0
            for o, c in pieces:
                assert o == off and c >= 0, (count, parts, pieces)  # contiguous, in order
                assert o % align == 0, (count, parts, pieces)
                off += c
            assert off == count  # every element exactly once
            sizes = [c for _, c in pieces]
            assert max(sizes) - min(sizes) <= align, (count, parts, sizes)
    # align=1 is the even split to the element
    assert split(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert split(10, 4, 4) == [(0, 4), (4, 4), (8, 0), (8, 2)]


def test_align_elements_and_chunks():
    assert [align_elements(s) for s in (1, 2, 4, 8)] == [256, 128, 64, 32]
    assert align_elements(None) == 1
    assert align_elements(12) * 12 % ALIGN_BYTES == 0  # not a power of two: lcm
    assert aligned_chunk(1000, 64) == 960
    assert aligned_chunk(10, 64) == 64  # never zero
    with pytest.raises(ValueError, match="itemsize"):
        align_elements(0)


# (collective, itemsize) pairs and counts chosen so that count * itemsize is rarely a
# multiple of 16 bytes: the old element-granular slices were misaligned for all of them
AWKWARD_COUNTS = (1, 63, 1001, 4099, 10_007)


def _block_aligned(off: int, block: int, align: int, n: int) -> bool:
    """``off`` is a block start plus a multiple of ``align`` (for the collectives whose
    block offsets the call fixes)."""
    return any(off >= b * block and (off - b * block) % align == 0 for b in range(n))


def _check_alignment(plan: Plan, coll: str, count: int, align: int, n: int) -> None:
    fixed_blocks = coll in ("all_gather", "reduce_scatter")
    for s in plan.data_steps():
        for b in s.touches:
            if b.role == STAGE or not fixed_blocks:
                assert b.offset % align == 0, (coll, count, str(plan.description), s)
            else:
                assert _block_aligned(b.offset, count, align, n), (coll, count, s)


@pytest.mark.parametrize("topo", ["flat:3", "flat:5", "pcie2s8"])
@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.slow
def test_plan_chosen_offsets_are_256_byte_aligned(topo, alg):
    topology = nt.Topology.preset(topo)
    n = topology.n
    tree_for = _trees(topology)
    for itemsize in (1, 2, 4, 8):
        align = align_elements(itemsize)
        for coll in COLLS:
            for count in AWKWARD_COUNTS:
                for in_place in (False, True):
                    plan = build_plan(
                        alg,
                        coll,
                        size=n,
                        count=count,
                        op="sum",
                        root=n - 1,
                        in_place=in_place,
                        chunk=1000,
                        tree_for=tree_for,
                        itemsize=itemsize,
                    )
                    _check_alignment(plan, coll, count, align, n)
                    assert check_races(plan) == [], (alg, coll, count, itemsize)


def _run_plan(plan: Plan, xs: list[np.ndarray], outs: list[np.ndarray]) -> None:
    """Perform a plan's data steps in order on numpy arrays (a valid schedule): an
    interpreter independent of the backends, so the test checks the plan alone."""
    arrays = []
    for r in range(plan.size):
        tmp = np.full(plan.scratch.get(r, 0), -99, xs[0].dtype)
        stage = np.full(plan.stage.get(r, 0), -77, xs[0].dtype)
        arrays.append(
            {IN: xs[r], OUT: xs[r] if plan.same_buffer else outs[r], TMP: tmp, STAGE: stage}
        )

    def view(b: Buf) -> np.ndarray:
        a = arrays[b.rank][b.role]
        assert 0 <= b.offset and b.offset + b.count <= a.size, b
        return a[b.offset : b.offset + b.count]

    for s in plan.data_steps():
        vals = [view(b).copy() for b in s.srcs]
        if s.kind == "copy":
            view(s.dst)[...] = vals[0]
        elif s.kind == "reduce":
            assert s.op == "sum" and s.alpha == 1.0
            view(s.dst)[...] = np.sum(vals, axis=0)
        else:
            raise AssertionError(s)


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("topo", ["flat:3", "pcie2s8"])
@pytest.mark.slow
def test_aligned_plans_cover_every_element_exactly_once(alg, topo):
    # integer sums: an element reduced twice, or never, or left at its sentinel is wrong
    topology = nt.Topology.preset(topo)
    n = topology.n
    tree_for = _trees(topology)
    rng = np.random.default_rng(3)
    for itemsize, dtype in ((4, np.int32), (8, np.int64)):
        for coll in COLLS:
            for count in (63, 1001, 4099):
                for in_place in (False, True):
                    if coll == "all_gather" and in_place:
                        continue  # blocks of the output as inputs: covered by test_collectives
                    root = n - 1
                    total = n * count if coll == "reduce_scatter" else count
                    xs = [rng.integers(-1000, 1000, total).astype(dtype) for _ in range(n)]
                    orig = [x.copy() for x in xs]
                    out_n = n * count if coll == "all_gather" else count
                    outs = [np.full(out_n, -55, dtype) for _ in range(n)]
                    plan = build_plan(
                        alg,
                        coll,
                        size=n,
                        count=count,
                        op="sum",
                        root=root,
                        in_place=in_place and coll != "all_gather",
                        chunk=300,
                        tree_for=tree_for,
                        itemsize=itemsize,
                    )
                    _run_plan(plan, xs, outs)
                    res = xs if plan.same_buffer else outs
                    what = (coll, count, in_place, itemsize)
                    full = np.sum(orig, axis=0)
                    for r in range(n):
                        if coll == "all_reduce":
                            np.testing.assert_array_equal(res[r], full, err_msg=str(what))
                        elif coll == "reduce" and r == root:
                            np.testing.assert_array_equal(res[r], full, err_msg=str(what))
                        elif coll == "reduce":
                            np.testing.assert_array_equal(xs[r], orig[r], err_msg=str(what))
                        elif coll == "broadcast":
                            np.testing.assert_array_equal(res[r], orig[root], err_msg=str(what))
                        elif coll == "all_gather":
                            np.testing.assert_array_equal(
                                outs[r], np.concatenate(orig), err_msg=str(what)
                            )
                        else:
                            block = slice(r * count, (r + 1) * count)
                            got = xs[r][block] if in_place else outs[r]
                            np.testing.assert_array_equal(got, full[block], err_msg=str(what))


def test_aligned_ring_slices_are_near_equal():
    # the plan keeps the ring's load balanced: segments within one 256-byte unit
    n, count, itemsize = 4, 10_007, 4
    plan = build_plan("ring", "all_reduce", size=n, count=count, chunk=1 << 20, itemsize=itemsize)
    final = {}
    for s in plan.data_steps():
        if s.kind == "copy":
            continue
        final.setdefault(s.rank, 0)
        final[s.rank] += s.dst.count
    per_rank = list(final.values())
    assert len(per_rank) == n
    assert max(per_rank) - min(per_rank) <= (n - 1) * align_elements(itemsize)


def test_world_plans_align_what_they_choose(host_devs):
    """The World passes the itemsize, so its plans' slices start on 256-byte boundaries."""
    import numpy as np

    with nt.World(host_devs(3), algorithm="ring") as w:
        for dtype in (np.float16, np.float32, np.float64):
            plan = w.plan("all_reduce", 4099, dtype=dtype, algorithm="ring")
            unit = 256 // np.dtype(dtype).itemsize
            offsets = {s.dst.offset for s in plan.steps if s.dst is not None}
            assert max(offsets) > 0 and all(off % unit == 0 for off in offsets), (dtype, offsets)


# -- one builder signature, one registry; build_plan's argument checks ---------------------


def test_every_algorithm_builds_every_collective_through_one_registry():
    from nccltree.comm.algorithms import ALGORITHMS
    from nccltree.comm.builders import BUILDERS, builds

    assert set(BUILDERS) == {(a, c) for a in ALGORITHMS for c in COLLECTIVES}
    with pytest.raises(AssertionError, match="two builders for ring all_reduce"):
        builds("ring", "all_reduce")(BUILDERS[("ring", "all_reduce")])
    with pytest.raises(ValueError, match="no plan for 'ring' 'scan'"):
        build_plan("ring", "scan", size=2, count=4)
    with pytest.raises(ValueError, match="no plan for 'mesh'"):
        build_plan("mesh", "all_reduce", size=2, count=4)


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("coll", COLLS)
def test_build_plan_accepts_numpy_integers(alg, coll):
    tree_for = _trees(nt.Topology.preset("flat:3"))
    ints = dict(size=3, count=100, root=2, chunk=40, itemsize=4)
    kw = dict(op="sum", in_place=True, tree_for=tree_for)
    plain = build_plan(alg, coll, **ints, **kw)
    for np_int in (np.int64, np.int32, np.uint16):
        numpy = build_plan(alg, coll, **{k: np_int(v) for k, v in ints.items()}, **kw)
        assert numpy.steps == plain.steps and numpy.scratch == plain.scratch
        assert all(type(b.offset) is int for s in numpy.data_steps() for b in s.touches)


@pytest.mark.parametrize(
    "name, bad, error, match",
    [
        ("size", True, TypeError, "size must be an integer, got True"),
        ("size", 3.0, TypeError, "size must be an integer"),
        ("size", 0, ValueError, "size must be >= 1, got 0"),
        ("count", np.bool_(True), TypeError, "count must be an integer"),
        ("count", float("nan"), TypeError, "count must be an integer"),
        ("count", -1, ValueError, "count must be >= 0, got -1"),
        ("root", False, TypeError, "root must be an integer, got False"),
        ("root", 3, ValueError, r"root must be in \[0, 3\), got 3"),
        ("root", np.int64(-1), ValueError, r"root must be in \[0, 3\), got -1"),
        ("chunk", True, TypeError, "chunk must be an integer"),
        ("chunk", 0, ValueError, "chunk must be >= 1, got 0"),
        ("chunk", float("inf"), TypeError, "chunk must be an integer"),
        ("itemsize", True, TypeError, "itemsize must be an integer"),
        ("itemsize", 0, ValueError, "itemsize must be >= 1, got 0"),
        ("itemsize", 4.0, TypeError, "itemsize must be an integer"),
        ("op", "avg", ValueError, "unknown reduction op 'avg'"),
    ],
)
def test_build_plan_checks_its_arguments(name, bad, error, match):
    kw = dict(size=3, count=12, root=0, chunk=4, itemsize=None, op="sum")
    kw[name] = bad
    for alg in ("tree", "ring", "direct"):
        tree_for = _trees(nt.Topology.preset("flat:3"))
        with pytest.raises(error, match=match):
            build_plan(alg, "reduce", tree_for=tree_for, **kw)


def test_build_plan_needs_a_tree_of_its_size_for_the_tree_algorithm():
    with pytest.raises(ValueError, match="needs a tree"):
        build_plan("tree", "all_reduce", size=2, count=4)
    with pytest.raises(ValueError, match="the tree spans 4 ranks, the plan 3"):
        build_plan(
            "tree", "all_reduce", size=3, count=4, tree_for=_trees(nt.Topology.preset("flat:4"))
        )
    # rooted collectives ask for the tree rooted at their root, the others for rank 0's
    asked = []
    topo = nt.Topology.preset("flat:4")

    def tree_for(root):
        asked.append(root)
        return nt.build_tree(topo, root=root)

    for coll in COLLS:
        build_plan("tree", coll, size=4, count=8, root=np.int64(3), tree_for=tree_for)
    assert asked == [0, 3, 3, 0, 0]


# -- bytes a plan moves (the byte-count bound of bench/collectives_table.py) --------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_moved_counts_reads_and_writes(n):
    count = 1 << 16
    size = 4 * count
    with nt.World(f"cpu:{n}", algorithm="tree") as w:
        # direct: every rank reduces its 1/n slice (n reads + 1 write) and writes it to
        # n-1 peers (a read and a write each): (n + 1) + 2 (n - 1) = 3n - 1 buffer passes
        for in_place in (False, True):
            plan = w.plan("all_reduce", count, in_place=in_place, algorithm="direct")
            assert plan.bytes_moved(4) == (3 * n - 1) * size
        # ring: n-1 reduce steps of 1/n (2 reads + 1 write), n-1 copies of 1/n (read + write)
        plan = w.plan("all_reduce", count, in_place=True, algorithm="ring")
        assert plan.bytes_moved(4) == pytest.approx(5 * (n - 1) * size, rel=1e-3)


def test_bytes_moved_skips_copies_onto_the_same_memory():
    a, a_out, b = Buf(0, IN, 0, 10), Buf(0, OUT, 0, 10), Buf(1, IN, 0, 10)
    pb = PlanBuilder(2, same_buffer=True)
    pb.copy(0, a_out, a)  # in place: "out" is "in", nothing moves
    pb.reduce(1, b, [a, b], "sum")  # two reads, one write
    pb.scale(1, b, 0.5)  # a read and a write
    plan = pb.build()
    assert plan.bytes_moved(8) == (3 + 2) * 10 * 8
    plan.same_buffer = False  # now the copy is real: a read and a write
    assert plan.bytes_moved(np.int64(8)) == (2 + 3 + 2) * 10 * 8
    for bad, error in ((0, ValueError), (True, TypeError), (8.0, TypeError)):
        with pytest.raises(error, match="itemsize"):
            plan.bytes_moved(bad)
