"""Process groups on GPUs (one rank per process): CUDA IPC within a node, NCCL between
nodes and for ``algorithm="nccl"``.

Two kinds of tests, kept apart:

- on ``tests/fakecupy`` (every test without a ``gpu`` mark): nccltree's unmodified GPU
  code under mpiexec, each process with its own fake of CuPy's layer, IPC blocks shared
  through /dev/shm files and NCCL across processes carried by MPI. They check wiring
  (which handles are exported and opened, which streams wait on which peer events, which
  NCCL calls are made, and that the results are numpy's) and never count as GPU
  verification;
- ``gpu``/``multi_gpu`` tests: the same worker on real GPUs. Two processes sharing one GPU
  through CUDA IPC run on a one-GPU machine; NCCL refuses two ranks on one GPU, so the
  NCCL paths need two GPUs.

The schedule's message order (gpu.py: every pair of processes issues its NCCL operations
in one agreed order) is checked without MPI by simulating NCCL's rules.
"""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import gpu_count, gpu_own_timeout
from tests.mpirun import needs_mpi, run_mpi

HERE = Path(__file__).resolve().parent / "mpi"
WORKER = HERE / "pg_gpu.py"
#: how long a killed rank's shell outlives it in the GPU kill tests: long enough that the
#: survivor must find the death itself (it does within a second), short for the GPU check
KILLED_SHELL_S = 4


def _nodes(*sizes: int) -> list[tuple[int, dict[str, str]]]:
    return [(n, {"NCCLTREE_NODE": f"node{chr(97 + i)}"}) for i, n in enumerate(sizes)]


def _run(tmp: Path, parts: Any, *args: str, **kw: Any) -> tuple[list[dict[str, Any]], Any]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    proc = run_mpi(parts, WORKER, *args, env={"NCCLTREE_TEST_OUT": str(out)}, **kw)
    got = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    return got, proc


def _all_pass(reports: list[dict[str, Any]], n: int, proc: Any) -> None:
    assert len(reports) == n, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in reports:
        assert r["nfail"] == 0 and r["checked"] > 0, r
        assert not r.get("misuse"), r
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- on the fake (wiring only, not GPU verification) ---------------------------------------

