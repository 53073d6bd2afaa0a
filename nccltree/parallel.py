"""The data-parallel driver: a solver thread per rank, synchronised through a World.

This is the P2PSync of the project. Every rank has its own model replica (a
:class:`~nccltree.params.FlatParams` on its device), its own :class:`~nccltree.solver.SGD`
and its own data stream (one shared reader dealing records round-robin to the ranks). Rank
0 initialises the parameters and a broadcast makes every replica identical before the first
step. Threads are enough for the host backend: numpy releases the GIL inside BLAS, so the
ranks' forward and backward passes run on separate cores.

The solver owns the training loop (:meth:`~nccltree.solver.SGD.iteration`: ``on_start``,
gradients, ``on_gradients_ready``, update); for each ``fit`` the driver registers a sync
callback with every rank's solver, as Caffe's P2PSync does with
``solver_->add_callback(this)``, and runs the solver's iterations. Two update modes:

* ``allreduce`` (:class:`AllReduceSync`) -- ``on_gradients_ready`` averages ``params.grad``
  over the ranks with one collective over the flat buffer; every rank applies the same
  update.
* ``root`` (:class:`RootSync`) -- Caffe's P2PSync: ``on_gradients_ready`` sums the gradients
  at the root, which scales them by ``1/N`` and alone updates; ``on_start`` of the next
  iteration broadcasts the root's parameters. Both modes compute the same parameters.

With ``bucket_bytes > 0`` (:class:`BucketSync`, as PyTorch's DDP does it) the flat gradient
is cut into buckets, contiguous slices in backward order (:func:`make_buckets`); the model
announces each parameter's gradient as backward writes it (the solver's
``gradient_ready``), and a bucket's collective (the all-reduce, or the reduce to the root)
starts asynchronously, on the communication streams, as soon as the bucket is complete,
while backward computes the earlier layers; ``on_gradients_ready`` then waits for every
bucket before the update. ``comm_hook="float16"`` sends the gradients as float16 (the
update stays in the parameters' dtype).

With the round-robin data rule, N ranks with batch ``b`` each see exactly the records of one
rank with batch ``N*b``, so weak-scaling training is the 1-device computation with the larger
batch, up to floating-point summation order. Snapshots are :mod:`nccltree.snapshot`'s.

Over a :class:`~nccltree.comm.group.ProcessGroup` (``group=``), the ranks live in several
processes: each process holds the replicas of its own ranks only (``pg.ranks``), runs their
loops through ``pg.run`` and feeds them from its own data source (a reader with the process
filter). Global rank 0 is the root: its process alone calls ``on_step``. The mean loss
and a stop flag travel in one small all-gather per iteration, so every rank of every
process stops after the same iteration.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import DTypeLike

from ._errors import CommTimeout, MissingRanks, NcclTreeError, PeerFailure
from ._validate import check_int, check_real
from .comm.plan import align_bytes
from .comm.rendezvous import Meeting, Rendezvous
from .data.source import BatchSource, RankBatch
from .models import Model, TrainableModel
from .params import FlatParams
from .snapshot import SNAPSHOT_FORMAT, Snapshot, load_snapshot, save_snapshot
from .solver import SGD, Callback, Diverged, GradientCallback

if TYPE_CHECKING:
    from .backends.base import Array, Device, Event, Stream
    from .comm import Comm, World
    from .comm.group import ProcessGroup
    from .comm.group.local import GroupComm
    from .comm.work import Work

__all__ = [
    "COMM_HOOKS",
    "DEFAULT_BUCKET_BYTES",
    "SCALING_MODES",
    "SNAPSHOT_FORMAT",
    "UPDATE_MODES",
    "AllReduceSync",
    "BatchSource",
    "Bucket",
    "BucketSync",
    "DataParallel",
    "Diverged",
    "FitResult",
    "RankFailure",
    "RootSync",
    "Snapshot",
    "StepInfo",
    "Sync",
    "evaluate",
    "load_snapshot",
    "make_buckets",
    "per_rank_batch",
    "save_snapshot",
]

UPDATE_MODES = ("allreduce", "root")
SCALING_MODES = ("weak", "strong")
#: gradient communication hooks: ``float16`` sends the gradients as float16
COMM_HOOKS = ("float16",)
#: the gradient bucket size of :class:`DataParallel` (0: one collective after backward)
DEFAULT_BUCKET_BYTES = 0

# How often a rank waiting for data looks at the stop flag (seconds).
_DATA_POLL_S = 0.5
# How often a rank waiting for its gradient buckets looks for a failure elsewhere (seconds).
_BOARD_POLL_S = 0.05


class RankFailure(NcclTreeError):
    """A rank's error ended the run; ``rank`` names it and ``__cause__`` is the error."""

    def __init__(self, rank: int, size: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} of {size} failed: {type(error).__name__}: {error}")
        self.rank = rank
        self.size = size
        self.error = error


def per_rank_batch(batch_size: int, ranks: int, scaling: str = "weak") -> int:
    """The batch each rank computes under ``scaling``: ``batch_size`` (``"weak"``) or
    ``batch_size / ranks`` (``"strong"``; ValueError when it does not divide evenly)."""
    batch_size = check_int(batch_size, "batch_size", min=1)
    ranks = check_int(ranks, "ranks", min=1)
    if scaling not in SCALING_MODES:
        raise ValueError(f"scaling must be one of {', '.join(SCALING_MODES)}; got {scaling!r}")
    if scaling == "weak":
        return batch_size
    if batch_size % ranks:
        raise ValueError(
            f"strong scaling splits the global batch across ranks, but {batch_size} does not "
            f"split evenly across {ranks} ranks; use a multiple of {ranks}"
        )
    return batch_size // ranks


