"""Worker: a process group that fails, and what it leaves in /dev/shm.

    mpiexec -disable-auto-cleanup -n 3 python tests/mpi/pg_leftovers.py MODE [TIMEOUT]

Each process first writes ``$NCCLTREE_TEST_OUT/start-<rank>.json``: its pid, the job's
name (in the names of its segments) and the MPICH segments it maps (``/proc/self/maps``),
so the test knows exactly which names are this job's. Then, by MODE:

``blame``: every process calls one collective; then process 2 kills itself (SIGKILL)
while process 0 sleeps, process 1 calls a collective (it sees the death, reports and
exits at once), and process 0, awake, calls one too: both must name rank 2.
``small``: process 1's arena does not fit in ``/dev/shm`` (``ShmTooSmall``, simulated)
while the others have made theirs; they are killed (SIGKILL) the moment the node learns
of the failure, as a launcher does, before they can free anything themselves.
``timeout``: process 1 never calls the collective (it sleeps, then exits).
``data``: process 1 raises a data error between collectives (outside the group).
``interrupt``: Ctrl-C: process 0 sends SIGINT to every process of the node while they
run collectives.
``stale``: the file ``$STALE`` (a stale segment of this user) makes ``/dev/shm`` look
full while it exists; the group reports whether its node shares memory.
``names``: process 0 makes, first, the names that process 1's next arena would have if
its names followed from those one can see (the generation counted up); then a call
makes every arena grow. Process 0 reports the names it made.

Survivors write ``<rank>.json`` (what they raised) and exit at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

import nccltree as nt
from nccltree.comm.group import shm

mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
out_dir = os.environ["NCCLTREE_TEST_OUT"]

if mode == "stale":
    stale = os.environ["STALE"]
    real_statvfs = os.statvfs

    def statvfs(path: str | int) -> os.statvfs_result:
        st = real_statvfs(path)
        if path == shm.SHM_DIR and os.path.exists(stale):
            return os.statvfs_result((*st[:4], 0, *st[5:]))  # f_bavail 0: "full"
        return st

    os.statvfs = statvfs  # type: ignore[assignment]


def mpich_mapped() -> list[str]:
    with open("/proc/self/maps") as f:
        names = {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
    return sorted(n for n in names if n.startswith("/"))


def write(name: str, d: dict[str, object]) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(json.dumps(d))


pg = nt.init_process_group(algorithm="tree", timeout=timeout)
rank = pg.rank
write(
    f"start-{rank}.json",
    {"rank": rank, "pid": os.getpid(), "job": pg.placement.job, "mpich": mpich_mapped(),
     "shm": pg.shm},
)  # fmt: skip
result: dict[str, object] = {"rank": rank, "mode": mode}


def survivor(exc: BaseException) -> None:
    result["raised"] = type(exc).__name__
    result["message"] = str(exc)
    write(f"{rank}.json", result)
    sys.exit(3)  # at once: a survivor that leaves first must have told the node


def watch_abort() -> None:
    """Die (SIGKILL) the moment the node learns of a failure: a launcher's kill."""
    mem = pg._mem
    while mem.abort_reason() is None:
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGKILL)


x = np.ones(1024, np.float32)
try:
    if mode == "blame":
        pg.all_reduce(x)
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            time.sleep(2.0)  # not in a wait: process 1 sees the death first, and leaves
        pg.all_reduce(x)
    elif mode == "small":
        pg.all_reduce(x)  # every process's first arena made, mapped and unlinked
        if rank == 1:

            def too_small(name: object, size: int) -> shm.Segment:
                raise shm._too_small(size, "simulated")

            shm.Segment.create = too_small  # type: ignore[assignment,method-assign]
        else:
            threading.Thread(target=watch_abort, daemon=True).start()
        pg.all_reduce(np.ones(1 << 20, np.float32))  # a new arena each
    elif mode == "timeout":
        pg.all_reduce(x)
        if rank == 1:
            time.sleep(timeout + 3)
            write(f"{rank}.json", {"rank": rank, "absent": True})
            sys.exit(0)
        pg.all_reduce(x)
    elif mode == "data":
        pg.all_reduce(x)
        if rank == 1:
            raise ValueError("a record of the data set is corrupt (the test's)")
        for _ in range(100000):
            pg.all_reduce(x)
    elif mode == "interrupt":
        pg.all_reduce(x)
        if rank == 0:
            pids = [pg._mem.pid(p) for p in pg.placement.node_procs]
            threading.Timer(0.5, lambda: [os.kill(p, signal.SIGINT) for p in pids]).start()
        for _ in range(1000000):
            pg.all_reduce(x)
    elif mode == "names":
        pg.all_reduce(x)
        if rank == 0:
            mem = pg._mem
            pid1 = mem.pid(1)
            uid = os.getuid()
            made = [f"nccltree-{uid}-{pg.placement.job}-p{pid1}-arena2"]  # no secret part
            if hasattr(mem, "name_of"):  # the name of arena1 as a listing showed it
                made.append(mem.name_of(1, "arena1").replace("arena1", "arena2"))
            for name in made:
                os.close(os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            result["made"] = made
        pg.all_reduce(x)  # (process 1 grows its arena only after process 0 made them)
        y = np.ones(1 << 20, np.float32)
        pg.all_reduce(y)
        result["value"] = float(y[0])
        pg.close()
    elif mode == "stale":
        pg.all_reduce(x)
        write(f"{rank}.json", {"rank": rank, "shm": pg.shm})
        pg.close()
        sys.exit(0)
except (nt.CommError, KeyboardInterrupt, FileExistsError) as exc:
    survivor(exc)
result["raised"] = None
write(f"{rank}.json", result)
