"""NCCL as a second engine, through ``cupy.cuda.nccl``.

One communicator per device from ``NcclCommunicator.initAll``; a driver-side call issues
every rank's NCCL call inside one ``groupStart``/``groupEnd`` on that rank's caller stream
and returns at once, as the tree, ring and direct engines do once the caller's stream is
ordered after their work.

Failures, made to look like every other engine's:

- Everything a call needs (pointers, counts, stream handles, the bound methods) is
  computed before ``groupStart``, so no Python error can leave a group half-issued.
  An NCCL error inside the group makes ``groupEnd`` launch nothing of it (NCCL's group
  error rule); either way the error becomes ``CommError`` and the owner (the World) aborts.
- A blocked NCCL call cannot be timed out, so work is launched only after every rank has
  arrived (the driver-side path guarantees it; the per-rank adapter launches from the last
  rank to arrive), and the owner's :class:`~nccltree.comm.watchdog.Watchdog` polls the
  completion events of the work against its deadline, aborting the communicators when one
  passes or a stream fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._errors import BackendUnavailable, CommError
from ..backends.base import Device, Event, Stream
from ._args import Launched, Prepared, data_ptr
from .collectives import COLLECTIVES

if TYPE_CHECKING:
    from ..backends.cuda import CudaDevice

_DTYPES = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
    # a bfloat16 buffer is a uint16 CuPy array whose call names its dtype (CuPy has none)
    "bfloat16": "NCCL_BFLOAT16",
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
}
_OPS = {
    "sum": "NCCL_SUM",
    "prod": "NCCL_PROD",
    "max": "NCCL_MAX",
    "min": "NCCL_MIN",
    "mean": "NCCL_AVG",
}


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


def stream_handle(stream: Stream) -> int:
    """The ``cudaStream_t`` of a CUDA stream, as the integer CuPy's NCCL calls take."""
    from ..backends.cuda import CudaStream

    if not isinstance(stream, CudaStream):
        raise TypeError(f"NCCL runs on CUDA streams, got {stream!r}")
    return int(stream.cupy_stream.ptr)


