"""Worker: send/recv and all_to_all_v on a process group (one rank per process), each
result against numpy: a ring exchange with sendrecv, a pipeline of lone sends and
receives, an all-pairs batch with two messages per pair (matched in call order), a batch
where every rank sends a large message to every other before receiving any (deadlocks
if a send waited for its receive), a mismatched size (raised within a node on both
sides, across nodes by the receiver, the group going on), all_to_all_v with uneven
blocks in two dtypes and a mismatched count, collectives after. The MPI layer is
counted (tests/mpi/counting.py): point-to-point bytes within and across nodes, and
collectives after bootstrap.

Host arrays, or with ``--fake N`` CuPy arrays on the fake of CuPy's layer (CUDA IPC
through /dev/shm files, NCCL across processes through MPI): that checks wiring only,
never a GPU. Without ``--fake`` and with ``--devices gpu...``, real GPUs run it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counting import CountingComm, report  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--fake", type=int, default=0)
p.add_argument("--devices", default="")
p.add_argument("--big", type=int, default=1 << 18, help="elements of the large messages")
p.add_argument("--kill", type=int, default=-1, help="this rank dies before the large messages")
args = p.parse_args()
xp = np
devices = args.devices or "cpu"
fake = None
if args.fake:
    sys.path.insert(0, os.path.dirname(HERE))
    import fakecupy

    fakecupy.private_kernel_cache()
    installed = fakecupy.install(n_gpus=args.fake)
    fake = installed.__enter__()
    fake.mpi_comm = MPI.COMM_WORLD
    devices = args.devices or "gpu"
if devices.startswith("gpu"):
    import cupy

    xp = cupy  # type: ignore[assignment]

import nccltree as nt  # noqa: E402

counting = CountingComm(MPI.COMM_WORLD)
pg = nt.init_process_group(comm=counting, devices=devices, algorithm="tree", timeout=30)
counting.reset()
me, n = pg.rank, pg.size
node = pg.node
nodes = MPI.COMM_WORLD.allgather(node)
# MPI ranks and group ranks differ where the nodes interleave: the group's numbering
node_of = [""] * n
for r_, nd in zip(MPI.COMM_WORLD.allgather(me), nodes, strict=True):
    node_of[r_] = nd
failures: list[str] = []
out: dict[str, object] = {"rank": me, "node": node}


def host(a: object) -> np.ndarray:
    return np.asarray(a) if xp is np else xp.asnumpy(a)


def arr(a: np.ndarray) -> object:
    return a if xp is np else xp.asarray(a)


# a ring with sendrecv
ring = arr(np.zeros(100, np.float32))
pg.sendrecv(arr(np.full(100, me, np.float32)), (me + 1) % n, ring, (me - 1) % n)
if not np.all(host(ring) == (me - 1) % n):
    failures.append(f"ring: got {host(ring)[0]}")
# from a symmetric buffer (pg.empty): its receiver reads it where it is, twice (the
# second time after the sender rewrote it)
sym = pg.empty(1000, np.float32)
for k in range(2):
    sym[...] = arr(np.arange(1000, dtype=np.float32) + me + k)
    got_sym = arr(np.zeros(1000, np.float32))
    pg.sendrecv(sym, (me + 1) % n, got_sym, (me - 1) % n)
    if not np.array_equal(host(got_sym), np.arange(1000) + (me - 1) % n + k):
        failures.append(f"from a symmetric buffer ({k}): got {host(got_sym)[:3]}")
# a pipeline of lone sends and receives
for micro in range(3):
    x = arr(np.full(8, float(micro)))
    if me > 0:
        pg.recv(x, me - 1)
    x = x + 100
    if me < n - 1:
        pg.send(x, me + 1)
    if me == n - 1 and not np.all(host(x) == micro + 100 * n):
        failures.append(f"pipeline micro {micro}: got {host(x)[0]}")
# every pair, two messages each (to itself too), matched in call order
firsts = [arr(np.zeros(3, np.int64)) for _ in range(n)]
seconds = [arr(np.zeros(5, np.int64)) for _ in range(n)]
with pg.batch():
    for q in range(n):
        pg.send(arr(np.full(3, 10 * me + q, np.int64)), q)
        pg.send(arr(np.full(5, -(10 * me + q), np.int64)), q)
    for q in range(n):
        pg.recv(firsts[q], q)
        pg.recv(seconds[q], q)
got = [(int(host(a)[0]), int(host(b)[0])) for a, b in zip(firsts, seconds, strict=True)]
if got != [(10 * q + me, -(10 * q + me)) for q in range(n)]:
    failures.append(f"all pairs: got {got}")
# large messages to everyone, every send posted before any receive (no deadlock), twice:
# the arena grows on the first, is reused on the second


def block(round_: int, src: int, dst: int) -> np.ndarray:
    rng = np.random.default_rng(10000 * round_ + 100 * src + dst)
    return rng.standard_normal(args.big + dst).astype(np.float32)


if me == args.kill:
    if fake is not None:
        fakecupy.release_process()  # os._exit runs no exit handlers
    os._exit(9)
if args.kill >= 0:
    # a survivor that raised stays a while, so the others find the dead process first

    def linger(*exc: Any) -> None:
        sys.__excepthook__(*exc)
        time.sleep(2)

    sys.excepthook = linger
for round_ in range(2):
    big_out = [block(round_, me, q) for q in range(n)]
    big_in = [arr(np.zeros(args.big + me, np.float32)) for _ in range(n)]
    with pg.batch():
        for q in range(n):
            if q != me:
                pg.send(arr(big_out[q]), q)
        for q in range(n):
            if q != me:
                pg.recv(big_in[q], q)
    for q in range(n):
        if q != me:
            if not np.array_equal(host(big_in[q]), block(round_, q, me)):
                failures.append(f"large round {round_}: from {q} differs")
# host messages above 4 MiB travel in 2 MiB chunks, copied out while the next goes in (a
# last chunk that is short)
if not getattr(pg, "_gpu", None):
    huge = (5 << 20) // 4 + 7
    out_h = [block(2, me, q)[:1].repeat(huge + q) + np.arange(huge + q, dtype=np.float32)
             for q in range(n)]  # fmt: skip
    in_h = [np.zeros(huge + me, np.float32) for _ in range(n)]
    with pg.batch():
        for q in range(n):
            if q != me:
                pg.send(out_h[q], q)
        for q in range(n):
            if q != me:
                pg.recv(in_h[q], q)
    for q in range(n):
        if q != me:
            got_h = in_h[q]
            want_h = block(2, q, me)[:1].repeat(huge + me) + np.arange(huge + me, dtype=np.float32)
            if not np.array_equal(got_h, want_h):
                failures.append(f"chunked message from {q} differs")
# a mismatched size: 0 sends 4, 1 expects 6; within a node both raise, across nodes the
# receiver (MPI tells only it); then the pair goes on
# (the same node, and sharing memory: NCCLTREE_SHM=0 makes every process a node of its own)
same_node = node_of[0] == node_of[1] and pg.shm
raised = None
try:
    if me == 0:
        pg.send(arr(np.ones(4, np.float32)), 1)
    elif me == 1:
        pg.recv(arr(np.zeros(6, np.float32)), 0)
except ValueError as exc:
    raised = str(exc)
if me == 1 and (raised is None or "received 4 float32 from rank 0, expected 6" not in raised):
    failures.append(f"mismatch at the receiver: {raised}")
if me == 0 and same_node and (raised is None or "whose receive takes 24 bytes" not in raised):
    failures.append(f"mismatch at the sender: {raised}")
if me > 1 and raised is not None:
    failures.append(f"mismatch raised on rank {me}: {raised}")
if me in (0, 1):
    z = arr(np.full(4, 5.0, np.float32))
    if me == 0:
        pg.send(z, 1)
    else:
        z = pg.recv(arr(np.zeros(4, np.float32)), 0)
    if not np.all(host(z) == 5.0):
        failures.append(f"after the mismatch: {host(z)}")

# across nodes (MPI), in a batch with a ring exchange: only the receiver raises, after
# the ring's messages moved (NCCL would hang until the watchdog: host arrays only)
if node_of[0] != node_of[n - 1] and xp is np:
    raised = None
    ring = np.zeros(7, np.float32)
    try:
        with pg.batch():
            if me == 0:
                pg.send(np.ones(4, np.float32), n - 1)
            elif me == n - 1:
                pg.recv(np.zeros(6, np.float32), 0)
            pg.send(np.full(7, me, np.float32), (me + 1) % n)
            pg.recv(ring, (me - 1) % n)
    except ValueError as exc:
        raised = str(exc)
    if (raised is not None) != (me == n - 1) or (
        raised is not None and "received 4 float32 from rank 0, expected 6" not in raised
    ):
        failures.append(f"mismatch across nodes, rank {me}: {raised}")
    if not np.all(ring == (me - 1) % n):
        failures.append(f"ring beside the mismatch: {ring}")


def _unpaired() -> None:
    with pg.batch():
        pg.send(arr(np.ones(2)), me)


# uneven all_to_all: rank r sends (r + q) % 3 + k elements to rank q, valued 100 r + q
def a2a(dtype: str, k: int) -> None:
    sc = [(me + q) % 3 + k for q in range(n)]
    rc = [(p_ + me) % 3 + k for p_ in range(n)]
    src = np.concatenate([np.full(c, 100 * me + q, dtype) for q, c in enumerate(sc)])
    dst = arr(np.zeros(sum(rc), dtype))
    pg.all_to_all_v(arr(src), dst, sc, rc)
    want = np.concatenate([np.full(c, 100 * p_ + me, dtype) for p_, c in enumerate(rc)])
    if not np.array_equal(host(dst), want):
        failures.append(f"all_to_all_v {dtype} k={k}: got {host(dst)}")


a2a("float32", 1)
a2a("int64", 0)  # empty blocks among them
a2a("float32", 5000)
# all_to_all_v with a count that disagrees: rank 1 expects one more element from rank 0
sc = [2] * n
rc = [3 if (me == 1 and p_ == 0) else 2 for p_ in range(n)]
raised = None
try:
    pg.all_to_all_v(arr(np.zeros(2 * n, np.float32)), arr(np.zeros(sum(rc), np.float32)), sc, rc)
except ValueError as exc:
    raised = str(exc)
if me == 1 and (raised is None or "received 2 float32 from rank 0, expected 3" not in raised):
    failures.append(f"all_to_all_v mismatch at the receiver: {raised}")
if me == 0 and same_node and raised is None:
    failures.append("all_to_all_v mismatch not raised at the sender")
if me > 1 and raised is not None:
    failures.append(f"all_to_all_v mismatch raised on rank {me}: {raised}")
# argument errors, raised where they are made, before anything moves
for what, fn, text in (
    ("a lone send to itself", lambda: pg.send(arr(np.ones(2)), me), "needs both halves"),
    ("a peer out of range", lambda: pg.recv(arr(np.ones(2)), n), f"is not a rank of {n}"),
    ("unpaired messages to itself", lambda: _unpaired(), "they must pair up"),
    ("counts of another length", lambda: pg.all_to_all_v(arr(np.ones(2)), arr(np.ones(2)),
                                                          [1, 1] * n, [1] * n), "a count per rank"),
):  # fmt: skip
    try:
        fn()
        failures.append(f"{what}: not refused")
    except ValueError as exc:
        if text not in str(exc):
            failures.append(f"{what}: {exc}")
a2a("float32", 2)  # the group goes on
if fake is not None:
    # the ranks NCCL carried send/recv messages to or from (the collectives after use
    # NCCL send/recv too, between nodes)
    out["nccl_p2p_peers"] = sorted(
        {int(c.peer) for c in fake.nccl.calls if c.method in ("send", "recv")}
    )
    # the group's stream waiting on its peers' inter-process events (one node), never
    # across nodes, where counters mean "done"
    opened = {e[3] for e in fake.ipc_log if e[0] == "open_event"}
    out["waits_on_peer_events"] = sum(
        1 for op in fake.ops if op.kind == "wait_event" and op.src in opened
    ) + sum(fake.event_queries.get(e, 0) for e in opened)  # host-side waits (eventQuery)
y = arr(np.ones(2))
pg.all_reduce(y)  # and its collectives
if not np.all(host(y) == n):
    failures.append("collective after send/recv")
if xp is np and pg.shm:
    # the arenas that send/recv grew have been mapped by every process of the node at
    # the collectives since, so their names are gone (the memory stays mapped)
    pg.barrier()
    pg.barrier()  # every process mapped the arenas in the first: gone in the second
    pids = MPI.COMM_WORLD.allgather(os.getpid())  # (every process returned from it)
    mine = [nm for nm in os.listdir("/dev/shm") for pid in pids if f"-p{pid}-arena" in nm]
    if mine:
        failures.append(f"arena names left while the group runs: {mine}")
out["p2p_within_node"] = counting.p2p_local_bytes
out["p2p_to_other_nodes"] = counting.p2p_remote_bytes
out["collectives_after_init"] = counting.collectives
if fake is not None:
    out["nccl"] = sorted({c.method for c in fake.nccl.calls})
    out["ipc_open"] = sum(1 for e in fake.ipc_log if e[0] == "open")
    out["misuse"] = fake.misuse[:5]
pg.close()
out["failures"] = failures
report(out, me)
