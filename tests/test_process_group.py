"""Process groups under mpiexec: every collective and algorithm against numpy and,
bitwise, against the in-process World of the same ranks and topology; one node and two
simulated nodes (NCCLTREE_NODE); several ranks per process; the MPI layer counted
(no collective after bootstrap, no payload between processes of one node, cross-node
bytes equal to the plan's top-level traffic); faults.

Each test is one mpiexec launch running a whole grid (tests/mpi/*.py), so the suite
pays a handful of process start-ups, not one per case."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mpirun import needs_mpi, run_mpi

pytestmark = [pytest.mark.mpi, needs_mpi]
HERE = Path(__file__).resolve().parent / "mpi"


def _reports(
    tmp: Path, parts: Any, script: str, *args: str, env_extra: dict[str, str] | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    env = {"NCCLTREE_TEST_OUT": str(out), **(env_extra or {})}
    proc = run_mpi(parts, HERE / script, *args, env=env, **kw)
    got = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not kw.get("faults"):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


def _nodes(*sizes: int) -> list[tuple[int, dict[str, str]]]:
    return [(n, {"NCCLTREE_NODE": f"node{chr(97 + i)}"}) for i, n in enumerate(sizes)]


GRIDS = {
    # (mpiexec parts, grid arguments)
    "2 processes, every algorithm, dtype and op": (2, []),
    "3 processes": (3, ["--algorithms", "tree,ring,direct,mpi", "--dtypes", "float32,float64",
                        "--ops", "sum,mean,max"]),
    "4 processes": (4, ["--algorithms", "tree,ring,direct", "--dtypes", "float32",
                        "--ops", "sum,max", "--counts", "1,1000,70001"]),
    "2 nodes x 2 processes": (_nodes(2, 2), ["--dtypes", "float32,int32", "--ops", "sum,mean"]),
    "2 nodes, 2 + 1 processes of 2 ranks": (
        _nodes(2, 1), ["--devices", "cpu:2", "--algorithms", "tree,ring,direct",
                       "--dtypes", "float32", "--ops", "sum", "--counts", "1,1000,70001"]),
    "2 processes of 2 ranks": (2, ["--devices", "cpu:2", "--algorithms", "tree,ring,direct,auto",
                                   "--dtypes", "float64", "--ops", "sum,prod"]),
    "3 processes, bfloat16 and 8-bit integers": (
        3, ["--algorithms", "tree,ring,direct,mpi", "--dtypes", "bfloat16,int8,uint8",
            "--ops", "sum,mean,prod,max,min", "--counts", "1,1000,70001"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GRIDS))
def test_every_collective_against_numpy_and_the_world(name: str, tmp_path: Path) -> None:
    parts, args = GRIDS[name]
    reports = _reports(tmp_path, parts, "pg_grid.py", *args, timeout=240)
    nprocs = parts if isinstance(parts, int) else sum(n for n, _ in parts)
    assert len(reports) == nprocs
    for rep in reports:
        assert rep["failures"] == [], rep["failures"]
        assert rep["checked"] > 50
        for alg, seen in rep["mpi"].items():
            # within a node no payload goes through MPI, whatever the algorithm but "mpi"
            if alg in ("tree", "ring", "direct"):
                assert seen["collectives_after_init"] == 0, (alg, seen)
                assert seen["payload_within_node"] == 0, (alg, seen)
                # the transport's own count of bytes to other nodes is the MPI layer's
                assert seen["payload_to_other_nodes"] == seen["sent_bytes"], (alg, seen)
            elif alg == "mpi":
                # the counting wrapper sees MPI's own collectives: it can count
                assert seen["collectives_after_init"] > 0
            if alg != "mpi":  # auto: MPI's collectives for small messages, never p2p
                assert seen["payload_within_node"] == 0, (alg, seen)
        if rep["nodes"] > 1:
            assert any(s["payload_to_other_nodes"] > 0 for a, s in rep["mpi"].items() if a != "mpi")


def test_numbering_bytes_symmetric_buffers_and_reinit(tmp_path: Path) -> None:
    # node a's processes are MPI ranks 0 and 2, node b's is MPI rank 1: global ranks are
    # node-major, so MPI rank 2 becomes rank 1 and MPI rank 1 becomes rank 2
    parts = [(1, {"NCCLTREE_NODE": "a"}), (1, {"NCCLTREE_NODE": "b"}),
             (1, {"NCCLTREE_NODE": "a"})]  # fmt: skip
    reports = {r["mpi_rank"]: r for r in _reports(tmp_path, parts, "pg_misc.py")}
    assert {m: r["rank"] for m, r in reports.items()} == {0: 0, 1: 2, 2: 1}
    assert {m: (r["local_rank"], r["local_size"]) for m, r in reports.items()} == {
        0: (0, 2),
        1: (0, 1),
        2: (1, 2),
    }
    for r in reports.values():
        assert r["nodes"] == 2 and r["size"] == 3
        assert r["sum_ok"] and r["symmetric_ok"] and r["again_ok"]
        assert r["async_ok"] and r["stream_ok"]
        assert r["collectives"] == 0 and r["local_bytes"] == 0
    # the bytes that crossed between nodes, counted at the MPI layer, are the plan's
    # transfers between nodes: the tree crosses once, at the top (both directions)
    crossed = sum(r["remote_bytes"] for r in reports.values())
    assert crossed == reports[0]["plan_cross_bytes"] == 2 * 4 * (1 << 16)


@pytest.mark.parametrize(
    "parts, args",
    [(2, []), (_nodes(1, 1), []), (2, ["--devices", "cpu:2"])],
    ids=["2 processes", "2 nodes", "2 processes of 2 ranks"],
)
def test_uint16_named_bfloat16(tmp_path: Path, parts: Any, args: list[str]) -> None:
    """``dtype="bfloat16"`` on uint16 host buffers: bitwise the bfloat16 arrays' results
    on every reducing collective and algorithm (pg.call, the one-rank API, per-rank
    faces); data movement and send/recv take it; MPI's reduction refused by name."""
    reports = _reports(tmp_path, parts, "pg_dtype.py", *args, timeout=240)
    assert len(reports) == 2
    for rep in reports:
        assert rep["failures"] == [], rep["failures"]
        assert rep["checked"] > 50
        assert rep["mpi_refused"] is True and rep["auto_off_mpi"] is True