PHB3 = [["X", "PHB", "PHB"], ["PHB", "X", "PHB"], ["PHB", "PHB", "X"]]
FAKE = {
    # name: (mpiexec parts, worker arguments, peer events waited on, NCCL methods, the
    # topology's link tokens: the fake has no NVML, so peer access says PHB)
    "one node, a GPU per process": (3, ["--counts", "5,70001"], True, [], PHB3),
    "one node, processes sharing GPU 0": (2, ["--devices", "gpu:0", "--dtypes", "float32"],
                                          True, [], [["X", "DEV"], ["DEV", "X"]]),
    "two nodes x two processes (NCCL send/recv between nodes)": (
        _nodes(2, 2), ["--counts", "5,70001", "--dtypes", "float32"], False, ["recv", "send"],
        [["X", "PHB", "NET", "NET"], ["PHB", "X", "NET", "NET"], ["NET", "NET", "X", "PHB"],
         ["NET", "NET", "PHB", "X"]]),
    "algorithm nccl and auto": (3, ["--algorithms", "nccl,auto", "--counts", "5,70001"], False,
                                ["allGather", "allReduce", "broadcast", "reduce",
                                 "reduceScatter"], PHB3),
}  # fmt: skip


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("name", list(FAKE))
def test_on_the_fake_every_collective_matches_numpy(name: str, tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification)."""
    parts, args, events, nccl, topology = FAKE[name]
    reports, proc = _run(tmp_path, parts, "--fake", "4", *args, timeout=300)
    n = parts if isinstance(parts, int) else sum(p[0] for p in parts)
    _all_pass(reports, n, proc)
    for r in reports:
        ipc = r["ipc"]
        if n > 1 and "nccl" not in args[1:2] and "--algorithms" not in args:
            # the arena and the symmetric buffers are exported, and the peers' opened
            # (and closed at close())
            assert ipc.get("export", 0) > 0 and ipc.get("open", 0) > 0, r
            assert ipc.get("open") == ipc.get("close"), r
        # events mode: every process's stream waits on its peers' inter-process events;
        # across nodes (sync mode) never: counters there mean the work is done
        assert (r["waits_on_peer_events"] > 0) == events, r
        assert r["nccl"] == nccl, r
        assert r["topology"] == topology, r


BF16_FAKE = {
    # name: (mpiexec parts, worker arguments, NCCL methods, NCCL datatypes: ncclBfloat16
    # (9) for the reductions, ncclUint8 (1) for what is only moved)
    "one node, every algorithm": (
        3, ["--algorithms", "tree,ring,direct,nccl"],
        ["allGather", "allReduce", "broadcast", "reduce", "reduceScatter"], {1, 9}),
    "two nodes x two processes (NCCL send/recv of bytes between nodes)": (
        _nodes(2, 2), ["--algorithms", "tree,direct"], ["recv", "send"], {1}),
}  # fmt: skip


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("name", list(BF16_FAKE))
def test_on_the_fake_bfloat16_in_uint16_cupy_arrays(name: str, tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): GPU groups take bfloat16 as
    uint16 CuPy arrays named ``dtype="bfloat16"`` on every collective and placement; the
    values match numpy; NCCL's reductions carry ncclBfloat16, and what NCCL only moves
    (broadcast, all_gather, the sends and receives between nodes) goes as bytes."""
    parts, args, nccl, datatypes = BF16_FAKE[name]
    reports, proc = _run(tmp_path, parts, "--fake", "4", "--dtypes", "bfloat16",
                         "--counts", "5,70001", *args, timeout=300)  # fmt: skip
    n = parts if isinstance(parts, int) else sum(p[0] for p in parts)
    _all_pass(reports, n, proc)
    for r in reports:
        assert r["nccl"] == nccl, r
        assert set(r["nccl_datatypes"]) == datatypes, r


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_nccl_refuses_processes_sharing_a_gpu(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy: the refusal comes from nccltree, on every process,
    before NCCL is asked (NCCL would fail with "Duplicate GPU detected")."""
    _, proc = _run(tmp_path, 2, "--fake", "4", "--devices", "gpu:0", "--algorithms", "nccl",
                   timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.count("needs one GPU per process") == 2, proc.stderr[-3000:]


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_the_checks_nccl_on_one_gpu_attempt_gets_past_nccltrees_refusal(
    tmp_path: Path,
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification, and not evidence that NCCL
    accepts it: only a GPU run can say). The GPU check's attempt at NCCL across two
    processes on one GPU, with its environment (a distinct ``NCCL_HOSTID`` per process,
    sockets over ``lo``, the test-only variable that lifts nccltree's own refusal): the
    groups make their NCCL communicator and the collectives of algorithm nccl match numpy
    (the fake, like NCCL 2.28, tells GPUs apart by host id and device)."""
    from tests.conftest import bench_module

    check = bench_module("gpu_check")
    attempt = check.nccl_one_gpu_attempts("gpu:0", ["--fake", "4"])[0]
    assert attempt["args"][:2] == ["--fake", "4"]
    parts = [(1, {**check.NCCL_ONE_GPU_ENV, **env}) for env in attempt["procs"]]
    assert len({env["NCCL_HOSTID"] for _, env in parts}) == 2
    out = tmp_path / "out"
    out.mkdir()
    proc = run_mpi(parts, attempt["worker"], *attempt["args"],
                   env={"NCCLTREE_TEST_OUT": str(out)}, timeout=180)  # fmt: skip
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    _all_pass(reports, 2, proc)
    for r in reports:
        assert "allReduce" in r["nccl"], r
    argv = check.nccl_one_gpu_argv("mpiexec", attempt)
    assert argv.count("NCCL_HOSTID") == 2 and argv.count(":") == 1


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_a_killed_process_is_named(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy: a process dying in its third call is named by the
    survivor, which exits on its own (no hang)."""
    parts = [(1, {}), (1, {}, "{cmd}; sleep 20")]
    _, proc = _run(tmp_path, parts, "--fake", "4", "--kill", "1", "--algorithms", "direct",
                   faults=True, timeout=90)  # fmt: skip
    lines = re.findall(r"nccltree: PeerFailure: rank 0: [^\n]*", proc.stderr)
    assert lines and "ranks [1]" in lines[0] and "died" in lines[0], proc.stderr[-3000:]


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_a_hung_nccl_call_fails_the_group_in_time(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy: NCCL work that never completes is found by the
    group's watchdog at the timeout, which aborts the communicator and fails the group on
    every process (no hang; later calls raise at once)."""
    reports, proc = _run(tmp_path, 2, "--fake", "4", "--algorithms", "nccl", "--hang-nccl",
                         "--timeout", "2", "--counts", "5", "--dtypes", "float32",
                         timeout=120)  # fmt: skip
    assert len(reports) == 2, proc.stderr[-3000:]
    for r in reports:
        assert r["nfail"] > 0 and any("failed earlier" in f for f in r["failures"]), r
    assert proc.stderr.count("nccltree: CommTimeout:") == 2, proc.stderr[-3000:]
    assert "did not complete within 2 s" in proc.stderr


# -- the message order, simulated (no MPI, no GPU) ----------------------------------------


def _simulate(scheds: list[Any], orders: list[list[tuple[str, int]]]) -> None:
    """Run every process's work under NCCL's rules and sync mode's: one stream per
    process performs its operations in order; a send and a receive complete together,
    the n-th message between two processes matching the n-th (same size); a process's
    host waits for its node's counters before issuing a step and for its stream after it.
    Fails on a deadlock or a mismatched pair."""
    from nccltree.comm.group.schedule import Schedule

    nproc = len(scheds)
    ops: list[deque[tuple[Any, ...]]] = []
    for s, order in zip(scheds, orders, strict=True):
        assert isinstance(s, Schedule)
        q: deque[tuple[Any, ...]] = deque()
        for kind, i in order:
            if kind == "recv":
                src, _, count, _ = s.recvs[i]
                q.append(("recv", src, max(count, 1)))
                continue
            it = s.items[i]
            if it.kind in ("step", "end"):
                q.append(("wait", it.waits))
                if it.kind == "step":
                    q.append(("step",))
            elif it.kind == "send":
                q.append(("send", it.peer, it.src.count))
            else:
                q.append(("send", it.peer, 1))
        ops.append(q)
    done = [0] * nproc  # steps completed
    moved = True
    while moved:
        moved = False
        for p in range(nproc):
            while ops[p]:
                head = ops[p][0]
                if head[0] == "wait":
                    if all(done[q] >= k for q, k in head[1]):
                        ops[p].popleft()
                        moved = True
                        continue
                    break
                if head[0] == "step":
                    ops[p].popleft()
                    done[p] += 1
                    moved = True
                    continue
                peer = head[1]
                other = ops[peer][0] if ops[peer] else None
                want = "recv" if head[0] == "send" else "send"
                if other is not None and other[0] == want and other[1] == p:
                    assert other[2] == head[2], f"messages {p}<->{peer} differ in size"
                    ops[p].popleft()
                    ops[peer].popleft()
                    moved = True
                    continue
                break
    stuck = {p: ops[p][0] for p in range(nproc) if ops[p]}
    assert not stuck, f"deadlock: {stuck}"


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("nodes", [(1, 1), (2, 2), (2, 1, 2), (1, 1, 1, 1), (3, 2)])
@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "reduce", "all_gather",
                                  "reduce_scatter"])  # fmt: skip
