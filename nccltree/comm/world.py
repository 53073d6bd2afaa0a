"""``World`` drives all ranks of one process; ``Comm`` is the per-rank face.

One controller, many streams: a driver-side call (``world.all_reduce([x0, x1, ...])``)
checks every rank's arguments together, builds (or reuses) the plan and enqueues each
rank's part on that rank's communication stream; the devices then work in parallel. A
per-rank call (``comm.all_reduce(x)`` from a thread per rank) is an adapter over the same
engine: ranks deposit their arguments at a rendezvous, and the last to arrive runs the
driver-side path for all of them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import DTypeLike

from .._errors import CommError, CommTimeout, NcclTreeError, PeerFailure
from .._native import ranges_overlap
from .._validate import check_call_timeout, check_choice, check_index, check_int
from ..backends.base import data_ptr
from . import auto, debug
from ._args import Array, Launched, Prepared, prepare
from .algorithms import ALGORITHMS, build_plan
from .collectives import COLLECTIVES, collective_name
from .comm import Comm, _Rendezvous
from .executor import Buffers, Program
from .faces import DriverCollectives
from .flight import FlightRecorder
from .lifecycle import LifeCycle
from .p2p import Mailbox
from .plan import (
    CHUNK_BYTES,
    GPU_CHUNK_MAX,
    IN,
    OUT,
    STAGE,
    TMP,
    Plan,
    chunk_elements,
    gpu_chunk_bytes,
)
from .rendezvous import run_ranks
from .trace import Span
from .work import Work

if TYPE_CHECKING:
    from ..backends.base import Device, Event, Stream
    from ..backends.host import HostDevice
    from ..topology import Topology
    from ..tree import Tree
    from .nccl import NcclEngine
    from .p2p import _Op
    from .watchdog import Watchdog

ALGORITHM_CHOICES = (*ALGORITHMS, "nccl", "auto")

# The plan cache keeps at most this many plans, and at most this many steps in all.
_PLAN_CACHE_PLANS = 256
_PLAN_CACHE_STEPS = 1 << 20


# Inline kernels run on ``inline_threads`` threads from these message sizes per rank, on
# their device's threads below (measured:
# docs/performance.md#inline-calls-on-the-host-backend). A driver-side call has one calling thread, whose OpenMP team serves every call:
# every core pays from a few hundred KiB. A call the ranks' threads make together is run
# by whichever arrives last, so each rank thread keeps a team of its own; the teams contend
# for the cores, and every core paid only from several MiB.
_INLINE_EVERY_CORE_FROM = {False: 512 << 10, True: 8 << 20}


class World(DriverCollectives):
    """All ranks of one process: ``World(devices, algorithm="tree", topology=None,
    timeout=60.0)``.

    ``devices`` is a list from :func:`nccltree.devices` or a spec string for it.
    ``algorithm`` is one of ``tree``, ``ring``, ``direct``, ``nccl``, ``auto``.
    ``timeout`` bounds every wait (seconds): a rank that stops arriving makes the others
    raise ``CommTimeout``; a rank that fails makes them raise ``PeerFailure``; either way
    the World is then closed for good. Argument errors leave it usable.

    ``chunk_bytes`` is the unit of pipelining: tree and ring cut messages into chunks,
    direct cuts each rank's slice. Given, it is one fixed size for every message. The
    default depends on the backend:

    * host: a fixed 16 MiB, since every stream operation is a hand-off between Python
      threads, so fewer, larger pieces win (measured: see
      docs/performance.md#chunk-size-on-the-host-backend);
    * GPUs: chunks by count, not by size (:func:`gpu_chunk_bytes`): each rank's largest
      buffer in ``GPU_CHUNKS`` (16) chunks of 256 KiB to 16 MiB. Every chunk is several
      steps issued from Python, so a fixed 1 MiB made a 256 MiB all_reduce over 8 ranks
      7,216 tree steps (milliseconds of host time where NCCL needs one or two), while a
      small message still needs several chunks to pipeline; NCCL itself pipelines finer
      (4 MiB per channel and peer in 8 slots, NCCL_BUFFSIZE), but inside one kernel, where
      a step costs no host time. Why these bounds: docs/architecture.md#collectives-nccltreecomm.

    ``chunk_for(nbytes)`` says which chunk a message gets; ``chunk_bytes`` is then the
    largest. The chunk never changes which values are summed in which order, so results
    are bitwise the same whatever it is. On the host backend synchronous calls of at most
    ``inline_bytes`` per rank (default None: any size) run in the calling thread, every
    step in turn, each kernel on ``inline_threads`` threads (default: the devices' threads
    together, at most the CPU count; from 512 KiB per rank, or 8 MiB when the ranks'
    threads make the call together): every rank's memory is the host's, so one caller
    giving each kernel all the cores reaches the memory bandwidth without a hand-off
    between threads (measured: docs/performance.md#inline-calls-on-the-host-backend).
    Calls with ``async_op=True`` or explicit streams go to the streams.

    Every collective takes ``dtype=``: None (the default) computes in the arrays' own
    dtype; ``"bfloat16"`` also takes ``uint16`` arrays holding bfloat16 bits, which is
    how CUDA arrays carry it (CuPy has no bfloat16): the reductions run the bfloat16
    kernels and NCCL gets ``ncclBfloat16``. On host devices a ``uint16`` numpy buffer
    named so reduces bitwise as the same bits in ``ml_dtypes.bfloat16`` arrays do. Every
    other ``dtype=`` must be the arrays' own (``TypeError`` otherwise).

    The collectives (one array per rank, declared in :mod:`nccltree.comm.faces`):
    ``all_reduce``, ``reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``,
    ``gather``, ``scatter``, ``all_to_all`` and ``shift`` (nccl-tests' ``sendrecv``, a ring
    shift), plus ``all_to_all_v`` and ``barrier``.
    """

    def __init__(
        self,
        devices: Sequence[Device] | str,
        algorithm: str = "tree",
        topology: Topology | None = None,
        timeout: float = 60.0,
        *,
        chunk_bytes: int | None = None,
        inline_bytes: int | None = None,
        inline_threads: int | None = None,
        max_scratch_bytes: int | None = None,
    ) -> None:
        if isinstance(devices, str):
            from ..backends import devices as make_devices

            devices = make_devices(devices)
        devices = list(devices)
        if not devices:
            raise ValueError("a World needs at least one device")
        from ..backends import check_ranks_fit

        # before the N x N link matrix and the per-rank streams are made
        check_ranks_fit(len(devices), f"a World of {len(devices)} ranks")
        if len({d.runtime if hasattr(d, "runtime") else d.backend for d in devices}) != 1:
            raise ValueError("all devices of a World must come from one devices() call")
        check_choice(algorithm, "algorithm", ALGORITHM_CHOICES)
        self.timeout = check_call_timeout(timeout)
        #: the most bytes of scratch and staging memory the World keeps between calls (all
        #: ranks together; None: no cap). A call that needs more gets buffers of its own,
        #: released when it is done
        self.max_scratch_bytes = (
            None
            if max_scratch_bytes is None
            else check_int(max_scratch_bytes, "max_scratch_bytes", min=0)
        )
        #: whether every message is cut into chunks of ``chunk_bytes`` (given, or the host
        #: default); else the GPU policy picks the chunk per message (``chunk_for``)
        self.fixed_chunk = chunk_bytes is not None or devices[0].backend == "host"
        if chunk_bytes is None:
            chunk_bytes = CHUNK_BYTES if devices[0].backend == "host" else GPU_CHUNK_MAX
        #: the chunk when fixed; under the GPU policy the largest chunk a plan uses
        self.chunk_bytes = check_int(chunk_bytes, "chunk_bytes", min=64)
        self.inline_bytes: int | None = (
            None if inline_bytes is None else check_int(inline_bytes, "inline_bytes", min=0)
        )
        if inline_threads is None:
            # one caller performs every rank's steps in turn: each kernel may use the
            # threads of all the devices, up to the cores there are
            inline_threads = min(
                sum(getattr(d, "threads", 1) for d in devices), os.cpu_count() or 1
            )
        self.inline_threads = check_int(inline_threads, "inline_threads", min=1)
        self.devices: list[Device] = devices
        self.size = len(devices)
        self.backend = devices[0].backend
        self.algorithm = algorithm
        if topology is None:
            from ..topology import Topology

            topology = Topology.detect(devices)
        if topology.n != self.size:
            raise ValueError(f"topology has {topology.n} devices, the World {self.size}")
        self.topology = topology
        self._topology_class = auto.topology_class(topology)
        # (collective, bytes per rank) -> what "auto" ran
        self._auto_choices: dict[tuple[str, int], str] = {}
        # NCCLTREE_AUTO=model: on GPUs the simulator picks among the hand-built plans
        # (auto.ModelChooser, made at the first choice: it asks CuPy for the GPU's name)
        self._auto_model_on = (
            algorithm == "auto" and devices[0].backend == "cuda" and auto.auto_mode() == "model"
        )
        self._auto_model: auto.ModelChooser | None = None
        self._trees: dict[int, Tree] = {}
        self._plans: dict[tuple[object, ...], Plan] = {}
        # the cached plans resolved for this World's devices (executor.Program), same keys
        self._programs: dict[tuple[object, ...], Program] = {}
        self._plan_steps = 0  # steps held by the cached plans
        self._scratch: dict[tuple[int, str, bool], Array] = {}
        self._transient = False  # this call got a scratch buffer past the cap
        self._streams = [d.new_stream() for d in devices]
        # recorded on each rank's caller stream at every launch; reused, as the waits on
        # them take their state when they are enqueued (see executor)
        self._caller_events = [d.new_event() for d in devices]
        self._lock = threading.RLock()  # one collective is launched at a time
        #: the last collectives, printed when the World fails (not when ``abort`` is called)
        self.flight = FlightRecorder()
        # closed, or failed for good (the first failure and when: run's deadline)
        self._life = LifeCycle(
            self.flight,
            self._describe,
            "the World is closed",
            "the World was aborted and is closed for good",
        )
        self._local = threading.local()  # the argument error raised in this thread
        self._nccl: NcclEngine | None = None
        self._nccl_unusable: str | None = None
        self._watchdog: Watchdog | None = None  # started by the first watched launch
        if algorithm == "nccl":
            self._nccl_engine()  # fail now, with the reason, rather than at the first call
        self._rendezvous = _Rendezvous(self)
        self._comms = [Comm(self, r) for r in range(self.size)]
        self._seq = 0
        # comm.split: the ranks meet, the last one makes the groups (see _split_by_ranks)
        self._mailbox = Mailbox(self)  # send/recv (p2p.py)
        self._split_barrier = threading.Barrier(self.size)
        self._split_choices: list[tuple[int | None, int]] = [(None, 0)] * self.size
        self._split_results: dict[int, dict[int, World]] = {}
        self._split_gen = [0] * self.size
        self._groups: list[World] = []  # made by new_group/split: closed with this World
        self._chunk_arg = chunk_bytes
        self._inline_args = (inline_bytes, inline_threads, max_scratch_bytes)

    # -- life cycle -----------------------------------------------------------------------
    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish queued work (within the timeout), stop the streams, destroy NCCL
        communicators. Later calls raise ``CommError``."""
        if not self._life.close():
            return
        if self._failure is None:
            for st in self._streams:
                try:
                    st.synchronize(self.timeout)
                except NcclTreeError:
                    pass
        drained = True
        if self._watchdog is not None:
            # outstanding NCCL work must finish before its communicators are destroyed
            # (ncclCommDestroy would wait for it without a bound); past the timeout, abort
            drained = self._failure is None and self._watchdog.drain(self.timeout)
            self._watchdog.close()
        if self._nccl is not None:
            self._nccl.close(abort=self._failure is not None or not drained)
            self._nccl = None
        self._rendezvous.wake_all()
        self._split_barrier.abort()
        for g in self._groups:
            g.close()
        self._streams = []
        self._scratch.clear()
        self._forget_memory()

    def abort(self, reason: str | BaseException = "aborted by the caller") -> None:
        """Fail the World for good, from any thread: every rank waiting in a collective
        wakes at once, and every later call raises ``PeerFailure`` naming ``reason``."""
        exc = reason if isinstance(reason, BaseException) else PeerFailure(reason)
        self._abort(exc, report=False)

    def _abort(self, exc: BaseException, report: bool = True) -> None:
        """Fail for good; ``report``: print the failure and the flight recorder (a
        failure found inside, not an abort the caller asked for)."""
        self._life.fail(exc, report)
        if self._nccl is not None:
            self._nccl.close(abort=True)
        self._rendezvous.wake_all()
        self._split_barrier.abort()
        self._mailbox.wake()

    def _check_usable(self) -> None:
        self._life.check_usable()

    @property
    def aborted(self) -> bool:
        return self._life.failed

    @property
    def _failure(self) -> BaseException | None:
        return self._life.failure

    @property
    def _failed_at(self) -> float | None:
        return self._life.failed_at

    @property
    def _closed(self) -> bool:
        return self._life.closed

    def _describe(self) -> str:
        names = ",".join(str(getattr(d, "name", "?")) for d in self.devices)
        return f"the World of {self.size} ranks ({names})"

    def _note_p2p(self, op: _Op) -> None:
        """A send or receive in the flight recorder (and the trace log)."""
        with self._lock:
            self._seq += 1
            seq = self._seq
        what = f"{op.kind} {'to' if op.kind == 'send' else 'from'} {op.peer}"
        entry = self.flight.start(seq, what, op.buf.size, op.buf.dtype, f"rank {op.rank}")
        entry.state = "matched" if op.done else "posted"
        if debug.trace_enabled():
            debug.log.log(debug.TRACE, f"World #{seq}: rank {op.rank} {what} "
                          f"count={op.buf.size} {op.buf.dtype}")  # fmt: skip

    # -- groups ---------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], algorithm: str | None = None) -> World:
        """A World of this World's ``ranks``, in that order (its rank ``i`` is rank
        ``ranks[i]`` here): the same devices, the matching part of this World's topology
        (so a tree of its own), and its own streams, plan cache and scratch; this World's
        algorithm, timeout and settings unless ``algorithm`` is given. It is closed with
        this World. Collectives of different groups never wait for each other; the ranks
        of a group call its collectives in one order (see docs/architecture.md, "Groups")."""
        self._check_usable()
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ranks must be a sequence of ranks, got {type(ranks).__name__}")
        picked = [check_index(r, "a rank of the group", self.size) for r in ranks]
        if not picked:
            raise ValueError("a group needs at least one rank")
        if len(set(picked)) != len(picked):
            raise ValueError(f"ranks of a group must be distinct, got {list(ranks)}")
        from ..topology import Topology

        topo = Topology(
            [[self.topology.link(i, j) for j in picked] for i in picked],
            [self.topology.names[i] for i in picked],
        )
        inline_bytes, inline_threads, max_scratch = self._inline_args
        group = World(
            [self.devices[r] for r in picked],
            algorithm=self.algorithm if algorithm is None else algorithm,
            topology=topo,
            timeout=self.timeout,
            chunk_bytes=self._chunk_arg,
            inline_bytes=inline_bytes,
            inline_threads=inline_threads,
            max_scratch_bytes=max_scratch,
        )
        self._groups.append(group)
        return group

    def split(
        self, colors: Sequence[int | None], keys: Sequence[int] | None = None
    ) -> dict[int, World]:
        """MPI's ``Comm_split``, driver side: the ranks of each color form a group
        (:meth:`new_group`), ordered by ``(keys[r], r)``; a rank of color None joins none.
        Returns the groups by color."""
        self._check_usable()
        if len(colors) != self.size:
            raise ValueError(f"colors has {len(colors)} entries for {self.size} ranks")
        if keys is not None and len(keys) != self.size:
            raise ValueError(f"keys has {len(keys)} entries for {self.size} ranks")
        order: dict[int, list[tuple[int, int]]] = {}
        for r, c in enumerate(colors):
            if c is None:
                continue
            c = check_int(c, "a color", min=0)
            k = 0 if keys is None else check_int(keys[r], "a key")
            order.setdefault(c, []).append((k, r))
        return {c: self.new_group([r for _, r in sorted(members)])
                for c, members in sorted(order.items())}  # fmt: skip

    def _split_by_ranks(self, rank: int, color: int | None, key: int) -> Comm | None:
        """``comm.split``: every rank calls it; the last to arrive makes the groups; each
        rank gets its face in its group (None for color None). Bounded by the timeout; an
        abort wakes every waiting rank."""
        from threading import BrokenBarrierError

        self._check_usable()
        gen = self._split_gen[rank] = self._split_gen[rank] + 1
        self._split_choices[rank] = (color, key)
        try:
            if self._split_barrier.wait(self.timeout) == 0:
                self._split_results.pop(gen - 1, None)
                colors = [c for c, _ in self._split_choices]
                keys = [k for _, k in self._split_choices]
                try:
                    self._split_results[gen] = self.split(colors, keys)
                except BaseException as exc:
                    self._abort(exc)
                    raise
            self._split_barrier.wait(self.timeout)
        except BrokenBarrierError:
            self._check_usable()  # aborted: PeerFailure, saying why
            self._abort(CommTimeout(f"rank {rank}: not every rank called split within "
                                    f"{self.timeout:g} s"))  # fmt: skip
            raise CommTimeout(
                f"rank {rank}: not every rank called split within {self.timeout:g} s"
            ) from None
        if color is None:
            return None
        group = self._split_results[gen][color]
        return group.comm(group.devices.index(self.devices[rank]))

    # -- per-rank side --------------------------------------------------------------------
    def comm(self, rank: int) -> Comm:
        """The per-rank face of ``rank`` (one thread per rank uses it)."""
        return self._comms[check_index(rank, "rank", self.size)]

    def run(self, fn: Callable[..., Any], *args: object) -> list[Any]:
        """Run ``fn(comm, *args)`` in a thread per rank; return each rank's result.

        An argument error of a collective (the ``ValueError``/``TypeError`` its checks
        raise on every rank, before anything is written) ends the ranks' functions and is
        re-raised here; the World stays usable, as it does driver-side and from the
        caller's own threads. Every other exception that ends a rank's function aborts the
        World (every other rank's collectives raise ``PeerFailure``) and is re-raised here,
        with the rank named.

        After the first failure (or abort, or timeout) the other ranks get at most
        ``timeout`` seconds more to return. A rank still running then is stuck outside
        the collectives, in ``fn``'s own code; its thread cannot be stopped, so it is left
        running as a daemon thread, the World is aborted, and ``MissingRanks`` names it
        (or, when another rank raised an error of its own, that error is raised with a
        note naming the stuck rank). Without a failure ``run`` waits as long as the ranks
        work: a rank's function may legitimately run for hours.
        """
        self._check_usable()

        def on_error(r: int, exc: BaseException) -> None:
            if not isinstance(exc, PeerFailure) and not self._is_argument_error(exc):
                self._abort(PeerFailure(f"rank {r} failed: {exc!r}"))

        def cleanup(r: int) -> None:
            self._local.argument_error = None

        return run_ranks(
            self.size,
            lambda r: fn(self._comms[r], *args),
            on_error=on_error,
            abort=self._abort,
            cleanup=cleanup,
            stuck_after=self.timeout,
            failed_at=lambda: self._failed_at,
            failure=lambda: self._failure,
        )

    def _argument_error_raised(self, exc: BaseException) -> None:
        """The rendezvous raises ``exc``, an argument error of a collective, in this
        thread: if it ends a rank's function in ``run``, it is no rank failure."""
        self._local.argument_error = exc

    def _is_argument_error(self, exc: BaseException) -> bool:
        return exc is getattr(self._local, "argument_error", None)

    # -- driver side (the collectives: faces.DriverCollectives over _driver) -------------
    def all_to_all_v(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        counts: Sequence[Sequence[int]],
        *,
        streams: Sequence[Stream | None] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """all_to_all with uneven blocks: ``counts[r][q]`` elements go from rank r to rank
        q. Rank r's input holds its blocks for ranks 0, 1, ... one after another
        (``sum(counts[r])`` elements); rank q's output receives the blocks of ranks 0, 1,
        ... one after another (``sum(counts[p][q] for p)``). Not in place. One copy per
        block, on every algorithm (NCCL Worlds too)."""
        self._check_usable()
        n = self.size
        if streams is None:
            callers = [self._caller_stream(r, None) for r in range(n)]
        else:
            callers = list(streams)
            if len(callers) != n:
                raise ValueError(f"streams has {len(callers)} entries for {n} ranks")
        with self._lock:
            self._check_usable()
            matrix = _count_matrix(counts, n)
            prep = _prepare_v(self.devices, xs, outs, matrix, dtype)
            key = ("all_to_all_v", matrix, prep.dtype.itemsize)
            program = self._programs.get(key)
            if program is None:
                plan = _all_to_all_v_plan(matrix)
                extents = {IN: [sum(row) for row in matrix],
                           OUT: [sum(row[q] for row in matrix) for q in range(n)],
                           TMP: [0] * n, STAGE: [0] * n}  # fmt: skip
                program = Program(plan, self.devices, extents)
                self._programs[key] = program
                self._plans[key] = plan
                self._plan_steps += len(plan.steps)
            self._seq += 1
            entry = self.flight.start(self._seq, "all_to_all_v", sum(map(sum, matrix)),
                                      prep.dtype, "direct")  # fmt: skip
            try:
                launched = self._issue(prep, "direct", callers, async_op, False, program)
            except BaseException as exc:
                entry.state = f"failed: {type(exc).__name__}"
                raise
            entry.state, entry.ended = "done", time.monotonic()
        if async_op:
            return Work(launched.events or [], launched.caller_streams, launched.results,
                        launched.keepalive, self.timeout, self._on_stream_error)  # fmt: skip
        return cast("list[Array]", launched.results)

    def barrier(self) -> None:
        """Block until every rank's queued work (caller and communication streams) ran."""
        self._check_usable()
        for d in self.devices:
            d.synchronize(self.timeout)
        for st in self._streams:
            st.synchronize(self.timeout)

    def _driver(
        self,
        collective: str,
        xs: Sequence[Array],
        outs: Sequence[Array] | None,
        op: str,
        root: int,
        streams: Sequence[Stream | None] | None,
        async_op: bool,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """Every driver-side collective (:mod:`nccltree.comm.faces`): the caller streams,
        the launch, a Work or the results."""
        self._check_usable()
        n = self.size
        if streams is None:
            callers = [self._caller_stream(r, None) for r in range(n)]
        else:
            callers = list(streams)
            if len(callers) != n:
                raise ValueError(f"streams has {len(callers)} entries for {n} ranks")
        launched = self._launch(collective, xs, outs, op, root, callers, async_op, dtype=dtype)
        if async_op:
            return Work(
                launched.events or [],
                launched.caller_streams,
                launched.results,
                launched.keepalive,
                self.timeout,
                self._on_stream_error,
            )
        return launched.results

    def _caller_stream(self, rank: int, stream: Stream | None) -> Stream | None:
        """The stream a rank's call is ordered against (None: the calling host thread)."""
        if stream is not None:
            return stream
        dev = self.devices[rank]
        if self.backend == "host":
            return dev.explicit_current_stream()
        return dev.current_stream()

    # -- the engine -----------------------------------------------------------------------
    def _launch(
        self,
        collective: str,
        xs: object,
        outs: object,
        op: str,
        root: object,
        streams: list[Stream | None],
        async_op: bool,
        by_ranks: bool = False,
        dtype: object = None,
    ) -> Launched:
        """``by_ranks``: the ranks' own threads made the call together (the last to arrive
        runs it), rather than one driver thread. ``dtype``: the dtype to compute in (None:
        the arrays'; ``"bfloat16"`` for ``uint16`` arrays of its bits)."""
        with self._lock:
            self._check_usable()
            prep = prepare(self.devices, collective, xs, outs, op, root, dtype=dtype)
            algorithm = self._choose(prep)
            self._seq += 1
            entry = self.flight.start(self._seq, prep.collective, prep.count, prep.dtype, algorithm)
            debug.trace_call(f"World #{self._seq}", prep, algorithm, " per rank" * by_ranks)
            try:
                launched = self._issue(prep, algorithm, streams, async_op, by_ranks)
            except (ValueError, TypeError):
                entry.state = "argument error"
                raise
            except BaseException as exc:
                entry.state = f"failed: {type(exc).__name__}"
                raise
            synchronous = all(cs is None for cs in streams) and algorithm != "nccl"
            entry.state = (
                "done"
                if launched.events is None or (synchronous and not async_op)
                else "issued (async)"
                if async_op
                else "issued (stream-ordered)"
            )
            entry.ended = time.monotonic()
            return launched

    def _issue(
        self,
        prep: Prepared,
        algorithm: str,
        streams: list[Stream | None],
        async_op: bool,
        by_ranks: bool,
        program: Program | None = None,
    ) -> Launched:
        """One checked call by ``algorithm`` (under the World's lock), or by ``program``
        where the call made its own (all_to_all_v)."""
        if program is None:
            if algorithm == "nccl":
                return self._launch_nccl(prep, streams)
            program = self._program(algorithm, prep)
        plan = program.plan
        bufs = self._buffers(program, prep)
        if self._can_inline(prep, streams, async_op):
            try:
                # _can_inline checked these are host devices
                every_core = prep.nbytes >= _INLINE_EVERY_CORE_FROM[by_ranks]
                program.run_inline(
                    bufs,
                    cast("list[HostDevice]", self.devices),
                    self.inline_threads if every_core else None,
                )
            except (ValueError, TypeError):
                raise
            except BaseException as exc:
                raise self._on_stream_error(exc) from exc
            return Launched(prep.results, None, list(streams), None)
        events = program.call_events(fresh_ends=async_op)
        try:
            for r, cs in enumerate(streams):
                if cs is not None:
                    self._streams[r].wait_event(cs.record(self._caller_events[r]))
            program.enqueue(bufs, self._streams, events)
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            # a device error while enqueueing (a broken CUDA context): part of the plan
            # may be queued, so the World cannot be trusted any more
            raise self._on_stream_error(exc) from exc
        ends = [events[plan.end_events[r]] for r in range(self.size)]
        keep = (bufs, prep, events)
        if not async_op:
            if all(cs is None for cs in streams):
                try:
                    for ev in ends:
                        ev.synchronize(self.timeout)
                except BaseException as exc:
                    raise self._on_stream_error(exc) from exc
            else:
                for cs, ev in zip(streams, ends):
                    if cs is not None:
                        cs.wait_event(ev)
                    else:
                        ev.synchronize(self.timeout)
        return Launched(prep.results, ends, list(streams), keep)

    def _buffers(self, program: Program, prep: Prepared) -> Buffers:
        """The call's buffers: its own, and the World's scratch and staging the plan needs
        (kept with the program while they stay the World's)."""
        plan = program.plan
        memory = program.memory
        # in the arrays' dtype: a uint16 scratch beside uint16 arrays that carry bfloat16
        dt = prep.array_dtype
        if memory is None or memory[0] != dt.str:
            self._transient = False
            tmps = [self._scratch_for(r, dt, plan.scratch.get(r, 0)) for r in range(self.size)]
            stages = [
                self._scratch_for(r, dt, plan.stage.get(r, 0), pinned=True)
                for r in range(self.size)
            ]
            # after the lookups, which forget every program's buffers when they replace
            # one; a call with buffers of its own (past max_scratch_bytes) keeps none
            memory = (dt.str, tmps, stages)
            if not self._transient:
                program.memory = memory
        return Buffers(prep.ins, prep.outs, memory[1], memory[2])

    def _choose_for(
        self, collective: str, xs: Sequence[Array], outs: Sequence[Array] | None, op: str,
        root: int, dtype: DTypeLike | None = None,
    ) -> str:  # fmt: skip
        """The algorithm a call with these arguments would run (nothing runs)."""
        with self._lock:
            return self._choose(prepare(self.devices, collective, xs, outs, op, root, dtype=dtype))

    def trace(
        self,
        collective: str,
        xs: Sequence[Array],
        outs: Sequence[Array] | None = None,
        *,
        op: str = "sum",
        root: int = 0,
        algorithm: str | None = None,
        dtype: DTypeLike | None = None,
    ) -> list[Span]:
        """Perform one call of ``collective`` (driver side, synchronous) step by step,
        timing each step (:mod:`nccltree.comm.trace`; ``write_chrome_trace`` shows them).
        ``algorithm``: tree, ring or direct (default: the World's choice for this call;
        NCCL runs as one call and has no steps to show); ``dtype`` as for the call."""
        from .trace import trace_program

        with self._lock:
            self._check_usable()
            prep = prepare(
                self.devices, collective_name(collective), xs, outs, op, root, dtype=dtype
            )
            alg = algorithm if algorithm is not None else self._choose(prep)
            if alg not in ALGORITHMS:
                raise ValueError(
                    f"a trace shows a plan's steps: algorithm tree, ring or direct, not {alg!r}"
                )
            program = self._program(alg, prep)
            bufs = self._buffers(program, prep)
            if self.backend == "host":
                for st in self._streams:
                    st.synchronize(self.timeout)
                return trace_program(program, bufs)
            for r, st in enumerate(self._streams):
                caller = self._caller_stream(r, None)
                if caller is not None:
                    st.wait_event(caller.record(self._caller_events[r]))
            return trace_program(program, bufs, self._streams)

    def _launch_nccl(self, prep: Prepared, streams: list[Stream | None]) -> Launched:
        """NCCL on the caller streams; returns at once (stream-ordered, as every engine),
        with the watchdog holding the buffers and the deadline until the work completes."""
        try:
            launched = self._nccl_engine().launch(prep, streams)
        except CommError as exc:
            raise self._on_stream_error(exc) from exc
        self._watch(
            f"NCCL {prep.collective} of {prep.nbytes} B per rank",
            launched.events or [],
            launched.keepalive,
        )
        return launched

    def _watch(self, what: str, events: list[Event], keepalive: object) -> None:
        if self._watchdog is None:
            from .watchdog import Watchdog

            self._watchdog = Watchdog(self._on_watchdog_failure, name="nccltree-watchdog")
        self._watchdog.watch(what, events, self.timeout, keepalive)

    def _on_watchdog_failure(self, exc: BaseException) -> None:
        # on the watchdog thread: abort the communicators and fail the World for good, which
        # wakes every rank waiting in a collective
        self._on_stream_error(exc)

    def _on_stream_error(self, exc: BaseException) -> BaseException:
        """A failure inside the devices' work: the World cannot be trusted any more."""
        if isinstance(exc, CommTimeout):
            err: BaseException = exc
        elif isinstance(exc, NcclTreeError):
            err = exc
        else:
            err = CommError(f"a collective failed on a device: {exc!r}")
        self._abort(err)
        return err

    def _can_inline(self, prep: Prepared, streams: list[Stream | None], async_op: bool) -> bool:
        return (
            self.backend == "host"
            and not async_op
            and (self.inline_bytes is None or prep.nbytes <= self.inline_bytes)
            and all(cs is None for cs in streams)
            and all(st.query() for st in self._streams)
        )

    def _choose(self, prep: Prepared) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        # the choice depends only on the collective and the size once NCCL's usability is
        # known (asked once, then kept): remember it, so a repeated call does not walk the
        # table (or ask the model) again
        key = (prep.collective, prep.nbytes)
        alg = self._auto_choices.get(key)
        if alg is None:
            rule = auto.choose_rule(self.backend, self._topology_class, prep.nbytes, self._usable)
            alg, why = rule.algorithm, rule.why
            if self._auto_model_on and alg != "nccl":  # NCCL stays where the table takes it
                choice = self._model_choice(prep)
                if choice is not None:
                    alg, why = choice.algorithm, choice.why
            if debug.info_enabled():
                debug.log.info(
                    f"World of {self.size} ranks: auto chose {alg} for {prep.nbytes} B per "
                    f"rank ({prep.collective}, {self.backend} backend, "
                    f"{self._topology_class} topology): {why}"
                )
            if len(self._auto_choices) >= 1024:
                self._auto_choices.clear()
            self._auto_choices[key] = alg
        return alg

    def _model_choice(self, prep: Prepared) -> auto.ModelChoice | None:
        """What the simulator predicts fastest for this call (NCCLTREE_AUTO=model)."""
        if self._auto_model is None:
            name = auto.gpu_name(self.devices)
            self._auto_model = auto.ModelChooser(self.topology, name)
            if debug.info_enabled():
                debug.log.info(
                    f"World of {self.size} ranks: auto consults the simulator "
                    f"(NCCLTREE_AUTO=model) with the {self._auto_model.device} device model "
                    f"for GPU {name!r}"
                    + (f": {self._auto_model.note}" if self._auto_model.note else "")
                )
        return self._auto_model.choose(
            prep.collective, prep.nbytes, prep.dtype.itemsize, lambda a: self._build_plan(a, prep)
        )

    def _build_plan(self, algorithm: str, prep: Prepared) -> Plan:
        """The plan this World builds for ``prep`` with ``algorithm``. The itemsize lets
        the plan align the slices and chunks it chooses (256 B), so the vector kernels
        keep their vector path."""
        return build_plan(
            algorithm,
            prep.collective,
            size=self.size,
            count=prep.count,
            op=prep.op,
            root=prep.root,
            in_place=prep.in_place,
            chunk=self._chunk_elements(prep),
            tree_for=self.tree,
            itemsize=prep.dtype.itemsize,
        )

    def _usable(self, algorithm: str) -> bool:
        return algorithm != "nccl" or self._nccl_usable()

    def _nccl_usable(self) -> bool:
        if self._nccl_unusable is None:
            try:
                self._nccl_engine()
                self._nccl_unusable = ""
            except (NcclTreeError, ValueError) as exc:
                self._nccl_unusable = str(exc)  # asked once: "auto" falls back for good
        return not self._nccl_unusable

    def _nccl_engine(self) -> NcclEngine:
        if self._nccl is None:
            from .nccl import NcclEngine

            self._nccl = NcclEngine(self.devices)
        return self._nccl

    def tree(self, root: int = 0) -> Tree:
        """The tree the tree algorithm uses for collectives rooted at ``root``."""
        root = check_index(root, "root", self.size)
        if root not in self._trees:
            from ..tree import build_tree

            self._trees[root] = build_tree(self.topology, root=root)
        return self._trees[root]

    def plan(
        self,
        collective: str,
        count: int,
        *,
        op: str = "sum",
        root: int = 0,
        in_place: bool = False,
        dtype: DTypeLike = np.float32,
        algorithm: str | None = None,
    ) -> Plan:
        """The plan a call with these parameters runs (for inspection and tests)."""
        prep = Prepared(
            collective_name(collective),
            [],
            [],
            [],
            np.dtype(dtype),
            check_int(count, "count", min=0),
            bool(in_place),
            op,
            check_index(root, "root", self.size),
        )
        alg = algorithm or self._choose(prep)
        if alg not in ALGORITHMS:
            raise ValueError(f"no inspectable plan for algorithm {alg!r}")
        return self._plan(alg, prep)

    def chunk_for(self, nbytes: int) -> int:
        """The chunk (bytes) the plans cut a message into when each rank's largest buffer
        holds ``nbytes`` bytes: ``chunk_bytes`` when it is fixed (given, or the host
        backend's default); otherwise the GPU policy, :func:`gpu_chunk_bytes`."""
        nbytes = check_int(nbytes, "nbytes", min=0)
        return self.chunk_bytes if self.fixed_chunk else gpu_chunk_bytes(nbytes)

    def _chunk_elements(self, prep: Prepared) -> int:
        """The chunk of a call's plan, in elements."""
        coll = COLLECTIVES[prep.collective]
        itemsize = prep.dtype.itemsize
        # the largest buffer a rank passes: the gathered output, the scattered input
        biggest = max(coll.in_count(prep.count, self.size), coll.out_count(prep.count, self.size))
        return chunk_elements(self.chunk_for(biggest * itemsize), itemsize)

    def _plan(self, algorithm: str, prep: Prepared) -> Plan:
        return self._program(algorithm, prep).plan

    def _program(self, algorithm: str, prep: Prepared) -> Program:
        """The cached plan of a call, resolved for this World (built on first use)."""
        # the chunk follows from these and the World's chunk setting, so it is no part of
        # the key; the itemsize lets the plan align what it chooses (dtypes of one size
        # share a plan); the dtype the arrays carry, where they carry one (bfloat16 in
        # uint16 CuPy arrays), is named to the kernels by the program, so it keys it too
        carried = prep.carried
        key = (
            algorithm,
            prep.collective,
            prep.count,
            prep.op,
            prep.root,
            prep.in_place,
            prep.dtype.itemsize,
            None if carried is None else carried.str,
        )
        program = self._programs.get(key)
        if program is None:
            chunk = self._chunk_elements(prep)
            plan = self._build_plan(algorithm, prep)
            coll = COLLECTIVES[prep.collective]
            n = self.size
            extents = {
                IN: [coll.in_count(prep.count, n)] * n,
                OUT: [coll.out_count(prep.count, n)] * n,
                TMP: [plan.scratch.get(r, 0) for r in range(n)],
                STAGE: [plan.stage.get(r, 0) for r in range(n)],
            }
            program = Program(plan, self.devices, extents, prep.carried)
            if debug.info_enabled():
                debug.log.info(
                    debug.plan_line(plan, prep.dtype.itemsize, f"World of {n} ranks", chunk)
                )
            # bounded by count and by steps: a ring plan holds O(size^2) steps (about
            # 180 B each, plus its resolved form), so a few large ones weigh more than
            # hundreds of small ones
            self._plan_steps += len(plan.steps)
            while self._plans and (
                len(self._plans) >= _PLAN_CACHE_PLANS or self._plan_steps > _PLAN_CACHE_STEPS
            ):
                old = next(iter(self._plans))
                self._plan_steps -= len(self._plans.pop(old).steps)
                del self._programs[old]
            self._plans[key] = plan
            self._programs[key] = program
        return program

    def _scratch_for(
        self, rank: int, dtype: np.dtype, count: int, pinned: bool = False
    ) -> Array | None:
        """Rank ``rank``'s scratch (device memory) or staging (pinned host) buffer."""
        if count == 0:
            return None
        key = (rank, dtype.str, pinned)
        buf = self._scratch.get(key)
        need = count * dtype.itemsize
        cap = self.max_scratch_bytes
        if cap is not None and (buf is None or buf.size < count):
            # room for the larger buffer within the cap: drop the other cached buffers,
            # largest first (a call that needs them gets them again); if it still does not
            # fit, this call gets a buffer of its own, kept by the call only
            held = self.scratch_bytes - (0 if buf is None else buf.nbytes)
            for other in sorted(self._scratch, key=lambda k: -self._scratch[k].nbytes):
                if held + need <= cap:
                    break
                if other != key:
                    held -= self._scratch.pop(other).nbytes
                    self._forget_memory()
            if held + need > cap:
                self._transient = True
                dev = self.devices[rank]
                if pinned:
                    return dev.pinned_empty((count,), dtype)
                return dev.empty((count,), dtype, stream=self._streams[rank])
        if buf is None or buf.size < count:
            # Reuse is safe: consecutive collectives are ordered on the comm streams and a
            # plan's end fences cover every access to a rank's scratch. Device scratch is
            # allocated for the rank's comm stream, the only stream that touches it, so a
            # pool reuses a replaced (smaller) block only in that stream's order.
            dev = self.devices[rank]
            if pinned:
                buf = dev.pinned_empty((count,), dtype)
            else:
                buf = dev.empty((count,), dtype, stream=self._streams[rank])
            self._scratch[key] = buf
            # programs that kept the replaced buffer look theirs up again (and do not keep
            # the old memory alive meanwhile)
            self._forget_memory()
        return buf[:count]

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch (device) and staging (pinned host) memory the World keeps
        between calls, over every rank: what ``max_scratch_bytes`` caps."""
        return sum(int(b.nbytes) for b in self._scratch.values())

    def trim(self) -> int:
        """Release the scratch and staging memory kept between calls, once the queued
        work is done (bounded by the timeout); returns the bytes released. The next call
        that needs scratch allocates it again."""
        with self._lock:
            for st in self._streams:
                st.synchronize(self.timeout)
            released = self.scratch_bytes
            self._scratch.clear()
            self._forget_memory()
            return released

    def _forget_memory(self) -> None:
        for program in self._programs.values():
            program.memory = None


def _count_matrix(counts: Sequence[Sequence[int]], n: int) -> tuple[tuple[int, ...], ...]:
    """all_to_all_v's counts, checked: n rows of n element counts, none negative."""
    if isinstance(counts, (str, bytes)) or len(counts) != n:
        raise ValueError(f"counts must have a row per rank ({n}), got {len(counts)}")
    rows = []
    for r, row in enumerate(counts):
        if isinstance(row, (str, bytes)) or len(row) != n:
            raise ValueError(f"counts[{r}] must have a count per rank ({n})")
        rows.append(tuple(check_int(c, f"counts[{r}][{q}]", min=0) for q, c in enumerate(row)))
    return tuple(rows)


def _prepare_v(
    devices: Sequence[Device], xs: Sequence[Array], outs: Sequence[Array],
    matrix: tuple[tuple[int, ...], ...], dtype: object = None,
) -> Prepared:  # fmt: skip
    """all_to_all_v's buffers, checked as a collective's are (one dtype, C-contiguous,
    the sizes the counts give, no output overlapping an input, ``dtype=`` as for every
    collective)."""
    from ._args import _as_list, _device_array, check_call_dtype, resolve_dtype

    n = len(devices)
    ins = [_device_array(d, x, f"rank {r}: input")
           for r, (d, x) in enumerate(zip(devices, _as_list(xs, "inputs", n), strict=True))]  # fmt: skip
    res = [_device_array(d, o, f"rank {r}: output")
           for r, (d, o) in enumerate(zip(devices, _as_list(outs, "outputs", n), strict=True))]  # fmt: skip
    stored = ins[0].dtype
    for r in range(n):
        if ins[r].dtype != stored or res[r].dtype != stored:
            raise TypeError(f"rank {r}: dtype differs from rank 0's {stored}")
        want_in, want_out = sum(matrix[r]), sum(row[r] for row in matrix)
        if ins[r].size != want_in:
            raise ValueError(f"rank {r}: the input needs {want_in} elements (its row of "
                             f"counts), got {ins[r].size}")  # fmt: skip
        if res[r].size != want_out:
            raise ValueError(f"rank {r}: the output needs {want_out} elements (its column "
                             f"of counts), got {res[r].size}")  # fmt: skip
    for r in range(n):
        for q in range(n):
            if (
                ins[r].nbytes
                and res[q].nbytes
                and ranges_overlap(data_ptr(ins[r]), ins[r].nbytes, data_ptr(res[q]), res[q].nbytes)
            ):
                raise ValueError(f"all_to_all_v cannot run in place: rank {q}'s output "
                                 f"overlaps rank {r}'s input")  # fmt: skip
    logical = check_call_dtype(dtype)
    ins, viewed, dt, storage = resolve_dtype(ins, list(res), logical, "rank 0: input")
    flat_in = [x.reshape(-1) for x in ins]
    flat_out = [o.reshape(-1) for o in viewed if o is not None]
    return Prepared("all_to_all_v", flat_in, flat_out, list(outs), dt, 0, False, "sum", 0, storage)


def _all_to_all_v_plan(matrix: tuple[tuple[int, ...], ...]) -> Plan:
    """One copy per nonzero block: rank r pushes its block for q into q's output, at the
    place of rank r's block there; ranks start at different destinations."""
    from .plan import Buf, PlanBuilder

    n = len(matrix)
    b = PlanBuilder(n, f"direct all_to_all_v of {sum(map(sum, matrix))} elements")
    for r in range(n):
        src_off = [sum(matrix[r][:q]) for q in range(n)]
        for i in range(n):
            q = (r + i) % n
            c = matrix[r][q]
            if c:
                dst_off = sum(matrix[p][q] for p in range(r))
                b.copy(r, Buf(q, OUT, dst_off, c), Buf(r, IN, src_off[q], c))
    return b.build()
