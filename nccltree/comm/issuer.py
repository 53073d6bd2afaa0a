"""How a World's checked call reaches the devices: inline, on the streams, or by NCCL.

``Issuer`` takes a prepared call and its algorithm and issues it: on the host backend a
synchronous call small enough runs inline in the calling thread (every step in turn);
otherwise the program is enqueued on the ranks' communication streams, ordered after the
caller streams, and waited for unless asynchronous; NCCL calls go to the NCCL engine, whose
outstanding work a watchdog bounds. A failure inside the devices' work goes to the World's
``on_stream_error`` (which fails the World for good). Every call into it is made under the
World's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, cast

from .._errors import CommError, NcclTreeError
from ._args import Launched, Prepared
from .executor import Buffers, Program
from .programs import ProgramCache

if TYPE_CHECKING:
    from ..backends.base import Device, Event, Stream
    from ..backends.host import HostDevice
    from .nccl import NcclEngine
    from .trace import Span
    from .watchdog import Watchdog

# Inline kernels run on ``inline_threads`` threads from these message sizes per rank, on
# their device's threads below (measured:
# docs/performance.md#inline-calls-on-the-host-backend). A driver-side call has one calling thread, whose OpenMP team serves every call:
# every core pays from a few hundred KiB. A call the ranks' threads make together is run
# by whichever arrives last, so each rank thread keeps a team of its own; the teams contend
# for the cores, and every core paid only from several MiB.
INLINE_EVERY_CORE_FROM = {False: 512 << 10, True: 8 << 20}


@dataclass(eq=False)
class Issuer:
    """Issues a World's calls on its ``devices`` and communication ``streams``, with the
    programs and scratch of ``cache``; ``timeout`` bounds every wait (seconds).
    ``inline_bytes`` and ``inline_threads`` are the World's settings (it forwards them);
    a failure inside the devices' work goes to ``on_stream_error``."""

    devices: list[Device]
    streams: list[Stream]
    cache: ProgramCache
    timeout: float
    inline_bytes: int | None
    inline_threads: int
    on_stream_error: Callable[[BaseException], BaseException]

    def __post_init__(self) -> None:
        self.size = len(self.devices)
        self.backend = self.devices[0].backend
        # recorded on each rank's caller stream at every launch; reused, as the waits on
        # them take their state when they are enqueued (see executor)
        self.caller_events = [d.new_event() for d in self.devices]
        self._nccl: NcclEngine | None = None
        self._nccl_unusable: str | None = None
        self._watchdog: Watchdog | None = None  # started by the first watched launch

    def issue(
        self,
        prep: Prepared,
        algorithm: str,
        streams: list[Stream | None],
        async_op: bool,
        by_ranks: bool,
        program: Program | None = None,
    ) -> Launched:
        """One checked call by ``algorithm``, or by ``program`` where the call made its
        own (all_to_all_v). ``by_ranks``: the ranks' own threads made the call together."""
        if program is None:
            if algorithm == "nccl":
                return self._launch_nccl(prep, streams)
            program = self.cache.program(algorithm, prep)
        plan = program.plan
        bufs = self.cache.buffers(program, prep)
        if self._can_inline(prep, streams, async_op):
            try:
                # _can_inline checked these are host devices
                every_core = prep.nbytes >= INLINE_EVERY_CORE_FROM[by_ranks]
                program.run_inline(
                    bufs,
                    cast("list[HostDevice]", self.devices),
                    self.inline_threads if every_core else None,
                )
            except (ValueError, TypeError):
                raise
            except BaseException as exc:  # noqa: BLE001 - re-raised
                self._raise_stream_error(exc)
            return Launched(prep.results, None, list(streams), None)
        events = program.call_events(fresh_ends=async_op)
        try:
            for r, cs in enumerate(streams):
                if cs is not None:
                    self.streams[r].wait_event(cs.record(self.caller_events[r]))
            program.enqueue(bufs, self.streams, events)
        except (ValueError, TypeError):
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised
            # a device error while enqueueing (a broken CUDA context): part of the plan
            # may be queued, so the World cannot be trusted any more
            self._raise_stream_error(exc)
        ends = [events[plan.end_events[r]] for r in range(self.size)]
        keep = (bufs, prep, events)
        if not async_op:
            if all(cs is None for cs in streams):
                try:
                    for ev in ends:
                        ev.synchronize(self.timeout)
                except BaseException as exc:  # noqa: BLE001 - re-raised
                    self._raise_stream_error(exc)
            else:
                for cs, ev in zip(streams, ends):
                    if cs is not None:
                        cs.wait_event(ev)
                    else:
                        ev.synchronize(self.timeout)
        return Launched(prep.results, ends, list(streams), keep)

    def _raise_stream_error(self, exc: BaseException) -> NoReturn:
        """Raise the error for ``exc``, caught in the devices' work: the World's own
        (chained to ``exc``), or ``exc`` itself where the World hands it back (an
        interrupt)."""
        err = self.on_stream_error(exc)
        if err is exc:
            raise exc
        raise err from exc

    def _can_inline(self, prep: Prepared, streams: list[Stream | None], async_op: bool) -> bool:
        return (
            self.backend == "host"
            and not async_op
            and (self.inline_bytes is None or prep.nbytes <= self.inline_bytes)
            and all(cs is None for cs in streams)
            and all(st.query() for st in self.streams)
        )

    def trace(self, program: Program, prep: Prepared, callers: list[Stream | None]) -> list[Span]:
        """Perform ``program`` for ``prep`` step by step, timing each step, after the
        queued work (host) or ordered after the ``callers`` streams (GPUs)."""
        from .trace import trace_program

        bufs: Buffers = self.cache.buffers(program, prep)
        if self.backend == "host":
            for st in self.streams:
                st.synchronize(self.timeout)
            return trace_program(program, bufs)
        for r, st in enumerate(self.streams):
            caller = callers[r]
            if caller is not None:
                st.wait_event(caller.record(self.caller_events[r]))
        return trace_program(program, bufs, self.streams)

    # -- NCCL -----------------------------------------------------------------------------
    def nccl_engine(self) -> NcclEngine:
        """The World's NCCL communicators (made on first use; fails with the reason)."""
        if self._nccl is None:
            from .nccl import NcclEngine

            self._nccl = NcclEngine(self.devices)
        return self._nccl

    def nccl_usable(self) -> bool:
        """Whether NCCL works for these devices (asked once, then kept)."""
        if self._nccl_unusable is None:
            try:
                self.nccl_engine()
                self._nccl_unusable = ""
            except (NcclTreeError, ValueError) as exc:
                self._nccl_unusable = str(exc)  # asked once: "auto" falls back for good
        return not self._nccl_unusable

    def _launch_nccl(self, prep: Prepared, streams: list[Stream | None]) -> Launched:
        """NCCL on the caller streams; returns at once (stream-ordered, as every engine),
        with the watchdog holding the buffers and the deadline until the work completes."""
        try:
            launched = self.nccl_engine().launch(prep, streams)
        except CommError as exc:
            self._raise_stream_error(exc)
        self._watch(
            f"NCCL {prep.collective} of {prep.nbytes} B per rank",
            launched.events or [],
            launched.keepalive,
        )
        return launched

    def _watch(self, what: str, events: list[Event], keepalive: object) -> None:
        if self._watchdog is None:
            from .watchdog import Watchdog

            # on the watchdog thread, a failure aborts the communicators and fails the
            # World for good, which wakes every rank waiting in a collective
            self._watchdog = Watchdog(self._on_watchdog_failure, name="nccltree-watchdog")
        self._watchdog.watch(what, events, self.timeout, keepalive)

    def _on_watchdog_failure(self, exc: BaseException) -> None:
        self.on_stream_error(exc)

    def close(self, failed: bool) -> None:
        """Outstanding NCCL work must finish before its communicators are destroyed
        (ncclCommDestroy would wait for it without a bound): drained within the timeout
        unless the World ``failed``, aborted otherwise."""
        drained = True
        if self._watchdog is not None:
            drained = not failed and self._watchdog.drain(self.timeout)
            self._watchdog.close()
        if self._nccl is not None:
            self._nccl.close(abort=failed or not drained)
            self._nccl = None

    def abort(self) -> None:
        """Abort the NCCL communicators (the World failed)."""
        if self._nccl is not None:
            self._nccl.close(abort=True)
