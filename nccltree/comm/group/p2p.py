"""Point-to-point on a process group (one rank per process): ``pg.send``, ``pg.recv``,
``pg.sendrecv`` and ``with pg.batch():``.

As for a World's ranks (:mod:`nccltree.comm.p2p`), the n-th send from A to B matches the
n-th receive at B from A; a lone send may wait for its receive, so ranks that exchange
post both halves in one batch. Host arrays travel as MPI messages on a communicator of
their own (non-blocking, waited on with the group's bounded, liveness-checking waits);
CuPy arrays as NCCL sends and receives on the caller's stream (one GPU per process; a
batch is one NCCL group), watched by the group's watchdog. A receive of another size
than its send raises ``ValueError`` on the receiving rank (MPI tells only the receiver);
a timeout or a dead peer fails the group, as in a collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._errors import CommError
from ...backends.base import data_ptr
from .._args import Array, _device_array
from ..flight import Entry
from .mpi_collectives import mpi_type

if TYPE_CHECKING:
    from mpi4py import MPI as _MPI

    from ...backends.base import Stream
    from .group import ProcessGroup


@dataclass
class _Posted:
    kind: str
    peer: int
    buf: Array
    entry: Entry
    request: _MPI.Request | None = None  # host: the MPI request
    call: tuple[str, tuple[object, ...]] | None = None  # GPU: the NCCL method, arguments


class GroupP2p:
    """The send/recv state of one process group."""

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.comm = pg._comm.Dup()  # a message space of its own: matched per pair, in order
        self._batch = threading.local()

    def close(self) -> None:
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

    def post(self, kind: str, buf: Array, peer: int, stream: Stream | None) -> None:
        """Check and issue one send or receive; outside a batch, finish it too."""
        pg = self.pg
        pg._check_usable()
        pg._one(kind)
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < pg.size:
            raise ValueError(f"rank {pg.rank}: peer {peer!r} is not a rank of {pg.size}")
        arr = _device_array(pg.devices[0], buf, f"rank {pg.rank}: {kind} buffer").reshape(-1)
        pending: list[_Posted] | None = getattr(self._batch, "ops", None)
        if pending is None and peer == pg.rank:
            raise ValueError(
                f"rank {pg.rank}: a {kind} with itself needs both halves in one batch "
                "(with pg.batch(): ...)"
            )
        pg._seq += 1
        what = f"{kind} {'to' if kind == 'send' else 'from'} {peer}"
        op = _Posted(kind, peer, arr, pg.flight.start(pg._seq, what, arr.size, arr.dtype, "p2p"))
        if pg._gpu is not None:
            from ..nccl import stream_handle
            from .gpu import nccl_dtype

            if pg._gpu.engine is None:
                pg._gpu.ensure_nccl()  # raises why there is none (made at bootstrap)

            caller = stream if stream is not None else pg.devices[0].current_stream()
            args = (data_ptr(arr), int(arr.size), nccl_dtype(arr.dtype), peer,
                    stream_handle(caller))  # fmt: skip
            op.call = (kind, args)
        else:
            dest = pg._mpi_rank_of_proc[pg._proc_of_rank[peer]]
            t = mpi_type(pg._MPI, arr.dtype)
            send = kind == "send"
            op.request = (self.comm.Isend if send else self.comm.Irecv)([arr, t], dest, 0)
        if pending is not None:
            pending.append(op)
            self._batch.stream = stream
        else:
            self._finish([op], stream)

    def _finish(self, ops: list[_Posted], stream: Stream | None) -> None:
        """Host: wait for the messages (bounded). GPU: issue them as one NCCL group."""
        pg = self.pg
        try:
            if pg._gpu is not None:
                self._launch(ops, stream)
            else:
                self._wait(ops)
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            for op in ops:
                op.entry.state = f"failed: {type(exc).__name__}"
            pg._fail(exc)
            raise
        now = time.monotonic()
        for op in ops:
            op.entry.state, op.entry.ended = "done", now

    def _wait(self, ops: list[_Posted]) -> None:
        pg = self.pg
        MPI = pg._MPI
        statuses = []
        for op in ops:
            assert op.request is not None
            what = "a message it sends" if op.kind == "recv" else "its receive"
            status = MPI.Status()
            pg._wait_request(op.request, pg._proc_of_rank[op.peer], what, status)
            statuses.append(status)
        for op, status in zip(ops, statuses, strict=True):
            if op.kind == "recv":
                got = status.Get_count(mpi_type(MPI, op.buf.dtype))
                if got != op.buf.size:
                    raise ValueError(
                        f"rank {pg.rank}: received {got} {op.buf.dtype} from rank "
                        f"{op.peer}, expected {op.buf.size}"
                    )

    def _launch(self, ops: list[_Posted], stream: Stream | None) -> None:
        g = self.pg._gpu
        assert g is not None
        engine = g.ensure_nccl()
        nccl, comm = engine.nccl, engine.comms[0]
        nccl.groupStart()
        error: BaseException | None = None
        try:
            for op in ops:
                assert op.call is not None
                method, args = op.call
                getattr(comm, method)(*args)
        except Exception as exc:  # noqa: BLE001 - groupEnd still balances the group
            error = exc
        try:
            nccl.groupEnd()
        except Exception as exc:  # noqa: BLE001
            error = error or exc
        if error is not None:
            raise CommError(f"rank {self.pg.rank}: NCCL send/recv failed: {error!r}") from error
        caller = stream if stream is not None else self.pg.devices[0].current_stream()
        g.watch("NCCL send/recv", [caller.record()], [op.buf for op in ops])

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Post every send and receive of the block; finish them all at its end."""
        if getattr(self._batch, "ops", None) is not None:
            raise ValueError(f"rank {self.pg.rank}: batches do not nest")
        self._batch.ops = []
        self._batch.stream = None
        try:
            yield
        except BaseException:
            self._batch.ops = None
            raise
        ops, self._batch.ops = self._batch.ops, None
        self._finish(ops, self._batch.stream)
