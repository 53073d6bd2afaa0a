"""Which launcher started a process, and the bootstrap each init_method gives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from nccltree.comm.group.bootstrap import LocalBootstrap, StoreBootstrap
from nccltree.comm.group.launch_env import (
    detect,
    expand_hostlist,
    first_host,
    several_processes,
    slurm_port,
    start,
    tasks_per_node,
)
from tests.test_store import run_threads

NOMPI = os.path.join(os.path.dirname(__file__), "nompi")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
SLURM = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
         "SLURM_STEP_NODELIST": "gpu[07-09],cpu1", "SLURM_NODELIST": "x[1-9]",
         "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "8"}  # fmt: skip


def test_detect_nothing():
    assert detect({}) is None
    assert detect({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}) is None  # sbatch, no step


def test_detect_torchrun():
    e = detect(TORCHRUN)
    assert e is not None and e.launcher == "torchrun"
    assert (e.rank, e.size, e.local_rank, e.local_size) == (1, 4, 1, 2)
    assert (e.master_addr, e.master_port) == ("10.0.0.1", 29500)


def test_detect_slurm():
    e = detect(SLURM)
    assert e is not None and e.launcher == "slurm"
    assert (e.rank, e.size, e.local_rank, e.local_size) == (5, 8, 1, 2)
    assert e.master_addr == "gpu07"  # the step's first node
    assert e.master_port == slurm_port(SLURM)
    assert detect({**SLURM, "MASTER_PORT": "4000", "MASTER_ADDR": "h"}).master_port == 4000  # type: ignore[union-attr]


def test_precedence():
    both = {**SLURM, **TORCHRUN}
    assert detect(both).launcher == "torchrun"  # type: ignore[union-attr]
    e = detect({**both, "PMI_SIZE": "4", "PMI_RANK": "3"})
    assert e is not None and (e.launcher, e.rank, e.size) == ("mpi", 3, 4)
    e = detect({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert e is not None and (e.launcher, e.rank) == ("mpi", 1)
    e = detect({**SLURM, "PMIX_RANK": "5"})  # srun --mpi=pmix: MPI, Slurm's size
    assert e is not None and (e.launcher, e.rank, e.size) == ("mpi", 5, 8)


def test_bad_number():
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not a whole number"):
        detect({"WORLD_SIZE": "two"})


def test_several_processes():
    assert several_processes({}) == []
    assert several_processes({"SLURM_NTASKS": "4"}) == []
    assert several_processes({"SLURM_STEP_NUM_TASKS": "4"}) == []  # no SLURM_PROCID
    assert several_processes({**SLURM, "WORLD_SIZE": "1", "PMI_SIZE": "3"}) == [
        "PMI_SIZE=3",
        "SLURM_STEP_NUM_TASKS=8",
    ]


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a1", ["a1"]),
        ("a,b", ["a", "b"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("x[009-010]y", ["x009y", "x010y"]),
        ("c[1,3],d[2]", ["c1", "c3", "d2"]),
    ],
)
def test_hostlist(text, hosts):
    assert list(expand_hostlist(text)) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text", ["n[1-", "n]1[", "n[a-b]", "n[3-1]", ""])
def test_bad_hostlist(text):
    with pytest.raises(ValueError, match="Slurm host list"):
        first_host(text)


def test_tasks_per_node_and_port():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    assert tasks_per_node("junk") == []
    p = slurm_port({"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "3"})
    assert p is not None and 20000 <= p < 60000
    assert p != slurm_port({"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "4"})
    assert slurm_port({}) is None


def exchange_in_threads(n: int, method, environ_of, **kw):
    """Every 'process' (a thread) starts with ``method`` and its own environment, then
    exchanges its rank; the results."""

    def one(i: int) -> object:
        s = start(method, kw.get("rank", [None] * n)[i], kw.get("world_size"), 10.0, environ_of(i))
        assert isinstance(s.boot, StoreBootstrap)
        assert (s.rank, s.size) == (i, n)
        got = s.boot.exchange(i)
        s.boot.close()
        return got

    return run_threads(one, n)


def test_env_method():
    port = free_port()

    def env(i: int) -> dict[str, str]:
        return {"RANK": str(i), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "NCCLTREE_STORE_TOKEN": "tok"}  # fmt: skip

    assert exchange_in_threads(3, None, env) == [[0, 1, 2]] * 3
    assert exchange_in_threads(3, "env://", env) == [[0, 1, 2]] * 3


def test_tcp_method():
    port = free_port()
    got = exchange_in_threads(2, f"tcp://127.0.0.1:{port}", lambda i: {}, rank=[0, 1], world_size=2)
    assert got == [[0, 1]] * 2


def test_file_method(tmp_path):
    path = tmp_path / "rdzv"
    got = exchange_in_threads(3, f"file://{path}", lambda i: {"RANK": str(i), "WORLD_SIZE": "3"})
    assert got == [[0, 1, 2]] * 3
    assert not path.exists()


def test_slurm_method():
    port = free_port()

    def env(i: int) -> dict[str, str]:
        return {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}  # fmt: skip

    assert exchange_in_threads(2, "slurm", env) == [[0, 1]] * 2
    assert exchange_in_threads(2, None, env) == [[0, 1]] * 2


def test_one_process_needs_no_store():
    s = start("env://", None, None, 1.0, {"RANK": "0", "WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})  # fmt: skip
    assert isinstance(s.boot, LocalBootstrap) and s.size == 1


def test_silent_case_refused():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(
        ValueError, match=r"several processes \(WORLD_SIZE=2\) but the process group would have one"
    ):
        start("env://", 0, 1, 1.0, env)


@pytest.mark.parametrize(
    "method, env, match",
    [
        ("env://", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "5"}, "MASTER_ADDR is not set"),
        ("env://", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
        ("env://", {"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"}, "RANK is not set"),
        ("env://", {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"},
         r"rank 2 is not in 0..1"),
        ("tcp://h", {}, "is not tcp://host:port"),
        ("tcp://h:5", {}, "needs rank= and world_size="),
        ("file://", {}, "is not file://path"),
        ("slurm", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_STEP_NODELIST"),
        ("udp://x", {}, "is not one of env://"),
    ],
)  # fmt: skip
def test_bad_methods(method, env, match):
    with pytest.raises(ValueError, match=match):
        start(method, None, None, 1.0, env)


# -- in processes: mpi4py unimportable on the paths without MPI ----------------------------

CHILD = textwrap.dedent(
    """
    import sys
    from nccltree.comm.group.launch_env import start
    try:
        s = start(None if sys.argv[1] == "-" else sys.argv[1], None, None, 20.0)
    except Exception as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    got = s.boot.exchange(s.rank)
    s.boot.close()
    assert sys.modules.get("mpi4py") is None, "mpi4py was imported"
    print(s.method, s.rank, s.size, got)
    """
)


def run_children(envs: list[dict[str, str]], method: str = "-", nompi: bool = True):
    procs = []
    for e in envs:
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "PMI_SIZE")}
        env.update(e)
        env["PYTHONPATH"] = os.pathsep.join(([NOMPI] if nompi else []) + [ROOT])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, method],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
    return [(p.communicate(timeout=60)[0].strip(), p.returncode) for p in procs]


@pytest.mark.subprocess
def test_torchrun_variables_without_mpi4py():
    port = free_port()
    envs = [{"RANK": str(i), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for i in range(2)]  # fmt: skip
    assert run_children(envs) == [(f"env:// {i} 2 [0, 1]", 0) for i in range(2)]


@pytest.mark.subprocess
def test_single_process_without_mpi4py():
    assert run_children([{}]) == [("single 0 1 [0]", 0)]


@pytest.mark.subprocess
def test_mpi_launcher_without_mpi4py():
    (out, rc), = run_children([{"PMI_SIZE": "2", "PMI_RANK": "0"}])  # fmt: skip
    assert rc == 3
    assert out.startswith("BackendUnavailable starting over MPI (launched by MPI: PMI_SIZE=2")


@pytest.mark.subprocess
def test_mpi_singleton_under_torchrun_variables_refused():
    pytest.importorskip("mpi4py")
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    (out, rc), = run_children([env], method="mpi", nompi=False)  # fmt: skip
    assert rc == 3
    assert out.splitlines()[-1] == (
        "ValueError the environment says this job has several processes (WORLD_SIZE=2) but "
        "the process group would have one (started by mpi); start every process the same "
        "way, or pass init_method= to match how they were launched"
    )


def test_store_port_under_torchrun_agent():
    # torchrun's agent holds MASTER_PORT (here: a listening socket): the store takes the
    # next port
    for _ in range(50):
        agent = socket.create_server(("127.0.0.1", 0))
        master = agent.getsockname()[1]
        try:
            socket.create_server(("127.0.0.1", master + 1)).close()
            break
        except OSError:
            agent.close()
    else:
        pytest.skip("no two free ports in a row")

    def env(i: int) -> dict[str, str]:
        return {"RANK": str(i), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip

    with agent:
        assert exchange_in_threads(2, "env://", env) == [[0, 1]] * 2
        other = free_port()
        got = exchange_in_threads(
            2, "env://", lambda i: {**env(i), "NCCLTREE_STORE_PORT": str(other)}
        )
        assert got == [[0, 1]] * 2
