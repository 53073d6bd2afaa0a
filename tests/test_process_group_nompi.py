"""Process groups started without MPI (mpi4py unimportable in every process): the host
grid (every collective x tree/ring/direct/auto, tests/mpi/grid_cases.py) started by
torchrun's variables set by hand and by Slurm's, bitwise the in-process World's, as the
MPI grid is; a split through the bootstrap; host groups across (simulated) nodes and
``algorithm="mpi"`` refused at start with one line on every process.

Each test is one launch of a few processes running a whole grid (tests/pg_nompi/*.py),
sized to run in seconds on a shared machine."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.envrun import run_env, run_nccltree_run

pytestmark = pytest.mark.subprocess
HERE = Path(__file__).resolve().parent / "pg_nompi"


def _reports(tmp: Path, parts: Any, script: str, *args: str, style: str = "torchrun",
             timeout: float = 100) -> tuple[list[dict[str, Any]], list[Any]]:  # fmt: skip
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    procs = run_env(parts, HERE / script, *args, style=style, timeout=timeout,
                    env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))], procs


GRIDS = {
    # (processes, launcher style, grid arguments)
    "2 processes, torchrun's variables": (2, "torchrun", []),
    "3 processes, Slurm's variables": (3, "slurm", ["--dtypes", "float64", "--ops", "sum,mean",
                                                   "--counts", "5,1000"]),
    "4 processes, torchrun's variables": (4, "torchrun", ["--algorithms", "tree,ring,direct",
                                                         "--dtypes", "float32", "--ops", "sum",
                                                         "--counts", "1,70001"]),
    "2 processes of 2 ranks, Slurm's variables": (2, "slurm", ["--devices", "cpu:2",
                                                              "--dtypes", "float32",
                                                              "--ops", "max", "--counts", "1000"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GRIDS))
def test_host_grid_without_mpi_is_the_worlds(name: str, tmp_path: Path) -> None:
    n, style, args = GRIDS[name]
    reports, procs = _reports(tmp_path, n, "grid.py", *args, style=style)
    for p in procs:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(reports) == n
    for rep in reports:
        assert rep["failures"] == [], rep["failures"]
        assert rep["checked"] > 20
        assert rep["nodes"] == 1 and rep["size"] == n * len(rep["ranks"])
        assert rep["mpi4py_loaded"] is False  # never imported (it cannot be)


def _nodes(*sizes: int) -> list[tuple[int, dict[str, str]]]:
    return [(n, {"NCCLTREE_NODE": f"node{chr(97 + i)}"}) for i, n in enumerate(sizes)]


GPU_WORKER = Path(__file__).resolve().parent / "mpi" / "pg_gpu.py"


@pytest.mark.parametrize("style", ["torchrun", "slurm"])
def test_on_the_fake_gpu_groups_across_two_nodes_without_mpi(style: str, tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): two simulated nodes of two
    processes, started without MPI: CUDA IPC within each node, NCCL send/recv between
    them (the fake carries NCCL between processes over files, not MPI), NCCL's own
    collectives, auto, and the argument agreement as one NCCL all_reduce of int64
    digests (ncclInt64, 4) before each call; every result numpy's; a split into two
    groups that each span both nodes."""
    out = tmp_path / "out"
    out.mkdir()
    procs = run_env(_nodes(2, 2), GPU_WORKER, "--no-mpi", "--fake", "4", "--algorithms",
                    "tree,nccl,auto", "--counts", "5,70001", "--dtypes", "float32", "--split",
                    style=style, timeout=100, env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    for p in procs:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 4
    net = [["X", "PHB", "NET", "NET"], ["PHB", "X", "NET", "NET"],
           ["NET", "NET", "X", "PHB"], ["NET", "NET", "PHB", "X"]]  # fmt: skip
    for r in reports:
        assert r["nfail"] == 0 and r["checked"] > 100, r
        assert not r["misuse"], r
        assert r["topology"] == net, r
        # sync mode between nodes: no stream waits on a peer's event
        assert r["waits_on_peer_events"] == 0, r
        assert {"send", "recv", "allReduce", "allGather"} <= set(r["nccl"]), r
        assert 4 in r["nccl_datatypes"], r  # the agreement's int64 digests
        assert r["ipc"].get("open", 0) > 0, r  # IPC within each node
        # split through the bootstrap: ranks {0, 2} and {1, 3}, each across both nodes
        assert r["split"] == [2, 4.0 if r["rank"] % 2 == 0 else 6.0], r


REFUSE = """
import nccltree as nt
try:
    nt.init_process_group(devices={devices!r}, algorithm={algorithm!r}, timeout=30)
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc).count(chr(10)), exc, flush=True)
else:
    print("STARTED", flush=True)
"""


@pytest.mark.parametrize(
    "parts, devices, algorithm, words",
    [
        (_nodes(2, 2), "cpu", "auto", "spans 2 nodes needs MPI"),
        (2, "cpu", "mpi", "algorithm='mpi' needs MPI"),
        ([(2, {"NCCLTREE_SHM": "0"})], "cpu", "auto", "cannot share memory"),
    ],
    ids=["a host group across two nodes", "algorithm mpi", "one node without shared memory"],
)
def test_refused_without_mpi_with_one_line(
    tmp_path: Path, parts: Any, devices: str, algorithm: str, words: str
) -> None:
    """What needs MPI is refused at start on every process, with one line that says so
    (BackendUnavailable), within seconds: no process waits for another."""
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE.format(devices=devices, algorithm=algorithm))
    procs = run_env(parts, script, timeout=90)
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
        assert "over MPI" not in p.stderr, p.stderr  # nothing said of a path not there
        line = p.stdout.strip()
        assert line.startswith("REFUSED BackendUnavailable 0 "), line
        assert words in line, line
        assert "mpiexec" in line, line


