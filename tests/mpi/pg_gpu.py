"""Worker: a GPU process group (one rank per process) checked against numpy, for every
collective, several algorithms, counts, dtypes and placements, through ``pg.call``, the
one-rank API with ``async_op``, and symmetric buffers (``pg.empty``). Prints one JSON line
per process: what was checked, what failed, and what the CUDA layer saw.

    mpiexec -n 2 python tests/mpi/pg_gpu.py [--devices gpu|gpu:0] [--algorithms tree,ring]
    mpiexec -n 2 python tests/mpi/pg_gpu.py --fake 4   # on tests/fakecupy (wiring only)

``--dtypes bfloat16``: CuPy has no bfloat16, so the buffers are ``uint16`` CuPy arrays
of its bits and every call says ``dtype="bfloat16"``.

With ``--fake N`` every process runs nccltree's unmodified GPU code on the fake of CuPy's
layer with N GPUs (CUDA IPC through /dev/shm files, NCCL across processes through MPI,
or with ``--no-mpi`` through files): that checks wiring, never the GPU. Without it, the
real GPU runs it. ``--no-mpi``: started without MPI (mpi4py need not import).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

p = argparse.ArgumentParser()
p.add_argument("--devices", default="gpu")
p.add_argument("--algorithms", default="tree,ring,direct")
p.add_argument("--counts", default="1,1000,70001")
p.add_argument("--dtypes", default="float32,float16")
p.add_argument("--fake", type=int, default=0, help="run on the fake of CuPy with N GPUs")
p.add_argument("--kill", type=int, default=-1, help="this MPI rank dies in its 3rd call")
p.add_argument("--hang-nccl", action="store_true",
               help="(fake) every process's 3rd NCCL call never completes")  # fmt: skip
p.add_argument("--timeout", type=float, default=30.0)
p.add_argument("--split", action="store_true",
               help="last, split into the even and the odd ranks and all_reduce there")  # fmt: skip
p.add_argument("--mismatch", action="store_true",
               help="last, process 1 passes another count (every process must raise)")  # fmt: skip
p.add_argument("--no-mpi", action="store_true",
               help="started without MPI (torchrun's or Slurm's variables, nccltree-run); "
               "on the fake, NCCL across processes is then carried by files")  # fmt: skip
args = p.parse_args()
if args.no_mpi:
    MPI = None
    me = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
else:
    from mpi4py import MPI

    me = MPI.COMM_WORLD.Get_rank()


def write_report(d: dict[str, object], key: object) -> None:
    """One JSON line on stdout, and $NCCLTREE_TEST_OUT/<key>.json where set."""
    text = json.dumps(d)
    print(text, flush=True)
    where = os.environ.get("NCCLTREE_TEST_OUT")
    if where:
        with open(os.path.join(where, f"{key}.json"), "w") as f:
            f.write(text)


if os.environ.get("NCCLTREE_TEST_TRACEBACK"):
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["NCCLTREE_TEST_TRACEBACK"]), exit=True)

fake = None
if args.fake:
    sys.path.insert(0, os.path.dirname(HERE))
    import fakecupy

    fakecupy.private_kernel_cache()
    installed = fakecupy.install(n_gpus=args.fake)  # kept: closing it uninstalls the fake
    fake = installed.__enter__()
    if MPI is not None:
        fake.mpi_comm = MPI.COMM_WORLD
    else:
        fake.nccl_files = True

import cupy as cp  # noqa: E402  (the fake, where installed above)

import nccltree as nt  # noqa: E402
from nccltree.comm.collectives import COLLECTIVES  # noqa: E402

failures: list[str] = []
checked = 0
counts = [int(c) for c in args.counts.split(",")]


def expect(coll: str, full: list[np.ndarray], rank: int, n: int, count: int, op: str,
           root: int) -> np.ndarray | None:  # fmt: skip
    """What ``rank`` holds after the collective (None: nothing defined)."""
    f64 = [x.astype(np.float64) for x in full]
    if coll in ("all_reduce", "reduce", "reduce_scatter"):
        acc = np.max(f64, axis=0) if op == "max" else np.sum(f64, axis=0)
        if op == "mean":
            acc = acc / n
        if coll == "reduce":
            return acc if rank == root else None
        if coll == "reduce_scatter":
            return acc[rank * count : (rank + 1) * count]
        return acc
    if coll == "broadcast":
        return f64[root]
    return np.concatenate(f64)  # all_gather


calls = 0
topology: list[list[str]] = []
for alg in args.algorithms.split(","):
    pg = nt.init_process_group(devices=args.devices, algorithm=alg, timeout=args.timeout)
    if not topology:
        topology = [[pg.topology.link(i, j).token for j in range(pg.size)]
                    for i in range(pg.size)]  # fmt: skip
    n = pg.size
    for coll in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"):
        c = COLLECTIVES[coll]
        for dtype in args.dtypes.split(","):
            for count in counts:
                for op in ("sum", "max", "mean") if c.reduces else ("sum",):
                    for mode in ("call", "async", "symmetric", "inplace"):
                        calls += 1
                        if calls == 3 and args.kill == me:
                            if fake is not None:
                                fakecupy.release_process()  # os._exit runs no exit handlers
                            os._exit(9)
                        if calls == 3 and args.hang_nccl and fake is not None:
                            fake.nccl.hang_next_call(pg.rank)
                        root = n - 1 if c.rooted else 0
                        rng = np.random.default_rng(count + 17 * len(coll))
                        full = [rng.integers(-4, 5, c.in_count(count, n)).astype(dtype)
                                for _ in range(n)]  # fmt: skip
                        # bfloat16 travels in uint16 CuPy arrays, named by every call
                        bf16 = dtype == "bfloat16"
                        store = np.uint16 if bf16 else dtype
                        named = {"dtype": "bfloat16"} if bf16 else {}
                        full_bits = [f.view(np.uint16) if bf16 else f for f in full]
                        mine = full_bits[pg.rank]
                        nout = c.out_count(count, n)
                        what = f"{alg} {coll} {dtype} {op} count={count} {mode}"
                        try:
                            if mode == "symmetric":
                                x = pg.empty(mine.size, store)
                                x[...] = cp.asarray(mine)
                                out = pg.empty(nout, store)
                            elif mode == "inplace":
                                # NCCL's in-place layouts: one buffer, or the input
                                # inside the output (all_gather) and the output inside the
                                # input (reduce_scatter)
                                r = pg.rank
                                if coll == "all_gather":
                                    out = cp.zeros(nout, store)
                                    out[r * count : (r + 1) * count] = cp.asarray(mine)
                                    x = out[r * count : (r + 1) * count]
                                elif coll == "reduce_scatter":
                                    x = cp.asarray(mine)
                                    out = x[r * count : (r + 1) * count]
                                else:
                                    x = cp.asarray(mine)
                                    out = None
                            else:
                                x = cp.asarray(mine)
                                out = cp.asarray(np.full(nout, 7, store))
                            if mode in ("call", "inplace"):
                                outs = None if out is None else [out]
                                got = pg.call(coll, [x], outs, op=op, root=root, **named)[0]
                            else:
                                kw: dict[str, object] = {"op": op} if c.reduces else {}
                                kw.update(named)
                                if c.rooted:
                                    kw["root"] = root
                                fn = getattr(pg, coll)
                                if mode == "async":
                                    w = fn(x, out=out, async_op=True, **kw)
                                    got = w.result()
                                else:
                                    got = fn(x, out=out, **kw)
                            host = cp.asnumpy(got)
                            host = (host.view(full[0].dtype) if bf16 else host).astype(np.float64)
                            want = expect(coll, full, pg.rank, n, count, op, root)
                            checked += 1
                            if want is not None:
                                half = dtype in ("float16", "bfloat16")
                                tol = 1e-2 if (op == "mean" and half) else 1e-6
                                if not np.allclose(host, want, rtol=tol, atol=tol):
                                    bad = int(np.argmax(np.abs(host - want)))
                                    failures.append(f"{what}: [{bad}] {host[bad]} != {want[bad]}")
                        except Exception as exc:  # noqa: BLE001 - reported, then stop
                            failures.append(f"{what}: {type(exc).__name__}: {exc}")
                            break
    if args.split and alg == args.algorithms.split(",")[-1]:
        # the even and the odd ranks: on two nodes of two, each sub-group spans both nodes
        sub = pg.split(pg.rank % 2)
        assert sub is not None
        y = cp.asarray(np.full(4, pg.rank + 1.0, np.float32))
        sub.all_reduce(y)
        split_result = [sub.size, float(cp.asnumpy(y)[0])]
        sub.close()
    if args.mismatch and alg == args.algorithms.split(",")[-1]:
        # process 1 passes another count: every process raises ValueError, naming it,
        # and the group goes on
        try:
            pg.all_reduce(cp.asarray(np.ones(4 + (pg.rank == 1), np.float32)))
            mismatch = "not raised"
        except ValueError as exc:
            mismatch = str(exc)
        y = cp.asarray(np.full(4, pg.rank + 1.0, np.float32))
        pg.all_reduce(y)
        after = float(cp.asnumpy(y)[0])
    pg.close()

report = {"rank": me, "checked": checked, "failures": failures[:20], "nfail": len(failures),
          "topology": topology}  # fmt: skip
if args.mismatch:
    report["mismatch"], report["after_mismatch"] = mismatch, after
if args.split:
    report["split"] = split_result
if fake is not None:
    kinds: dict[str, int] = {}
    for entry in fake.ipc_log:
        kinds[entry[0]] = kinds.get(entry[0], 0) + 1
    opened_events = {e[3] for e in fake.ipc_log if e[0] == "open_event"}
    report["ipc"] = kinds
    # waits on the peers' events: on the host (eventQuery; the group's stream never
    # waits on another process's event), or by a stream
    report["waits_on_peer_events"] = sum(
        1 for op in fake.ops if op.kind == "wait_event" and op.src in opened_events
    ) + sum(fake.event_queries.get(e, 0) for e in opened_events)
    report["nccl"] = sorted({c.method for c in fake.nccl.calls})
    report["nccl_datatypes"] = sorted({int(c.datatype) for c in fake.nccl.calls})
    report["misuse"] = fake.misuse[:5]
write_report(report, me)
