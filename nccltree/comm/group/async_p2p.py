"""``pg.isend``/``pg.irecv``: a process group's sends and receives that return a Work.

A host group runs them on its own stream (the worker that also runs its asynchronous
collectives), in the order posted, after the work of the caller's stream: the caller
returns at once and the Work is done once the operation finished there. That stream
performs one operation at a time, so a rank's later operations wait behind an ``isend``
whose receive is not posted yet: ranks that exchange (each sending to the other) post
both halves in one ``with pg.batch():``, as with NCCL.

A GPU group issues them as ``send``/``recv`` do: on the caller's stream (NCCL between
nodes; CUDA IPC copies within one), the host returning once the operation is matched and
issued; the Work then marks the caller's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...backends.base import carried_dtype, carry
from .._args import Array, _device_array, check_call_dtype
from ..interop import StreamArg, as_stream
from ..work import Work

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ...backends.base import Device, Event, Stream


@dataclass
class AsyncP2pContext:
    """What ``isend``/``irecv`` need of the group (made by ``ProcessGroup``)."""

    rank: int
    device: Device
    timeout: float
    gpu: bool
    check: Callable[[], None]  # one rank per process, the group usable
    in_batch: Callable[[], bool]  # inside ``with pg.batch():`` in this thread
    post_now: Callable[[Array, StreamArg], None]  # as send/recv do (GPU groups)
    queued: Callable[[Array], None]  # post and finish it (run on the group's stream)
    group_stream: Callable[[], Stream]  # the group's stream, made on first use


def post_async(
    ctx: AsyncP2pContext, kind: str, buf: Array, stream: StreamArg, dtype: DTypeLike | None
) -> Work:
    """Post one send or receive of the group's one rank; its Work (see the module)."""
    ctx.check()
    dev = ctx.device
    st = as_stream(dev, stream)
    if ctx.in_batch():
        raise ValueError(
            f"rank {ctx.rank}: i{kind} posts on its own; inside a batch use {kind} (the "
            "batch finishes it)"
        )
    if ctx.gpu:
        ctx.post_now(buf, st)
        caller = st if st is not None else dev.current_stream()
        return Work([caller.record()], [caller], buf, buf, ctx.timeout)
    arr = _carried(dev, buf, f"rank {ctx.rank}: {kind} buffer", dtype)
    group_stream = ctx.group_stream()
    host_caller: Stream | None = st if st is not None else dev.explicit_current_stream()
    if host_caller is not None:
        group_stream.wait_event(host_caller.record())
    work = ArgumentErrorWork([], [host_caller], buf, buf, ctx.timeout)
    group_stream.call(work.perform, lambda: ctx.queued(arr))
    work.add_event(group_stream.record())
    return work


class ArgumentErrorWork(Work):
    """The ``Work`` of an operation on a host group's stream (an ``isend``/``irecv``, an
    asynchronous collective) whose argument error (``ValueError``, ``TypeError``: a
    receive of another size, a mismatch between processes) is kept here, raised by
    ``synchronize``, not left on the group's stream, where it would fail every operation
    behind it."""

    error: BaseException | None = None

    def perform(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``, run on the group's stream, keeping its argument error."""
        try:
            fn(*args)
        except (ValueError, TypeError) as exc:
            self.error = exc

    def add_event(self, event: Event) -> None:
        """Mark the operation's end on the group's stream (once it is queued there)."""
        self._events.append(event)

    def synchronize(self, timeout: float | None = None) -> None:
        super().synchronize(timeout)
        if self.error is not None:
            raise self.error


def _carried(dev: Device, buf: Array, what: str, dtype: DTypeLike | None) -> Array:
    """The buffer with ``dtype=`` checked as a collective's is (a numpy buffer that
    carries the dtype viewed as it)."""
    logical = check_call_dtype(dtype)
    if logical is None:
        return buf
    arr = _device_array(dev, buf, what)
    return carry(arr, carried_dtype(arr, logical, what))[0]
