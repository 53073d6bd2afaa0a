"""Worker: the small path of a process group within a node (``small.py``). Each process
records what it saw as JSON (``counting.report``). Modes:

``bitwise``: every dtype and op the path takes, odd counts, in place and not: the small
path's results against the general path's (the ``direct`` plan on the schedule engine,
selected in the same group by switching its private settings alike on every process),
compared as bytes; also ``broadcast``, ``reduce`` and ``all_gather``; and which path ran
(the flight recorder's algorithm);
``mismatch``: count, dtype and op mismatches through the fast entry (signatures learnt
first), a small call against a large one (the engine), a small call against a call that
``auto`` gives to MPI, and ``split`` against a small call: the texts each process raised,
then a correct call;
``kill``: process 1 is SIGKILLed by a timer while the others run small calls;
``abort``: process 1 calls ``pg.abort`` while the others run small calls;
``fallback``: which path calls at, and above, the threshold take.
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
from nccltree.backends.base import BFLOAT16

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from counting import report

mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
pg = nt.init_process_group(algorithm="auto", timeout=timeout)
out: dict[str, object] = {"rank": pg.rank, "small": pg._small is not None}
victim = 1
me = pg.rank == victim


def last_algorithm() -> str:
    return str(pg.flight.entries[-1].algorithm)


def general() -> None:
    pg._small, pg.algorithm = None, "direct"


def fast(saved: object) -> None:
    pg._small, pg.algorithm = saved, "auto"  # type: ignore[assignment]


def data(dtype: np.dtype, count: int, seed: int, op: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "f" or dtype == BFLOAT16:
        # products of many values stay finite; sums of mixed signs round differently by
        # order
        x = rng.uniform(0.5, 1.5, count) if op == "prod" else rng.normal(0, 100, count)
        return x.astype(dtype)
    info = np.iinfo(dtype)
    lo, hi = (-3, 4) if op == "prod" else (info.min // 4, info.max // 4)
    return rng.integers(lo, hi, count).astype(dtype)


if mode == "bitwise":
    saved = pg._small
    bad: list[str] = []
    paths: set[str] = set()
    dtypes = [np.float16, np.float32, np.float64, np.int32, np.int64, BFLOAT16, np.int8, np.uint8]
    calls = 0
    for dt in map(np.dtype, dtypes):
        floating = dt.kind == "f" or dt == BFLOAT16
        for op in ["sum", "prod", "max", "min"] + (["mean"] if floating else []):
            for count in (1, 3, 7, 1001):
                for in_place in (True, False):
                    x = data(dt, count, 1000 * pg.rank + count, op)
                    got = []
                    for _rep in range(2):  # the general path once, then the fast entry
                        y = x.copy()
                        o = None if in_place else np.zeros_like(x)
                        r = pg.all_reduce(y, out=o)
                        got.append((r if o is None else o).tobytes())
                        paths.add(last_algorithm())
                        assert y.tobytes() == (r.tobytes() if in_place else x.tobytes())
                    general()
                    y = x.copy()
                    o = None if in_place else np.zeros_like(x)
                    r = pg.all_reduce(y, out=o)
                    ref = (r if o is None else o).tobytes()
                    fast(saved)
                    calls += 1
                    if got[0] != ref or got[1] != ref:
                        bad.append(f"all_reduce {dt} {op} count={count} in_place={in_place}")
    # the other collectives the path takes
    for dt in map(np.dtype, [np.float32, np.float16, BFLOAT16, np.int64, np.uint8]):
        for count in (1, 5, 333):
            x = data(dt, count, 7 + pg.rank, "sum")
            res = {}
            for label in ("fast", "fast2", "general"):
                if label == "general":
                    general()
                b = x.copy()
                pg.broadcast(b, root=1)
                g = np.zeros(count * pg.size, dt)
                pg.all_gather(x.copy(), g)
                rd = x.copy()
                pg.reduce(rd, root=0)
                bo, ro = np.zeros_like(x), np.zeros_like(x)
                pg.broadcast(x.copy(), root=1, out=bo)
                pg.reduce(x.copy(), root=1, out=ro, op="max")
                g2 = np.zeros(count * pg.size, dt)
                mine = g2[pg.rank * count : (pg.rank + 1) * count]
                mine[:] = x
                pg.all_gather(mine, g2)  # in place: the input is this rank's block
                res[label] = tuple(v.tobytes() for v in (b, g, rd, bo, ro, g2))
                if label != "general":
                    paths.add(last_algorithm())
                fast(saved)
            if not res["fast"] == res["fast2"] == res["general"]:
                bad.append(f"broadcast/all_gather/reduce {dt} count={count}")
    out["bad"] = bad
    out["paths"] = sorted(paths)
    out["calls"] = calls
elif mode == "mismatch":

    def attempt(name: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
            out[name] = "not raised"
        except ValueError as exc:
            out[name] = str(exc)
        x = np.full(4, pg.rank + 1.0, np.float32)
        pg.all_reduce(x)  # the group goes on
        out[f"after_{name}"] = float(x[0])

    for n in (4, 5):  # every signature learnt on every process: the fast entry next
        for dt in (np.float32, np.int32):
            for op in ("sum", "max"):
                pg.all_reduce(np.ones(n, dt), op=op)
                pg.all_reduce(np.ones(n, dt), op=op)
    attempt("count", lambda: pg.all_reduce(np.ones(5 if me else 4, np.float32)))
    attempt("dtype", lambda: pg.all_reduce(np.ones(4, np.int32 if me else np.float32)))
    attempt("op", lambda: pg.all_reduce(np.ones(4, np.float32), op="max" if me else "sum"))
    attempt("large", lambda: pg.all_reduce(np.ones((1 << 20) if me else 4, np.float32)))
    attempt(
        "mpi",
        lambda: (
            pg.reduce_scatter(np.ones(4 * pg.size, np.float32), np.ones(4, np.float32))
            if me
            else pg.all_reduce(np.ones(4, np.float32))
        ),
    )
    attempt(
        "split",
        lambda: pg.split(0) if me else pg.all_reduce(np.ones(4, np.float32)),
    )
    out["last"] = last_algorithm()
elif mode == "kill":
    if me:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    x = np.ones(2, np.float32)
    t0 = time.monotonic()
    try:
        for _ in range(10_000_000):
            pg.all_reduce(x)
            x.fill(1.0)
        out["error"] = "none"
    except (PeerFailure, CommTimeout) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["algorithm"] = last_algorithm()
    out["seconds"] = time.monotonic() - t0
    report(out, pg.rank)
    sys.exit(3)
elif mode == "abort":
    x = np.ones(2, np.float32)
    for _ in range(3):
        pg.all_reduce(x)
    if me:
        time.sleep(0.5)  # the others wait in a small call meanwhile
        pg.abort("stopped on purpose")
        out["error"] = "aborted here"
    else:
        try:
            for _ in range(10_000_000):
                pg.all_reduce(x)
                x.fill(1.0)
            out["error"] = "none"
        except (PeerFailure, CommTimeout) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    report(out, pg.rank)
    time.sleep(1)
    sys.exit(3)
elif mode == "fallback":
    setting = os.environ.get("NCCLTREE_SMALL", "")
    limit = int(setting) if setting.isdigit() else 4096
    seen = {}
    for nbytes in (4, limit, limit + 4, 4 * limit):
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(2):
            pg.all_reduce(x)
            x.fill(1.0)
        seen[str(nbytes)] = last_algorithm()
        seen[f"{nbytes}_value"] = float(pg.all_reduce(np.ones(nbytes // 4, np.float32))[0])
    # a collective the path does not take, small: MPI, as before
    g = pg.reduce_scatter(np.ones(4 * pg.size, np.float32), np.zeros(4, np.float32))
    seen["reduce_scatter"] = last_algorithm()
    seen["reduce_scatter_value"] = float(g[0])
    out["seen"] = seen
    out["threshold"] = pg._small.threshold if pg._small is not None else 0
report(out, pg.rank)
pg.close()
