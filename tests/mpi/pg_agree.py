"""Worker: processes that disagree. Every case below is made to disagree on purpose; each
process records what it saw (the error's text, or "not raised"), then every process makes
a correct call to show the group goes on. ``ALG``: the group's algorithm. Modes:

``calls``: dtype, op, count and collective mismatches, a local argument error on one
process followed by calls every process makes alike, a point-to-point dtype mismatch;
``groups`` (3 processes): ``new_group`` with different rank lists;
``split``: process 1 calls ``split`` while the others call ``all_reduce``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import nccltree as nt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
try:
    from counting import report
except ImportError:  # started without MPI (mpi4py hidden): the same report, by hand
    import json

    def report(d: dict[str, object], key: object) -> None:
        where = os.environ["NCCLTREE_TEST_OUT"]
        with open(os.path.join(where, f"{key}.json"), "w") as f:
            f.write(json.dumps(d))


mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
pg = nt.init_process_group(algorithm=os.environ.get("ALG", "auto"), timeout=timeout)
victim = 1
out: dict[str, object] = {"rank": pg.rank}


def attempt(name: str, fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
        out[name] = "not raised"
    except ValueError as exc:
        out[name] = str(exc)


def correct(name: str) -> None:
    x = np.full(8, pg.rank + 1.0, np.float32)
    pg.all_reduce(x)
    out[name] = float(x[0])


me = pg.rank == victim
if mode == "calls":
    attempt("dtype", lambda: pg.all_reduce(np.ones(3, np.float64 if me else np.float32)))
    correct("after_dtype")
    attempt("op", lambda: pg.all_reduce(np.ones(3, np.float32), op="max" if me else "sum"))
    correct("after_op")
    attempt("count", lambda: pg.all_reduce(np.ones(32 if me else 16, np.float32)))
    correct("after_count")
    attempt(
        "collective",
        lambda: (
            pg.broadcast(np.ones(4, np.float32)) if me else pg.all_reduce(np.ones(4, np.float32))
        ),
    )
    correct("after_collective")
    # one process's own checks refuse its call (an op that does not exist)
    attempt("local", lambda: pg.all_reduce(np.ones(4, np.float32), op="bogus" if me else "sum"))
    pg.barrier()
    correct("after_local")
    # the same behind asynchronous calls in flight: the refusal keeps its place
    works = [pg.all_reduce(np.full(4, 1.0, np.float32), async_op=True) for _ in range(3)]

    def refused_async() -> None:
        pg.all_reduce(np.ones(4, np.float32), op="bogus" if me else "sum", async_op=True).result()

    attempt("local_async", refused_async)
    out["async_before"] = [float(w.result()[0]) for w in works]
    correct("after_local_async")
    # point-to-point: float32 sent, int32 received
    if pg.rank == 0:
        attempt("p2p", lambda: pg.send(np.ones(4, np.float32), victim))
    elif me:
        attempt("p2p", lambda: pg.recv(np.zeros(4, np.int32), 0))
    correct("after_p2p")
elif mode == "groups":
    ranks = [0, 1] if pg.rank == 0 else [0, 2]
    attempt("new_group", lambda: pg.new_group(ranks))
    correct("after_new_group")
    sub = pg.new_group([0, 2])
    if sub is not None:
        y = np.ones(2, np.float32)
        sub.all_reduce(y)
        out["sub"] = float(y[0])
        sub.close()
elif mode == "split":
    try:
        if me:
            pg.split(0)
        else:
            pg.all_reduce(np.ones(4, np.float32))
        out["split"] = "not raised"
    except (ValueError, nt.CommError) as exc:
        out["split"] = f"{type(exc).__name__}: {exc}"
    if not pg.aborted:
        correct("after_split")
report(out, pg.rank)
pg.close()
