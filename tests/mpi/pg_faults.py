"""Worker: faults in a process group. Prints one JSON line per surviving process.

    mpiexec -disable-auto-cleanup -n 3 python tests/mpi/pg_faults.py MODE

MODE: ``kill`` (process 1 is SIGKILLed by a timer while the group runs collectives),
``absent`` (process 1 never calls the collective), ``mismatch`` (process 1 passes
another count; then every process calls correctly), ``p2p-kill`` (as ``kill``, while
the ranks exchange in a ring with ``sendrecv``), ``p2p-absent`` (rank 0 waits for a
message rank 1 never sends), ``abort`` (process 1 calls ``pg.abort`` between two
collectives, then tries a third). Survivors exit with status 3 after a fault, 0 otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import nccltree as nt
from nccltree import CommTimeout, PeerFailure

sys.path.insert(0, __file__.rsplit("/", 1)[0])
try:
    from counting import report as _report
except ImportError:  # started without MPI (mpi4py hidden): the same report, by hand
    import json

    def _report(d: dict[str, object], key: object) -> None:
        print(json.dumps(d), flush=True)
        where = os.environ.get("NCCLTREE_TEST_OUT")
        if where:
            with open(os.path.join(where, f"{key}.json"), "w") as f:
                f.write(json.dumps(d))


def report(d: dict[str, object]) -> None:
    _report(d, d["rank"])


mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
pg = nt.init_process_group(algorithm=os.environ.get("ALG", "tree"), timeout=timeout)
out: dict[str, object] = {"rank": pg.rank, "mode": mode}
victim = 1
t0 = time.monotonic()
try:
    if mode == "kill":
        if pg.rank == victim:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        x = np.ones(1 << 18, np.float32)
        for _ in range(100000):
            pg.all_reduce(x)
            x /= pg.size
    elif mode == "p2p-kill":
        if pg.rank == victim:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        x = np.ones(1 << 18, np.float32)
        y = np.empty_like(x)
        for _ in range(100000):
            pg.sendrecv(x, (pg.rank + 1) % pg.size, y, (pg.rank - 1) % pg.size)
    elif mode == "p2p-absent":
        if pg.rank == victim:
            time.sleep(timeout + 2)
            report({"rank": pg.rank, "absent": True})
            sys.exit(0)
        if pg.rank == 0:
            pg.recv(np.ones(8, np.float32), victim)
        else:
            pg.all_reduce(np.ones(8, np.float32))
    elif mode == "abort":
        pg.all_reduce(np.ones(8, np.float32))
        if pg.rank == victim:
            pg.abort("stopped on purpose")
            try:
                pg.all_reduce(np.ones(8, np.float32))
            except PeerFailure as exc:  # the abort, refused by this process itself
                out["after_abort"] = str(exc)
                out["cause"] = repr(exc.__cause__)
            report(out)
            time.sleep(2)  # as a survivor's below: the others report first
            sys.exit(3)
        for _ in range(100000):
            pg.all_reduce(np.ones(8, np.float32))
    elif mode == "absent":
        if pg.rank == victim:
            time.sleep(timeout + 2)
            report({"rank": pg.rank, "absent": True})
            sys.exit(0)
        pg.all_reduce(np.ones(8, np.float32))
    elif mode == "mismatch":
        n = 9 if pg.rank == victim else 8
        try:
            pg.all_reduce(np.ones(n, np.float32))
            out["mismatch"] = "not raised"
        except ValueError as exc:
            out["mismatch"] = str(exc)
        x = np.full(8, pg.rank + 1.0, np.float32)
        pg.all_reduce(x)
        out["after"] = float(x[0])
        # the same sizes in another dtype of the same itemsize: still a mismatch
        try:
            pg.all_reduce(np.ones(8, np.int32 if pg.rank == victim else np.float32))
            out["dtype_mismatch"] = "not raised"
        except ValueError as exc:
            out["dtype_mismatch"] = str(exc)
        report(out)
        pg.close()
        sys.exit(0)
except (PeerFailure, CommTimeout) as exc:
    out["raised"] = type(exc).__name__
    out["message"] = str(exc)
    out["elapsed"] = time.monotonic() - t0
    report(out)
    # MPICH's launcher ends the remaining processes as soon as one exits after a failure
    # (even with -disable-auto-cleanup): give the other survivors time to report
    time.sleep(2)
    sys.exit(3)
out["raised"] = None
report(out)
