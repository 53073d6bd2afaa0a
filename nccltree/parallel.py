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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import DTypeLike

from ._errors import MissingRanks, NcclTreeError, PeerFailure
from ._validate import check_int, check_real
from .data.source import BatchSource, RankBatch
from .models import Model
from .params import FlatParams
from .snapshot import SNAPSHOT_FORMAT, Snapshot, load_snapshot, save_snapshot
from .solver import SGD, Callback, Diverged

if TYPE_CHECKING:
    from .backends.base import Device
    from .comm import Comm, World
    from .comm.group import ProcessGroup
    from .comm.group.local import GroupComm

__all__ = [
    "SCALING_MODES",
    "SNAPSHOT_FORMAT",
    "UPDATE_MODES",
    "AllReduceSync",
    "BatchSource",
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
    "per_rank_batch",
    "save_snapshot",
]

UPDATE_MODES = ("allreduce", "root")
SCALING_MODES = ("weak", "strong")

# How often a rank waiting for data looks at the stop flag (seconds).
_DATA_POLL_S = 0.5


class RankFailure(NcclTreeError):
    """A rank's error ended the run; ``rank`` names it and ``__cause__`` is the error."""

    def __init__(self, rank: int, size: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} of {size} failed: {type(error).__name__}: {error}")
        self.rank = rank
        self.size = size
        self.error = error


def per_rank_batch(batch_size: int, ranks: int, scaling: str = "weak") -> int:
    """The batch each rank computes: ``batch_size`` (weak) or ``batch_size / ranks``
    (strong; ValueError when it does not divide evenly)."""
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
    """What the root sees after each iteration (passed to ``fit``'s ``on_step``)."""

    iter: int  # iterations completed (the solver's iter)
    loss: float  # mean training loss over all ranks' batches (root's own without comm)
    lr: float  # the learning rate this iteration used
    examples: int  # examples in this iteration, over all ranks
    step_s: float  # wall time of this iteration on the root
    comm_s: float  # of which inside the sync callback (its collectives)
    elapsed_s: float  # since fit started
    position: int | None  # data position where the next iteration starts
    params: FlatParams  # the root's parameters (read-only use, in the root's thread)


@dataclass
class FitResult:
    """Summary of a ``fit`` call; per-iteration lists are the root's."""

    start_iter: int
    iter: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    comm_times: list[float] = field(default_factory=list)
    examples: int = 0
    elapsed_s: float = 0.0
    position: int | None = None
    stopped: bool = False
    rank_comm_s: list[float] = field(default_factory=list)
    rank_step_s: list[float] = field(default_factory=list)

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def comm_fraction(self) -> float:
        """Time inside the sync callbacks (collectives) over step time, all ranks."""
        total = sum(self.rank_step_s)
        return sum(self.rank_comm_s) / total if total > 0 else 0.0


# -- evaluation --------------------------------------------------------------------------


