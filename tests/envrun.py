"""Starting test programs without MPI, as other launchers would: ``run_env(parts, script,
*args, style=...)`` starts one process per rank with the variables torchrun sets
(``style="torchrun"``: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) or srun sets (``style="slurm"``: SLURM_PROCID, SLURM_NTASKS,
SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODELIST, SLURM_JOB_ID, the store's port
derived from the job's id), set by hand, with mpi4py unimportable in every child (a
``sitecustomize`` first on ``PYTHONPATH``: ``import mpi4py`` raises ImportError).

``parts``: a process count, or ``[(count, {env})...]`` (one simulated node per part where
its environment sets ``NCCLTREE_NODE``). Each child is a session of its own; at the
timeout every child is killed. Returns each child's completed process, by rank.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_MPI = Path(__file__).resolve().parent / "nompi"  # its sitecustomize hides mpi4py
_tests_only: Path | None = None


def tests_path() -> Path:
    """A folder from which ``import tests`` works but ``import nccltree`` does not find
    the checkout (a link to ``tests/`` alone): the children's ``PYTHONPATH`` entry and
    working directory, so that they import the installed nccltree, as the test process
    does (an editable install, or a wheel under test)."""
    global _tests_only
    if _tests_only is None:
        import tempfile

        _tests_only = Path(tempfile.mkdtemp(prefix="tests-path-"))
        (_tests_only / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    return _tests_only


Part = tuple[int, Mapping[str, str]]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slurm_job_for_free_port() -> tuple[int, int]:
    """A Slurm job id whose derived store port (step 0) is free here: (job, port)."""
    for _ in range(200):
        k = random.randrange(1, 2000)
        port = 20000 + 20 * k
        if _bindable(port):
            return k, port
    raise RuntimeError("no free port for a Slurm-style job")


def launch_env(style: str, rank: int, size: int, local: int, local_size: int,
               port: int, job: int = 0) -> dict[str, str]:  # fmt: skip
    """The variables ``style``'s launcher gives process ``rank`` of ``size``."""
    if style == "torchrun":
        return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}  # fmt: skip
    if style == "slurm":
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size),
                "SLURM_STEP_NUM_TASKS": str(size), "SLURM_LOCALID": str(local),
                "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": str(job),
                "SLURM_STEP_ID": "0"}  # fmt: skip
    raise ValueError(f"unknown launcher style {style!r}")


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child without MPI: no launcher's variables from the test's
    own environment, mpi4py hidden, one BLAS thread."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_", "HYDRA_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(NO_MPI), str(tests_path()), env.get("PYTHONPATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_env(
    parts: int | Sequence[Part],
    script: str | os.PathLike[str],
    *args: str,
    style: str = "torchrun",
    timeout: float = 100,
    env: Mapping[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python script args`` once per rank (see the module docstring)."""
    if isinstance(parts, int):
        parts = [(parts, {})]
    size = sum(n for n, _ in parts)
    job, port = slurm_job_for_free_port() if style == "slurm" else (0, free_port())
    procs: list[subprocess.Popen[str]] = []
    rank = 0
    try:
        for n, penv in parts:
            for local in range(n):
                e = child_env({**(env or {}), **penv,
                               **launch_env(style, rank, size, local, n, port, job)})  # fmt: skip
                cmd = [sys.executable, str(script), *args]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, env=e,
                                              cwd=str(tests_path()), start_new_session=True))  # fmt: skip
                rank += 1
        deadline = time.monotonic() + timeout
        done = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                raise
            cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
            cp.pid = p.pid  # type: ignore[attr-defined]  # (in its segments' names)
            done.append(cp)
        return done
    except BaseException:
        kill_all(procs)
        raise


def kill_all(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Kill each child's session and reap it."""
    import signal

    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            pass


def run_nccltree_run(
    nodes: Sequence[Mapping[str, str]],
    nproc_per_node: int,
    script: str | os.PathLike[str],
    *args: str,
    timeout: float = 100,
    env: Mapping[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """One ``nccltree-run`` per node (``nodes``: each node's extra variables, e.g. its
    ``NCCLTREE_NODE``), on loopback, mpi4py hidden; their completed processes."""
    import secrets

    port = free_port()
    # every node's launcher presents the job's token (node 0 would draw one otherwise)
    env = {"NCCLTREE_STORE_TOKEN": secrets.token_hex(16), **(env or {})}
    launchers = []
    try:
        for k, nenv in enumerate(nodes):
            cmd = [sys.executable, "-m", "nccltree.run", "--nproc-per-node",
                   str(nproc_per_node), "--nnodes", str(len(nodes)), "--node-rank", str(k),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), str(script),
                   *args]  # fmt: skip
            launchers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True,
                                              env=child_env({**env, **nenv}),
                                              cwd=str(tests_path()), start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + timeout
        done = []
        for p in launchers:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
            cp.pid = p.pid  # type: ignore[attr-defined]  # (in its segments' names)
            done.append(cp)
        return done
    except BaseException:
        kill_all(launchers)
        raise
