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
from .._validate import check_call_timeout, check_choice, check_index, check_int
from . import debug
from ._args import Array, Launched, Prepared, prepare
from .algorithms import ALGORITHMS
from .alltoallv import (
    AllToAllV,
    prepare_all_gather_v,
    prepare_all_to_all_v,
    prepare_reduce_scatter_v,
)
from .chooser import Chooser
from .collectives import collective_name
from .comm import Comm, _Rendezvous
from .faces import DriverCollectives
from .flight import FlightRecorder
from .interop import StreamArg, as_stream
from .issuer import Issuer
from .lifecycle import HasLifeCycle, LifeCycle
from .p2p import Mailbox
from .plan import (
    CHUNK_BYTES,
    GPU_CHUNK_MAX,
    Plan,
)
from .plan import gpu_chunk_bytes as gpu_chunk_bytes  # the GPU chunk policy World documents
from .planner import Planner
from .programs import ProgramCache
from .rendezvous import run_ranks
from .subgroups import Subgroups
from .trace import Span
from .work import Work

if TYPE_CHECKING:
    from ..backends.base import Device, Stream
    from ..topology import Topology
    from ..tree import Tree
    from .p2p import _Op

ALGORITHM_CHOICES = (*ALGORITHMS, "nccl", "auto")


class World(DriverCollectives, HasLifeCycle):
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
    ``max_scratch_bytes`` caps the scratch (device) and staging (pinned host) memory the
    World keeps between calls for intermediate results (default None: no cap); a call
    that needs more gets buffers of its own for that call only.

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
        devices = _world_devices(devices)
        check_choice(algorithm, "algorithm", ALGORITHM_CHOICES)
        timeout = check_call_timeout(timeout)
        if max_scratch_bytes is not None:
            max_scratch_bytes = check_int(max_scratch_bytes, "max_scratch_bytes", min=0)
        fixed_chunk = chunk_bytes is not None or devices[0].backend == "host"
        if chunk_bytes is None:
            chunk_bytes = CHUNK_BYTES if devices[0].backend == "host" else GPU_CHUNK_MAX
        chunk_bytes = check_int(chunk_bytes, "chunk_bytes", min=64)
        if inline_bytes is not None:
            inline_bytes = check_int(inline_bytes, "inline_bytes", min=0)
        if inline_threads is None:
            # one caller performs every rank's steps in turn: each kernel may use the
            # threads of all the devices, up to the cores there are
            inline_threads = min(
                sum(getattr(d, "threads", 1) for d in devices), os.cpu_count() or 1
            )
        inline_threads = check_int(inline_threads, "inline_threads", min=1)
        self.devices: list[Device] = devices
        self.size = len(devices)
        self.backend = devices[0].backend
        if topology is None:
            from ..topology import Topology

            topology = Topology.detect(devices)
        if topology.n != self.size:
            raise ValueError(f"topology has {topology.n} devices, the World {self.size}")
        self.topology = topology
        # the chunk policy, the trees and the plan builder
        self._planner = Planner(topology, chunk_bytes, fixed_chunk)
        # the algorithm of each call (bound: the launch asks it on every call)
        self._chooser = Chooser(algorithm, devices, topology, self._usable, self._planner.build)
        self._choose = self._chooser.choose
        self._streams = [d.new_stream() for d in devices]
        # the cached programs and the scratch and staging memory kept between calls
        self._programs = ProgramCache(
            devices,
            self._streams,
            max_scratch_bytes,
            self._planner.build,
            self._planner.chunk_elements,
            f"World of {self.size} ranks",
        )
        # inline, on the streams, or by NCCL
        self._issuer = Issuer(
            devices,
            self._streams,
            self._programs,
            timeout,
            inline_bytes,
            inline_threads,
            self._on_stream_error,
        )
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
        if algorithm == "nccl":
            self._issuer.nccl_engine()  # fail now, with the reason, rather than at the first call
        self._rendezvous = _Rendezvous(self)
        self._comms = [Comm(self, r) for r in range(self.size)]
        self._seq = 0
        self._mailbox = Mailbox(self)  # send/recv (p2p.py)
        # new_group, split and comm.split (the ranks meet, the last one makes the groups)
        self._subgroups = Subgroups(
            devices, timeout, self._make_group, self._check_usable, self._abort
        )
        # the settings a group made of these ranks inherits
        self._group_settings: dict[str, int | None] = {
            "chunk_bytes": chunk_bytes,
            "inline_bytes": inline_bytes,
            "inline_threads": inline_threads,
            "max_scratch_bytes": max_scratch_bytes,
        }

    # -- life cycle -----------------------------------------------------------------------
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
        self._issuer.close(failed=self._failure is not None)
        self._rendezvous.wake_all()
        self._subgroups.close()
        self._streams = []
        self._programs.release()

    def abort(self, reason: str | BaseException = "aborted by the caller") -> None:
        """Fail the World for good, from any thread: every rank waiting in a collective
        wakes at once, and every later call raises ``PeerFailure`` naming ``reason``."""
        exc = reason if isinstance(reason, BaseException) else PeerFailure(reason)
        self._abort(exc, report=False)

    def _abort(self, exc: BaseException, report: bool = True) -> None:
        """Fail for good; ``report``: print the failure and the flight recorder (a
        failure found inside, not an abort the caller asked for)."""
        self._life.fail(exc, report)
        self._issuer.abort()
        self._rendezvous.wake_all()
        self._subgroups.wake()
        self._mailbox.wake()

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
        return self._subgroups.new_group(ranks, algorithm)

    def _make_group(self, picked: list[int], algorithm: str | None) -> World:
        """A World of this World's ranks ``picked`` (Subgroups checked them)."""
        from ..topology import Topology

        topo = Topology(
            [[self.topology.link(i, j) for j in picked] for i in picked],
            [self.topology.names[i] for i in picked],
        )
        algorithm = self.algorithm if algorithm is None else algorithm
        devices = [self.devices[r] for r in picked]
        return World(devices, algorithm, topo, self.timeout, **self._group_settings)

    def split(
        self, colors: Sequence[int | None], keys: Sequence[int] | None = None
    ) -> dict[int, World]:
        """MPI's ``Comm_split``, driver side: the ranks of each color form a group
        (:meth:`new_group`), ordered by ``(keys[r], r)``; a rank of color None joins none.
        ``colors[r]`` is rank r's color. Returns the groups by color."""
        self._check_usable()
        return self._subgroups.split(colors, keys)

    def _split_by_ranks(self, rank: int, color: int | None, key: int) -> Comm | None:
        """``comm.split``: every rank calls it; the last to arrive makes the groups; each
        rank gets its face in its group (None for color None). Bounded by the timeout; an
        abort wakes every waiting rank."""
        return self._subgroups.split_by_ranks(rank, color, key)

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
        streams: Sequence[StreamArg] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """all_to_all with uneven blocks: ``counts[r][q]`` elements go from rank r to rank
        q. Rank r's input holds its blocks for ranks 0, 1, ... one after another
        (``sum(counts[r])`` elements); rank q's output receives the blocks of ranks 0, 1,
        ... one after another (``sum(counts[p][q] for p)``). ``xs``/``outs``: one input
        and one output array per rank. Not in place. One copy per block, on every
        algorithm (NCCL Worlds too). ``streams``, ``async_op``, ``dtype`` and the errors as
        for every collective (:class:`~nccltree.comm.faces.DriverCollectives`); counts
        that do not match the arrays raise ``ValueError``."""
        return self._run_v(
            lambda: prepare_all_to_all_v(self.devices, xs, outs, counts, dtype), streams, async_op
        )

    def all_gather_v(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        counts: Sequence[int],
        *,
        streams: Sequence[StreamArg] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """all_gather with uneven blocks: rank r's input holds ``counts[r]`` elements;
        every output (``sum(counts)``) gets them all, rank r's at ``sum(counts[:r])``.
        ``xs``/``outs``: one input and one output array per rank. Not in place. One copy
        per block and rank, on every algorithm."""
        return self._run_v(
            lambda: prepare_all_gather_v(self.devices, xs, outs, counts, dtype), streams, async_op
        )

    def reduce_scatter_v(
        self,
        xs: Sequence[Array],
        outs: Sequence[Array],
        counts: Sequence[int],
        *,
        op: str = "sum",
        streams: Sequence[StreamArg] | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """reduce_scatter with uneven blocks: every input holds ``sum(counts)``
        elements; rank q's output (``counts[q]``) gets ``op`` over every rank's block q
        (at ``sum(counts[:q])``), reduced at rank q in rank order. ``xs``/``outs``: one
        input and one output array per rank. Not in place."""
        return self._run_v(
            lambda: prepare_reduce_scatter_v(self.devices, xs, outs, counts, op, dtype),
            streams,
            async_op,
        )

    def _run_v(
        self,
        prepare_call: Callable[[], AllToAllV],
        streams: Sequence[StreamArg] | None,
        async_op: bool,
    ) -> list[Array] | Work:
        """A v-collective: checked by ``prepare_call``, run by its own cached plan."""
        self._check_usable()
        callers = self._callers(streams)
        with self._lock:
            self._check_usable()
            call = prepare_call()
            prep, program = call.prep, self._programs.program_for(call.key, call.make)
            self._seq += 1
            entry = self.flight.start(self._seq, prep.collective, call.total, prep.dtype, "direct")
            try:
                launched = self._issuer.issue(prep, "direct", callers, async_op, False, program)
            except BaseException as exc:
                entry.state = f"failed: {type(exc).__name__}"
                raise
            entry.state, entry.ended = "done", time.monotonic()
        return self._work(launched) if async_op else cast("list[Array]", launched.results)

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
        streams: Sequence[StreamArg] | None,
        async_op: bool,
        dtype: DTypeLike | None = None,
    ) -> list[Array] | Work:
        """Every driver-side collective (:mod:`nccltree.comm.faces`): the caller streams,
        the launch, a Work or the results."""
        self._check_usable()
        callers = self._callers(streams)
        launched = self._launch(collective, xs, outs, op, root, callers, async_op, dtype=dtype)
        return self._work(launched) if async_op else launched.results

    def _callers(self, streams: Sequence[StreamArg] | None) -> list[Stream | None]:
        """The stream each rank's driver-side call is ordered against: ``streams``
        (checked: one per rank), or each device's current stream (None on the host
        backend where none is made explicit: the calling host thread)."""
        if streams is None:
            if self.backend == "host":
                return [d.explicit_current_stream() for d in self.devices]
            return [d.current_stream() for d in self.devices]
        callers = list(streams)
        if len(callers) != self.size:
            raise ValueError(f"streams has {len(callers)} entries for {self.size} ranks")
        return [as_stream(d, s) for d, s in zip(self.devices, callers, strict=True)]

    def _work(self, launched: Launched) -> Work:
        """The Work of an asynchronous driver-side call."""
        return Work(launched.events or [], launched.caller_streams, launched.results,
                    launched.keepalive, self.timeout, self._on_stream_error)  # fmt: skip

    def _caller_stream(self, rank: int, stream: StreamArg) -> Stream | None:
        """The stream a rank's call is ordered against (None: the calling host thread);
        ``stream`` may be any kind :func:`~nccltree.comm.interop.as_stream` takes."""
        dev = self.devices[rank]
        if stream is not None:
            return as_stream(dev, stream)
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
                launched = self._issuer.issue(prep, algorithm, streams, async_op, by_ranks)
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
        NCCL runs as one call and has no steps to show); ``xs``, ``outs``, ``op``,
        ``root`` and ``dtype`` as for the call. Returns the timed steps."""
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
            program = self._programs.program(alg, prep)
            return self._issuer.trace(program, prep, self._callers(None))

    def _on_stream_error(self, exc: BaseException) -> BaseException:
        """A failure inside the devices' work: the World cannot be trusted any more.
        Returns the error to raise: ``exc`` itself for an interrupt (Ctrl-C), so that the
        caller's ``except KeyboardInterrupt`` sees it; the World is closed all the same
        (part of the plan may have run), quietly: the user knows why."""
        if isinstance(exc, KeyboardInterrupt):
            self._abort(CommError("interrupted (KeyboardInterrupt) during a collective"), False)
            return exc
        if isinstance(exc, CommTimeout):
            err: BaseException = exc
        elif isinstance(exc, NcclTreeError):
            err = exc
        else:
            err = CommError(f"a collective failed on a device: {exc!r}")
        self._abort(err)
        return err

    def _usable(self, algorithm: str) -> bool:
        return algorithm != "nccl" or self._issuer.nccl_usable()

    def tree(self, root: int = 0) -> Tree:
        """The tree the tree algorithm uses for collectives rooted at ``root``."""
        return self._planner.tree(root)

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
        """The plan a call with these parameters runs (for inspection and tests):
        ``collective`` over ``count`` elements per rank of ``dtype``, with ``op``,
        ``root``, ``in_place`` and ``algorithm`` (default: the World's choice) as the call
        would have them. Pure data: nothing runs."""
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
        return self._programs.program(alg, prep).plan

    def chunk_for(self, nbytes: int) -> int:
        """The chunk (bytes) the plans cut a message into when each rank's largest buffer
        holds ``nbytes`` bytes: ``chunk_bytes`` when it is fixed (given, or the host
        backend's default); otherwise the GPU policy, :func:`gpu_chunk_bytes`."""
        return self._planner.chunk_for(nbytes)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch (device) and staging (pinned host) memory the World keeps
        between calls, over every rank: what ``max_scratch_bytes`` caps."""
        return self._programs.scratch_bytes

    def trim(self) -> int:
        """Release the scratch and staging memory kept between calls, once the queued
        work is done (bounded by the timeout); returns the bytes released. The next call
        that needs scratch allocates it again."""
        with self._lock:
            for st in self._streams:
                st.synchronize(self.timeout)
            return self._programs.release()

    # -- settings the chooser, the issuer and the cache read on every call ----------------
    @property
    def fixed_chunk(self) -> bool:
        """Whether every message is cut into chunks of ``chunk_bytes`` (given, or the host
        default); else the GPU policy picks the chunk per message (``chunk_for``). Fixed
        when the World is made: the cached plans depend on it."""
        return self._planner.fixed_chunk

    @property
    def chunk_bytes(self) -> int:
        """The chunk when fixed; under the GPU policy the largest chunk a plan uses."""
        return self._planner.chunk_bytes

    @property
    def timeout(self) -> float:
        """The bound of every wait (seconds)."""
        return self._issuer.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._issuer.timeout = self._subgroups.timeout = check_call_timeout(value)

    @property
    def algorithm(self) -> str:
        """``tree``, ``ring``, ``direct``, ``nccl`` or ``auto``: what the calls run."""
        return self._chooser.algorithm

    @algorithm.setter
    def algorithm(self, value: str) -> None:
        self._chooser.algorithm = check_choice(value, "algorithm", ALGORITHM_CHOICES)

    @property
    def inline_bytes(self) -> int | None:
        """Synchronous host calls of at most this many bytes per rank run inline (None:
        any size)."""
        return self._issuer.inline_bytes

    @inline_bytes.setter
    def inline_bytes(self, value: int | None) -> None:
        self._issuer.inline_bytes = (
            None if value is None else check_int(value, "inline_bytes", min=0)
        )

    @property
    def inline_threads(self) -> int:
        """The threads of each inline kernel from 512 KiB per rank (8 MiB when the ranks'
        threads make the call together); below that, each device's own."""
        return self._issuer.inline_threads

    @inline_threads.setter
    def inline_threads(self, value: int) -> None:
        self._issuer.inline_threads = check_int(value, "inline_threads", min=1)

    @property
    def max_scratch_bytes(self) -> int | None:
        """The most bytes of scratch and staging memory the World keeps between calls (all
        ranks together; None: no cap). A call that needs more gets buffers of its own,
        released when it is done."""
        return self._programs.max_scratch_bytes

    @max_scratch_bytes.setter
    def max_scratch_bytes(self, value: int | None) -> None:
        self._programs.max_scratch_bytes = (
            None if value is None else check_int(value, "max_scratch_bytes", min=0)
        )


def _world_devices(devices: Sequence[Device] | str) -> list[Device]:
    """A World's devices (a spec string made into them), checked: at least one, few
    enough to fit in memory, all from one ``devices()`` call."""
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
    return devices
