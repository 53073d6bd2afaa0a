"""The collective interface, declared once: every face's signatures and docstrings.

Two shapes of call exist. A **per-rank** face is one rank's, called from that rank's
thread (or process) with that rank's array: :class:`~nccltree.comm.Comm` (a World's
rank), ``GroupComm`` (a process group's rank, ``pg.comm(i)``) and
:class:`~nccltree.comm.group.ProcessGroup` itself (one rank per process). They share
:class:`RankCollectives` (and :class:`PointToPoint`), written over one method,
``_call(call)``, of one :class:`RankCall` (collective, x, out, op, root, stream,
async_op, dtype). The **driver-side** face, :class:`~nccltree.comm.World`, is called once for all ranks with one array per
rank: :class:`DriverCollectives`, over ``_driver(collective, xs, outs, op, root, streams,
async_op, dtype)``. The two declare the same parameters in the same places (``xs`` for
``x``, ``outs`` for ``out``, ``streams`` for ``stream``): ``root`` positional after the
buffers, then keyword-only ``out``, ``op``, ``stream``, ``async_op``, ``dtype``.

``collective`` is a name of the collectives table (:mod:`nccltree.comm.collectives`);
its ``"sendrecv"`` row is nccl-tests' ring shift, public as :meth:`DriverCollectives.shift`
(a per-rank ``sendrecv`` is a point-to-point exchange with named peers).

``dtype`` (every collective, send and recv): None (the default) computes in the arrays'
own dtype; ``"bfloat16"`` also takes ``uint16`` arrays holding bfloat16 bits, which is
how CuPy arrays carry it; the ranks of one call name the same. ``async_op=True`` (or an
explicit ``stream``) returns once the work is issued: a :class:`~nccltree.comm.Work`
(``async_op``) or the result, ordered on the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._args import Array
from .work import Work

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ..backends.base import Stream

#: the per-rank collectives every face declares (in the collectives table's order)
RANK_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
)
#: the World method of each collective of the table whose name it does not take
_DRIVER_NAMES = {"sendrecv": "shift"}


def driver_method(collective: str) -> str:
    """The name of the World method that runs ``collective`` (a name of the collectives
    table): the same name, except ``shift`` for the table's ``sendrecv`` (the ring
    shift)."""
    return _DRIVER_NAMES.get(collective, collective)


@dataclass(slots=True)
class RankCall:
    """One rank's call of a collective of the table, as every per-rank face's ``_call``
    takes it: the arguments of the methods below, in their order (``root`` 0 and ``op``
    "sum" where the collective has none). Made on every call: slots, not frozen (a frozen
    dataclass costs microseconds to build)."""

    collective: str
    x: Array
    out: Array | None = None
    op: str = "sum"
    root: int = 0
    stream: Stream | None = None
    async_op: bool = False
    dtype: DTypeLike | None = None


#: the point-to-point calls of the faces that have them (``Comm``, ``ProcessGroup``)
POINT_TO_POINT = ("send", "recv", "sendrecv", "batch")


class RankCollectives:
    """The per-rank collectives over ``_call``: every rank calls the same collectives in
    the same order, each with its own ``x`` (and ``out``). Returns the result (``out``,
    or ``x`` for a collective computed in place), or a ``Work`` when ``async_op``.

    The arguments, the same on every method that takes them:

    - ``x``: this rank's input (a numpy array on host devices, a CuPy array on the
      rank's GPU), contiguous; the ranks' arrays agree in size and dtype.
    - ``out``: where the result goes; None computes in place into ``x`` (where the
      collective allows it). Methods with a positional ``out`` need one.
    - ``root``: the rank that owns the result (``reduce``, ``gather``) or the data
      (``broadcast``, ``scatter``); every rank passes the same.
    - ``op``: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
    - ``stream``: the stream the call is ordered against: its work starts after the work
      already queued there, and that stream waits for the result. None: on GPUs the
      thread's current CuPy stream, and the call returns once the work is issued (as
      NCCL's); on host devices the calling thread, and the call returns once the result
      is in place (each wait bounded by the timeout). An explicit host ``stream`` orders
      the call after that stream's queued work and returns once it is issued.
    - ``async_op``: return a :class:`~nccltree.comm.Work` once the work is issued:
      ``wait()`` orders the caller's stream after it, ``synchronize()`` blocks,
      ``result()`` returns the output; the Work keeps the buffers alive until done.
    - ``dtype``: None computes in the arrays' own dtype; ``"bfloat16"`` also takes
      ``uint16`` arrays holding bfloat16 bits (how CuPy carries it). Every rank names
      the same.

    Errors: ``ValueError`` or ``TypeError`` for bad arguments (shape, dtype, device,
    contiguity, or a mismatch between the ranks), raised on every rank before any buffer
    is written; :class:`~nccltree.CommTimeout` when the ranks do not all arrive or the
    work does not finish within the timeout; :class:`~nccltree.PeerFailure` once another
    rank failed (every later call raises it too); :class:`~nccltree.CommError` for other
    failures of the communication itself.
    """

    def _call(self, call: RankCall) -> Array | Work:
        """One collective of the table, by name, for this rank: what every method below
        calls (and what a caller with the name in hand, as the benchmark, calls)."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Return once every rank has called ``barrier`` and its queued work has run."""
        raise NotImplementedError

    def all_reduce(
        self,
        x: Array,
        *,
        out: Array | None = None,
        op: str = "sum",
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """``op`` over every rank's ``x``; returns ``out`` (or ``x`` in place), or a Work."""
        return self._call(RankCall("all_reduce", x, out, op, 0, stream, async_op, dtype))

    def reduce(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Array | None = None,
        op: str = "sum",
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """``op`` over every rank's ``x`` at ``root``; other ranks' ``x`` stay unchanged."""
        return self._call(RankCall("reduce", x, out, op, root, stream, async_op, dtype))

    def broadcast(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Array | None = None,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """Every rank gets the root's ``x``."""
        return self._call(RankCall("broadcast", x, out, "sum", root, stream, async_op, dtype))

    def all_gather(
        self,
        x: Array,
        out: Array,
        *,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """``out`` gets every rank's ``x``, rank i's at ``[i*x.size, (i+1)*x.size)``."""
        return self._call(RankCall("all_gather", x, out, "sum", 0, stream, async_op, dtype))

    def reduce_scatter(
        self,
        x: Array,
        out: Array,
        *,
        op: str = "sum",
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """``out`` gets block ``rank`` of ``op`` over every rank's ``x``."""
        return self._call(RankCall("reduce_scatter", x, out, op, 0, stream, async_op, dtype))

    def gather(
        self,
        x: Array,
        out: Array,
        root: int = 0,
        *,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """The root's ``out`` gets every rank's ``x``, rank i's at ``[i*x.size,
        (i+1)*x.size)``; every rank passes an ``out`` of that size, only the root's is
        written."""
        return self._call(RankCall("gather", x, out, "sum", root, stream, async_op, dtype))

    def scatter(
        self,
        x: Array,
        out: Array,
        root: int = 0,
        *,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """``out`` gets block ``rank`` of the root's ``x`` (every rank passes an ``x`` of
        that size; only the root's is read)."""
        return self._call(RankCall("scatter", x, out, "sum", root, stream, async_op, dtype))

    def all_to_all(
        self,
        x: Array,
        out: Array,
        *,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """Block q of ``x`` goes to rank q, whose block ``rank`` of ``out`` it becomes
        (equal blocks; not in place)."""
        return self._call(RankCall("all_to_all", x, out, "sum", 0, stream, async_op, dtype))


class PointToPoint:
    """Sends and receives of one rank over ``_post_p2p`` (post one, and wait for it
    unless a batch is open) and ``batch``.

    ``peer``, ``dest`` and ``source`` are ranks of the group; sends and receives between
    one pair are matched in call order. ``stream`` and ``dtype`` mean what they mean for
    the collectives (:class:`RankCollectives`): the transfer is ordered after the work on
    ``stream`` (None: the current stream on GPUs, the calling thread on host devices),
    and the receiving side names the same ``dtype`` as the sending side. The errors are
    the collectives' too.
    """

    def _post_p2p(
        self, kind: str, buf: Array, peer: int, stream: Stream | None, dtype: DTypeLike | None
    ) -> None:
        """Post a ``"send"`` of ``buf`` to ``peer`` or a ``"recv"`` into it from ``peer``;
        outside a batch, return once it is matched and issued."""
        raise NotImplementedError

    def batch(self) -> AbstractContextManager[None]:
        """``with batch():`` posts this rank's sends and receives at once and finishes them
        all when the block ends (NCCL's ``groupStart``/``groupEnd``): no deadlock when
        ranks exchange."""
        raise NotImplementedError

    def send(
        self,
        x: Array,
        peer: int,
        *,
        stream: Stream | None = None,
        dtype: DTypeLike | None = None,
    ) -> None:
        """Send ``x`` to rank ``peer``, matched with its n-th ``recv`` from this rank.
        Returns once matched and issued; inside ``with batch():`` at the end of the
        block. ``dtype``: what ``x`` holds, as for the collectives; the receive must name
        the same (the bytes move as they are)."""
        self._post_p2p("send", x, peer, stream, dtype)

    def recv(
        self,
        out: Array,
        peer: int,
        *,
        stream: Stream | None = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """Receive into ``out`` what rank ``peer`` sends (its n-th send to this rank);
        returns ``out`` (filled once the call returns, or at the end of a batch; on GPUs
        ordered on the caller's stream). ``dtype`` as for :meth:`send`."""
        self._post_p2p("recv", out, peer, stream, dtype)
        return out

    def sendrecv(
        self,
        x: Array,
        dest: int,
        out: Array,
        source: int,
        *,
        stream: Stream | None = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """Send ``x`` to ``dest`` and receive ``out`` from ``source`` together (one batch:
        no deadlock when ranks exchange in a ring); returns ``out``."""
        with self.batch():
            self.send(x, dest, stream=stream, dtype=dtype)
            self.recv(out, source, stream=stream, dtype=dtype)
        return out


class DriverCollectives:
    """The driver-side collectives over ``_driver``: one call for every rank, ``xs[r]``
    (and ``outs[r]``, ``streams[r]``) rank r's. Returns each rank's result, or one
    ``Work`` for all when ``async_op``. The parameters are the per-rank ones
    (:class:`RankCollectives`) with a list for each buffer and stream.

    - ``xs``: one input array per rank, in rank order (``xs[r]`` on rank r's device).
    - ``outs``: one output array per rank; None computes in place into ``xs`` (where the
      collective allows it). Methods with a positional ``outs`` need them.
    - ``root``, ``op``, ``async_op``, ``dtype``: as per rank (:class:`RankCollectives`).
    - ``streams``: one stream per rank (or None) that rank's part is ordered against;
      None for all: each device's current stream on GPUs; on host devices the call
      returns once every result is in place.

    Errors are the per-rank ones: ``ValueError``/``TypeError`` before any buffer is
    written, ``CommTimeout``, ``PeerFailure``, ``CommError``.
    """

    #: one collective of the table, by name, for every rank: ``_driver(collective, xs,
    #: outs, op, root, streams, async_op, dtype)``, implemented by the face (World)
    _driver: Callable[
        [str, Sequence[Array], Sequence[Array] | None, str, int,
         Sequence[Stream | None] | None, bool, DTypeLike | None],
        list[Array] | Work,
    ]  # fmt: skip

    def all_reduce(
        self,
        xs: Sequence[Array],
        *,
        outs: Sequence[Array] | None = None,
        op: str = "sum",
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """Every rank gets ``op`` over all ranks' arrays; in place unless ``outs``."""
        return self._driver("all_reduce", xs, outs, op, 0, streams, async_op, dtype)

    def reduce(
        self,
        xs: Sequence[Array],
        root: int = 0,
        *,
        outs: Sequence[Array] | None = None,
        op: str = "sum",
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """The root gets ``op`` over all ranks' arrays; other inputs stay unchanged."""
        return self._driver("reduce", xs, outs, op, root, streams, async_op, dtype)

    def broadcast(
        self,
        xs: Sequence[Array],
        root: int = 0,
        *,
        outs: Sequence[Array] | None = None,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """Every rank gets the root's array."""
        return self._driver("broadcast", xs, outs, "sum", root, streams, async_op, dtype)

    def all_gather(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        *,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """``outs[r]`` holds every rank's array, rank i's at ``[i*x.size, (i+1)*x.size)``."""
        return self._driver("all_gather", xs, outs, "sum", 0, streams, async_op, dtype)

    def reduce_scatter(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        *,
        op: str = "sum",
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """``outs[r]`` gets block r of ``op`` over all ranks' arrays."""
        return self._driver("reduce_scatter", xs, outs, op, 0, streams, async_op, dtype)

    def gather(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        root: int = 0,
        *,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """``outs[root]`` gets every rank's array, rank i's at ``[i*x.size, (i+1)*x.size)``;
        every rank passes an output of that size, only the root's is written."""
        return self._driver("gather", xs, outs, "sum", root, streams, async_op, dtype)

    def scatter(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        root: int = 0,
        *,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """``outs[r]`` gets block r of the root's array (every rank passes an input of
        that size; only the root's is read)."""
        return self._driver("scatter", xs, outs, "sum", root, streams, async_op, dtype)

    def all_to_all(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        *,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """Block q of rank r's array goes to block r of rank q's output (equal blocks; not
        in place)."""
        return self._driver("all_to_all", xs, outs, "sum", 0, streams, async_op, dtype)

    def shift(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        *,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """A ring shift, nccl-tests' ``sendrecv``: rank r's array goes to rank r+1's
        output, so ``outs[r]`` gets rank r-1's (not in place). Per rank, ``sendrecv``
        names its peers (:meth:`PointToPoint.sendrecv`)."""
        return self._driver("sendrecv", xs, outs, "sum", 0, streams, async_op, dtype)

    def sendrecv(self, *args: object, **kwargs: object) -> None:
        """Renamed :meth:`shift` (the ring shift); ``sendrecv`` is the per-rank
        point-to-point exchange (``comm.sendrecv(x, dest, out, source)``)."""
        raise TypeError(
            "World.sendrecv(xs, outs) is now World.shift(xs, outs) (nccl-tests' ring "
            "shift); sendrecv is the per-rank point-to-point exchange, "
            "comm.sendrecv(x, dest, out, source)"
        )
