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

``stream`` (every call) takes nccltree's Stream, and on GPUs a CuPy stream, a torch
stream or a raw ``cudaStream_t`` (:func:`~nccltree.comm.interop.as_stream`); arrays may
be any that expose DLPack or the (CUDA) array interface, viewed without a copy.

Written once here over the collectives and point-to-point above, for every face alike:
the object collectives (:meth:`RankCollectives.broadcast_object`,
:meth:`RankCollectives.all_gather_object`: pickled, so for data of the job itself only),
and, over sends and receives, the per-rank v-collectives (``all_to_all_v``,
``all_gather_v``, ``reduce_scatter_v``) and the asynchronous ``isend``/``irecv``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ._args import Array
from .work import Work

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ..backends.base import Device
    from .interop import StreamArg

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
    stream: StreamArg = None
    async_op: bool = False
    dtype: DTypeLike | None = None


#: the point-to-point calls of the faces that have them (``Comm``, ``ProcessGroup``), and
#: what is written over them
POINT_TO_POINT = (
    "send", "recv", "sendrecv", "batch", "isend", "irecv",
    "all_to_all_v", "all_gather_v", "reduce_scatter_v",
)  # fmt: skip
#: the object collectives of every face (pickled: trusted data only)
OBJECT_COLLECTIVES = ("broadcast_object", "all_gather_object")


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
        stream: StreamArg = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """``op`` over every rank's ``x``; returns ``out`` (or ``x`` in place), or a Work."""
        if stream is None and not async_op and dtype is None:
            got = self._plain_all_reduce(x, out, op)
            if got is not None:
                return got
        return self._call(RankCall("all_reduce", x, out, op, 0, stream, async_op, dtype))

    def _plain_all_reduce(self, x: Array, out: Array | None, op: str) -> Array | None:
        """A face's short way for a plain ``all_reduce`` (no ``stream``, ``async_op`` or
        ``dtype``): the result, or None for the general path (here, always None)."""
        return None

    def reduce(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Array | None = None,
        op: str = "sum",
        stream: StreamArg = None,
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """Block q of ``x`` goes to rank q, whose block ``rank`` of ``out`` it becomes
        (equal blocks; not in place)."""
        return self._call(RankCall("all_to_all", x, out, "sum", 0, stream, async_op, dtype))

    # -- written once over the collectives above ----------------------------------------
    def _own(self) -> tuple[int, int, Device]:
        """This rank, the group's size, and this rank's device (where the buffers of
        what is written over the collectives and sends live)."""
        raise NotImplementedError

    def broadcast_object(self, obj: object, root: int = 0) -> object:
        """Every rank gets the root's ``obj`` (torch's ``broadcast_object_list`` for one
        object): pickled at the root, broadcast as bytes (its length first), unpickled
        elsewhere; the root gets its ``obj`` back as it is. Collective: every rank calls
        it, in order with the other collectives; the others' ``obj`` is ignored.

        Trust: unpickling runs code the bytes name. Use it within one job whose ranks
        all run your code; never on data from outside it (nccltree never exposes it to
        the network: its bytes travel only between the group's ranks)."""
        me, _, dev = self._own()
        payload = _pickle(obj) if me == root else b""
        n = _on_device(dev, np.array([len(payload)], np.int64))
        self.broadcast(n, root)
        size = int(_to_host(dev, n)[0])
        buf = _on_device(dev, _bytes(payload, size))
        self.broadcast(buf, root)
        if me == root:
            return obj
        return pickle.loads(_to_host(dev, buf).tobytes())

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (torch's ``all_gather_object``): pickled,
        all-gathered as bytes (the lengths first, then every rank's bytes padded to the
        longest), unpickled. Collective, and the trust rule of :meth:`broadcast_object`
        applies: trusted data of the job only."""
        _, n, dev = self._own()
        payload = _pickle(obj)
        lens = _on_device(dev, np.zeros(n, np.int64))
        self.all_gather(_on_device(dev, np.array([len(payload)], np.int64)), lens)
        sizes = [int(v) for v in _to_host(dev, lens)]
        width = max(sizes)
        out = _on_device(dev, np.zeros(width * n, np.uint8))
        self.all_gather(_on_device(dev, _bytes(payload, width)), out)
        host = _to_host(dev, out)
        return [pickle.loads(host[r * width : r * width + sizes[r]].tobytes()) for r in range(n)]


def _pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _bytes(payload: bytes, size: int) -> np.ndarray:
    """``payload`` in a uint8 array of ``size`` bytes (zero-padded)."""
    arr = np.zeros(size, np.uint8)
    arr[: len(payload)] = np.frombuffer(payload, np.uint8)
    return arr


def _on_device(dev: Device, host: np.ndarray) -> Array:
    """A host array as an array of ``dev`` (host devices: itself)."""
    return host if dev.backend == "host" else dev.from_host(host)


def _to_host(dev: Device, arr: Array) -> np.ndarray:
    return arr if isinstance(arr, np.ndarray) else dev.to_host(arr)


def _counts(counts: Sequence[int], n: int, what: str) -> list[int]:
    from .._validate import check_int

    if isinstance(counts, (str, bytes)) or len(counts) != n:
        raise ValueError(f"{what} needs a count per rank ({n}), got {len(counts)}")
    return [check_int(c, f"{what}[{i}]", min=0) for i, c in enumerate(counts)]


def _offsets(counts: Sequence[int]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _flat(dev: Device, arr: Array, what: str) -> Array:
    from ._args import _device_array

    return _device_array(dev, arr, what).reshape(-1)


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
        self, kind: str, buf: Array, peer: int, stream: StreamArg, dtype: DTypeLike | None
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
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
        stream: StreamArg = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """Send ``x`` to ``dest`` and receive ``out`` from ``source`` together (one batch:
        no deadlock when ranks exchange in a ring); returns ``out``."""
        with self.batch():
            self.send(x, dest, stream=stream, dtype=dtype)
            self.recv(out, source, stream=stream, dtype=dtype)
        return out

    # -- asynchronous sends and receives ------------------------------------------------
    def _post_p2p_async(
        self, kind: str, buf: Array, peer: int, stream: StreamArg, dtype: DTypeLike | None
    ) -> Work:
        """Post a ``"send"`` or ``"recv"`` and return its Work at once."""
        raise NotImplementedError

    def isend(
        self,
        x: Array,
        peer: int,
        *,
        stream: StreamArg = None,
        dtype: DTypeLike | None = None,
    ) -> Work:
        """:meth:`send` without waiting: posted now (in order with this rank's other
        sends to ``peer``), finished when its receive is posted; returns a Work
        (``wait``, ``is_completed``, ``add_done_callback``). ``x`` must stay unchanged
        until the Work is done. Not inside ``with batch():`` (a batch finishes its sends
        itself)."""
        return self._post_p2p_async("send", x, peer, stream, dtype)

    def irecv(
        self,
        out: Array,
        peer: int,
        *,
        stream: StreamArg = None,
        dtype: DTypeLike | None = None,
    ) -> Work:
        """:meth:`recv` without waiting; the Work's ``result()`` is ``out``, filled once
        the Work is done."""
        return self._post_p2p_async("recv", out, peer, stream, dtype)

    # -- the v-collectives, over one batch of sends and receives --------------------------
    def _own(self) -> tuple[int, int, Device]:
        raise NotImplementedError

    def all_to_all_v(
        self,
        x: Array,
        out: Array,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        stream: StreamArg = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """all_to_all with uneven blocks: ``x`` holds this rank's blocks for ranks 0, 1,
        ... (``send_counts[q]`` elements for rank q), ``out`` receives rank p's block at
        the place ``recv_counts`` give (rank p's ``send_counts[me]`` must equal this
        rank's ``recv_counts[p]``: each side says its own). One batch of sends and
        receives; returns ``out``."""
        me, n, dev = self._own()
        sc, rc = _counts(send_counts, n, "send_counts"), _counts(recv_counts, n, "recv_counts")
        xa, oa = _flat(dev, x, f"rank {me}: input"), _flat(dev, out, f"rank {me}: output")
        if xa.size != sum(sc) or oa.size != sum(rc):
            raise ValueError(
                f"rank {me}: the input needs {sum(sc)} elements (send_counts) and the "
                f"output {sum(rc)} (recv_counts), got {xa.size} and {oa.size}"
            )
        self._all_to_all_v(xa, oa, sc, rc, stream, dtype)
        return out

    def _all_to_all_v(self, xa: Array, oa: Array, sc: list[int], rc: list[int],
                      stream: StreamArg, dtype: DTypeLike | None) -> None:  # fmt: skip
        """all_to_all_v's blocks moved, its arguments checked: one batch of this face's
        sends and receives (a process group moves them its own way)."""
        me, n, _ = self._own()
        so, ro = _offsets(sc), _offsets(rc)
        with self.batch():
            for i in range(n):
                q, p = (me + i) % n, (me - i) % n  # each sends to q while p sends to it
                if sc[q]:
                    self.send(xa[so[q] : so[q] + sc[q]], q, stream=stream, dtype=dtype)
                if rc[p]:
                    self.recv(oa[ro[p] : ro[p] + rc[p]], p, stream=stream, dtype=dtype)

    def all_gather_v(
        self,
        x: Array,
        out: Array,
        counts: Sequence[int],
        *,
        stream: StreamArg = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """all_gather with uneven blocks: rank r's ``x`` holds ``counts[r]`` elements;
        ``out`` (``sum(counts)``) gets every rank's, rank r's at ``sum(counts[:r])``.
        Every rank passes the same ``counts``. Returns ``out``."""
        me, n, dev = self._own()
        cs = _counts(counts, n, "counts")
        sc = [cs[me]] * n
        xa = _flat(dev, x, f"rank {me}: input")
        if xa.size != cs[me]:
            raise ValueError(f"rank {me}: the input needs counts[{me}] = {cs[me]} elements, "
                             f"got {xa.size}")  # fmt: skip
        # rank r's block once for each rank: an all_to_all_v of views of one input
        oa = _flat(dev, out, f"rank {me}: output")
        if oa.size != sum(cs):
            raise ValueError(f"rank {me}: the output needs sum(counts) = {sum(cs)} elements, "
                             f"got {oa.size}")  # fmt: skip
        with self.batch():
            for i in range(n):
                q, p = (me + i) % n, (me - i) % n
                if sc[q]:
                    self.send(xa, q, stream=stream, dtype=dtype)
                if cs[p]:
                    at = sum(cs[:p])
                    self.recv(oa[at : at + cs[p]], p, stream=stream, dtype=dtype)
        return out

    def reduce_scatter_v(
        self,
        x: Array,
        out: Array,
        counts: Sequence[int],
        *,
        op: str = "sum",
        stream: StreamArg = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """reduce_scatter with uneven blocks: every rank's ``x`` holds ``sum(counts)``
        elements; rank q's ``out`` (``counts[q]``) gets ``op`` over every rank's block q
        (at ``sum(counts[:q])``), summed in rank order. Every rank passes the same
        ``counts`` and ``op``. Returns ``out``."""
        from . import _ops
        from .interop import as_stream

        me, n, dev = self._own()
        cs = _counts(counts, n, "counts")
        xa, oa = _flat(dev, x, f"rank {me}: input"), _flat(dev, out, f"rank {me}: output")
        if xa.size != sum(cs) or oa.size != cs[me]:
            raise ValueError(
                f"rank {me}: the input needs sum(counts) = {sum(cs)} elements and the "
                f"output counts[{me}] = {cs[me]}, got {xa.size} and {oa.size}"
            )
        from ._args import check_call_dtype

        logical = check_call_dtype(dtype)
        kernel_op = _ops.check_op(op, xa.dtype if logical is None else logical)
        blocks = dev.empty((n, cs[me]), xa.dtype)
        with self.batch():
            for i in range(n):
                q, p = (me + i) % n, (me - i) % n
                if cs[q]:
                    at = sum(cs[:q])
                    self.send(xa[at : at + cs[q]], q, stream=stream, dtype=dtype)
                if cs[me]:
                    self.recv(blocks[p], p, stream=stream, dtype=dtype)
        if cs[me]:
            st = as_stream(dev, stream)
            run_on = st if st is not None else dev.current_stream()
            alpha = 1.0 / n if op == "mean" else 1.0
            run_on.reduce(oa, [blocks[r] for r in range(n)], kernel_op, alpha=alpha,
                          dtype=dtype)  # fmt: skip
            if st is None and dev.backend == "host":
                run_on.synchronize()
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
         Sequence[StreamArg] | None, bool, DTypeLike | None],
        list[Array] | Work,
    ]  # fmt: skip

    def all_reduce(
        self,
        xs: Sequence[Array],
        *,
        outs: Sequence[Array] | None = None,
        op: str = "sum",
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
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
        streams: Sequence[StreamArg] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """A ring shift, nccl-tests' ``sendrecv``: rank r's array goes to rank r+1's
        output, so ``outs[r]`` gets rank r-1's (not in place). Per rank, ``sendrecv``
        names its peers (:meth:`PointToPoint.sendrecv`)."""
        return self._driver("sendrecv", xs, outs, "sum", 0, streams, async_op, dtype)

    #: the devices, one per rank (the object collectives' buffers live there)
    devices: list[Device]

    def broadcast_object(self, objs: Sequence[object], root: int = 0) -> list[object]:
        """Every rank gets ``objs[root]`` (the others are ignored; pass None): what
        :meth:`RankCollectives.broadcast_object` gives each rank, as a list per rank
        (pickled and broadcast as bytes; the root's entry is its object as it is). The
        trust rule applies: trusted data of the job only."""
        n = len(self.devices)
        if len(objs) != n:
            raise ValueError(f"objs needs an object per rank ({n}), got {len(objs)}")
        from .._validate import check_index

        root = check_index(root, "root", n)
        payload = _pickle(objs[root])
        bufs = [
            _on_device(d, _bytes(payload if r == root else b"", len(payload)))
            for r, d in enumerate(self.devices)
        ]
        self.broadcast(bufs, root)
        return [
            objs[root] if r == root else pickle.loads(_to_host(d, bufs[r]).tobytes())
            for r, d in enumerate(self.devices)
        ]

    def all_gather_object(self, objs: Sequence[object]) -> list[list[object]]:
        """``objs``: one object per rank. Rank r's entry: every rank's object in rank order, as
        :meth:`RankCollectives.all_gather_object` gives rank r (pickled, all-gathered as
        bytes padded to the longest, unpickled). Trusted data of the job only."""
        n = len(self.devices)
        if len(objs) != n:
            raise ValueError(f"objs needs an object per rank ({n}), got {len(objs)}")
        payloads = [_pickle(o) for o in objs]
        width = max(len(p) for p in payloads)
        ins = [_on_device(d, _bytes(p, width)) for d, p in zip(self.devices, payloads, strict=True)]
        outs = [_on_device(d, np.zeros(width * n, np.uint8)) for d in self.devices]
        self.all_gather(ins, outs)
        gathered = []
        for d, out in zip(self.devices, outs, strict=True):
            host = _to_host(d, out)
            gathered.append(
                [
                    pickle.loads(host[q * width : q * width + len(payloads[q])].tobytes())
                    for q in range(n)
                ]  # fmt: skip
            )
        return gathered

    def sendrecv(self, *args: object, **kwargs: object) -> None:
        """Renamed :meth:`shift` (the ring shift); ``sendrecv`` is the per-rank
        point-to-point exchange (``comm.sendrecv(x, dest, out, source)``)."""
        raise TypeError(
            "World.sendrecv(xs, outs) is now World.shift(xs, outs) (nccl-tests' ring "
            "shift); sendrecv is the per-rank point-to-point exchange, "
            "comm.sendrecv(x, dest, out, source)"
        )