# -- results -------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """What the root sees after each iteration (passed to ``fit``'s ``on_step``):
    ``iter`` (iterations completed), ``loss`` (mean training loss over all ranks'
    batches), ``lr`` (the learning rate this iteration used), ``examples`` (over all
    ranks), ``step_s`` (the iteration's wall time on the root), ``comm_s`` (of which in
    the sync callback), ``exposed_s`` (of ``comm_s``, from the end of backward to the
    update: communication backward did not hide), ``elapsed_s`` (since ``fit`` started),
    ``position`` (where the next iteration's data starts) and ``params`` (the root's
    parameters, for read-only use in the root's thread)."""

    iter: int  # iterations completed (the solver's iter)
    loss: float  # mean training loss over all ranks' batches (root's own without comm)
    lr: float  # the learning rate this iteration used
    examples: int  # examples in this iteration, over all ranks
    step_s: float  # wall time of this iteration on the root
    comm_s: float  # of which inside the sync callback (its collectives)
    elapsed_s: float  # since fit started
    position: int | None  # data position where the next iteration starts
    params: FlatParams  # the root's parameters (read-only use, in the root's thread)
    # of comm_s, from the end of backward to the update: communication backward did not hide
    exposed_s: float = 0.0


@dataclass
class FitResult:
    """Summary of a ``fit`` call; per-iteration lists are the root's.

    ``start_iter`` and ``iter``: the solver's iteration at the start and the end;
    ``losses``, ``step_times``, ``comm_times`` and ``exposed_times``: per iteration, as in
    :class:`StepInfo`; ``examples``: over all ranks and iterations; ``elapsed_s``: the
    wall time; ``position``: where the next ``fit``'s data starts; ``stopped``: whether
    :meth:`DataParallel.stop` ended it early; ``rank_comm_s``, ``rank_step_s`` and
    ``rank_exposed_s``: each rank's totals over the run."""

    start_iter: int
    iter: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    comm_times: list[float] = field(default_factory=list)
    exposed_times: list[float] = field(default_factory=list)
    examples: int = 0
    elapsed_s: float = 0.0
    position: int | None = None
    stopped: bool = False
    rank_comm_s: list[float] = field(default_factory=list)
    rank_step_s: list[float] = field(default_factory=list)
    rank_exposed_s: list[float] = field(default_factory=list)

    @property
    def examples_per_s(self) -> float:
        """Examples per second over the run (0 when no time passed)."""
        return self.examples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def comm_fraction(self) -> float:
        """Time inside the sync callbacks (collectives) over step time, all ranks."""
        total = sum(self.rank_step_s)
        return sum(self.rank_comm_s) / total if total > 0 else 0.0

    @property
    def exposed_fraction(self) -> float:
        """Time from the end of backward to the update (the communication backward did
        not hide) over step time, all ranks."""
        total = sum(self.rank_step_s)
        return sum(self.rank_exposed_s) / total if total > 0 else 0.0


# -- evaluation --------------------------------------------------------------------------


def evaluate(
    model: Model, params: FlatParams, x: np.ndarray, y: np.ndarray, batch_size: int = 1024
) -> tuple[float, float]:
    """``(accuracy, mean loss)`` of ``model`` with ``params`` on the arrays ``x``, ``y``,
    computed ``batch_size`` examples at a time."""
    batch_size = check_int(batch_size, "batch_size", min=1)
    n = len(y)
    if n == 0:
        raise ValueError("evaluation needs at least one example")
    correct, loss = 0, 0.0
    for i in range(0, n, batch_size):
        logits = model.forward(params, x[i : i + batch_size])
        if not isinstance(logits, np.ndarray):
            logits = logits.get()  # a CuPy array
        logits = logits.astype(np.float64)
        yb = np.asarray(y[i : i + batch_size])
        correct += int((logits.argmax(axis=1) == yb).sum())
        logits -= logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits).sum(axis=1))
        loss += float((logz - logits[np.arange(len(yb)), yb]).sum())
    return correct / n, loss / n


# -- the synchronisation callbacks ---------------------------------------------------------


class Sync(Callback):
    """A solver callback that keeps one rank's replica (its ``params``) in step with the
    others through ``comm``. The driver registers one with each rank's solver for a ``fit``, calls
    :meth:`begin` before the first iteration and :meth:`finish` after the last; the
    solver times its hooks (:attr:`~nccltree.solver.SGD.callback_s`). ``updates`` says
    whether this rank's solver applies the update itself."""

    updates = True

    def __init__(self, comm: Comm | GroupComm, params: FlatParams) -> None:
        self.comm, self.params = comm, params

    def begin(self) -> None:
        """Before the first iteration of a ``fit``."""

    def finish(self) -> None:
        """After the last iteration of a ``fit`` (not after a failure or a stop)."""

    def close(self) -> None:
        """When the ``fit`` ends, however it ends (after a failure or a stop too)."""


class AllReduceSync(Sync):
    """``on_gradients_ready``: average the flat gradient buffer over all ranks. The
    replicas are made equal once, at :meth:`begin`; equal updates keep them so."""

    def begin(self) -> None:
        """Make every replica the rank 0's (a broadcast of the parameters)."""
        self.comm.broadcast(self.params.data, root=0)

    def on_gradients_ready(self) -> None:
        """Average the gradient over all ranks (an all_reduce with ``op="mean"``)."""
        self.comm.all_reduce(self.params.grad, op="mean")


class RootSync(Sync):
    """Caffe's P2PSync: gradients summed at the root, which alone updates; the root's
    parameters are broadcast at the start of the next iteration, and at :meth:`finish`.
    ``comm`` and ``params`` as for :class:`Sync`; ``root`` is the rank that updates."""

    def __init__(self, comm: Comm | GroupComm, params: FlatParams, root: int = 0) -> None:
        super().__init__(comm, params)
        self.root = root
        self.updates = comm.rank == root

    def on_start(self) -> None:
        """Give every rank the root's parameters (a broadcast)."""
        self.comm.broadcast(self.params.data, root=self.root)

    def on_gradients_ready(self) -> None:
        """Sum the gradients at the root, which scales them to the mean (a reduce)."""
        self.comm.reduce(self.params.grad, root=self.root)
        if self.comm.rank == self.root:
            # each rank's loss is a mean over its batch: the sum of N means needs 1/N
            device = self.params.device
            assert device is not None, "DataParallel's parameters live on a device"
            device.scale(self.params.grad, 1.0 / self.comm.size)

    def finish(self) -> None:
        # the last update lives on the root only: share it so every replica ends equal
        self.comm.broadcast(self.params.data, root=self.root)