class NcclEngine:
    """NCCL communicators for a list of distinct CUDA devices: made here with
    ``initAll``, or given (``comms``, one per device: a process group's communicator,
    whose ranks number ``size`` across processes)."""

    def __init__(
        self,
        devices: Sequence[Device],
        comms: Sequence[object] | None = None,
        size: int | None = None,
    ) -> None:
        if any(d.backend != "cuda" for d in devices):
            raise ValueError("the nccl algorithm needs CUDA devices (e.g. devices('gpu:all'))")
        ids = [d.physical_id for d in devices]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"NCCL needs one rank per distinct GPU, got GPUs {ids}; use the tree, ring "
                "or direct algorithm for logical ranks that share a GPU"
            )
        self.nccl = _nccl_module()
        self.devices = cast("list[CudaDevice]", list(devices))  # all CUDA: checked above
        self._lock = threading.Lock()  # launch and close never overlap
        self.size = len(ids) if size is None else size
        self.rank0: int | None = None  # given communicators: the NCCL rank of the first
        if comms is not None:
            self.comms: list[Any] = list(comms)
            return
        try:
            self.comms = list(self.nccl.NcclCommunicator.initAll(ids))
        except Exception as exc:  # NcclError, CUDARuntimeError: no usable NCCL here
            raise BackendUnavailable(
                f"NCCL could not create communicators for GPUs {ids}: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self, abort: bool = False) -> None:
        """Destroy the communicators; ``abort=True`` aborts them (pending work is
        abandoned, nothing waits for it). Idempotent."""
        with self._lock:
            comms, self.comms = self.comms, []
        for c in comms:
            try:
                c.abort() if abort else c.destroy()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass

    def _calls(
        self, prep: Prepared, handles: Sequence[int]
    ) -> list[tuple[Callable[..., None], tuple[object, ...]]]:
        """Each rank's NCCL call as (bound method, arguments), all computed up front, in
        the order the collectives table gives for the method."""
        nccl = self.nccl
        coll = COLLECTIVES[prep.collective]
        # A collective that only moves data (broadcast, all_gather, and the sends and
        # receives of gather, scatter, all_to_all, sendrecv) moves bytes: ncclUint8 and
        # the byte count, whatever the dtype. Only reductions name their datatype.
        item = prep.dtype.itemsize
        scale = 1 if coll.reduces else item
        try:
            name_of = _DTYPES[prep.dtype.name] if coll.reduces else "NCCL_UINT8"
            dtype = getattr(nccl, name_of)
            # One rank: the mean is the sum (x / 1 == x, exactly). NCCL before 2.29.7 runs
            # its one-rank average as a kernel that leaves the last elements of a count
            # not divisible by its block count unwritten (NVIDIA/nccl#1950); the sum of
            # one rank is a plain copy there.
            name = "sum" if prep.op == "mean" and self.size == 1 else prep.op
            op = getattr(nccl, _OPS[name]) if coll.reduces else None
        except (KeyError, AttributeError) as exc:
            raise BackendUnavailable(
                f"this NCCL build has no {exc} ({prep.dtype}, op {prep.op!r})"
            ) from exc
        calls: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        if coll.p2p is not None:
            # no NCCL call of its own: the table's sends and receives, in one group
            for r, comm in enumerate(self.comms):
                me = self._rank_of(r)
                bufs = {"in": data_ptr(prep.ins[r]), "out": data_ptr(prep.outs[r])}
                for kind, peer, which, off, cnt in coll.p2p(
                    me, prep.count, self.size, prep.root, prep.in_place
                ):
                    args = (bufs[which] + off * item, cnt * scale, dtype, peer, handles[r])
                    calls.append((getattr(comm, kind), args))
            return calls
        method, names = coll.nccl
        for r, comm in enumerate(self.comms):
            values = {
                "send": data_ptr(prep.ins[r]),
                "recv": data_ptr(prep.outs[r]),
                "count": prep.count * scale,
                "dtype": dtype,
                "op": op,
                "root": prep.root,
                "stream": handles[r],
            }
            calls.append((getattr(comm, method), tuple(values[k] for k in names)))
        return calls

    def _rank_of(self, index: int) -> int:
        """The NCCL rank of this engine's ``index``-th communicator."""
        return index if self.rank0 is None else self.rank0 + index

    def launch(self, prep: Prepared, streams: Sequence[Stream | None]) -> Launched:
        """Issue the collective on every rank's stream (None: the device's current
        stream) in one NCCL group, record an event after it on each, and return without
        waiting. The caller watches the events. NCCL or CUDA errors raise ``CommError``
        (after which the communicators must be aborted)."""
        if len(streams) != len(self.devices):
            raise ValueError(f"{len(streams)} streams for {len(self.devices)} NCCL ranks")
        with self._lock:
            if not self.comms:
                raise CommError("the NCCL communicators were destroyed")
            order: list[Stream] = [
                s if s is not None else d.current_stream()
                for s, d in zip(streams, self.devices, strict=True)
            ]
            handles = [stream_handle(s) for s in order]
            calls = self._calls(prep, handles)
            nccl = self.nccl
            error: BaseException | None = None
            try:
                nccl.groupStart()
            except Exception as exc:
                raise CommError(f"NCCL groupStart failed: {exc!r}") from exc
            try:
                for fn, args in calls:
                    fn(*args)
            except Exception as exc:  # noqa: BLE001 - groupEnd still balances the group
                error = exc
            try:
                nccl.groupEnd()  # after an error inside the group, NCCL launches none of it
            except Exception as exc:  # noqa: BLE001
                error = error or exc
            if error is not None:
                raise CommError(
                    f"NCCL {prep.collective} failed on GPUs "
                    f"{[d.physical_id for d in self.devices]}: {type(error).__name__}: {error}"
                ) from error
            try:
                events: list[Event] = [s.record() for s in order]
            except Exception as exc:
                raise CommError(f"recording the end of NCCL {prep.collective}: {exc!r}") from exc
        return Launched(prep.results, events, order, (prep,))
