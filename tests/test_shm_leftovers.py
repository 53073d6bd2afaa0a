"""Shared-memory segments: what a job leaves in ``/dev/shm``, whose segments the stale
cleanup may remove, names nobody can guess, and the MPICH segments a process that leaves
without ``MPI_Finalize`` unlinks (nccltree/comm/group/shm.py)."""

from __future__ import annotations

import json
import mmap
import os
import secrets
import subprocess
import sys

import pytest

from nccltree._errors import CommError
from nccltree.comm.group import shm
from tests.mpirun import needs_mpi, run_mpi

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="needs /dev/shm")


def _dead_pid() -> int:
    """A process id that no process of this machine has now (a child, reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not shm.alive(child.pid)
    return child.pid


def _path(name: str) -> str:
    return os.path.join(shm.SHM_DIR, name)


def _name(job: str, pid: int, what: str) -> str:
    """A segment's name as a creator of process ``pid`` makes it (see shm.name_for)."""
    return f"nccltree-{shm.user_tag()}-{job}-p{pid}-{secrets.token_hex(8)}-{what}"


def _make(name: str, size: int = 4096) -> str:
    """A segment file as a creator leaves it (0600), holding no lock."""
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return _path(name)


_HOLDER = """
import fcntl, os, sys
# made and locked here, as its creator does: a segment that exists unlocked for a moment
# is any stale-segment sweep's to remove (another test run's sweep included)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
if os.fstat(fd).st_size == 0:
    os.ftruncate(fd, 4096)
print("locked", flush=True)
sys.stdin.read()  # until the test closes it
"""


_MAPPER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)  # (made here if missing)
if os.fstat(fd).st_size == 0:
    os.ftruncate(fd, 1 << 16)
m = mmap.mmap(fd, os.fstat(fd).st_size)
print("mapped", flush=True)
sys.stdin.read()  # until the test closes it
"""


def _mpich_like(name: str) -> tuple[str, mmap.mmap]:
    """An ``mpich_shm_*`` file of this test's, mapped here at once: other test runs
    sharing the machine remove the MPICH segments no process maps."""
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 16)
    m = mmap.mmap(fd, 1 << 16)
    os.close(fd)
    return _path(name), m


def _map_elsewhere(path: str, holders: list[subprocess.Popen[str]]) -> None:
    """Another process maps ``path`` (made there if missing) until the test ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _MAPPER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    holders.append(holder)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"


def _release(holders: list[subprocess.Popen[str]]) -> None:
    for h in holders:
        h.kill()
        h.wait()


@pytest.fixture
def job() -> str:
    """A job name of this test's own (its segments match no other run's)."""
    return "t" + secrets.token_hex(4)


def _cleanup(job: str) -> None:
    for name in os.listdir(shm.SHM_DIR):
        if name.startswith(f"{shm.PREFIX}-{shm.user_tag()}-{job}-"):
            os.unlink(_path(name))


def test_a_live_jobs_segment_survives_the_cleanup_whatever_pid_its_name_carries(job):
    # a job of another pid namespace (a container sharing /dev/shm): the pid in its
    # segment's name is no process here, but the job lives and holds the segment's lock
    name = _name(job, _dead_pid(), "arena1")
    path = _path(name)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert name not in shm.remove_stale()
        assert os.path.exists(path), "the stale-segment cleanup removed a live job's segment"
        # the job ends without unlinking it (killed): nobody holds the lock any more
        holder.kill()
        holder.wait()
        shm.remove_stale()
        # removed by this sweep, or by another run's beside it (the same code)
        assert not os.path.exists(path)
    finally:
        holder.kill()
        holder.wait()
        _cleanup(job)


def test_a_dead_creators_segment_is_removed_and_a_live_creators_kept(job):
    dead = _make(_name(job, _dead_pid(), "arena2"))
    # a segment of a live process of this machine that holds no lock (as a version that
    # took none made them): its pid keeps it
    kept = _make(_name(job, os.getpid(), "arena3"))
    try:
        shm.remove_stale()
        # removed by this sweep, or by another run's beside it (the same code)
        assert not os.path.exists(dead)
        assert os.path.exists(kept)
    finally:
        _cleanup(job)


def test_a_segment_this_process_creates_is_locked_until_its_name_goes(job):
    seg = shm.Segment.create(lambda: shm.segment_name(job, "arena1"), 1 << 16)
    path = _path(seg.name)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            import fcntl

            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert seg.name not in shm.remove_stale() and os.path.exists(path)
        assert seg.name in shm.unlink_own()
        assert not os.path.exists(path) and seg.lock_fd == -1
    finally:
        seg.close()
        _cleanup(job)


