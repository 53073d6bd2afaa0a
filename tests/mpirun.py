"""Running test programs under ``mpiexec`` (the process groups' tests).

``run_mpi(parts, script, *args)`` starts ``mpiexec`` with one part per ``(processes,
environment)`` (MPMD: ``-n 2 -env K V python script : -n 2 -env K W python script``), waits
with a timeout, and returns the completed process. ``needs_mpi`` marks a test to skip
where ``mpiexec`` or ``mpi4py`` is missing. ``faults=True`` adds
``-disable-auto-cleanup``: MPICH's launcher otherwise kills the survivors about 0.1 s
after one process dies, which would make fault tests pass without nccltree doing
anything.

Each rank first appends its process id to the file named by ``NCCLTREE_TEST_PIDS`` where
that is set (``tests/conftest.py`` sets it), then becomes the program (``exec``, the same
process id): the test run tells the shared-memory segments its ranks leave from those of
other runs by that list.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str | None:
    """The ``mpiexec`` next to this interpreter (the MPICH wheel's), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec")


def _have_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


needs_mpi = pytest.mark.skipif(
    mpiexec() is None or not _have_mpi4py(), reason="needs mpiexec and mpi4py (the mpi extra)"
)

Part = tuple[int, Mapping[str, str]] | tuple[int, Mapping[str, str], str]


def _recorded() -> list[str]:
    """A prefix that makes a rank write down its process id first (see the docstring)."""
    if not os.environ.get("NCCLTREE_TEST_PIDS"):
        return []
    return ["sh", "-c", 'echo $$ >> "$NCCLTREE_TEST_PIDS" && exec "$@"', "rank"]


def run_mpi(
    parts: int | Sequence[Part],
    script: str | os.PathLike[str],
    *args: str,
    timeout: float = 120,
    faults: bool = False,
    env: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` under mpiexec; ``parts``: a process count, or
    ``[(count, {env})...]`` for an MPMD launch, a part optionally with a shell line
    around the program (``"{cmd}; sleep 10"``). Output is captured (text)."""
    exe = mpiexec()
    assert exe is not None, "needs_mpi should have skipped this test"
    if isinstance(parts, int):
        parts = [(parts, {})]
    cmd = [exe]
    if faults:
        cmd.append("-disable-auto-cleanup")
    cmd += list(extra)
    for i, part in enumerate(parts):
        n, penv = part[0], part[1]
        if i:
            cmd.append(":")
        cmd += ["-n", str(n)]
        for k, v in penv.items():
            cmd += ["-env", k, v]
        line = [*_recorded(), sys.executable, str(script), *args]
        if len(part) == 3:
            # a shell line around the program: "{cmd}" stands for it
            line = ["sh", "-c", part[2].replace("{cmd}", shlex.join(line))]  # type: ignore[misc]
        cmd += line
    full = dict(os.environ)
    full.update(env or {})
    full.setdefault("PYTHONUNBUFFERED", "1")
    # one BLAS/OpenMP thread per process: the machine's cores are shared by all of them
    full.setdefault("OMP_NUM_THREADS", "1")
    full.setdefault("OPENBLAS_NUM_THREADS", "1")
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=str(ROOT)
    )
