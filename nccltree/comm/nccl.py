"""NCCL as a second engine, through ``cupy.cuda.nccl``.

One communicator per device from ``NcclCommunicator.initAll``; a driver-side call issues
every rank's NCCL call inside ``groupStart``/``groupEnd`` on that rank's caller stream.
A blocked NCCL call cannot be timed out, so work is launched only after every rank has
arrived (the driver-side path guarantees it: the per-rank adapter launches from the last
rank to arrive), and a wait that outlives the World's timeout aborts the communicators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._errors import BackendUnavailable, CommTimeout

_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
           "int32": "NCCL_INT32", "int64": "NCCL_INT64"}
_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN",
        "mean": "NCCL_AVG"}


def _nccl_module() -> Any:
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or CuPy failing to load its CUDA libraries
        raise BackendUnavailable(
            f"the nccl algorithm needs CuPy with NCCL support ({exc}); install "
            "nccltree[cuda12] or nccltree[cuda13]"
        ) from exc
    if not getattr(nccl, "available", False):
        raise BackendUnavailable(
            "CuPy was built without NCCL: install nvidia-nccl-cu12 / -cu13 "
            "(nccltree[cuda12] or nccltree[cuda13])"
        )
    return nccl


class NcclEngine:
    """NCCL communicators for a list of distinct CUDA devices."""

    def __init__(self, devices: Sequence[Any]) -> None:
        if any(d.backend != "cuda" for d in devices):
            raise ValueError("the nccl algorithm needs CUDA devices (e.g. devices('gpu:all'))")
        ids = [d.physical_id for d in devices]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"NCCL needs one rank per distinct GPU, got GPUs {ids}; use the tree, ring "
                "or direct algorithm for logical ranks that share a GPU"
            )
        self.nccl = _nccl_module()
        self.devices = list(devices)
        self.comms = self.nccl.NcclCommunicator.initAll(ids)

    def close(self, abort: bool = False) -> None:
        comms, self.comms = self.comms, []
        for c in comms:
            try:
                c.abort() if abort else c.destroy()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass

    def launch(self, prep: Any, streams: list[Any], async_op: bool, timeout: float,
               on_error: Callable[[BaseException], BaseException]) -> Any:
        from ._args import Launched

        nccl = self.nccl
        if not self.comms:
            raise BackendUnavailable("the NCCL communicators were destroyed")
        dtype = getattr(nccl, _DTYPES[prep.dtype.name])
        op_name = prep.op
        scale_after = op_name == "mean" and not hasattr(nccl, "NCCL_AVG")
        op = getattr(nccl, _OPS["sum" if scale_after else op_name])
        streams = [s if s is not None else d.current_stream() for s, d in zip(streams,
                                                                            self.devices)]
        count = prep.count
        nccl.groupStart()
        try:
            for r, comm in enumerate(self.comms):
                x, o = prep.ins[r], prep.outs[r]
                sp = streams[r].ptr
                coll = prep.collective
                if coll == "all_reduce":
                    comm.allReduce(x.data.ptr, o.data.ptr, count, dtype, op, sp)
                elif coll == "reduce":
                    comm.reduce(x.data.ptr, o.data.ptr, count, dtype, op, prep.root, sp)
                elif coll == "broadcast":
                    comm.broadcast(x.data.ptr, o.data.ptr, count, dtype, prep.root, sp)
                elif coll == "all_gather":
                    comm.allGather(x.data.ptr, o.data.ptr, count, dtype, sp)
                elif coll == "reduce_scatter":
                    comm.reduceScatter(x.data.ptr, o.data.ptr, count, dtype, op, sp)
        finally:
            nccl.groupEnd()
        if scale_after:
            for r, d in enumerate(self.devices):
                target = prep.outs[r] if prep.collective != "reduce" or r == prep.root else None
                if target is not None:
                    with streams[r]:
                        d.scale(target, 1.0 / len(self.devices))
        events = [s.record() for s in streams]
        if not async_op:
            try:
                for ev in events:
                    ev.synchronize(timeout)
            except CommTimeout as exc:
                self.close(abort=True)
                raise on_error(exc) from exc
        return Launched(prep.results, events, streams, (prep,))
