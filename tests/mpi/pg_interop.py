"""Worker: interop on a process group (one rank per process), each result checked here:
torch CPU tensors through a collective and a send (zero-copy: written into the tensor),
broadcast_object and all_gather_object, isend/irecv with a Work (wait with a timeout that
runs out and leaves the group usable, is_completed, a done-callback), all_gather_v and
reduce_scatter_v with uneven counts, and a collective after. Host arrays; with ``--fake N``
CuPy arrays on the fake of CuPy's layer (wiring only, never a GPU): the objects, an
isend/irecv pair and the v-collectives (torch's tensors and the timed-out wait are host
checks: a GPU group's irecv returns once matched)."""

from __future__ import annotations

import argparse
import os
import sys
import threading

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counting import report  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fake", type=int, default=0)
args = ap.parse_args()
xp = np
devices = "cpu"
if args.fake:
    sys.path.insert(0, os.path.dirname(HERE))
    import fakecupy

    fakecupy.private_kernel_cache()
    installed = fakecupy.install(n_gpus=args.fake)  # kept: its exit restores the modules
    fake = installed.__enter__()
    fake.mpi_comm = MPI.COMM_WORLD
    import cupy

    xp, devices = cupy, "gpu"  # type: ignore[assignment]

import nccltree as nt  # noqa: E402
from nccltree import CommTimeout  # noqa: E402

pg = nt.init_process_group(devices=devices, timeout=30)
me, n = pg.rank, pg.size
failures: list[str] = []


def host(a: object) -> np.ndarray:
    return np.asarray(a) if xp is np else xp.asnumpy(a)


def arr(a: np.ndarray) -> object:
    return a if xp is np else xp.asarray(a)


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


if not args.fake:
    import torch

    # torch tensors, in place
    t = torch.full((5,), float(me + 1))
    ptr = t.data_ptr()
    res = pg.all_reduce(t)
    check(res is t and t.data_ptr() == ptr, "all_reduce returns the caller's tensor")
    check(t.tolist() == [n * (n + 1) / 2] * 5, f"all_reduce of tensors: {t.tolist()}")

# object collectives
cfg = pg.broadcast_object({"lr": 0.5, "rank": me} if me == 1 else None, 1)
check(cfg == {"lr": 0.5, "rank": 1}, f"broadcast_object: {cfg}")
got = pg.all_gather_object(("r", me, "x" * me))
check(got == [("r", q, "x" * q) for q in range(n)], f"all_gather_object: {got}")

# isend/irecv: rank n-1 sends to rank 0 only once told to (outside the group, by MPI),
# after rank 0's wait with a timeout ran out; the group's operations run in order on its
# stream, so rank 0 does nothing else of the group meanwhile
last = n - 1
if args.fake:
    buf = arr(np.zeros(4, np.float32))
    if me == 0:
        recv = pg.irecv(buf, last)
        called = threading.Event()
        recv.add_done_callback(lambda w: called.set())
        recv.wait()
        check(called.wait(10), "done-callback")
        check(recv.result() is buf and host(buf).tolist() == [float(last)] * 4, "irecv")
    elif me == last:
        pg.isend(arr(np.full(4, float(me), np.float32)), 0).wait()
elif me == 0:
    buf = torch.zeros(4)
    recv = pg.irecv(buf, last)
    try:
        recv.wait(timeout=0.05)
        failures.append("wait(timeout) did not time out")
    except CommTimeout:
        pass
    check(not recv.is_completed(), "is_completed before the send")
    called = threading.Event()
    recv.add_done_callback(lambda w: called.set())
    MPI.COMM_WORLD.send("go", dest=last)
    recv.wait()
    check(called.wait(10), "done-callback")
    check(recv.is_completed() and recv.result() is buf, "is_completed and result")
    check(buf.tolist() == [float(last)] * 4, f"irecv: {buf.tolist()}")
elif me == last:
    buf = torch.zeros(4)
    MPI.COMM_WORLD.recv(source=0)
    pg.isend(torch.full((4,), float(me)), 0).wait()

# the v-collectives
counts = [q + 1 for q in range(n)]
x = arr(np.arange(counts[me], dtype=np.float64) + 10 * me)
out = arr(np.zeros(sum(counts)))
pg.all_gather_v(x, out, counts)
out = host(out)
want = np.concatenate([np.arange(c, dtype=np.float64) + 10 * q for q, c in enumerate(counts)])
check(np.array_equal(out, want), f"all_gather_v: {out}")
y = arr(np.arange(sum(counts), dtype=np.float64) * (me + 1))
red = arr(np.zeros(counts[me]))
pg.reduce_scatter_v(y, red, counts)
red = host(red)
at = sum(counts[:me])
full = np.arange(sum(counts), dtype=np.float64) * sum(q + 1 for q in range(n))
check(np.array_equal(red, full[at : at + counts[me]]), f"reduce_scatter_v: {red}")

z = arr(np.ones(3))
pg.all_reduce(z)
check(bool(np.all(host(z) == n)), "a collective after")
result = {"rank": me, "failures": failures}
if args.fake:
    result["misuse"] = fake.misuse[:5]
pg.close()
report(result, me)
