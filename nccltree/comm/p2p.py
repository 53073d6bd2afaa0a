"""Point-to-point: ``comm.send``/``comm.recv`` between the ranks of one World.

The n-th send from rank A to rank B matches the n-th receive at B from A (NCCL's and
MPI's rule). A posted operation waits in the World's mailbox until its partner is posted;
whichever comes second moves the data: on the host backend at once, in its own thread;
on GPUs on the receiver's communication stream, after the work the sender and the
receiver had on their caller streams, and both caller streams then wait for the copy
(stream-ordered, as collectives are). A sender or receiver returns once its operation is
matched and issued.

A lone ``send`` blocks until its receive is posted, so two ranks that send to each other
first would wait for ever: ``with comm.batch():`` posts every operation inside and waits
for all of them at the end (NCCL's ``groupStart``/``groupEnd`` with send/recv), which is
how a pipeline stage exchanges with its neighbours. Every wait is bounded by the World's
timeout (``CommTimeout`` naming the peer, and the World fails, as for a collective) and
wakes on an abort; a send matched with a receive of another size or dtype raises
``ValueError`` on both ranks.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from .._errors import CommTimeout, PeerFailure
from ..backends.base import CopyArgs, carried_dtype, carry
from ._args import Array, _device_array, check_call_dtype
from .work import Work

if TYPE_CHECKING:
    from ..backends.base import Event, Stream
    from ..backends.host import HostDevice
    from .interop import StreamArg
    from .world import World


@dataclass(eq=False)
class _Op:
    """One posted send or receive."""

    kind: str  # "send" | "recv"
    rank: int  # who posted it
    peer: int
    buf: Array
    caller: Stream | None  # the poster's caller stream (None: the host thread)
    ready: Event | None = None  # recorded on ``caller`` when posted (GPUs)
    done: bool = False
    end: Event | None = None  # the copy's end (GPUs)
    error: BaseException | None = None
    partner: _Op | None = field(default=None, repr=False)
    #: what the buffer holds: its dtype, or the one ``dtype=`` named for it (bfloat16 in
    #: a uint16 CuPy array); a send and its receive must agree on it
    dtype: object = None


class Mailbox:
    """A World's unmatched sends and receives, by (source, destination)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._cond = threading.Condition()
        self._sends: dict[tuple[int, int], collections.deque[_Op]] = {}
        self._recvs: dict[tuple[int, int], collections.deque[_Op]] = {}
        self._batch = threading.local()

    # -- posting and matching -------------------------------------------------------------
    def post(
        self,
        kind: str,
        rank: int,
        peer: int,
        buf: Array,
        stream: StreamArg,
        dtype: object = None,
    ) -> _Op:
        """Check and post one operation (matched at once where its partner waits). An
        argument error is the caller's, raised before anything is posted: it does not
        fail the World (as a collective's argument error does not). ``dtype``: as for a
        collective (a send moves bytes, so it only has to fit the buffer)."""
        w = self.world
        w._check_usable()
        try:
            buf, held = self._check(kind, rank, peer, buf, dtype)
        except (ValueError, TypeError) as exc:
            w._argument_error_raised(exc)
            raise
        caller = w._caller_stream(rank, stream)
        op = _Op(kind, rank, peer, buf.reshape(-1), caller)
        op.dtype = buf.dtype if held is None else held
        if w.backend != "host" and caller is not None:
            op.ready = caller.record()
        elif caller is not None:
            caller.synchronize(w.timeout)  # the host copy happens in a thread: no stream
        key = (rank, peer) if kind == "send" else (peer, rank)
        mine, theirs = (self._sends, self._recvs) if kind == "send" else (self._recvs, self._sends)
        with self._cond:
            waiting = theirs.get(key)
            if waiting:
                self._match(op, waiting.popleft())
                self._cond.notify_all()
            else:
                mine.setdefault(key, collections.deque()).append(op)
        w._note_p2p(op)
        return op

    def _check(
        self, kind: str, rank: int, peer: int, buf: Array, dtype: object = None
    ) -> tuple[Array, object]:
        w = self.world
        what = f"rank {rank}: {kind} buffer"
        buf = _device_array(w.devices[rank], buf, what)
        logical = check_call_dtype(dtype)
        carried = None if logical is None else carried_dtype(buf, logical, what)
        buf, _ = carry(buf, carried)  # a numpy buffer viewed as the dtype it holds
        if kind == "recv" and not getattr(buf.flags, "writeable", True):
            raise ValueError(f"rank {rank}: the receive buffer is read-only")
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < w.size:
            raise ValueError(f"rank {rank}: peer {peer!r} is not a rank of {w.size}")
        return buf, buf.dtype if carried is None else carried

    def _match(self, a: _Op, b: _Op) -> None:
        """Move the data of a matched pair (under the lock)."""
        send, recv = (a, b) if a.kind == "send" else (b, a)
        send.partner, recv.partner = recv, send
        if send.dtype != recv.dtype or send.buf.size != recv.buf.size:
            err = ValueError(
                f"rank {send.rank} sends {send.buf.size} {send.dtype} to rank "
                f"{recv.rank}, which receives {recv.buf.size} {recv.dtype}"
            )
            send.error = recv.error = err
            return
        w = self.world
        src_dev, dst_dev = w.devices[send.rank], w.devices[recv.rank]
        try:
            if w.backend == "host":
                host = cast("HostDevice", dst_dev)
                host.inline_stream.copy_checked(CopyArgs(recv.buf, send.buf, src_dev, dst_dev))
            else:
                st = w._streams[recv.rank]
                for ev in (send.ready, recv.ready):
                    if ev is not None:
                        st.wait_event(ev)
                st.copy_checked(CopyArgs(recv.buf, send.buf, src_dev, dst_dev))
                send.end = recv.end = st.record()
        except BaseException as exc:  # noqa: BLE001 - both ranks see it
            send.error = recv.error = exc
            return
        send.done = recv.done = True

    # -- waiting ---------------------------------------------------------------------------
    def wait(
        self, ops: list[_Op], timeout: float | None = None, stream: Stream | None = None
    ) -> None:
        """Until every op is matched and issued (bounded; an abort wakes it); then the
        callers' streams (or ``stream``) are ordered after the copies. ``timeout``: the
        caller's own bound (an ``irecv``'s ``Work.wait(timeout=...)``): running out of it
        raises ``CommTimeout`` and fails nothing, the ops still posted."""
        w = self.world
        deadline = time.monotonic() + (w.timeout if timeout is None else timeout)
        with self._cond:
            while not all(op.done or op.error for op in ops):
                if w._failure is not None:
                    raise PeerFailure(f"the World failed: {w._failure}") from w._failure
                left = deadline - time.monotonic()
                if left <= 0:
                    stuck = next(op for op in ops if not (op.done or op.error))
                    what = "send to" if stuck.kind == "send" else "receive from"
                    exc = CommTimeout(
                        f"rank {stuck.rank}: its {what} rank {stuck.peer} "
                        f"({stuck.buf.size} {stuck.buf.dtype}) was not matched within "
                        f"{w.timeout if timeout is None else timeout:g} s"
                    )
                    if timeout is None:
                        w._abort(exc)
                    raise exc
                self._cond.wait(min(left, 0.1))
        for op in ops:
            if op.error is not None:
                if isinstance(op.error, (ValueError, TypeError)):
                    w._argument_error_raised(op.error)  # both ranks' error: the World is fine
                raise op.error
        for op in ops:
            if op.end is not None:
                caller = stream if stream is not None else op.caller
                if caller is not None:
                    caller.wait_event(op.end)
                else:
                    op.end.synchronize(w.timeout)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- batches ---------------------------------------------------------------------------
    def in_batch(self, rank: int) -> list[_Op] | None:
        batches: dict[int, list[_Op]] = getattr(self._batch, "ops", {})
        return batches.get(rank)

    @contextmanager
    def batch(self, rank: int) -> Iterator[None]:
        """Post every operation of the block, wait for all of them at its end."""
        if not hasattr(self._batch, "ops"):
            self._batch.ops = {}
        if rank in self._batch.ops:
            raise ValueError(f"rank {rank}: batches do not nest")
        ops: list[_Op] = []
        self._batch.ops[rank] = ops
        try:
            yield
        except BaseException:
            del self._batch.ops[rank]
            raise
        del self._batch.ops[rank]
        self.wait(ops)


class P2pWork(Work):
    """The ``Work`` of an ``isend``/``irecv`` on a World's rank: done once the operation
    is matched and its copy has run. ``wait()`` returns once it is matched, with the
    caller's stream ordered after the copy (a host caller: after the copy itself);
    ``wait(timeout=...)``/``synchronize`` block until the copy is done."""

    def __init__(self, box: Mailbox, op: _Op, result: object, timeout: float) -> None:
        super().__init__([], [op.caller], result, op, timeout)
        self._box, self._op = box, op

    def _wait_all(self, limit: float, callers_bound: bool) -> None:
        self._box.wait([self._op], limit if callers_bound else None)
        if self._op.end is not None:
            self._op.end.synchronize(limit)

    def _query(self) -> bool:
        op = self._op
        if op.error is not None:
            return True  # finished, with an error that wait/synchronize raise
        return op.done and (op.end is None or op.end.query())

    def _order(self, stream: Stream | None) -> bool:
        self._box.wait([self._op], None, stream)
        return True
