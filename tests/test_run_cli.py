"""``nccltree-run``: children, their variables, faults, and what is left after a job.

Every test here ends within a few seconds: the workers' bootstrap timeout and the
launchers' --rdzv-timeout are short. After each job, the test checks that no child is
left running, that the store's port is free and that nothing of the job is left in
/dev/shm.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from nccltree.cli.run import build_parser, main
from nccltree.comm.group.shm import alive
from nccltree.comm.group.store import TCPStore
from tests.test_launch_env import NOMPI, ROOT, free_port

pytestmark = pytest.mark.subprocess

WORKER = os.path.join(os.path.dirname(__file__), "launch", "worker.py")
LINE = re.compile(r"^nccltree-run: .*$", re.M)


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "NCCLTREE_STORE_TOKEN")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([NOMPI, ROOT])  # no mpi4py anywhere in the job
    env["WORKER_TIMEOUT"] = "3"
    env.update(extra)
    return env


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nccltree.run", "--grace", "2", *args],
        env=env or env_for(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen[str], limit: float = 30) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=limit)
    return p.returncode, out, err


def pids(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"pid \d+ (\d+)", out)]


def assert_clean(out: str, port: int | None = None) -> None:
    """No child alive, the port free, nothing of this job's children in /dev/shm."""
    children = pids(out)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if alive(p)], "children left running"
    if port:
        socket.create_server(("127.0.0.1", port)).close()  # nobody listens there
    left = [n for n in os.listdir("/dev/shm") if any(f"-p{p}-" in n for p in children)]
    assert not left, left


def one_line(err: str) -> str:
    lines = LINE.findall(err)
    assert len(lines) == 1, err
    return lines[0]


def test_variables_and_prefix():
    p = launch("--nproc_per_node", "3", "--prefix", WORKER, "ok")
    rc, out, err = finish(p)
    assert rc == 0, err
    for r in range(3):
        assert f"[{r}] rank {r} of 3: [0, 1, 2]" in out
    assert_clean(out)


def test_module_and_env(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text(  # one write per line: the children share the launcher's stdout
        "import os, sys\n"
        "vals = [os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
        "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'NCCLTREE_STORE_HOSTED', "
        "'PMI_SIZE')] + [len(os.environ['NCCLTREE_STORE_TOKEN'])]\n"
        "sys.stdout.write(' '.join(map(str, vals)) + '\\n')\n"
    )
    env = env_for(PMI_SIZE="9", PYTHONPATH=os.pathsep.join([NOMPI, ROOT, str(tmp_path)]))
    rc, out, err = finish(launch("--nproc-per-node", "2", "-m", "show_env", env=env))
    assert rc == 0, err
    assert sorted(out.splitlines()) == [
        "0 2 0 2 0 127.0.0.1 1 None 32",
        "1 2 1 2 0 127.0.0.1 1 None 32",
    ]


def test_two_nodes_on_loopback():
    port = free_port()
    env = env_for(NCCLTREE_STORE_TOKEN="t0k3n")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", str(port),
              "--rdzv-timeout", "10", "--prefix"]  # fmt: skip
    n1 = launch(*common, "--node-rank", "1", WORKER, "ok", env=env)
    n0 = launch(*common, "--node-rank", "0", WORKER, "ok", env=env)
    (rc0, out0, err0), (rc1, out1, err1) = finish(n0), finish(n1)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "[0] rank 0 of 4: [0, 1, 2, 3]" in out0 and "[3] rank 3 of 4: [0, 1, 2, 3]" in out1
    assert_clean(out0 + out1, port)


def test_failure_on_another_node_stops_the_job():
    port = free_port()
    env = env_for(NCCLTREE_STORE_TOKEN="t0k3n", WORKER_TIMEOUT="20")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", str(port),
              "--rdzv-timeout", "10"]  # fmt: skip
    n1 = launch(*common, "--node-rank", "1", WORKER, "fail", "3", env=env)
    n0 = launch(*common, "--node-rank", "0", WORKER, "fail", "3", env=env)
    (rc0, out0, err0), (rc1, out1, err1) = finish(n0), finish(n1)
    assert (rc0, rc1) == (7, 7), err0 + err1
    assert re.fullmatch(
        r"nccltree-run: rank 3 \(local rank 1, pid \d+, node 1\) exited with status 7; "
        r"stopping the job",
        one_line(err1),
    )
    assert re.fullmatch(
        r"nccltree-run: on another node, rank 3 \(local rank 1, pid \d+, node 1\) exited "
        r"with status 7; stopping this node's children",
        one_line(err0),
    )
    assert_clean(out0 + out1, port)


def test_killed_child():
    rc, out, err = finish(launch("--nproc-per-node", "3", WORKER, "die", "1"))
    assert rc == 128 + signal.SIGKILL
    assert re.fullmatch(
        r"nccltree-run: rank 1 \(local rank 1, pid \d+\) was killed by signal 9 \(SIGKILL\); "
        r"stopping the job",
        one_line(err),
    )
    assert_clean(out)


def test_failed_child_status():
    rc, out, err = finish(launch("--nproc-per-node", "2", WORKER, "fail", "0"))
    assert rc == 7
    assert "rank 0 (local rank 0, pid" in one_line(err) and "exited with status 7" in err
    assert_clean(out)


def test_child_that_never_arrives():
    rc, out, err = finish(launch("--nproc-per-node", "3", WORKER, "absent", "2"))
    assert rc == 1
    assert "processes [2] did not reach the bootstrap's exchange within 3 s" in err
    assert "exited with status 1; stopping the job" in one_line(err)
    assert_clean(out)


