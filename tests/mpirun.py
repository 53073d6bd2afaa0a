"""Running test programs under ``mpiexec`` (the process groups' tests).

``run_mpi(parts, script, *args)`` starts ``mpiexec`` with one part per ``(processes,
environment)`` (MPMD: ``-n 2 -env K V python script : -n 2 -env K W python script``), waits
with a timeout, and returns the completed process. ``needs_mpi`` marks a test to skip
where ``mpiexec`` or ``mpi4py`` is missing. ``faults=True`` adds
``-disable-auto-cleanup``: MPICH's launcher otherwise kills the survivors about 0.1 s
after one process dies, which would make fault tests pass without nccltree doing
anything.

MPICH's own segments (``/dev/shm/mpich_shm_*``) are unlinked by MPICH when a job ends
well, and by nccltree in a process that leaves without ``MPI_Finalize`` after its group
failed; a job all of whose processes on a node are killed leaves them. ``run_mpi``
removes the ones that appeared during its job and that no live process maps once the
job is over (:func:`remove_orphaned_mpich_segments`), so a test run leaves none; the
tests that prove nccltree leaves none pass ``clean_mpich=False``.

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
import time
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


SHM_DIR = "/dev/shm"
MPICH_PREFIX = "mpich_shm_"


def mpich_segments() -> set[str]:
    """The names of MPICH's segments in ``/dev/shm`` now."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(MPICH_PREFIX)}
    except OSError:
        return set()


def _mapped_mpich_segments() -> set[str]:
    """MPICH segments some live process of this machine has mapped (``/proc/*/maps``)."""
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(f"{SHM_DIR}/{MPICH_PREFIX}")
                    if at >= 0:
                        mapped.add(line[at + len(SHM_DIR) + 1 :].split()[0])
        except OSError:
            continue
    return mapped


def remove_orphaned_mpich_segments(before: set[str], wait: float = 2.0) -> list[str]:
    """Remove the MPICH segments that appeared since ``before`` (a :func:`mpich_segments`
    listing taken when a job started) and that no live process maps, waiting up to
    ``wait`` seconds for killed ranks to be gone; the names removed. A segment another
    run's job still uses is mapped, so it stays."""
    removed: list[str] = []
    deadline = time.monotonic() + wait
    while True:
        new = mpich_segments() - before
        if not new:
            return removed
        orphans = new - _mapped_mpich_segments()
        for name in orphans:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
        if orphans == new or time.monotonic() > deadline:
            return removed
        time.sleep(0.05)


def run_mpi(
    parts: int | Sequence[Part],
    script: str | os.PathLike[str],
    *args: str,
    timeout: float = 120,
    faults: bool = False,
    env: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
    clean_mpich: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` under mpiexec; ``parts``: a process count, or
    ``[(count, {env})...]`` for an MPMD launch, a part optionally with a shell line
    around the program (``"{cmd}; sleep 10"``). Output is captured (text).
    ``clean_mpich=False``: leave the MPICH segments the job left (the caller looks)."""
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
    before = mpich_segments()
    try:
        # a session of its own: at the timeout (or when the test is stopped) the whole
        # job goes, mpiexec and every rank it started, not mpiexec alone
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full,
            cwd=str(ROOT),
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            _kill_session(proc)
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        if clean_mpich:
            remove_orphaned_mpich_segments(before)


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc``'s session (its process group: mpiexec and its ranks) and reap it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        pass
