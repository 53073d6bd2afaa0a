"""A World's memory between calls: its cached programs and its scratch and staging.

``ProgramCache`` keeps the plans a World built, resolved for its devices
(:class:`~nccltree.comm.executor.Program`), bounded by count and by steps, and each rank's
scratch (device) and staging (pinned host) buffers, bounded by ``max_scratch_bytes``. It
builds nothing itself: the World hands it the plan builder and the chunk policy, and it
never takes the World's lock (every call into it is made under that lock).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import debug
from ._args import Array, Prepared
from .collectives import COLLECTIVES
from .executor import Buffers, Program
from .plan import IN, OUT, STAGE, TMP, Plan

if TYPE_CHECKING:
    from ..backends.base import Device, Stream

# The plan cache keeps at most this many plans, and at most this many steps in all.
PLAN_CACHE_PLANS = 256
PLAN_CACHE_STEPS = 1 << 20


class ProgramCache:
    """The programs and the scratch of one World (``label`` names it in the log).

    ``build_plan(algorithm, prep)`` builds a call's plan and ``chunk_elements(prep)``
    says its chunk (for the log); ``streams`` are the ranks' communication streams, the
    only ones that touch their device scratch.
    """

    def __init__(
        self,
        devices: Sequence[Device],
        streams: Sequence[Stream],
        max_scratch_bytes: int | None,
        build_plan: Callable[[str, Prepared], Plan],
        chunk_elements: Callable[[Prepared], int],
        label: str,
    ) -> None:
        self.devices = list(devices)
        self.size = len(self.devices)
        self.streams = list(streams)
        #: the cap on the scratch and staging kept between calls (None: no cap)
        self.max_scratch_bytes = max_scratch_bytes
        self.build_plan = build_plan
        self.chunk_elements = chunk_elements
        self.label = label
        #: the cached plans and their programs (same keys, oldest first)
        self.plans: dict[tuple[object, ...], Plan] = {}
        self.programs: dict[tuple[object, ...], Program] = {}
        self.plan_steps = 0  # steps held by the cached plans
        self._scratch: dict[tuple[int, str, bool], Array] = {}
        self._transient = False  # this call got a scratch buffer past the cap

    def program(self, algorithm: str, prep: Prepared) -> Program:
        """The cached plan of a call, resolved for the World (built on first use)."""
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
        program = self.programs.get(key)
        if program is None:
            chunk = self.chunk_elements(prep)
            plan = self.build_plan(algorithm, prep)
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
                debug.log.info(debug.plan_line(plan, prep.dtype.itemsize, self.label, chunk))
            # bounded by count and by steps: a ring plan holds O(size^2) steps (about
            # 180 B each, plus its resolved form), so a few large ones weigh more than
            # hundreds of small ones
            self.plan_steps += len(plan.steps)
            while self.plans and (
                len(self.plans) >= PLAN_CACHE_PLANS or self.plan_steps > PLAN_CACHE_STEPS
            ):
                old = next(iter(self.plans))
                self.plan_steps -= len(self.plans.pop(old).steps)
                del self.programs[old]
            self.plans[key] = plan
            self.programs[key] = program
        return program

    def program_for(
        self, key: tuple[object, ...], make: Callable[[], tuple[Plan, Mapping[str, Sequence[int]]]]
    ) -> Program:
        """The cached program of a call that builds its own plan (all_to_all_v): ``make``
        returns the plan and its buffers' extents, on first use."""
        program = self.programs.get(key)
        if program is None:
            plan, extents = make()
            program = Program(plan, self.devices, extents)
            self.programs[key] = program
            self.plans[key] = plan
            self.plan_steps += len(plan.steps)
        return program

    def buffers(self, program: Program, prep: Prepared) -> Buffers:
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
                return dev.empty((count,), dtype, stream=self.streams[rank])
        if buf is None or buf.size < count:
            # Reuse is safe: consecutive collectives are ordered on the comm streams and a
            # plan's end fences cover every access to a rank's scratch. Device scratch is
            # allocated for the rank's comm stream, the only stream that touches it, so a
            # pool reuses a replaced (smaller) block only in that stream's order.
            dev = self.devices[rank]
            if pinned:
                buf = dev.pinned_empty((count,), dtype)
            else:
                buf = dev.empty((count,), dtype, stream=self.streams[rank])
            self._scratch[key] = buf
            # programs that kept the replaced buffer look theirs up again (and do not keep
            # the old memory alive meanwhile)
            self._forget_memory()
        return buf[:count]

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch and staging memory kept between calls, over every rank."""
        return sum(int(b.nbytes) for b in self._scratch.values())

    def release(self) -> int:
        """Drop the scratch and staging kept between calls (the caller has made sure no
        queued work uses them); returns the bytes released."""
        released = self.scratch_bytes
        self._scratch.clear()
        self._forget_memory()
        return released

    def _forget_memory(self) -> None:
        for program in self.programs.values():
            program.memory = None
