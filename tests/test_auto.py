"""``algorithm="auto"`` as a table (nccltree.comm.auto): the same choices as the if-chain it
replaced, over sizes x backends x topologies, on host devices and on the fake of CuPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm import auto
from nccltree.comm._args import Prepared

# message sizes per rank: zero, tiny, each threshold and its neighbours, large
SIZES = sorted(
    {0, 4, 252, 256, 260, 1000}
    | {t + d for t in (64 << 10, 256 << 10, 1 << 20) for d in (-4, 0, 4)}
    | {4 << 20, 64 << 20}
)


def old_choose(world: nt.World, nbytes: int) -> str:
    """World._choose written as an if-chain (the oracle of this test): as before the table,
    except that uniform host links take direct at every size."""
    if world.backend == "cuda" and nbytes >= 256 << 10 and world._issuer.nccl_usable():
        return "nccl"
    topo, n = world.topology, world.size
    links = {
        (topo.link(i, j).kind, topo.link(i, j).p2p) for i in range(n) for j in range(n) if i != j
    }
    uniform = len(links) == 1 and next(iter(links))[1]
    if world.backend == "host" and uniform:
        return "direct"
    if nbytes <= {"host": 1 << 20, "cuda": 64 << 10}[world.backend]:
        return "tree"
    return "direct" if uniform else "tree"


def choices(world: nt.World) -> list[tuple[int, str, str]]:
    """(bytes, new choice, old choice) for every size, float32 all_reduce."""
    out = []
    for nbytes in SIZES:
        prep = Prepared(
            "all_reduce", [], [], [], np.dtype(np.float32), nbytes // 4, False, "sum", 0
        )
        out.append((nbytes, world._choose(prep), old_choose(world, prep.nbytes)))
    return out


def assert_same(world: nt.World) -> set[str]:
    seen = choices(world)
    assert [(b, new) for b, new, _ in seen] == [(b, old) for b, _, old in seen]
    return {new for _, new, _ in seen}


HOST_TOPOLOGIES = [None, "dgx1", "nvswitch8", "k80x4", "pcie2s8", "flat:3"]


@pytest.mark.parametrize("preset", HOST_TOPOLOGIES)
def test_host_choices_are_unchanged(preset: str | None) -> None:
    topo = None if preset is None else nt.Topology.preset(preset)
    n = 4 if topo is None else topo.n
    with nt.World(nt.devices(f"cpu:{n}"), algorithm="auto", topology=topo) as w:
        used = assert_same(w)
        uniform = auto.topology_class(w.topology) == auto.UNIFORM_PEER
    assert used == ({"direct"} if uniform else {"tree"})


def test_host_one_device() -> None:
    with nt.World(nt.devices("cpu:1"), algorithm="auto") as w:
        assert assert_same(w) == {"tree"}


EIGHT = "gpu:0,1,2,3,4,5,6,7"
SHARED = "gpu:0,0,1,1,2,2,3,3"


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 8}], indirect=True)
@pytest.mark.parametrize(
    "spec,preset",
    [
        (EIGHT, None),  # distinct GPUs, peer access: NCCL usable, uniform links
        (EIGHT, "nvswitch8"),
        (EIGHT, "dgx1"),  # NCCL usable, mixed links
        (EIGHT, "k80x4"),
        (EIGHT, "pcie2s8"),
        ("gpu:0,1,2,3", "flat:4"),
        (SHARED, None),  # shared GPUs: NCCL unusable, the table falls back
        (SHARED, "dgx1"),
        ("gpu:0", None),
    ],
)
def test_cuda_choices_are_unchanged(fake_cupy: Any, spec: str, preset: str | None) -> None:
    topo = None if preset is None else nt.Topology.preset(preset)
    with nt.World(nt.devices(spec), algorithm="auto", topology=topo) as w:
        used = assert_same(w)
        gpus = spec[4:].split(",")
        assert ("nccl" in used) == (len(set(gpus)) == len(gpus))


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 3, "peer": False}], indirect=True)
def test_cuda_without_peer_access(fake_cupy: Any) -> None:
    with nt.World(nt.devices("gpu:0,1,2"), algorithm="auto") as w:
        assert auto.topology_class(w.topology) == auto.OTHER
        assert "direct" not in assert_same(w)


def test_nodes_over_the_network_take_the_tree() -> None:
    cluster = nt.Topology.cluster([0, 0, 1, 1])
    assert auto.topology_class(cluster) == auto.OTHER
    # even when every pair crosses (one rank per node)
    assert auto.topology_class(nt.Topology.cluster([0, 1, 2])) == auto.OTHER
    for size in (8, 1 << 20):
        assert auto.choose("host", auto.OTHER, size, lambda a: True) == "tree"


def test_the_table_is_declarative() -> None:
    for (backend, topo_class), rules in auto.AUTO.items():
        assert backend in ("host", "cuda")
        assert topo_class in (auto.UNIFORM_PEER, auto.OTHER, auto.GROUP_ONE_NODE, auto.GROUP_NODES)
        assert all(r.why for r in rules)
        last = rules[-1]  # the last rule takes every size
        assert last.min_bytes == 0 and last.max_bytes is None
    with pytest.raises(AssertionError, match="no auto rule"):
        auto.choose("host", auto.UNIFORM_PEER, 1 << 30, lambda a: a != "direct")


def test_process_groups_read_the_same_table() -> None:
    """A group's MPI rule is a row of the table: its size range and its conditions."""
    facts = dict(gpu=False, nccl_usable=False, nodes=1, ranks_per_process=1, mpi_order=True,
                 reduces=True, mpi_reduces=True)  # fmt: skip
    assert auto.choose_group(nbytes=auto.AUTO_MPI_BYTES, **facts) == "mpi"
    assert auto.choose_group(nbytes=auto.AUTO_MPI_BYTES + 1, **facts) == "direct"
    assert auto.choose_group(nbytes=8, **{**facts, "nodes": 2, "mpi_order": False}) == "tree"
    assert auto.choose_group(nbytes=8, **{**facts, "mpi_reduces": False}) == "direct"
    assert auto.choose_group(nbytes=8, **{**facts, "reduces": False, "mpi_reduces": False}) == "mpi"
    assert auto.choose_group(nbytes=8, **{**facts, "gpu": True}) == "direct"
    assert auto.choose_group(nbytes=8, **{**facts, "gpu": True, "nccl_usable": True}) == "nccl"
    assert [r.algorithm for r in auto.AUTO["host", auto.GROUP_ONE_NODE]] == ["mpi", "direct"]


def test_nccl_is_asked_only_when_its_size_range_matches() -> None:
    asked: list[str] = []

    def usable(alg: str) -> bool:
        asked.append(alg)
        return True

    assert auto.choose("cuda", auto.UNIFORM_PEER, 1000, usable) == "tree"
    assert asked == ["tree"]
    assert auto.choose("cuda", auto.OTHER, 1 << 20, usable) == "nccl"