def test_shared_memory_swept():
    rc, out, err = finish(launch("--nproc-per-node", "2", WORKER, "shm", "1"))
    assert rc == 128 + signal.SIGKILL
    (name,) = re.findall(r"segment (\S+)", out)
    assert not os.path.exists(os.path.join("/dev/shm", name))
    assert_clean(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_forwarded(sig):
    p = launch("--nproc-per-node", "2", WORKER, "hang")
    assert p.stdout is not None
    seen = [p.stdout.readline(), p.stdout.readline()]  # both children started
    time.sleep(0.5)
    p.send_signal(sig)
    rc, out, err = finish(p)
    assert rc == 128 + sig
    assert one_line(err) == f"nccltree-run: got {signal.Signals(sig).name}: stopping the children"
    assert_clean("".join(seen) + out)


def test_signal_while_waiting_for_node0():
    p = node(1, free_port(), timeout="60")
    assert p.stderr is not None
    time.sleep(1.0)  # connecting to a store that is not there
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, limit=10)
    assert rc == 128 + signal.SIGTERM
    assert one_line(err) == "nccltree-run: got SIGTERM before the children started"


def test_port_in_use():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        rc, out, err = finish(launch("--master-port", str(port), WORKER, "ok"))
    assert rc == 1
    assert one_line(err) == (
        f"nccltree-run: store: cannot listen on 127.0.0.1:{port}: the port is in use "
        "(another job's store? choose another port)"
    )
    assert out == ""


def node(
    rank: int, port: int, token: str | None = "tok", timeout: str = "2"
) -> subprocess.Popen[str]:
    env = env_for(**({"NCCLTREE_STORE_TOKEN": token} if token else {}))
    return launch("--nnodes", "2", "--node-rank", str(rank), "--master-port", str(port),
                  "--rdzv-timeout", timeout, WORKER, "ok", env=env)  # fmt: skip


def test_wrong_master_port():
    port, wrong = free_port(), free_port()
    n0, n1 = node(0, port), node(1, wrong)
    (rc0, out0, err0), (rc1, _, err1) = finish(n0), finish(n1)
    assert (rc0, rc1) == (1, 1)
    assert "node rank 0: node ranks [1] of 2 did not join within 2 s" in one_line(err0)
    assert f"node rank 1: store at 127.0.0.1:{wrong}: could not connect within 2 s" in one_line(
        err1
    )
    assert_clean(out0, port)


def test_wrong_token():
    port = free_port()
    n0, n1 = node(0, port, timeout="3"), node(1, port, token="not-the-token")
    (rc0, out0, err0), (rc1, out1, err1) = finish(n0), finish(n1)
    assert out0 + out1 == ""  # no child started
    assert_clean("", port)
    assert (rc0, rc1) == (1, 1)
    assert "node ranks [1] of 2 did not join" in one_line(err0)
    assert one_line(err1) == (
        f"nccltree-run: node rank 1: store at 127.0.0.1:{port} refused this process: "
        "wrong job token (NCCLTREE_STORE_TOKEN)"
    )


def test_node_without_token_refused():
    rc, _, err = finish(node(1, free_port(), token=None))
    assert rc == 2
    assert "node rank 1 needs the job's token: pass --token or set NCCLTREE_STORE_TOKEN" in err


def test_node0_prints_a_drawn_token():
    port = free_port()
    n0 = node(0, port, token=None, timeout="10")
    assert n0.stderr is not None
    line = n0.stderr.readline()
    token = line.rsplit(" ", 1)[-1].strip()
    assert "the job's token" in line and len(token) == 32
    n1 = node(1, port, token=token)
    (rc0, out0, err0), (rc1, out1, err1) = finish(n0), finish(n1)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_clean(out0 + out1, port)


def test_store_that_never_answers():
    mute = socket.create_server(("127.0.0.1", 0))
    port = mute.getsockname()[1]
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:  # accepts and says nothing
        mute.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(mute.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        rc, _, err = finish(node(1, port))
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        mute.close()
    assert rc == 1
    assert one_line(err) == (
        f"nccltree-run: node rank 1: store at 127.0.0.1:{port}: it accepted the connection "
        "but did not answer within 2 s (not a nccltree store?)"
    )


# -- a torchrun-style process on its own (variables set by hand), against these faults ----


def by_hand(port: int, token: str | None = None, timeout: str = "2") -> tuple[int, str]:
    env = env_for(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                  WORKER_TIMEOUT=timeout)  # fmt: skip
    if token:
        env["NCCLTREE_STORE_TOKEN"] = token
    p = subprocess.run([sys.executable, WORKER, "ok"], env=env, capture_output=True,
                       text=True, timeout=30)  # fmt: skip
    return p.returncode, p.stderr.strip().splitlines()[-1]


def test_by_hand_wrong_port():
    port = free_port()
    rc, last = by_hand(port)
    assert rc == 1
    assert f"rank 1 (env://): store at 127.0.0.1:{port}: could not connect within 2 s" in last


def test_by_hand_wrong_token():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5, token="right") as s:
        rc, last = by_hand(s.port, token="wrong")
    assert rc == 1
    assert last.endswith("refused this process: wrong job token (NCCLTREE_STORE_TOKEN)")


def test_usage_errors(capsys):
    assert main(["--nnodes", "1:2", WORKER]) == 2
    assert "elastic ranges are not supported" in capsys.readouterr().err
    assert main(["--nnodes", "2", "--node-rank", "2", WORKER]) == 2
    assert "--node-rank 2 is not in 0..1" in capsys.readouterr().err
    assert main(["--nproc-per-node", "0", WORKER]) == 2
    assert main(["--rdzv-endpoint", "nohost", WORKER]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().err
    help_text = build_parser().format_help()
    for word in ("--nproc_per_node", "examples:", "The token", "NCCLTREE_STORE_TOKEN"):
        assert word in help_text