def test_cross_node_bytes_two_by_two(tmp_path: Path) -> None:
    reports = _reports(tmp_path, _nodes(2, 2), "pg_misc.py")
    crossed = sum(r["remote_bytes"] for r in reports)
    assert crossed == reports[0]["plan_cross_bytes"] == 2 * 4 * (1 << 16)


def _shm_names() -> set[str]:
    """The nccltree segments of this test process's jobs: made by it or by a rank that its
    mpiexec jobs started (tests/mpirun.py notes each rank's pid in NCCLTREE_TEST_PIDS); the
    suite's other part may be running a job of its own beside it."""
    mine = {str(os.getpid())}
    try:
        with open(os.environ["NCCLTREE_TEST_PIDS"]) as f:
            mine.update(f.read().split())
    except (KeyError, OSError):
        pass
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return set()
    prefix = f"nccltree-{os.getuid()}-"
    return {
        n for n in names
        if n.startswith(prefix) and (m := re.search(r"-p(\d+)-", n)) and m.group(1) in mine
    }  # fmt: skip


def _failure_lines(stderr: str) -> dict[int, str]:
    """Each process's failure line (``nccltree: <error>: rank R: ...``), printed when its
    group failed, before its flight recorder; the launcher may interleave the processes'
    output, so the lines are found by pattern, not by position."""
    got = {}
    for m in re.finditer(r"nccltree: (\w+): rank (\d+): [^\n]*?(?=nccltree: |\n|$)", stderr):
        got.setdefault(int(m.group(2)), m.group(0))
    return got