def test_segment_names_carry_a_part_nobody_can_guess(job):
    a, b = shm.segment_name(job, "ctl0"), shm.segment_name(job, "ctl0")
    assert a != b  # drawn at random
    assert a.startswith(f"nccltree-{shm.user_tag()}-{job}-p{os.getpid()}-")
    # derived: the node's processes name each other's segments from a shared secret; the
    # next generation's name does not follow from this one's
    s1, s2 = secrets.token_bytes(32), secrets.token_bytes(32)
    assert shm.name_part(s1, "arena1") == shm.name_part(s1, "arena1")
    assert len({shm.name_part(s1, "arena1"), shm.name_part(s1, "arena2"),
                shm.name_part(s2, "arena1")}) == 3  # fmt: skip
    one = shm.segment_name(job, "arena1", s1)
    assert shm.segment_name(job, "arena2", s1) != one.replace("arena1", "arena2")


def test_a_name_someone_else_made_first_is_a_clear_error_or_another_name(job):
    # another local user made the name first (O_EXCL: their file is never used)
    taken = shm.segment_name(job, "arena1")
    _make(taken)
    try:
        with pytest.raises(CommError, match="exist.* already, made by another process or user"):
            shm.Segment.create(taken, 4096)
        # where the name may change (a fresh unguessable part), another is drawn
        names = iter([taken, shm.segment_name(job, "arena1")])
        seg = shm.Segment.create(lambda: next(names), 4096)
        try:
            assert seg.name != taken and os.path.exists(_path(seg.name))
        finally:
            seg.close()
    finally:
        _cleanup(job)


def test_leaving_without_finalize_unlinks_the_mpich_segments_this_process_maps():
    tag = secrets.token_hex(6)
    holders: list[subprocess.Popen[str]] = []
    maps = []
    paths = []
    try:
        mapped, m = _mpich_like(f"{shm.MPICH_PREFIX}{tag}a_0")
        paths.append(mapped)
        maps.append(m)
        # another job's: mapped by another process, not this one
        other, m = _mpich_like(f"{shm.MPICH_PREFIX}{tag}b_0")
        paths.append(other)
        _map_elsewhere(other, holders)
        m.close()
        # a name that now names another file than the one this process maps
        replaced, m = _mpich_like(f"{shm.MPICH_PREFIX}{tag}c_0")
        paths.append(replaced)
        maps.append(m)
        os.unlink(replaced)
        _map_elsewhere(replaced, holders)  # a new file under the same name
        done = shm.unlink_mapped_mpich()
        assert done == [mapped]
        assert not os.path.exists(mapped)
        assert os.path.exists(other) and os.path.exists(replaced)
        maps[0][:5] = b"still"  # the mapping itself stays
        assert maps[0][:5] == b"still"
    finally:
        for m in maps:
            m.close()
        _release(holders)
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_exit_without_finalize_frees_the_names_first(job, tmp_path):
    # a child process: makes a segment of its own and maps an MPICH-like segment, then
    # leaves as a failed group's process does
    mpich, m = _mpich_like(f"{shm.MPICH_PREFIX}{secrets.token_hex(6)}_0")
    code = f"""
import mmap, os, sys
from nccltree.comm.group import shm
seg = shm.Segment.create(lambda: shm.segment_name({job!r}, "arena1"), 1 << 16)
fd = os.open({mpich!r}, os.O_RDWR)
m = mmap.mmap(fd, 1 << 16)
print(seg.name, flush=True)
shm.exit_without_finalize()
"""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        name = proc.stdout.strip()
        assert name.startswith(f"nccltree-{shm.user_tag()}-{job}-"), (proc.stdout, proc.stderr)
        assert not os.path.exists(_path(name))
        assert not os.path.exists(mpich)
    finally:
        m.close()
        if os.path.exists(mpich):
            os.unlink(mpich)
        _cleanup(job)


def test_a_normal_exit_frees_the_names_this_process_still_holds(job):
    code = f"""
from nccltree.comm.group import shm
seg = shm.Segment.create(lambda: shm.segment_name({job!r}, "arena1"), 1 << 16)
print(seg.name, flush=True)
raise SystemExit(0)
"""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert not os.path.exists(_path(proc.stdout.strip()))
    finally:
        _cleanup(job)


# -- under mpiexec: a fault suite that must leave nothing of its job ---------------------

MPI_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi")
_LINGER = "{cmd}; sleep 20"  # the launcher does not see this process end (see below)


def _job_names(out: str) -> tuple[set[str], set[str]]:
    """(the job names, the MPICH segment paths) the job's processes wrote down at start."""
    jobs: set[str] = set()
    mpich: set[str] = set()
    for name in os.listdir(out):
        if name.startswith("start-"):
            with open(os.path.join(out, name)) as f:
                d = json.load(f)
            jobs.add(d["job"])
            mpich.update(d["mpich"])
    return jobs, mpich