AGREE = Path(__file__).resolve().parent / "mpi" / "pg_agree.py"
MISMATCH = "collective arguments differ between processes"


@pytest.mark.parametrize("alg", ["auto", "tree"])
def test_disagreeing_host_calls_without_mpi_raise_everywhere(alg: str, tmp_path: Path) -> None:
    """Without MPI the engine's arrival is the agreement: dtype, op, count and collective
    mismatches, and a local refusal, raise ``ValueError`` on every process, and the group
    goes on (tests/mpi/pg_agree.py, as under mpiexec)."""
    out = tmp_path / "out"
    out.mkdir()
    procs = run_env(2, AGREE, "calls", "20", timeout=90,
                    env={"NCCLTREE_TEST_OUT": str(out), "ALG": alg})  # fmt: skip
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 2
    for r in reports:
        for case in ("dtype", "op", "count", "collective", "local_async"):
            assert r[case].startswith(MISMATCH) or "bogus" in r[case], (case, r[case])
        for after in ("after_dtype", "after_op", "after_count", "after_collective"):
            assert r[after] == 3.0, r


def test_split_and_new_group_without_mpi_agree_first(tmp_path: Path) -> None:
    """``new_group`` with different rank lists raises on every process (the agreement
    through the node's arrival); ``split`` against an ``auto`` collective too."""
    for mode, n in (("groups", 3), ("split", 2)):
        out = tmp_path / mode
        out.mkdir()
        procs = run_env(n, AGREE, mode, "20", timeout=90,
                        env={"NCCLTREE_TEST_OUT": str(out), "ALG": "auto"})  # fmt: skip
        for p in procs:
            assert p.returncode == 0, p.stderr[-3000:]
        for r in [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]:
            if mode == "groups":
                assert r["new_group"].startswith(MISMATCH), r
                assert r["after_new_group"] == 6.0, r
                assert r.get("sub", 2.0) == 2.0, r
            else:
                assert r["split"].startswith(f"ValueError: {MISMATCH}"), r
                assert r["after_split"] == 3.0, r