@pytest.mark.slow
def test_message_order_never_deadlocks_under_nccls_rules(
    alg: str, nodes: tuple[int, ...], coll: str
) -> None:
    from nccltree.comm.algorithms import build_plan
    from nccltree.comm.group.gpu import message_order
    from nccltree.comm.group.schedule import split
    from nccltree.topology import Topology
    from nccltree.tree import build_tree

    node_of_proc = [i for i, k in enumerate(nodes) for _ in range(k)]
    n = len(node_of_proc)
    topo = Topology.cluster(node_of_proc)
    for root in sorted({0, n - 1}):
        for count, chunk in ((1, 1 << 20), (9000, 1000)):
            plan = build_plan(alg, coll, size=n, count=count, op="sum", root=root,
                              in_place=False, chunk=chunk,
                              tree_for=lambda r: build_tree(topo, root=r), itemsize=4)  # fmt: skip
            scheds = split(plan, list(range(n)), node_of_proc)
            _simulate(scheds, [message_order(scheds, p) for p in range(n)])


def test_the_simulation_catches_a_bad_order() -> None:
    """Negative control: receives in the receiver's own order (each before the item that
    needs it, as MPI allows) deadlock a ring across nodes under NCCL's rules."""
    from nccltree.comm.algorithms import build_plan
    from nccltree.comm.group.schedule import split
    from nccltree.topology import Topology
    from nccltree.tree import build_tree

    node_of_proc = [0, 1, 2]
    topo = Topology.cluster(node_of_proc)
    plan = build_plan("ring", "all_reduce", size=3, count=9000, op="sum", root=0,
                      in_place=False, chunk=1000, tree_for=lambda r: build_tree(topo, root=r),
                      itemsize=4)  # fmt: skip
    scheds = split(plan, [0, 1, 2], node_of_proc)

    def naive(p: int) -> list[tuple[str, int]]:
        # every receive right before the first item waiting for it, in tag order
        s = scheds[p]
        index = {(q, tag): j for j, (q, tag, _, _) in enumerate(s.recvs)}
        out: list[tuple[str, int]] = []
        for i, it in enumerate(s.items):
            out += [("recv", index[m]) for m in it.recvs]
            out.append(("item", i))
        return out

    with pytest.raises(AssertionError, match="deadlock|differ"):
        _simulate(scheds, [naive(p) for p in range(3)])


