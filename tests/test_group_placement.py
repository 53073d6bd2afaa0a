"""Who is where in a process group (nccltree/comm/group/placement.py), worked out from the
bootstrap's allgather without starting processes: a stand-in communicator answers for
the other processes."""

from __future__ import annotations

import os
from typing import Any, cast

import pytest

pytest.importorskip("mpi4py")

from nccltree.comm.group.placement import Placement, place


class FakeBoot:
    """MPI rank ``me`` of a job whose other processes said ``others`` (by MPI rank:
    node name, ranks, pid, shared memory usable), through the bootstrap's one exchange."""

    def __init__(self, me: int, others: list[tuple[str, int, int, bool]],
                 settings: list[dict[str, object]] | None = None) -> None:  # fmt: skip
        self.rank = me
        self.size = len(others)
        self.others = others
        self.settings = settings
        self.calls: list[str] = []

    def exchange(self, mine: list[object]) -> list[object]:
        self.calls.append("exchange")
        assert mine[0] == self.others[self.rank][0] and mine[1] == self.others[self.rank][1]
        got: list[object] = []
        for i, o in enumerate(self.others):
            if i == self.rank:
                got.append(mine)
            else:
                s = mine[5] if self.settings is None else self.settings[i]
                got.append([*o, "cafe0123" if i == 0 else "beef4567", s])
        return got


# MPI ranks 0..4: node b first (so b is node 0), then a; MPI rank 1 holds two ranks
JOB = [("b", 1, 10, True), ("a", 2, 11, True), ("b", 1, 12, True), ("a", 1, 13, True),
       ("b", 1, 14, True)]  # fmt: skip


def _place(me: int, others: list[tuple[str, int, int, bool]], monkeypatch: pytest.MonkeyPatch,
           shm: bool | None = None) -> tuple[Placement, FakeBoot]:  # fmt: skip
    monkeypatch.setenv("NCCLTREE_NODE", others[me][0])
    boot = FakeBoot(me, others)
    want = others[me][3] if shm is None else shm
    return place(cast("Any", boot), others[me][1], want), boot


def test_processes_are_numbered_node_major_and_ranks_by_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pl, comm = _place(1, JOB, monkeypatch)
    assert comm.calls == ["exchange"]  # one round
    assert pl.job == "cafe0123"  # process 0's
    # nodes in order of their first MPI rank: b (MPI 0, 2, 4), then a (MPI 1, 3)
    assert pl.mpi_rank_of_proc == [0, 2, 4, 1, 3]
    assert pl.node_of_proc == [0, 0, 0, 1, 1]
    assert pl.nlocal_of_proc == [1, 1, 1, 2, 1]
    assert pl.first_rank_of_proc == [0, 1, 2, 3, 5]
    assert pl.proc_of_rank == [0, 1, 2, 3, 3, 4]
    assert (pl.nprocs, pl.size, pl.nodes) == (5, 6, 2)
    # MPI rank 1 is process 3: ranks 3 and 4, on node a (index 1), the first of its node
    assert (pl.proc, pl.ranks, pl.rank, pl.node, pl.node_index) == (3, (3, 4), 3, "a", 1)
    assert (pl.local_rank, pl.local_size) == (0, 3)
    assert pl.phys == pl.node_procs == [3, 4] and pl.remote_procs == [0, 1, 2]
    assert pl.shm and pl.job == "cafe0123"
    assert pl.ranks_of(3) == [3, 4] and pl.ranks_of(0) == [0]


def test_a_node_that_cannot_share_memory_is_a_node_per_process_for_the_transports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = [(n, k, pid, ok and n != "b") for n, k, pid, ok in JOB]
    pl, _ = _place(0, job, monkeypatch, shm=False)  # process 0: the first of node b
    assert not pl.shm
    # b's processes are transport nodes of their own (numbered after the real nodes);
    # a keeps its node; the topology's nodes stay the real ones
    assert pl.tnode_of_proc == [2, 3, 4, 1, 1]
    assert pl.node_of_proc == [0, 0, 0, 1, 1]
    assert pl.node_procs == [0] and pl.remote_procs == [1, 2, 3, 4]
    assert pl.phys == [0, 1, 2]
    err = capsys.readouterr().err
    assert "the processes of node b exchange data over MPI instead of shared memory" in err
    # only the node's first process says so
    _place(2, job, monkeypatch, shm=False)
    assert capsys.readouterr().err == ""


def test_the_job_name_comes_from_mpi_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    pl, _ = _place(0, JOB, monkeypatch)
    assert len(pl.job) == 8 and pl.job != "cafe0123"
    assert os.environ["NCCLTREE_NODE"] == "b"


def test_different_settings_raise_naming_what_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCLTREE_NODE", "b")
    every = [{"algorithm": "auto"}, {"algorithm": "tree"}, {"algorithm": "auto"},
             {"algorithm": "auto"}, {"algorithm": "auto"}]  # fmt: skip
    boot = FakeBoot(0, JOB, every)
    with pytest.raises(
        ValueError,
        match=r"algorithm: 'auto' on MPI ranks \[0, 2, 3, 4\], 'tree' on MPI ranks \[1\]",
    ):
        place(cast("Any", boot), 1, True, {"algorithm": "auto"})
    # started without MPI: the processes by the launcher's rank
    with pytest.raises(ValueError, match=r"'auto' on processes \[0, 2, 3, 4\], 'tree' on proc"):
        place(cast("Any", FakeBoot(0, JOB, every)), 1, True, {"algorithm": "auto"}, None,
              "processes")  # fmt: skip


def test_a_malformed_placement_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCLTREE_NODE", "b")
    boot = FakeBoot(0, JOB)
    boot.exchange = lambda mine: [mine, ["a", 1]]  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="process 1 sent a malformed placement"):
        place(cast("Any", boot), 1, True)