@pytest.mark.parametrize("parts", [2, _nodes(1, 1)], ids=["one node", "two nodes"])
def test_on_the_fake_disagreeing_gpu_calls_without_mpi_raise_everywhere(
    parts: Any, tmp_path: Path
) -> None:
    """Wiring check on tests/fakecupy: without MPI a GPU group's calls agree through the
    node's arrival (one node) or one NCCL all_reduce of digests (two nodes); a count
    mismatch raises ``ValueError`` on every process and the group goes on."""
    out = tmp_path / "out"
    out.mkdir()
    procs = run_env(parts, GPU_WORKER, "--no-mpi", "--fake", "4", "--algorithms", "auto",
                    "--counts", "5", "--dtypes", "float32", "--mismatch", timeout=100,
                    env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 2
    for r in reports:
        assert r["nfail"] == 0, r
        assert r["mismatch"].startswith(MISMATCH), r
        assert "count=5" in r["mismatch"] and "count=4" in r["mismatch"], r
        assert r["after_mismatch"] == 3.0, r


# -- started by nccltree-run -------------------------------------------------------------


def test_host_grid_under_nccltree_run(tmp_path: Path) -> None:
    """The host grid started by ``nccltree-run --nproc-per-node 3`` (its store, its token):
    bitwise the in-process World's."""
    out = tmp_path / "out"
    out.mkdir()
    launched = run_nccltree_run([{}], 3, HERE / "grid.py", "--dtypes", "float32",
                                "--ops", "sum,max", "--counts", "5,70001",
                                env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    for p in launched:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 3
    for rep in reports:
        assert rep["failures"] == [] and rep["checked"] > 20, rep
        assert rep["mpi4py_loaded"] is False


def test_on_the_fake_two_nccltree_run_nodes(tmp_path: Path) -> None:
    """Wiring check on tests/fakecupy: two ``nccltree-run --nnodes 2`` invocations on
    loopback, two processes each (``NCCLTREE_NODE`` tells the simulated nodes apart):
    GPU groups run with NCCL between the nodes (carried by files in the fake), and a host
    group is refused at start with one line on every process."""
    out = tmp_path / "out"
    out.mkdir()
    nodes = [{"NCCLTREE_NODE": "nodea"}, {"NCCLTREE_NODE": "nodeb"}]
    launched = run_nccltree_run(nodes, 2, GPU_WORKER, "--no-mpi", "--fake", "4",
                                "--algorithms", "direct,auto", "--counts", "5,70001",
                                "--dtypes", "float32",
                                env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    for p in launched:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 4
    for r in reports:
        assert r["nfail"] == 0 and r["checked"] > 50, r
        assert {"send", "recv"} <= set(r["nccl"]), r
        assert r["topology"][0][2] == "NET", r
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE.format(devices="cpu", algorithm="auto"))
    launched = run_nccltree_run(nodes, 2, script)
    lines = [ln for p in launched for ln in p.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 4, [p.stdout + p.stderr for p in launched]
    for line in lines:
        assert line.startswith("REFUSED BackendUnavailable 0 ") and "spans 2 nodes" in line


# -- faults without MPI ------------------------------------------------------------------

FAULTS = Path(__file__).resolve().parent / "mpi" / "pg_faults.py"


def _failure_lines(stderr: str) -> list[str]:
    return re.findall(r"nccltree: \w+: rank \d+: [^\n]*", stderr)


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"nccltree-{os.getuid()}-")}


@pytest.mark.parametrize("mode", ["kill", "absent", "mismatch"])
def test_faults_without_mpi_are_named_as_under_mpi(mode: str, tmp_path: Path) -> None:
    """Started by torchrun's variables, no MPI: a process SIGKILLed in a collective is
    named by both survivors (``PeerFailure``, "died"), one that never calls by the
    others' timeout (``CommTimeout``), a count mismatch raises everywhere and the group
    goes on; nothing is left in /dev/shm (tests/mpi/pg_faults.py, as under mpiexec)."""
    before = _shm_names()
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    procs = run_env(3, FAULTS, mode, "5", timeout=90, env={"NCCLTREE_TEST_OUT": str(out)})
    took = time.monotonic() - t0
    reports = {r["rank"]: r for r in map(json.loads, map(Path.read_text, out.glob("*.json")))}
    if mode == "mismatch":
        assert [p.returncode for p in procs] == [0, 0, 0], procs[0].stderr[-3000:]
        for r in reports.values():
            assert r["mismatch"].startswith("collective arguments differ"), r
            assert r["after"] == 6.0, r
    else:
        survivors = [procs[0], procs[2]]
        for p in survivors:
            assert p.returncode != 0
            lines = _failure_lines(p.stderr)
            assert lines, p.stderr[-3000:]
            assert "ranks [1]" in lines[0], lines
            kind = "PeerFailure" if mode == "kill" else "PeerFailure|CommTimeout"
            assert re.match(rf"nccltree: ({kind}): ", lines[0]), lines
            if mode == "kill":
                assert "died" in lines[0], lines
        if mode == "kill":
            assert procs[1].returncode == -signal.SIGKILL
    assert took < 60
    # this job's segments only (the suite's other part may be running a job beside it)
    mine = [f"-p{p.pid}-" for p in procs]  # type: ignore[attr-defined]
    assert not {n for n in _shm_names() - before if any(m in n for m in mine)}