def _left(out: str) -> list[str]:
    """What the job left in /dev/shm: its own segments (by its job name) and the MPICH
    segments its processes mapped; removed here once listed (a failed test leaves
    nothing to the next)."""
    jobs, mpich = _job_names(out)
    assert jobs and mpich, "the processes did not write down their segments"
    left = [p for p in sorted(mpich) if os.path.exists(p)]
    left += [
        _path(n) for n in sorted(os.listdir(shm.SHM_DIR))
        if any(n.startswith(f"{shm.PREFIX}-{shm.user_tag()}-{j}-") for j in jobs)
    ]  # fmt: skip
    for p in left:
        try:
            os.unlink(p)
        except OSError:
            pass
    return left


def _run(tmp_path, parts, mode: str, *args: str, env: dict[str, str] | None = None,
         faults: bool = True, next_start: bool = False):  # fmt: skip
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    proc = run_mpi(
        parts, os.path.join(MPI_HERE, "pg_leftovers.py"), mode, *args, faults=faults,
        timeout=90, env={"NCCLTREE_TEST_OUT": str(out), **(env or {})}, clean_mpich=False,
    )  # fmt: skip
    reports = {}
    for name in os.listdir(out):
        if name[0].isdigit():
            with open(out / name) as f:
                d = json.load(f)
            reports[d["rank"]] = d
    if next_start:
        # what the next group's start removes first: segments nobody holds any more
        shm.remove_stale()
    return proc, reports, _left(str(out))


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("attempt", range(3))
def test_every_survivor_blames_the_process_that_was_killed(tmp_path, attempt):
    # process 2 is killed; process 1 sees it and leaves at once; process 0, busy then,
    # finds process 1 gone too: it must still blame rank 2, as process 1 did
    parts = [(1, {}), (1, {}, _LINGER), (1, {}, _LINGER)]
    proc, reports, left = _run(tmp_path, parts, "blame")
    assert sorted(reports) == [0, 1], proc.stderr[-3000:]
    for r in (0, 1):
        assert reports[r]["raised"] == "PeerFailure", reports[r]
        assert "ranks [2]" in reports[r]["message"] and "died" in reports[r]["message"], reports
    assert left == []


FAULTS = {
    # mode: (mpiexec parts, the launcher's -disable-auto-cleanup). In "small" the others
    # are killed the moment the node learns of the failure; one killed between creating
    # its new arena and reading the failure (an instant, but a thread's SIGKILL can land
    # there) leaves that name, unlocked, for the next group's start to remove: the test
    # counts what is left after that cleanup
    "blame": ([(1, {}), (1, {}, _LINGER), (1, {}, _LINGER)], True),  # kill -9
    "small": (3, True),  # /dev/shm too small for one process's arena
    "timeout": (3, True),  # a process that never calls
    "data": (3, True),  # a data error in one process, outside the group
    "interrupt": (3, False),  # Ctrl-C
}


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("mode", list(FAULTS))
def test_a_failed_job_leaves_nothing_in_dev_shm(tmp_path, mode):
    parts, faults = FAULTS[mode]
    proc, reports, left = _run(tmp_path, parts, mode, "3", faults=faults,
                               next_start=mode == "small")  # fmt: skip
    assert proc.returncode != 0
    failed = [r for r in reports.values() if r.get("raised")]
    assert failed, (reports, proc.stderr[-3000:])
    assert left == [], proc.stderr[-3000:]


@pytest.mark.mpi
@needs_mpi
def test_stale_segments_are_removed_before_they_make_the_next_group_give_up_shared_memory(
    tmp_path,
):
    # a dead job's segment that no process holds: while it exists, /dev/shm looks full
    # (the program counts it so): the next group must remove it first, then share memory
    job = "t" + secrets.token_hex(4)
    stale = _make(_name(job, _dead_pid(), "arena1"), 1 << 16)
    try:
        proc, reports, left = _run(tmp_path, 2, "stale", env={"STALE": stale}, faults=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not os.path.exists(stale)
        assert [reports[r]["shm"] for r in (0, 1)] == [True, True], proc.stderr[-2000:]
        assert left == []
    finally:
        _cleanup(job)


@pytest.mark.mpi
@needs_mpi
def test_names_someone_made_in_advance_do_not_stop_the_job(tmp_path):
    # another local user who saw a segment's name makes the next generation's first:
    # the job must not meet it (the names are not guessable) nor crash on it
    made: list[str] = []
    try:
        proc, reports, left = _run(tmp_path, 3, "names", faults=False)
        made = reports.get(0, {}).get("made", [])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert all(reports[r].get("value") == 3.0 for r in range(3)), reports
        # the names made in advance stay theirs (listed with the job's names, and
        # removed there); nothing else is left
        assert made and sorted(left) == sorted(_path(n) for n in made)
    finally:
        for name in made:
            if os.path.exists(_path(name)):
                os.unlink(_path(name))
