"""The grid of one process group and algorithm: every collective x dtype x op x count x
in place, checked against numpy and, bitwise, against an in-process World of the same
ranks and topology (shared by the workers started by mpiexec and by other launchers)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

import nccltree as nt
from nccltree.backends.base import FLOAT_DTYPES
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.faces import driver_method


def check_group(
    pg: Any, alg: str, DTYPES: list[str], OPS: list[str], counts: list[int], failures: list[str]
) -> int:
    """Run the grid on ``pg`` (every process calls it alike); failures appended to
    ``failures``; returns how many results were checked."""
    checked = 0
    n = pg.size
    ref = nt.World(nt.devices(f"cpu:{n}"), algorithm="tree" if alg in ("auto", "mpi") else alg,
                   topology=pg.topology)  # fmt: skip
    for coll, dtype, op, count, in_place in itertools.product(
        ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "gather",
         "scatter", "all_to_all", "sendrecv"),
        DTYPES, OPS, counts, (False, True),
    ):  # fmt: skip
        c = COLLECTIVES[coll]
        is_float = np.dtype(dtype) in FLOAT_DTYPES
        if op == "mean" and not is_float:
            continue
        if (not c.reduces and op != "sum") or (in_place and not c.in_place_ok):
            continue
        if alg == "mpi" and dtype in ("float16", "bfloat16") and c.reduces:
            # refused, by name
            try:
                pg.call(coll, [np.zeros(c.in_count(count, n), dtype) for _ in pg.ranks],
                        [np.zeros(c.out_count(count, n), dtype) for _ in pg.ranks],
                        op=op, root=n - 1 if c.rooted else 0)  # fmt: skip
                failures.append(f"mpi {coll} {dtype}: not refused")
            except TypeError as exc:
                if f"cannot reduce {dtype}" not in str(exc):
                    failures.append(f"mpi {coll} {dtype}: {exc}")
            continue
        if alg == "mpi" and pg.nodes > 1 and coll in (
            "all_gather", "gather", "scatter", "all_to_all", "sendrecv"
        ):  # fmt: skip
            continue
        if op == "prod" and count > 1000:
            continue
        root = n - 1 if c.rooted else 0
        rng = np.random.default_rng(count * 7 + len(coll))
        if not is_float:
            full = [rng.integers(-3, 4, c.in_count(count, n)).astype(dtype) for _ in range(n)]
        else:
            lo, hi = (0.8, 1.25) if op == "prod" else (-1, 1)
            full = [rng.uniform(lo, hi, c.in_count(count, n)).astype(dtype) for _ in range(n)]
        xs = [full[r].copy() for r in pg.ranks]
        outs = None
        if not in_place:
            outs = [np.full(c.out_count(count, n), 7, dtype) for _ in pg.ranks]
        elif coll in ("all_gather", "gather"):
            bufs = [np.zeros(c.out_count(count, n), dtype) for _ in pg.ranks]
            for i, r in enumerate(pg.ranks):
                bufs[i][r * count : (r + 1) * count] = full[r]
            xs = [bufs[i][r * count : (r + 1) * count] for i, r in enumerate(pg.ranks)]
            outs = bufs
        elif coll in ("reduce_scatter", "scatter"):
            outs = [xs[i][r * count : (r + 1) * count] for i, r in enumerate(pg.ranks)]
        what = f"{alg} {coll} {dtype} {op} count={count} in_place={in_place}"
        try:
            res = pg.call(coll, xs, outs, op=op, root=root)
        except Exception as exc:  # noqa: BLE001 - reported
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        # the in-process World of the same ranks and topology
        wxs = [f.copy() for f in full]
        wouts = (
            None if outs is None else [np.full(c.out_count(count, n), 7, dtype) for _ in range(n)]
        )
        if in_place and coll in ("all_gather", "gather"):
            wouts = [np.zeros(c.out_count(count, n), dtype) for _ in range(n)]
            for r in range(n):
                wouts[r][r * count : (r + 1) * count] = full[r]
            wxs = [wouts[r][r * count : (r + 1) * count] for r in range(n)]
        elif in_place and coll in ("reduce_scatter", "scatter"):
            wouts = [wxs[r][r * count : (r + 1) * count] for r in range(n)]
        kw = {"root": root} if c.rooted else {}
        if c.reduces:
            kw["op"] = op
        method = getattr(ref, driver_method(coll))  # sendrecv: the ring shift, shift
        wres = (
            method(wxs, **kw)
            if wouts is None
            else method(wxs, wouts, **kw)
            if not c.one_buffer
            else method(wxs, outs=wouts, **kw)
        )
        expected = c.expected([f.copy() for f in full], op, root)
        for i, r in enumerate(pg.ranks):
            which, want = expected[r]
            got = np.asarray(res[i]).reshape(-1)
            if which == "in":
                if not np.array_equal(xs[i], full[r]):
                    failures.append(f"{what} rank {r}: input changed")
                continue
            tol = {"float16": 2e-2, "float32": 2e-5, "float64": 1e-12, "bfloat16": 5e-2}.get(
                dtype, 0
            )
            if not is_float:
                want = want.astype(dtype)  # integers wrap (uint8 of negative data)
            if not np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol):
                failures.append(f"{what} rank {r}: wrong result")
            elif alg not in ("mpi", "auto") and not np.array_equal(
                got, np.asarray(wres[r]).reshape(-1)
            ):
                failures.append(f"{what} rank {r}: not bitwise the in-process World's")
            checked += 1
    ref.close()
    return checked
