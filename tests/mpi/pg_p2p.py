"""Worker: send/recv on a process group (one rank per process): a ring exchange with
sendrecv, a pipeline of lone sends and receives, an all-pairs batch, a mismatched size
(caught by the receiver). Host arrays, or with ``--fake N`` CuPy arrays on the fake of
CuPy's layer (NCCL across processes through MPI: wiring only)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counting import report  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--fake", type=int, default=0)
args = p.parse_args()
xp = np
devices = "cpu"
if args.fake:
    sys.path.insert(0, os.path.dirname(HERE))
    import fakecupy

    os.environ["NCCLTREE_CACHE_DIR"] = tempfile.mkdtemp(prefix="nccltree-fake-cache-")
    installed = fakecupy.install(n_gpus=args.fake)
    fake = installed.__enter__()
    fake.mpi_comm = MPI.COMM_WORLD
    import cupy

    xp = cupy  # type: ignore[assignment]
    devices = "gpu"

import nccltree as nt  # noqa: E402

pg = nt.init_process_group(devices=devices, algorithm="tree")
me, n = pg.rank, pg.size
failures: list[str] = []


def host(a: object) -> np.ndarray:
    return np.asarray(a) if xp is np else xp.asnumpy(a)


out = xp.zeros(100, np.float32)
pg.sendrecv(xp.asarray(np.full(100, me, np.float32)), (me + 1) % n, out, (me - 1) % n)
if not np.all(host(out) == (me - 1) % n):
    failures.append(f"ring: got {host(out)[0]}")
for micro in range(3):
    x = xp.asarray(np.full(8, float(micro)))
    if me > 0:
        pg.recv(x, me - 1)
    x = x + 100 if xp is not np else x + 100
    if me < n - 1:
        pg.send(x, me + 1)
    if me == n - 1 and not np.all(host(x) == micro + 100 * n):
        failures.append(f"pipeline micro {micro}: got {host(x)[0]}")
outs = [xp.zeros(3, np.int64) for _ in range(n)]
with pg.batch():
    for q in range(n):
        pg.send(xp.asarray(np.full(3, 10 * me + q, np.int64)), q)
    for q in range(n):
        pg.recv(outs[q], q)
if [int(host(o)[0]) for o in outs] != [10 * q + me for q in range(n)]:
    failures.append(f"all pairs: got {[int(host(o)[0]) for o in outs]}")
if xp is np:
    try:
        if me == 0:
            pg.send(np.ones(4, np.float32), 1)
        elif me == 1:
            pg.recv(np.zeros(6, np.float32), 0)
            failures.append("a short message was not noticed")
    except ValueError as exc:
        if me != 1 or "received 4 float32 from rank 0, expected 6" not in str(exc):
            failures.append(f"mismatch: {exc}")
# uneven all_to_all: rank r sends (r + q) % 3 + 1 elements to rank q, valued 100 r + q
sc = [(me + q) % 3 + 1 for q in range(n)]
rc = [(p + me) % 3 + 1 for p in range(n)]
src = xp.asarray(np.concatenate([np.full(c, 100 * me + q, np.float32) for q, c in enumerate(sc)]))
dst = xp.asarray(np.zeros(sum(rc), np.float32))
pg.all_to_all_v(src, dst, sc, rc)
want = np.concatenate([np.full(c, 100 * p + me, np.float32) for p, c in enumerate(rc)])
if not np.array_equal(host(dst), want):
    failures.append(f"all_to_all_v: got {host(dst)}")
y = xp.asarray(np.ones(2))
pg.all_reduce(y)  # the group's collectives go on after
if not np.all(host(y) == n):
    failures.append("collective after send/recv")
pg.close()
report({"rank": me, "failures": failures}, me)
