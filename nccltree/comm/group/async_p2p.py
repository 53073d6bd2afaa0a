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
from typing import TYPE_CHECKING

from ...backends.base import carried_dtype, carry
from .._args import Array, _device_array, check_call_dtype
from ..interop import as_stream
from ..work import Work

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ...backends.base import Device, Stream
    from .group import ProcessGroup


def post_async(
    pg: ProcessGroup, kind: str, buf: Array, peer: int, stream: object, dtype: DTypeLike | None
) -> Work:
    """Post one send or receive of ``pg``'s one rank; its Work (see the module)."""
    pg._one(f"i{kind}")
    pg._check_usable()
    dev = pg.devices[0]
    st = as_stream(dev, stream)
    if getattr(pg._p2p._batch, "ops", None) is not None:
        raise ValueError(
            f"rank {pg.rank}: i{kind} posts on its own; inside a batch use {kind} (the "
            "batch finishes it)"
        )
    if pg._gpu is not None:
        pg._post_p2p(kind, buf, peer, st, dtype)
        caller = st if st is not None else dev.current_stream()
        return Work([caller.record()], [caller], buf, buf, pg.timeout)
    arr = _carried(dev, buf, f"rank {pg.rank}: {kind} buffer", dtype)
    if pg._stream is None:
        pg._stream = dev.new_stream()
    host_caller: Stream | None = st if st is not None else dev.explicit_current_stream()
    if host_caller is not None:
        pg._stream.wait_event(host_caller.record())
    work = _Posted([], [host_caller], buf, buf, pg.timeout)

    def run() -> None:
        with pg._lock:
            pg._p2p.post(kind, arr, peer, None)

    pg._stream.call(work.perform, run)
    work._events.append(pg._stream.record())
    return work


class _Posted(Work):
    """An ``isend``/``irecv`` on a host group's stream: an argument error (a receive of
    another size) is kept here, raised by ``synchronize``, not left on the group's
    stream, where it would fail every operation behind it."""

    error: BaseException | None = None

    def perform(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except (ValueError, TypeError) as exc:
            self.error = exc

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