@pytest.mark.parametrize("alg", ["tree", "direct"])
def test_a_killed_process_is_named_by_every_survivor(alg: str, tmp_path: Path) -> None:
    before = _shm_names()
    t0 = time.monotonic()
    # MPICH's launcher (5.0) ends the other processes soon after it sees one die, even
    # with -disable-auto-cleanup: the victim runs under a shell that lingers, so the
    # launcher sees nothing and the survivors must find the death themselves
    parts = [(1, {}), (1, {}, "{cmd}; sleep 20"), (1, {})]
    proc = run_mpi(parts, HERE / "pg_faults.py", "kill", "5", faults=True, timeout=60,
                   env={"ALG": alg}, extra=["-print-all-exitcodes"])  # fmt: skip
    took = time.monotonic() - t0
    failed = _failure_lines(proc.stderr)
    assert set(failed) == {0, 2}, proc.stderr[-3000:]
    for line in failed.values():
        assert line.startswith("nccltree: PeerFailure: "), line
        assert "ranks [1]" in line and "died" in line, line
    # the survivors exit on their own, non-zero (status 1: a process whose group failed
    # leaves without MPI_Finalize, which would wait for the dead one), while the victim's
    # shell still waits: the launcher prints each exit status (times 256)
    codes = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
             if "Exit codes" in line]  # fmt: skip
    assert codes, proc.stdout[-2000:]
    statuses = codes[-1].rsplit("]", 1)[1].strip().split(",")
    assert statuses[0] == statuses[2] == str(1 * 256), codes
    assert proc.returncode != 0
    assert took < 40
    assert _shm_names() <= before


def test_a_process_that_never_calls_times_out_by_name(tmp_path: Path) -> None:
    before = _shm_names()
    t0 = time.monotonic()
    proc = run_mpi(3, HERE / "pg_faults.py", "absent", "2", faults=True, timeout=60)
    failed = _failure_lines(proc.stderr)
    assert set(failed) == {0, 2}, proc.stderr[-3000:]  # the absent process exits cleanly
    # the first to time out names rank 1; the other may see its abort first, which names
    # rank 1 too
    assert any(line.startswith("nccltree: CommTimeout: ") for line in failed.values())
    for line in failed.values():
        assert "ranks [1]" in line, line
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 40
    assert _shm_names() <= before


