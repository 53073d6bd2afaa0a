"""Worker for nccltree-run's tests: starts a bootstrap from the environment as a process
group would, then does what ``MODE`` says. Prints ``pid RANK PID`` first, so that the
test can check that no process is left.

ok: exchange ranks and print them. die R: rank R kills itself (SIGKILL) after the
exchange; the others wait in a barrier. fail R: rank R exits with status 7. absent R:
rank R never starts (it sleeps); the others time out naming it. hang: every rank waits
for a minute. shm R: rank R creates a shared-memory segment, prints its name, and is
killed before it can unlink it."""

from __future__ import annotations

import os
import signal
import sys
import time

from nccltree.comm.group.launch_env import start

mode = sys.argv[1]
who = int(sys.argv[2]) if len(sys.argv) > 2 else -1
timeout = float(os.environ.get("WORKER_TIMEOUT", "20"))
rank = int(os.environ["RANK"])
print(f"pid {rank} {os.getpid()}", flush=True)
if mode == "absent" and rank == who:
    time.sleep(60)
    sys.exit(0)
s = start(None, None, None, timeout)
got = s.boot.exchange(rank)
print(f"rank {rank} of {s.size}: {got}", flush=True)
if mode == "die" and rank == who:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "fail" and rank == who:
    os._exit(7)
if mode == "shm" and rank == who:
    from nccltree.comm.group.shm import Segment, segment_name

    seg = Segment.create(segment_name("testjob", "x"), 4096)
    print(f"segment {seg.name}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang":
    time.sleep(60)
s.boot.barrier()
s.boot.close()