# -- gradient buckets ----------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """A contiguous slice ``[start, stop)`` of the flat gradient (alignment padding
    included) and the parameters in it (``names``), in the order backward writes them."""

    start: int
    stop: int
    names: tuple[str, ...]


def make_buckets(params: FlatParams, bucket_bytes: int) -> list[Bucket]:
    """Cut ``params``' flat gradient into buckets in backward order: from the end of the
    buffer (the last layer, whose gradient backward writes first) towards its start.
    Parameters are never split; a bucket closes once it holds at least ``bucket_bytes``
    (so a parameter larger than that is a bucket of its own). The buckets cover the whole
    buffer; ``bucket_bytes=0`` gives one bucket, the whole buffer."""
    bucket_bytes = check_int(bucket_bytes, "bucket_bytes", min=0)
    names, offsets = params.names, params.offsets
    if bucket_bytes == 0:
        return [Bucket(0, params.size, names[::-1])]
    item = params.dtype.itemsize
    buckets: list[Bucket] = []
    stop, names_in = params.size, []
    for name in reversed(names):
        names_in.append(name)
        start = offsets[name]
        if (stop - start) * item >= bucket_bytes or start == 0:
            buckets.append(Bucket(start, stop, tuple(names_in)))
            stop, names_in = start, []
    assert buckets[-1].start == 0, "the first parameter starts the flat buffer"
    return buckets


class _Job:
    """A collective handed to a :class:`_CommThread`; ``synchronize`` waits for it."""

    def __init__(self, fn: Callable[[], object], timeout: float) -> None:
        self.fn, self.timeout = fn, timeout
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: object = None  # what ``fn`` returned

    def synchronize(self) -> None:
        # the collective has its own timeout; this bound only keeps a wait from hanging
        if not self.done.wait(2 * self.timeout + 1.0):
            raise CommTimeout(f"a gradient bucket's collective did not end in {self.timeout:g} s")
        if self.error is not None:
            raise self.error


class _CommThread:
    """One rank's bucket collectives, called in order from a daemon thread, so that the
    rank's own thread never blocks in a call: a collective returns only once every rank
    has called it (in one process, the last to arrive runs it for all), and a rank that
    is ahead keeps computing its backward pass meanwhile. The rank's own thread calls no
    collective while a job is pending (it waits for every bucket first), so the comm
    still sees one caller at a time. A call on a stream is ordered after an event the rank
    thread recorded on its own stream when the bucket was ready (see
    :meth:`BucketSync._start`), never after whatever that stream holds when the helper
    issues it."""

    def __init__(self, name: str, device: Device | None) -> None:
        self._device = device
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], timeout: float) -> _Job:
        job = _Job(fn, timeout)
        self._q.put(job)
        return job

    def close(self) -> None:
        self._q.put(None)

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if self._device is None:
                    job.result = job.fn()
                else:
                    with self._device.activate():
                        job.result = job.fn()
            except BaseException as exc:  # noqa: BLE001 - raised in the rank's thread
                job.error = exc
            job.done.set()
            del job


@dataclass
class _BucketCall:
    buf: Array
    stream: Stream | None


class _Board:
    """The bucket collectives of the ranks of one process's World, each run by the last
    rank to complete the bucket, for every rank at once (a driver-side call, in that
    rank's own thread): a rank that completes a bucket early never blocks, it keeps
    computing its backward pass, and no other thread has to be woken (on a machine
    whose cores all run backward, a woken thread waits milliseconds for a core).
    ``root`` None: ``all_reduce(op="mean")``; else a ``reduce`` to ``root``. The ranks
    meet at a :class:`~nccltree.comm.rendezvous.Rendezvous`, a channel per bucket."""

    def __init__(self, world: World, nbuckets: int, root: int | None, timeout: float) -> None:
        self.world, self.root, self.timeout = world, root, timeout
        self.nbuckets = nbuckets
        from .comm.rendezvous import Rendezvous

        self.meet: Rendezvous[_BucketCall, Work] = Rendezvous(world.size, nbuckets)
        self.error: BaseException | None = None

    def _check(self, rank: int) -> None:
        if self.error is not None:
            raise PeerFailure(f"rank {rank}: a bucket's collective failed: {self.error}")

    def arrive(
        self, k: int, rank: int, buf: Array, stream: Stream | None
    ) -> Meeting[_BucketCall, Work]:
        """Rank ``rank`` completed bucket ``k`` (``buf``, ordered after ``stream``); the
        last to arrive runs its collective. Returns the meeting :meth:`wait` waits for."""
        call = _BucketCall(buf, stream)
        m, last = self.meet.arrive(rank, call, channel=k, check=lambda: self._check(rank))
        if not last:
            return m
        calls = [c for c in m.calls if c is not None]
        bufs, streams = [c.buf for c in calls], [c.stream for c in calls]
        # Every bucket but the last goes to the ranks' communication streams, which share
        # the work out over the ranks' workers while backward goes on (run here, it would
        # all fall on this rank, which the others then wait for); the last finds the others
        # waiting for it, and runs in this thread on every core when the streams are idle.
        last_bucket = k == self.nbuckets - 1
        world = self.world
        try:
            if self.root is None:
                work = world.all_reduce(bufs, op="mean", streams=streams, async_op=not last_bucket)
            else:
                work = world.reduce(bufs, root=self.root, streams=streams, async_op=not last_bucket)
        except BaseException as exc:
            self.abort(exc)
            raise
        self.meet.finish(m, None if last_bucket else cast("Work", work))
        return m

    def wait(self, m: Meeting[_BucketCall, Work], rank: int) -> None:
        """Until the bucket collective ``m`` ran; PeerFailure when the World failed
        meanwhile, MissingRanks naming the ranks that never completed the bucket after
        the timeout."""
        deadline = time.monotonic() + self.timeout

        def waiting() -> float:
            self._check(rank)
            if self.world.aborted:
                self.world._check_usable()  # raises PeerFailure naming the reason
            left = deadline - time.monotonic()
            if left <= 0:
                missing = self.meet.missing(m)
                raise MissingRanks(
                    f"rank {rank}: gradient bucket {m.channel} timed out after "
                    f"{self.timeout:g} s waiting for rank(s) {missing}",
                    missing,
                )
            return left

        # woken at once when the collective ran; the short slice only notices a failure
        # elsewhere (an aborted World)
        self.meet.wait(m, waiting, _BOARD_POLL_S)
        work = m.result
        if work is not None:
            work.wait()  # the host waits for it (on a GPU: the rank's stream does)

    def abort(self, exc: BaseException) -> None:
        with self.meet.lock:
            if self.error is None:
                self.error = exc
        self.meet.wake_all()


class _BoardWait:
    """``synchronize`` waits for one bucket's collective run through a :class:`_Board`."""

    def __init__(self, board: _Board, m: Meeting[_BucketCall, Work], rank: int) -> None:
        self.board, self.m, self.rank = board, m, rank

    def synchronize(self) -> None:
        self.board.wait(self.m, self.rank)


class BucketSync(Sync, GradientCallback):
    """Gradient buckets communicated during backward (PyTorch DDP's reducer): the
    ``buckets`` of ``params``' gradient, over ``comm``.

    ``on_gradient_ready(name)`` counts the bucket's parameters down; once the next bucket
    (in :func:`make_buckets` order) is complete, its collective starts asynchronously --
    ``all_reduce(op="mean")``, or with ``root`` a ``reduce`` to the root (which scales by
    ``1/N`` and alone updates, the parameters broadcast at the next ``on_start``, as
    :class:`RootSync`). Buckets start in the same order on every rank, whatever the
    model announces. ``on_gradients_ready`` starts any bucket not started yet and waits
    for all of them: no gradient is read before its collective ended.

    How a bucket's collective starts without blocking the rank: in one process (``board``,
    a :class:`_Board` shared by the ranks of a World) the last rank to complete a bucket
    runs it for every rank; over a process group each rank hands its calls to a helper
    thread (:class:`_CommThread`; ``timeout`` bounds the waits for it).

    ``wire`` (a float16 buffer the size of the gradient, or None): the gradient is cast
    into it before a bucket's collective and back after it (the float16 communication
    hook)."""

    def __init__(
        self,
        comm: Comm | GroupComm,
        params: FlatParams,
        buckets: Sequence[Bucket],
        *,
        root: int | None = None,
        wire: Array = None,
        timeout: float = 60.0,
        board: _Board | None = None,
    ) -> None:
        super().__init__(comm, params)
        self.buckets = list(buckets)
        self.root = root
        self.updates = root is None or comm.rank == root
        self.wire = wire
        self.timeout = timeout
        self._bucket_of = {name: i for i, b in enumerate(self.buckets) for name in b.names}
        self._pending = [len(b.names) for b in self.buckets]
        self._next = 0  # the first bucket not started in this iteration
        self._works: list[_Job | _BoardWait] = []
        self._thread: _CommThread | None = None
        self._board = board
        self._comm_stream: Stream | None = None  # the bucket collectives' own stream
        self._consumers: list[Stream | None] = []  # per helper job: the stream to order

    def begin(self) -> None:
        if self.root is None:
            self.comm.broadcast(self.params.data, root=0)

    def on_start(self) -> None:
        if self.root is not None:
            self.comm.broadcast(self.params.data, root=self.root)

    def on_gradient_ready(self, name: str) -> None:
        i = self._bucket_of[name]
        self._pending[i] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._start(self._next)

    def _start(self, i: int) -> None:
        self._next = i + 1
        b = self.buckets[i]
        buf = self.params.grad[b.start : b.stop]
        if self.wire is not None:
            wire = self.wire[b.start : b.stop]
            wire[...] = buf
            buf = wire
        comm, device = self.comm, self.params.device
        stream = None
        if device is not None:
            # on the host backend the calling thread is the order, unless it set a stream
            host = device.backend == "host"
            stream = device.explicit_current_stream() if host else device.current_stream()
        if self._board is not None:
            meeting = self._board.arrive(i, comm.rank, buf, stream)
            self._works.append(_BoardWait(self._board, meeting, comm.rank))
            return
        # On a stream (a GPU's, or a host stream the rank set), the bucket is ready at the
        # stream's current end: recorded here, on the thread that made it ready. The
        # collective goes on a communication stream that waits for that point only, so
        # backward's later kernels on the rank's stream never wait for it; the rank's
        # stream waits for the communication stream once, in on_gradients_ready (the
        # consumer of the gradient).
        ready = None
        side: Stream | None = None
        if stream is not None:
            assert device is not None
            ready = stream.record()
            if self._comm_stream is None:
                self._comm_stream = device.new_stream()
            side = self._comm_stream
        root = self.root

        def run() -> object:
            if side is None:
                if root is None:
                    return comm.all_reduce(buf, op="mean", stream=stream)
                return comm.reduce(buf, root=root, stream=stream)
            assert ready is not None
            side.wait_event(ready)
            if root is None:
                comm.all_reduce(buf, op="mean", stream=side)
            else:
                comm.reduce(buf, root=root, stream=side)
            return side.record()  # the end of the bucket's collective, for the consumer

        if self._thread is None:
            self._thread = _CommThread(f"nccltree-buckets-{comm.rank}", device)
        self._works.append(self._thread.submit(run, self.timeout))
        self._consumers.append(stream)

    def on_gradients_ready(self) -> None:
        while self._next < len(self.buckets):
            self._start(self._next)  # parameters the model did not announce
        works, self._works = self._works, []
        consumers, self._consumers = self._consumers, []
        self._next = 0
        self._pending = [len(b.names) for b in self.buckets]
        for work in works:
            work.synchronize()
        # the consumer (the update, on the rank's stream) after each bucket's collective
        jobs = [w for w in works if isinstance(w, _Job)]
        for job, consumer in zip(jobs, consumers, strict=True):
            if consumer is not None:  # then the job returned its end (an event)
                consumer.wait_event(cast("Event", job.result))
        if not self.updates:
            return
        if self.wire is not None:
            self.params.grad[...] = self.wire
        if self.root is not None:
            # each rank's loss is a mean over its batch: the sum of N means needs 1/N
            device = self.params.device
            assert device is not None, "DataParallel's parameters live on a device"
            device.scale(self.params.grad, 1.0 / self.comm.size)

    def finish(self) -> None:
        if self.root is not None:
            self.comm.broadcast(self.params.data, root=self.root)

    def close(self) -> None:
        """Stop the helper thread, if any (at the end of a ``fit``)."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None


# -- the driver ----------------------------------------------------------------------------


class _Stopped(Exception):
    """Raised inside a rank thread when the run was asked to stop."""


class _Run:
    """One ``fit`` call: what it was asked to do, and the state its rank threads share."""

    def __init__(
        self,
        data: BatchSource,
        iters: int,
        on_step: Callable[[StepInfo], None] | None,
        result: FitResult,
        size: int,
    ) -> None:
        self.data, self.iters, self.on_step, self.result = data, iters, on_step, result
        self.t_start = time.perf_counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[tuple[int, BaseException]] = []
        # Two slots per rank: a rank can run at most one iteration ahead of the root
        # (the next collective needs the root), so slot it % 2 is stable while read.
        self.losses = [[0.0, 0.0] for _ in range(size)]
        # the last iteration whose loss each rank stored: with gradient buckets the
        # ranks meet inside the backward pass, before a rank's loss_and_grad returns, so
        # the root waits for the others' loss of its iteration (bounded) before reading
        self.loss_iter = [-1] * size
        self.loss_posted = threading.Condition()
        self.alive = size
        self.done = threading.Condition(self.lock)
        self.agreed_stop = False  # over a process group: every rank saw a stop flag
        self.board: _Board | None = None  # the gradient buckets' collectives in one process

    def post_loss(self, rank: int, it: int, loss: float) -> None:
        with self.loss_posted:
            self.losses[rank][it % 2] = loss
            self.loss_iter[rank] = it
            self.loss_posted.notify_all()

    def losses_of(self, it: int, timeout: float) -> list[float]:
        """Every rank's loss of iteration ``it``, once stored (at most ``timeout`` s: a
        rank that failed meanwhile ends the run anyway)."""
        with self.loss_posted:
            self.loss_posted.wait_for(
                lambda: self.stop.is_set() or min(self.loss_iter) >= it, timeout
            )
            return [per_rank[it % 2] for per_rank in self.losses]


class DataParallel:
    """Data-parallel SGD over ``devices`` (a list from :func:`nccltree.devices` or a spec).

    ``model`` is a :class:`~nccltree.models.Model`, or any model that follows the
    protocol :class:`~nccltree.models.TrainableModel` (parameters as one flat buffer, a
    gradient callback); keyword arguments not listed below
    (``sgd``) go
    to every rank's :class:`~nccltree.solver.SGD` (``lr``, ``momentum``, ``weight_decay``,
    ``lr_policy`` and its parameters). ``algorithm`` picks the collective algorithm
    (``tree``, ``ring``, ``direct``, ``nccl``, ``auto``), ``update_mode`` is
    ``allreduce`` or ``root``; ``comm=False`` turns communication off (each rank steps on
    its own gradient -- a control for measuring the cost of communication). ``seed``
    seeds the model's initial parameters (the same on every rank); ``timeout`` bounds
    every wait of the collectives (seconds). ``blas_threads``
    limits BLAS threads during :meth:`fit` (None: ``max(1, cores // ranks)``; needs the
    ``threadpoolctl`` package, otherwise BLAS is left alone).

    ``bucket_bytes`` (default :data:`DEFAULT_BUCKET_BYTES`) cuts the gradient into buckets
    of about that many bytes, communicated during the backward pass, each as soon as the
    backward pass has written it (:class:`BucketSync`); 0 communicates the whole buffer
    with one collective after backward. With the ``tree`` and ``direct`` algorithms the
    trained parameters are bitwise those of ``bucket_bytes=0`` for every bucket size (each
    element's summation order does not depend on how the buffer is sliced); with ``ring``
    they agree within floating-point rounding. ``comm_hook="float16"`` communicates the
    gradients as float16 and updates in the parameters' dtype (half the bytes; each
    gradient rounded to float16 once before and once after the collective).

    ``grad_hook(rank, iteration, params)`` runs on every rank after the backward pass and
    before the wait for the gradients' communication (tests inject faults with it).

    ``iter_size`` (Caffe's ``iter_size``, gradient accumulation): each iteration, every
    rank runs forward and backward over its next ``iter_size`` batches and the solver
    applies the mean of their gradients (communicated once, after the last pass); the
    reported loss is the mean of the passes' losses. ``iter_size`` k with batch b is the
    computation of batch k*b up to floating-point summation order. ``clip_gradients``
    keeps Caffe's meaning (the norm of the passes' summed gradient).

    ``group`` (a :class:`~nccltree.comm.group.ProcessGroup`) trains over several
    processes: ``devices`` are this process's ranks' (``group.devices``), the collectives
    are the group's (its algorithm; ``algorithm`` is ignored), the data source serves this
    process's ranks only, and ``on_step`` runs in the process of global rank 0. A
    :meth:`stop` in any process ends the run after the same iteration on every rank (the
    ranks agree through a small all-gather each iteration); run every process's ``fit``
    with the same ``iters``.

    Every rank's solver checks that its loss and the gradient it applies are finite (see
    :class:`~nccltree.solver.SGD`'s ``check_finite``, which may be passed here): a
    diverging run ends with a :class:`RankFailure` whose cause is :class:`Diverged`, raised
    before the update, so the root still holds the last good state.
    """

    def __init__(
        self,
        model: TrainableModel,
        devices: Sequence[Device] | str,
        *,
        algorithm: str = "tree",
        update_mode: str = "allreduce",
        comm: bool = True,
        seed: int = 0,
        dtype: DTypeLike = np.float32,
        timeout: float = 60.0,
        blas_threads: int | None = None,
        grad_hook: Callable[[int, int, FlatParams], None] | None = None,
        group: ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        comm_hook: str | None = None,
        iter_size: int = 1,
        **sgd: Any,
    ) -> None:
        from .backends import devices as make_devices
        from .comm import ALGORITHM_CHOICES

        if not isinstance(model, TrainableModel):
            raise TypeError(
                f"model must follow the model protocol (make_params, init, loss_and_grad: "
                f"nccltree.models.TrainableModel), got {type(model).__name__}"
            )
        self._owns_devices = isinstance(devices, str)  # then close() shuts them down
        if isinstance(devices, str):
            devices = make_devices(devices)
        devices = list(devices)
        if not devices:
            raise ValueError("DataParallel needs at least one device")
        if update_mode not in UPDATE_MODES:
            raise ValueError(
                f"update_mode must be one of {', '.join(UPDATE_MODES)}; got {update_mode!r}"
            )
        if group is None and algorithm not in ALGORITHM_CHOICES:
            # over a group the group's algorithm is used (``mpi`` among them)
            raise ValueError(
                f"algorithm must be one of {', '.join(ALGORITHM_CHOICES)}; got {algorithm!r}"
            )
        if blas_threads is not None:
            blas_threads = check_int(blas_threads, "blas_threads", min=1)
        if grad_hook is not None and not callable(grad_hook):
            raise TypeError("grad_hook must be callable(rank, iteration, params)")
        bucket_bytes = check_int(bucket_bytes, "bucket_bytes", min=0)
        self.iter_size = check_int(iter_size, "iter_size", min=1)
        clip = sgd.get("clip_gradients")
        if clip is not None and self.iter_size > 1:
            # Caffe clips the sum of the iter_size passes' gradients; the solver here sees
            # their mean: the same rule with the threshold divided by iter_size
            sgd["clip_gradients"] = check_real(clip, "clip_gradients", min=0.0) / self.iter_size
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise ValueError(
                f"comm_hook must be None or one of {', '.join(COMM_HOOKS)}; got {comm_hook!r}"
            )
        if group is not None:
            if len(devices) != len(group.ranks):
                raise ValueError(
                    f"the process group holds {len(group.ranks)} ranks in this process, "
                    f"but {len(devices)} devices were given: pass group.devices"
                )
            if not comm:
                raise ValueError("comm=False (no communication) is not supported over a group")
            algorithm = group.algorithm
        self.model = model
        self.devices = devices
        self.group = group
        self.local_size = len(devices)  # ranks in this process
        self.size = group.size if group is not None else len(devices)  # over all processes
        self.is_root = group is None or group.rank == 0  # holds global rank 0
        self.algorithm = algorithm
        self.update_mode = update_mode
        self.comm_enabled = bool(comm)
        self.seed = check_int(seed, "seed", min=0)
        # a bound, not None: fit waits for the ranks with it
        self.timeout = check_real(timeout, "timeout", min=0.0, min_open=True)
        self.blas_threads = blas_threads
        self.grad_hook = grad_hook
        self.bucket_bytes = bucket_bytes
        self.comm_hook = comm_hook
        self.params = [model.make_params(dtype=dtype, device=d) for d in devices]
        self.buckets = make_buckets(self.params[0], bucket_bytes)
        if group is not None:
            # the gradients in the group's symmetric memory: the node's other processes read
            # them in place, no staging through the group's mirrors (every process makes the
            # same allocations in the same order: one per rank it holds)
            # one allocation per process (so processes holding different numbers of ranks
            # still make the same calls), a 256-byte-aligned slice per rank
            first = self.params[0]
            stride = align_bytes(first.size * first.dtype.itemsize) // first.dtype.itemsize
            sym = group.empty(stride * len(self.params), first.dtype)
            for i, p in enumerate(self.params):
                p.place_grad(sym[i * stride : i * stride + p.size])
        # the float16 hook's wire buffers, symmetric over a group as the gradients are
        self._wires: list[Array] = [None] * len(devices)
        if comm_hook == "float16":
            size = self.params[0].size
            if group is not None:
                stride = align_bytes(size * 2) // 2  # aligned slices of float16
                wires = group.empty(stride * len(devices), np.float16)
                self._wires = [wires[i * stride : i * stride + size] for i in range(len(devices))]
            else:
                self._wires = [d.zeros((size,), np.float16) for d in devices]
        self.solvers = [SGD(p, **sgd) for p in self.params]
        # iter_size > 1: each rank's sum of its passes' gradients
        self._accumulators: list[Array] = (
            [p.xp.zeros(p.size, p.dtype) for p in self.params] if self.iter_size > 1 else []
        )
        # Only rank 0 initialises; the first broadcast of fit makes the replicas equal.
        model.init(self.params[0], seed=seed)
        self.position: int | None = None  # data position of the next iteration, if known
        self.last_snapshot: str | None = None
        self._world: World | None = None
        self._run: _Run | None = None
        self._busy_ranks = 0  # rank threads of the last fit that had not stopped
        self._restored = False

    # -- properties and state -------------------------------------------------------------
    @property
    def iter(self) -> int:
        """Iterations completed (the root solver's iteration counter)."""
        return self.solvers[0].iter

    @property
    def idle(self) -> bool:
        """No rank thread runs, so the root's state may be read or snapshotted (false only
        after an interrupted ``fit`` whose ranks did not stop within the timeout)."""
        return self._run is None and self._busy_ranks == 0

    @property
    def root_updates(self) -> bool:
        """Whether the root alone updates (``update_mode="root"`` with communication on)."""
        return self.update_mode == "root" and self.comm_enabled

    def world(self) -> World:
        """The World the ranks communicate through (created on first use)."""
        # a World aborted by a failed rank or closed by stop() is closed for good
        if self._world is None or self._world.aborted:
            from .comm import World

            self._world = World(self.devices, algorithm=self.algorithm, timeout=self.timeout)
        return self._world

    def state_dict(self) -> dict[str, np.ndarray]:
        """The root's parameters, by name, as host arrays."""
        return self.params[0].state_dict()

    def snapshot(
        self, path: str | os.PathLike[str], config: Mapping[str, Any] | None = None
    ) -> None:
        """Save the root's state (parameters, solver, data position) to ``path``, with
        ``config`` (JSON-able, e.g. the command line) beside it.

        Call it between iterations: from ``fit``'s ``on_step`` (the root's thread) or when
        no ``fit`` is running.
        """
        save_snapshot(
            path, self.params[0].state_dict(), self.solvers[0].state_dict(), self.position, config
        )
        self.last_snapshot = os.fspath(path)

    def restore(self, snap: Snapshot | str | os.PathLike[str]) -> Snapshot:
        """Load a snapshot (or a path to one) into every rank; returns it.

        The next ``fit`` continues at ``snap.iter``; create its reader with
        ``start=snap.position`` so the data continue where they stopped.
        """
        if not isinstance(snap, Snapshot):
            snap = load_snapshot(snap)
        self.params[0].load(snap.params)  # checks names and shapes before writing
        state = snap.solver_state()
        for p, s in zip(self.params[1:], self.solvers[1:], strict=True):
            p.copy_from(self.params[0])
            s.load_state_dict(state)
        self.solvers[0].load_state_dict(state)
        self.position = snap.position
        self._restored = snap.position is not None  # the next fit checks its reader's start
        return snap

    def stop(self) -> None:
        """Ask a running ``fit`` to stop (thread-safe): ranks stop at their next
        iteration boundary and ranks waiting in a collective are released at once."""
        run = self._run
        if run is None or run.stop.is_set():
            return
        run.stop.set()
        if self.group is not None:
            return  # the ranks agree on the iteration to stop after (see _agree)
        world, self._world = self._world, None  # the next fit makes a fresh one
        if world is not None:
            world.abort("the run was stopped")  # wakes every rank waiting in a collective
            world.close()

    def close(self) -> None:
        """Release the World (streams, communicators), and the devices if they were
        made from a spec string."""
        if self._world is not None:
            self._world.close()
            self._world = None
        if self._owns_devices:
            self.devices[0].runtime.shutdown()
            self._owns_devices = False

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- training -------------------------------------------------------------------------
    def fit(
        self,
        data: BatchSource,
        iters: int,
        *,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> FitResult:
        """Train until the solvers have done ``iters`` iterations in all (Caffe's
        ``max_iter``: a restored driver continues from its snapshot's iteration).

        ``data`` is a :class:`~nccltree.data.BatchSource` serving every rank (a
        :class:`~nccltree.data.DataReader` with ``ranks=size``, or a
        :class:`~nccltree.data.MemorySource`). ``on_step(info)`` runs in the root's thread
        after every iteration (progress, evaluation, snapshots).

        A rank that raises ends the run: every rank stops and :class:`RankFailure` names
        the rank, with its error as the cause. Ctrl-C stops every rank promptly and
        re-raises ``KeyboardInterrupt``; :meth:`stop` ends the run early with
        ``FitResult.stopped`` set.
        """
        iters = check_int(iters, "iters", min=0)
        if not isinstance(data, BatchSource):
            raise TypeError(
                "data must be a BatchSource (ranks, start, round_size, next_batch), "
                f"got {type(data).__name__}"
            )
        if data.ranks != self.local_size:
            raise ValueError(
                f"the data serve {data.ranks} ranks, the driver has {self.local_size} devices"
            )
        start = data.start
        if self._restored and start is not None and start != self.position:
            raise ValueError(
                f"the data start at position {start}, but the restored state continues at "
                f"{self.position}: create the reader with start={self.position}"
            )
        self._restored = False
        if self.position is None and start is not None:
            self.position = int(start)
        result = FitResult(
            start_iter=self.iter,
            iter=self.iter,
            position=self.position,
            rank_comm_s=[0.0] * self.local_size,
            rank_step_s=[0.0] * self.local_size,
            rank_exposed_s=[0.0] * self.local_size,
        )
        if iters <= self.iter:
            return result
        if not self.comm_enabled:
            # no communication: every replica starts from the root's initial parameters
            for p in self.params[1:]:
                p.copy_from(self.params[0])
        world = None
        if self.group is None and (self.comm_enabled or self.size > 1):
            world = self.world()
        run = self._run = _Run(data, iters, on_step, result, self.local_size)
        if world is not None and self.comm_enabled and self._bucketed:
            root = 0 if self.update_mode == "root" else None
            run.board = _Board(world, len(self.buckets), root, self.timeout)
        try:
            with _blas_limit(self._blas_threads()):
                self._launch(world, run)
        except KeyboardInterrupt:
            self.stop()
            with run.done:
                run.done.wait_for(lambda: run.alive == 0, timeout=self.timeout)
            raise
        finally:
            with run.lock:
                self._busy_ranks = run.alive
            self._run = None
            result.elapsed_s = time.perf_counter() - run.t_start
            result.iter = self.iter
            result.position = self.position
        return result

    def _blas_threads(self) -> int:
        if self.blas_threads is not None:
            return self.blas_threads
        if self.group is not None:  # the ranks of every process of this node
            return max(1, (os.cpu_count() or 1) // self.group.local_size)
        return max(1, (os.cpu_count() or 1) // self.size)

    def _global_rank(self, index: int) -> int:
        """The global rank of this process's ``index``-th rank."""
        return self.group.ranks[index] if self.group is not None else index

    def _launch(self, world: World | None, run: _Run) -> None:
        """Run every rank's loop in its own thread (one thread without a World) and turn
        the first rank's error into :class:`RankFailure`."""

        def body(rank: int, comm: Comm | GroupComm | None) -> None:
            try:
                with self.devices[rank].activate():
                    self._rank_loop(rank, comm, run)
            except _Stopped:
                pass
            except BaseException as exc:
                if run.stop.is_set() and not isinstance(exc, KeyboardInterrupt):
                    return  # a consequence of stop(): released from a collective
                if not isinstance(exc, PeerFailure):
                    with run.lock:
                        run.errors.append((rank, exc))
                    if run.board is not None:  # wake the ranks waiting for their buckets
                        run.board.abort(PeerFailure(f"rank {rank} failed: {exc!r}"))
                raise
            finally:
                with run.done:
                    run.alive -= 1
                    run.done.notify_all()

        try:
            if self.group is not None:
                self.group.run(lambda comm: body(comm.index, comm))
            elif world is not None:
                world.run(lambda comm: body(comm.rank, comm))
            else:
                body(0, None)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            if run.errors:
                rank, err = run.errors[0]
                failure = RankFailure(self._global_rank(rank), self.size, err)
                if self.group is not None:
                    # the other processes' ranks wait in a collective for this one: they
                    # learn now which rank failed, rather than after the timeout
                    self.group.abort(str(failure))
                raise failure from err
            if isinstance(exc, MissingRanks):  # a rank stuck in its own code: blame it
                raise RankFailure(exc.ranks[0], self.size, exc) from exc
            raise
        if run.errors:  # an error swallowed on the way (cannot happen with world.run)
            rank, err = run.errors[0]
            raise RankFailure(self._global_rank(rank), self.size, err) from err
        run.result.stopped = run.agreed_stop if self.group is not None else run.stop.is_set()

    @property
    def _bucketed(self) -> bool:
        # one rank has nothing to overlap: its collective copies nothing (the hook still
        # rounds its gradient as it would travel)
        return (bool(self.bucket_bytes) and self.size > 1) or self.comm_hook is not None

    def _make_sync(self, comm: Comm | GroupComm | None, rank: int, run: _Run) -> Sync | None:
        """The rank's sync callback for the update mode; None without communication."""
        if not self.comm_enabled:
            return None
        assert comm is not None, "communication is on: every rank has a Comm"
        params = self.params[rank]
        root = 0 if self.update_mode == "root" else None
        if self._bucketed:
            return BucketSync(
                comm,
                params,
                self.buckets,
                root=root,
                wire=self._wires[rank],
                timeout=self.timeout,
                board=run.board,
            )
        if root is not None:
            return RootSync(comm, params)
        return AllReduceSync(comm, params)

    def _rank_loop(self, rank: int, comm: Comm | GroupComm | None, run: _Run) -> None:
        """One rank's training: register the sync callback with the rank's solver, then
        run the solver's iterations until ``run.iters``."""
        solver = self.solvers[rank]
        sync = self._make_sync(comm, rank, run)
        if self.group is not None:
            assert comm is not None and sync is not None, "a group always communicates"
            sync.begin()
            solver.add_callback(sync)
            try:
                while solver.iter < run.iters:
                    self._iteration(rank, run, update=sync.updates, comm=cast("GroupComm", comm))
                    if run.agreed_stop:
                        raise _Stopped
            finally:
                solver.remove_callback(sync)
                sync.close()
            sync.finish()
            return
        if sync is None:
            while solver.iter < run.iters:
                self._iteration(rank, run, update=True)
            return
        sync.begin()
        solver.add_callback(sync)
        try:
            while solver.iter < run.iters:
                self._iteration(rank, run, update=sync.updates)
        finally:
            solver.remove_callback(sync)
            sync.close()
        sync.finish()

    def _iteration(
        self, rank: int, run: _Run, *, update: bool, comm: GroupComm | None = None
    ) -> None:
        """One iteration of one rank (``solver.iteration`` over its next batch); the root
        then records it and calls ``on_step``. Over a group (``comm`` given), every rank
        then all-gathers its loss and stop flag (:meth:`_agree`)."""
        if comm is None and run.stop.is_set():
            raise _Stopped
        params, solver = self.params[rank], self.solvers[rank]
        it, comm_before, exposed_before = solver.iter, solver.callback_s, solver.gradients_ready_s
        ready = solver.gradient_ready if solver.takes_gradients else None
        k = self.iter_size
        t0 = time.perf_counter()
        stop = comm is None  # over a group the ranks stop where they agree to
        first = _next_batch(run.data, rank, run, stoppable=stop)
        lr = solver.learning_rate()
        n_local, batch_pos = 0, None

        def one_pass(batch: RankBatch) -> float:
            """Forward and backward over one of the rank's batches."""
            nonlocal n_local, batch_pos
            with batch:
                x, y = batch
                n_local, batch_pos = n_local + len(y), batch.position
                if ready is None or k > 1:
                    loss = self.model.loss_and_grad(params, x, y)
                else:
                    loss = self.model.loss_and_grad(params, x, y, ready=ready)
                batch.release()  # the reader may refill the buffer during communication
            return loss

        def gradients() -> float:
            if k == 1:
                loss = one_pass(first)
            else:
                # Caffe's Solver::Step: iter_size forward/backward passes accumulate
                # their gradients; their mean is communicated and applied once
                acc = self._accumulators[rank]
                losses = []
                for j in range(k):
                    batch = first if j == 0 else _next_batch(run.data, rank, run, stoppable=stop)
                    losses.append(one_pass(batch))
                    if j == 0:
                        acc[...] = params.grad
                    else:
                        acc += params.grad
                params.grad[...] = acc
                params.grad *= params.grad.dtype.type(1.0 / k)
                loss = math.fsum(losses) / k
                if ready is not None:  # every gradient is final now, in backward order
                    order = getattr(self.model, "gradient_order", None)
                    for name in order() if order is not None else reversed(list(params.views)):
                        ready(name)
            run.post_loss(rank, it, loss)
            if self.grad_hook is not None:
                self.grad_hook(rank, it, params)
            return loss

        with first:
            loss = solver.iteration(gradients, update=update)
        step_s = time.perf_counter() - t0
        comm_s = solver.callback_s - comm_before
        exposed_s = solver.gradients_ready_s - exposed_before
        result = run.result
        result.rank_comm_s[rank] += comm_s
        result.rank_step_s[rank] += step_s
        result.rank_exposed_s[rank] += exposed_s
        losses = self._agree(comm, loss, run) if comm is not None else None
        if rank != 0:
            return
        round_size = run.data.round_size * self.iter_size
        if losses is not None:
            mean_loss = math.fsum(losses) / self.size
            examples = round_size
        elif self.comm_enabled:
            mean_loss = math.fsum(run.losses_of(it, self.timeout)) / self.size
            examples = round_size
        else:
            mean_loss, examples = loss, n_local * self.size
        if batch_pos is not None:  # after the last of the iteration's batches
            self.position = batch_pos + run.data.round_size
        result.losses.append(mean_loss)
        result.step_times.append(step_s)
        result.comm_times.append(comm_s)
        result.exposed_times.append(exposed_s)
        result.examples += examples
        if run.on_step is not None and self.is_root:
            run.on_step(
                StepInfo(
                    solver.iter,
                    mean_loss,
                    lr,
                    examples,
                    step_s,
                    comm_s,
                    time.perf_counter() - run.t_start,
                    self.position,
                    params,
                    exposed_s,
                )
            )

    def _agree(self, comm: GroupComm, loss: float, run: _Run) -> list[float]:
        """Over a process group: all-gather every rank's ``(loss, stop flag)``; returns the
        losses in global rank order, and sets ``run.agreed_stop`` when any rank's process
        was asked to stop, so that every rank stops after this same iteration."""
        dev = self.devices[comm.index]
        mine = dev.from_host(np.array([loss, 1.0 if run.stop.is_set() else 0.0], np.float64))
        out = dev.from_host(np.empty(2 * self.size, dtype=np.float64))  # on a GPU group: CuPy
        comm.all_gather(mine, out)
        every = out if isinstance(out, np.ndarray) else dev.to_host(out)
        if every[1::2].any():
            run.agreed_stop = True
        return [float(v) for v in every[0::2]]


def _next_batch(data: BatchSource, rank: int, run: _Run, *, stoppable: bool = True) -> RankBatch:
    """The rank's next batch, looking at the stop flag while it waits (unless the ranks
    stop only where they agree to, over a process group)."""
    while True:
        try:
            return data.next_batch(rank, timeout=_DATA_POLL_S)
        except TimeoutError:
            if stoppable and run.stop.is_set():
                raise _Stopped from None


class _blas_limit:
    """Limit BLAS threads with threadpoolctl when it is installed (else do nothing)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._ctl: Any = None

    def __enter__(self) -> _blas_limit:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return self
        self._ctl = threadpool_limits(limits=self.threads, user_api="blas")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctl is not None:
            self._ctl.restore_original_limits()