def test_an_abort_is_reported_by_the_processes_that_learn_of_it_not_by_its_caller(
    tmp_path: Path,
) -> None:
    # as a World's: the caller of abort() knows why and prints nothing; the processes
    # whose collectives it stops print the failure and their flight recorders
    before = _shm_names()
    out = tmp_path / "out"
    out.mkdir()
    proc = run_mpi(3, HERE / "pg_faults.py", "abort", "20", faults=True, timeout=60,
                   env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    failed = _failure_lines(proc.stderr)
    assert set(failed) == {0, 2}, proc.stderr[-3000:]
    for line in failed.values():
        assert line.startswith("nccltree: PeerFailure: "), line
        assert "ranks [1] failed: CommError: stopped on purpose" in line, line
    assert "flight recorder of rank 0 " in proc.stderr
    assert "flight recorder of rank 1 " not in proc.stderr, proc.stderr[-3000:]
    reports = {r["rank"]: r for r in map(json.loads, map(Path.read_text, out.glob("*.json")))}
    victim = reports[1]
    assert victim["after_abort"] == "the process group failed earlier: stopped on purpose"
    assert victim["cause"] == "CommError('stopped on purpose')"
    assert {reports[r]["raised"] for r in (0, 2)} == {"PeerFailure"}
    assert proc.returncode != 0
    assert _shm_names() <= before


def test_argument_mismatch_raises_on_every_process_and_the_group_goes_on(tmp_path: Path) -> None:
    reports = _reports(tmp_path, 3, "pg_faults.py", "mismatch")
    assert len(reports) == 3
    for r in reports:
        assert r["mismatch"].startswith("collective arguments differ between processes"), r
        assert "count=9" in r["mismatch"] and "count=8" in r["mismatch"]
        assert r["after"] == 6.0
        assert "dtype=int32" in r["dtype_mismatch"] and "dtype=float32" in r["dtype_mismatch"]


def test_without_shared_memory_the_data_goes_over_mpi(tmp_path: Path) -> None:
    # NCCLTREE_SHM=0 (what a too small /dev/shm does by itself): every process is its own
    # transport node, the tree keeps the real topology, and all payload is MPI's
    parts = [(3, {"NCCLTREE_SHM": "0"})]
    args = ["--algorithms", "tree,ring,direct", "--dtypes", "float32", "--ops", "sum,max"]
    reports = _reports(tmp_path, parts, "pg_grid.py", *args, timeout=200)
    assert len(reports) == 3
    for rep in reports:
        assert rep["failures"] == [], rep["failures"]
        for alg, seen in rep["mpi"].items():
            assert seen["collectives_after_init"] == 0, (alg, seen)
            assert seen["payload_within_node"] == seen["sent_bytes"] > 0, (alg, seen)


@pytest.mark.parametrize("alg", ["tree", "mpi"])
def test_split_and_new_group_make_independent_groups(alg: str, tmp_path: Path) -> None:
    reports = _reports(tmp_path, 4, "pg_split.py", env_extra={"ALG": alg})
    assert len(reports) == 4
    assert all(r["failures"] == [] for r in reports), reports


P2P = {
    # name: (mpiexec parts, whether processes of one node share memory)
    "3 processes of one node": (3, True),
    "2 nodes x 2 processes": (_nodes(2, 2), True),
    "2 processes, shared memory off": ([(2, {"NCCLTREE_SHM": "0"})], False),
}


@pytest.mark.parametrize("name", list(P2P))
def test_send_and_recv_between_processes(name: str, tmp_path: Path) -> None:
    """A ring with sendrecv, a pipeline of lone sends, an all-pairs batch of two messages
    per pair, a batch of large messages to everyone (no deadlock), a size mismatch
    (within a node raised on both sides), all_to_all_v against numpy and with a count
    that disagrees, collectives after. Within a node no payload goes through MPI, and
    all_to_all_v is no MPI collective."""
    parts, shm = P2P[name]
    reports = _reports(tmp_path, parts, "pg_p2p.py", "--big", str(1 << 17), timeout=120)
    nprocs = parts if isinstance(parts, int) else sum(n for n, _ in parts)
    assert len(reports) == nprocs and all(r["failures"] == [] for r in reports), reports
    nodes = {r["node"] for r in reports}
    for r in reports:
        assert r["collectives_after_init"] == 0, r
        if shm:
            assert r["p2p_within_node"] == 0, r
        else:
            assert r["p2p_within_node"] > 0, r
        assert (r["p2p_to_other_nodes"] > 0) == (len(nodes) > 1), r


def test_a_process_killed_during_send_and_recv_is_named(tmp_path: Path) -> None:
    before = _shm_names()
    t0 = time.monotonic()
    parts = [(1, {}), (1, {}, "{cmd}; sleep 20"), (1, {})]
    proc = run_mpi(parts, HERE / "pg_faults.py", "p2p-kill", "5", faults=True, timeout=60)
    failed = _failure_lines(proc.stderr)
    assert set(failed) == {0, 2}, proc.stderr[-3000:]
    for line in failed.values():
        assert line.startswith("nccltree: PeerFailure: "), line
        assert "ranks [1]" in line and "died" in line, line
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 40
    assert _shm_names() <= before


def test_a_message_that_never_comes_times_out_by_name(tmp_path: Path) -> None:
    proc = run_mpi(3, HERE / "pg_faults.py", "p2p-absent", "2", faults=True, timeout=60)
    failed = _failure_lines(proc.stderr)
    assert failed.get(0, "").startswith("nccltree: CommTimeout: rank 0: waited 2 s for ranks [1]")
    assert "message #0" in failed[0], failed
    assert proc.returncode != 0


def test_interop_torch_tensors_objects_async_p2p_and_v_collectives(tmp_path: Path) -> None:
    """tests/mpi/pg_interop.py on 3 processes: every check passes on every rank."""
    pytest.importorskip("torch")
    got = _reports(tmp_path, 3, "pg_interop.py", timeout=120)
    assert sorted(r["rank"] for r in got) == [0, 1, 2]
    assert all(r["failures"] == [] for r in got), got