def evaluate(
    model: Model, params: FlatParams, x: np.ndarray, y: np.ndarray, batch_size: int = 1024
) -> tuple[float, float]:
    """``(accuracy, mean loss)`` of ``model`` with ``params`` on the arrays ``x``, ``y``."""
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
    """A solver callback that keeps one rank's replica in step with the others through
    ``comm``. The driver registers one with each rank's solver for a ``fit``, calls
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


class AllReduceSync(Sync):
    """``on_gradients_ready``: average the flat gradient buffer over all ranks. The
    replicas are made equal once, at :meth:`begin`; equal updates keep them so."""

    def begin(self) -> None:
        self.comm.broadcast(self.params.data, root=0)

    def on_gradients_ready(self) -> None:
        self.comm.all_reduce(self.params.grad, op="mean")


class RootSync(Sync):
    """Caffe's P2PSync: gradients summed at the root, which alone updates; the root's
    parameters are broadcast at the start of the next iteration, and at :meth:`finish`."""

    def __init__(self, comm: Comm | GroupComm, params: FlatParams, root: int = 0) -> None:
        super().__init__(comm, params)
        self.root = root
        self.updates = comm.rank == root

    def on_start(self) -> None:
        self.comm.broadcast(self.params.data, root=self.root)

    def on_gradients_ready(self) -> None:
        self.comm.reduce(self.params.grad, root=self.root)
        if self.comm.rank == self.root:
            # each rank's loss is a mean over its batch: the sum of N means needs 1/N
            device = self.params.device
            assert device is not None, "DataParallel's parameters live on a device"
            device.scale(self.params.grad, 1.0 / self.comm.size)

    def finish(self) -> None:
        # the last update lives on the root only: share it so every replica ends equal
        self.comm.broadcast(self.params.data, root=self.root)


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
        self.alive = size
        self.done = threading.Condition(self.lock)
        self.agreed_stop = False  # over a process group: every rank saw a stop flag


class DataParallel:
    """Data-parallel SGD over ``devices`` (a list from :func:`nccltree.devices` or a spec).

    ``model`` is a :class:`~nccltree.models.Model`; keyword arguments not listed below go
    to every rank's :class:`~nccltree.solver.SGD` (``lr``, ``momentum``, ``weight_decay``,
    ``lr_policy`` and its parameters). ``algorithm`` picks the collective algorithm
    (``tree``, ``ring``, ``direct``, ``nccl``, ``auto``), ``update_mode`` is
    ``allreduce`` or ``root``; ``comm=False`` turns communication off (each rank steps on
    its own gradient -- a control for measuring the cost of communication). ``blas_threads``
    limits BLAS threads during :meth:`fit` (None: ``max(1, cores // ranks)``; needs the
    ``threadpoolctl`` package, otherwise BLAS is left alone).

    ``grad_hook(rank, iteration, params)`` runs on every rank after the backward pass and
    before communication (tests inject faults with it).

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
        model: Model,
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
        **sgd: Any,
    ) -> None:
        from .backends import devices as make_devices
        from .comm import ALGORITHM_CHOICES

        if not isinstance(model, Model):
            raise TypeError(f"model must be an nccltree Model, got {type(model).__name__}")
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
        if algorithm not in ALGORITHM_CHOICES:
            raise ValueError(
                f"algorithm must be one of {', '.join(ALGORITHM_CHOICES)}; got {algorithm!r}"
            )
        if blas_threads is not None:
            blas_threads = check_int(blas_threads, "blas_threads", min=1)
        if grad_hook is not None and not callable(grad_hook):
            raise TypeError("grad_hook must be callable(rank, iteration, params)")
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
        self.params = [model.make_params(dtype=dtype, device=d) for d in devices]
        if group is not None:
            # the gradients in the group's symmetric memory: the node's other processes read
            # them in place, no staging through the group's mirrors (every process makes the
            # same allocations in the same order: one per rank it holds)
            # one allocation per process (so processes holding different numbers of ranks
            # still make the same calls), a 256-byte-aligned slice per rank
            first = self.params[0]
            stride = -(-first.size * first.dtype.itemsize // 256) * 256 // first.dtype.itemsize
            sym = group.empty(stride * len(self.params), first.dtype)
            for i, p in enumerate(self.params):
                p.place_grad(sym[i * stride : i * stride + p.size])
        self.solvers = [SGD(p, **sgd) for p in self.params]
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
        """Save the root's state (parameters, solver, data position) to ``path``.

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
                raise RankFailure(self._global_rank(rank), self.size, err) from err
            if isinstance(exc, MissingRanks):  # a rank stuck in its own code: blame it
                raise RankFailure(exc.ranks[0], self.size, exc) from exc
            raise
        if run.errors:  # an error swallowed on the way (cannot happen with world.run)
            rank, err = run.errors[0]
            raise RankFailure(self._global_rank(rank), self.size, err) from err
        run.result.stopped = run.agreed_stop if self.group is not None else run.stop.is_set()

    def _make_sync(self, comm: Comm | GroupComm | None, params: FlatParams) -> Sync | None:
        """The rank's sync callback for the update mode; None without communication."""
        if not self.comm_enabled:
            return None
        assert comm is not None, "communication is on: every rank has a Comm"
        if self.update_mode == "root":
            return RootSync(comm, params)
        return AllReduceSync(comm, params)

    def _rank_loop(self, rank: int, comm: Comm | GroupComm | None, run: _Run) -> None:
        """One rank's training: register the sync callback with the rank's solver, then
        run the solver's iterations until ``run.iters``."""
        solver = self.solvers[rank]
        sync = self._make_sync(comm, self.params[rank])
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
        it, comm_before = solver.iter, solver.callback_s
        t0 = time.perf_counter()
        with _next_batch(run.data, rank, run, stoppable=comm is None) as batch:
            x, y = batch
            n_local, batch_pos = len(y), batch.position
            lr = solver.learning_rate()

            def gradients() -> float:
                loss = self.model.loss_and_grad(params, x, y)
                batch.release()  # the reader may refill the buffer during communication
                run.losses[rank][it % 2] = loss
                if self.grad_hook is not None:
                    self.grad_hook(rank, it, params)
                return loss

            loss = solver.iteration(gradients, update=update)
        step_s = time.perf_counter() - t0
        comm_s = solver.callback_s - comm_before
        result = run.result
        result.rank_comm_s[rank] += comm_s
        result.rank_step_s[rank] += step_s
        losses = self._agree(comm, loss, run) if comm is not None else None
        if rank != 0:
            return
        round_size = run.data.round_size
        if losses is not None:
            mean_loss = math.fsum(losses) / self.size
            examples = round_size
        elif self.comm_enabled:
            mean_loss = math.fsum(run.losses[k][it % 2] for k in range(self.size)) / self.size
            examples = round_size
        else:
            mean_loss, examples = loss, n_local * self.size
        if batch_pos is not None:
            self.position = batch_pos + round_size
        result.losses.append(mean_loss)
        result.step_times.append(step_s)
        result.comm_times.append(comm_s)
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
                )
            )

    def _agree(self, comm: GroupComm, loss: float, run: _Run) -> list[float]:
        """Over a process group: all-gather every rank's ``(loss, stop flag)``; returns the
        losses in global rank order, and sets ``run.agreed_stop`` when any rank's process
        was asked to stop, so that every rank stops after this same iteration."""
        mine = np.array([loss, 1.0 if run.stop.is_set() else 0.0], dtype=np.float64)
        every = np.empty(2 * self.size, dtype=np.float64)
        comm.all_gather(mine, every)
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