# -- on real GPUs -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(15)
@needs_mpi
def test_gpu_two_processes_sharing_one_gpu_through_ipc(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two processes on GPU 0, CUDA IPC between them: tree, ring and direct, every
    collective, against numpy (one element, an odd count and a million: the sizes that
    take the paths apart; the GPU check's budget has room for three)."""
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    reports, proc = _run(tmp_path, 2, "--devices", "gpu:0", "--counts", "1,70001,1000003",
                         timeout=gpu_own_timeout(request))  # fmt: skip
    _all_pass(reports, 2, proc)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(8)
@needs_mpi
def test_gpu_bfloat16_in_uint16_arrays_two_processes_sharing_one_gpu(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """bfloat16 as uint16 CuPy arrays named ``dtype="bfloat16"``, two processes on GPU 0
    (CUDA IPC): tree, ring and direct, every collective and placement, against numpy."""
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    reports, proc = _run(tmp_path, 2, "--devices", "gpu:0", "--dtypes", "bfloat16",
                         "--counts", "1,70001", timeout=gpu_own_timeout(request))  # fmt: skip
    _all_pass(reports, 2, proc)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(4)
@needs_mpi
def test_gpu_a_killed_process_is_named(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The killed rank's shell stays a few seconds (the launcher does not see it go),
    so the survivor must find the death itself: it names it and exits on its own."""
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    parts = [(1, {}), (1, {}, "{cmd}; sleep " + str(KILLED_SHELL_S))]
    _, proc = _run(tmp_path, parts, "--devices", "gpu:0", "--kill", "1", "--algorithms",
                   "direct", faults=True, timeout=gpu_own_timeout(request))  # fmt: skip
    lines = re.findall(r"nccltree: PeerFailure: rank 0: [^\n]*", proc.stderr)
    assert lines and "ranks [1]" in lines[0] and "died" in lines[0], proc.stderr[-3000:]


@pytest.mark.multi_gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(20)
@needs_mpi
def test_multi_gpu_nccl_across_processes_and_two_simulated_nodes(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """NCCL needs one GPU per process: the nccl algorithm on two GPUs, and two simulated
    nodes of one process each (NCCL send/recv between them)."""
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    own = gpu_own_timeout(request) / 2
    reports, proc = _run(tmp_path, 2, "--algorithms", "nccl,auto,tree,direct", timeout=own)
    _all_pass(reports, 2, proc)
    reports, proc = _run(tmp_path, _nodes(1, 1), "--algorithms", "tree,ring", timeout=own)
    _all_pass(reports, 2, proc)


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_the_benchmark_runs_a_gpu_group(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy: ``nccltree-bench collectives --devices gpu`` under
    mpiexec (one table from rank 0; every algorithm's results checked; NCCL among them)."""
    out = tmp_path / "bench.json"
    proc = run_mpi(2, HERE / "fake_gpu_cli.py", "bench", "collectives", "--devices", "gpu",
                   "-b", "8", "-e", "64K", "-f", "64", "--algorithm", "tree,ring,direct,nccl",
                   "-c", "1", "-n", "2", "-w", "1", "--json", str(out), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("# Avg bus bandwidth") == 1, proc.stdout[-2000:]
    records = json.loads(out.read_text())["records"]
    assert {r["algorithm"] for r in records} == {"tree", "ring", "direct", "nccl"}
    assert all(r["wrong"] == 0 for r in records), records
    assert all(r["devices"].startswith("gpu") for r in records), records[0]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(8)
@needs_mpi
def test_gpu_training_over_two_processes_sharing_a_gpu_equals_one_process(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``mpiexec -n 2 nccltree-train --devices gpu:0`` trains bitwise as one process on
    two logical ranks of GPU 0 (``gpu:0,0``) with the tree: the same plan over the same
    topology, the same kernels in the same order."""
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    import numpy as np

    from nccltree.cli import train
    from tests.mpirun import ROOT

    common = ["--synthetic", "512", "--batch-size", "8", "--seed", "1", "--algorithm", "tree",
              "--iters", "8", "--quiet"]  # fmt: skip
    ref = tmp_path / "single"
    assert train.main([*common, "--devices", "gpu:0,0", "--out", str(ref)]) == 0
    out = tmp_path / "mpi"
    proc = run_mpi(2, ROOT / "tests" / "mpi" / "cli_main.py", "train", *common, "--devices",
                   "gpu:0", "--out", str(out), timeout=gpu_own_timeout(request))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    a, b = np.load(ref / "final.npz"), np.load(out / "final.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert np.array_equal(a[k], b[k]), k


P2P_FAKE = {
    # name: (mpiexec parts, worker arguments, the ranks NCCL may carry messages with,
    # whether streams wait on peer events: events mode, one node)
    "one node, a GPU per process (CUDA IPC)": (3, [], {}, True),
    "one node, processes sharing GPU 0 (CUDA IPC; NCCL would refuse)": (
        2, ["--devices", "gpu:0"], {}, True),
    "two nodes x two processes (CUDA IPC within, NCCL between)": (
        _nodes(2, 2), [], {0: {2, 3}, 1: {2, 3}, 2: {0, 1}, 3: {0, 1}}, False),
}  # fmt: skip


def _p2p_run(tmp: Path, parts: Any, *args: str, **kw: Any) -> tuple[list[dict[str, Any]], Any]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    proc = run_mpi(parts, HERE / "pg_p2p.py", *args, env={"NCCLTREE_TEST_OUT": str(out)}, **kw)
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))], proc


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("name", list(P2P_FAKE))
def test_on_the_fake_send_recv_and_all_to_all_v(name: str, tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): the p2p worker with CuPy
    arrays (ring, pipeline, ordered pairs, a batch of large messages, size mismatches on
    both sides, all_to_all_v), results against numpy. Within a node the messages go
    through the senders' arenas, opened over CUDA IPC, never NCCL or MPI; between nodes
    NCCL carries them."""
    parts, args, nccl_peers, events = P2P_FAKE[name]
    reports, proc = _p2p_run(tmp_path, parts, "--fake", "4", "--big", "5000", *args,
                             timeout=240)  # fmt: skip
    n = parts if isinstance(parts, int) else sum(p[0] for p in parts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(reports) == n and all(r["failures"] == [] for r in reports), reports
    for r in reports:
        assert not r["misuse"], r
        assert r["ipc_open"] > 0, r
        assert set(r["nccl_p2p_peers"]) == nccl_peers.get(r["rank"], set()), r
        assert (r["waits_on_peer_events"] > 0) == events, r
        assert r["p2p_within_node"] == r["p2p_to_other_nodes"] == 0, r
        assert r["collectives_after_init"] == 0, r


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_a_process_killed_before_its_messages_is_named(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): rank 1 dies before the
    batch of large messages; the others, waiting for its messages or its receives over
    CUDA IPC, name it and exit on their own."""
    parts = [(1, {}), (1, {}, "{cmd}; sleep 20"), (1, {})]
    _, proc = _p2p_run(tmp_path, parts, "--fake", "4", "--big", "5000", "--kill", "1",
                       faults=True, timeout=90)  # fmt: skip
    for rank in (0, 2):
        lines = re.findall(rf"nccltree: PeerFailure: rank {rank}: [^\n]*", proc.stderr)
        assert lines and "ranks [1]" in lines[0] and "died" in lines[0], proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(8)
@needs_mpi
def test_gpu_send_recv_and_all_to_all_v_between_processes_sharing_one_gpu(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two processes on GPU 0: send/recv, batches and all_to_all_v over CUDA IPC (NCCL
    refuses two ranks on one GPU), results against numpy, mismatches on both sides."""
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    reports, proc = _p2p_run(tmp_path, 2, "--devices", "gpu:0", "--big", str(1 << 22),
                             timeout=gpu_own_timeout(request))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(reports) == 2 and all(r["failures"] == [] for r in reports), reports
    assert all(r["p2p_within_node"] == 0 for r in reports), reports


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.gpu_seconds(4)
@needs_mpi
def test_gpu_a_process_killed_before_its_messages_is_named(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    parts = [(1, {}), (1, {}, "{cmd}; sleep " + str(KILLED_SHELL_S))]
    _, proc = _p2p_run(tmp_path, parts, "--devices", "gpu:0", "--kill", "1", faults=True,
                       timeout=gpu_own_timeout(request))  # fmt: skip
    lines = re.findall(r"nccltree: PeerFailure: rank 0: [^\n]*", proc.stderr)
    assert lines and "ranks [1]" in lines[0] and "died" in lines[0], proc.stderr[-3000:]


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_gpu_groups_split(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): GPU process groups split
    by parity and into a pair (each sub-group on its processes' GPUs, with an NCCL
    communicator of its own), collectives in both and in the parent."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_mpi(4, HERE / "pg_split.py", "--fake", env={"NCCLTREE_TEST_OUT": str(out)},
                   timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 4 and all(r["failures"] == [] for r in reports), reports


@pytest.mark.mpi
@needs_mpi
def test_on_the_fake_objects_async_p2p_and_v_collectives(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): tests/mpi/pg_interop.py with
    CuPy arrays on 3 processes: broadcast_object/all_gather_object through device
    buffers, an irecv/isend pair with a done-callback, all_gather_v and reduce_scatter_v
    with uneven counts, a collective after; every check passes on every rank."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_mpi(3, HERE / "pg_interop.py", "--fake", "4",
                   env={"NCCLTREE_TEST_OUT": str(out)}, timeout=240)  # fmt: skip
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(reports) == 3 and all(r["failures"] == [] for r in reports), reports
    assert all(not r["misuse"] for r in reports), reports
