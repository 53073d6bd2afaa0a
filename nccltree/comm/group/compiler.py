"""A process group's call compiled for one process: the plan every process builds, cut
into schedules (:mod:`.schedule`), the node's arenas laid out for its buffers, and this
process's items as runs (consecutive steps without waits fused into one program; with
staging, :mod:`.staging`, its steps and sends rewritten). Pure data from the call's
signature and the group's placement: no memory is touched, no message sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ...backends.base import Array, Device
from .. import debug
from .._args import Prepared
from ..algorithms import ALGORITHMS
from ..collectives import COLLECTIVES
from ..executor import Program
from ..plan import IN, OUT, STAGE, TMP, Plan, Step, align_bytes
from .gpu import message_order
from .node_memory import SIG_BYTES, Mem
from .schedule import RECV, Item, Schedule, split
from .staging import MIRROR, Staging
from .staging import plan as staged_plan

if TYPE_CHECKING:
    from .placement import Placement

#: what the ``plan`` hook takes: (collective, count, algorithm=, op=, root=, in_place=,
#: dtype=) -> the plan every process builds
PlanFn = Callable[..., Plan]

BASE = "base"  # an in-place rank's one buffer (its mirror holds the input and the output)


def in_place_shape(collective: str, rank: int, count: int, size: int) -> tuple[int, int]:
    """In place: (where the input starts minus where the output starts, in elements; the
    elements of the one buffer holding both)."""
    coll = COLLECTIVES[collective]
    off_in, off_out = coll.in_place(rank, count, size)
    shift = off_in - off_out
    nin, nout = coll.in_count(count, size), coll.out_count(count, size)
    return shift, max(nin + max(shift, 0), nout + max(-shift, 0))


@dataclass
class Run:
    """A stretch of a schedule: ``steps`` (a program of consecutive steps without waits,
    ``count`` of them), ``wait`` (the waits of ``item``) or ``send`` (``item``: a send or
    notify)."""

    kind: str
    program: Program | None = None
    item: Item | None = None
    count: int = 0
    recvs: tuple[int, ...] = ()  # kind "recv" (GPU groups): indices into the receives


@dataclass
class Compiled:
    """One call of one signature, compiled for this process (kept for the next call of
    the same signature)."""

    plan: Plan
    scheds: list[Schedule]
    mine: Schedule
    # per same-node process q: (rank, role) -> offset (bytes) in q's arena, and its size
    layouts: dict[int, tuple[dict[tuple[int, str], int], int]]
    # runs of this process's items: ("steps", Program, first item) or ("item", Item)
    runs: list[Run]
    writes: set[tuple[int, str]]  # (rank, role) that some step writes
    # the schedule with this process's user buffers staged range by range (staging.py);
    # None where that is not possible (then whole buffers are mirrored)
    staged_runs: list[Run] | None = None
    staging: Staging | None = None
    sig: str = ""  # the call's signature, compared between processes
    sig_raw: bytes = b""
    # the buffers of every rank, as the last call left them (see _buffers), and what they
    # were made for: the node's arena generations and heap use
    arrays: list[dict[str, np.ndarray]] | None = None
    arrays_for: tuple[object, ...] = ()
    # this process's mirrors in its arena: (arena segment, {(rank, role): view})
    mirrors: tuple[Mem | None, dict[tuple[int, str], np.ndarray]] = (None, {})
    # where the messages from other nodes land: every call's receives have completed when
    # it returns, so the next call of this signature reuses it (no fresh pages per call)
    recv_arena: Array | None = None


class Compiler:
    """Compiles the calls of one process (cached by signature). ``plan``: the group's
    plan hook; ``all_devices``: the device the executor names for each rank;
    ``sync_mode``: a GPU group across nodes (NCCL receives placed in the global
    message order, :func:`~.gpu.message_order`)."""

    def __init__(
        self, placement: Placement, plan: PlanFn, all_devices: list[Device], sync_mode: bool
    ) -> None:
        self.pl = placement
        self.plan = plan
        self.all_devices = all_devices
        self.sync_mode = sync_mode
        self._compiled: dict[tuple[object, ...], Compiled] = {}

    def compile(self, algorithm: str, prep: Prepared, in_place: bool) -> Compiled:
        # the dtype itself, not its size: the compiled call keeps typed views and the
        # signature
        key = (algorithm, prep.collective, prep.count, prep.op, prep.root, in_place,
               prep.dtype.str, prep.array_dtype.str)  # fmt: skip
        got = self._compiled.get(key)
        if got is not None:
            return got
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r} has no plan")
        plan = self.plan(prep.collective, prep.count, algorithm=algorithm, op=prep.op,
                         root=prep.root, in_place=in_place, dtype=prep.dtype)  # fmt: skip
        scheds = split(plan, self.pl.proc_of_rank, self.pl.tnode_of_proc)
        mine = scheds[self.pl.proc]
        coll = COLLECTIVES[prep.collective]
        n = self.pl.size
        item = prep.dtype.itemsize
        extents = {
            IN: [coll.in_count(prep.count, n)] * n,
            OUT: [coll.out_count(prep.count, n)] * n,
            TMP: [plan.scratch.get(r, 0) for r in range(n)],
            STAGE: [plan.stage.get(r, 0) for r in range(n)],
            RECV: [mine.arena] * n,
        }
        layouts = {}
        for q in self.pl.node_procs:
            lay: dict[tuple[int, str], int] = {}
            off = 0
            for r in range(n):
                if self.pl.proc_of_rank[r] != q:
                    continue
                exposed = scheds[q].exposed
                roles = [TMP, STAGE]
                if not in_place:
                    roles += [role for role in (IN, OUT) if (r, role) in exposed]
                for role in roles:
                    cnt = extents[role][r]
                    if cnt:
                        lay[(r, role)] = off
                        off += align_bytes(cnt * item)
                if in_place and ((r, IN) in exposed or (r, OUT) in exposed):
                    # one mirror for the one buffer: input and output at their in-place
                    # offsets inside it (all_gather: the input inside the output;
                    # reduce_scatter: the output inside the input)
                    shift, base = in_place_shape(prep.collective, r, prep.count, n)
                    lay[(r, BASE)] = off
                    lay[(r, IN)] = off + max(shift, 0) * item
                    lay[(r, OUT)] = off + max(-shift, 0) * item
                    off += align_bytes(base * item)
            layouts[q] = (lay, off)
        # GPU groups across nodes: NCCL receives at their place in the global order
        recv_before: dict[int, tuple[int, ...]] = {}
        if self.sync_mode and mine.recvs:
            pending: list[int] = []
            for kind, i in message_order(scheds, self.pl.proc):
                if kind == "recv":
                    pending.append(i)
                elif pending:
                    recv_before[i] = tuple(pending)
                    pending = []
            if pending:
                recv_before[len(mine.items)] = tuple(pending)
        # this process's items, consecutive steps without waits fused into one program
        runs = self._runs(plan, mine.items, extents, None, recv_before, prep.carried)
        exec_proc = [0] * len(plan.data_steps())
        for p, sched in enumerate(scheds):
            for it in sched.items:
                if it.kind == "step":
                    exec_proc[it.index] = p
        mirrored: dict[tuple[int, str], int] = {}
        one_buffer = set()
        lay = layouts[self.pl.proc][0]
        for r in self.pl.ranks:
            if in_place and (r, BASE) in lay:
                shift, _ = in_place_shape(prep.collective, r, prep.count, n)
                mirrored[(r, IN)], mirrored[(r, OUT)] = max(shift, 0), max(-shift, 0)
                one_buffer.add(r)
            elif not in_place:
                mirrored.update({(r, role): 0 for role in (IN, OUT) if (r, role) in lay})
        staging = staged_plan(
            plan.data_steps(), exec_proc, mine.items, self.pl.proc, set(self.pl.node_procs),
            mirrored, one_buffer,
        )  # fmt: skip
        staged_runs = None
        if staging is not None:
            extents = {**extents, MIRROR[IN]: extents[IN], MIRROR[OUT]: extents[OUT]}
            staged_runs = self._runs(plan, mine.items, extents, staging, recv_before, prep.carried)
        writes = {(s.dst.rank, s.dst.role) for s in plan.steps if s.dst is not None}
        got = Compiled(plan, scheds, mine, layouts, runs, writes, staged_runs, staging)
        got.sig = (
            f"{coll.describe(prep.op, prep.root)} count={prep.count} dtype={prep.dtype.name} "
            f"in_place={in_place} algorithm={algorithm}"
        )
        got.sig_raw = got.sig.encode()[:SIG_BYTES]
        self._compiled[key] = got
        if debug.info_enabled():
            debug.log.info(
                debug.plan_line(plan, item, f"process group rank {self.pl.rank}")
                + f"; this process: {len(mine.items)} items, {len(mine.recvs)} messages in, "
                f"{sum(it.kind in ('send', 'notify') for it in mine.items)} out"
            )
        return got

    def _runs(
        self,
        plan: Plan,
        items: Sequence[Item],
        extents: dict[str, list[int]],
        staging: Staging | None,
        recv_before: dict[int, tuple[int, ...]],
        carried: np.dtype | None = None,
    ) -> list[Run]:
        """This process's items as runs: consecutive steps without waits fused into one
        program; with ``staging``, its steps and sends rewritten (staging.py); receives
        (GPU groups across nodes) placed before the items ``recv_before`` names;
        ``carried``: the dtype the arrays carry, for the programs to name (see
        :class:`~nccltree.comm.executor.Program`)."""
        n = plan.size
        runs: list[Run] = []
        group: list[Item] = []

        def steps_of(it: Item) -> list[Step]:
            assert it.step is not None
            if staging is None:
                return [it.step]
            return staging.steps.get(it.index, [it.step])

        def flush() -> None:
            if group:
                steps = [st for it in group for st in steps_of(it)]
                sub = Plan(n, steps, 0, dict(plan.scratch), dict(plan.stage), plan.same_buffer)
                runs.append(
                    Run(
                        "steps",
                        Program(sub, self.all_devices, extents, carried),
                        None,
                        len(group),
                    )
                )
                group.clear()

        for k, it in enumerate(items):
            if k in recv_before:
                flush()
                runs.append(Run("recv", recvs=recv_before[k]))
            if it.kind == "step" and not it.waits and not it.recvs:
                group.append(it)
                continue
            flush()
            if it.kind in ("step", "end"):
                runs.append(Run("wait", item=it))
                if it.kind == "step":
                    group.append(it)
            else:
                src = staging.sends.get(k) if staging is not None else None
                runs.append(Run("send", item=it if src is None else replace(it, src=src)))
        flush()
        if len(items) in recv_before:
            runs.append(Run("recv", recvs=recv_before[len(items)]))
        return runs
