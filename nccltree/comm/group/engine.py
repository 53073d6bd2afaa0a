"""The schedule engine of a process group: one call compiled into this process's part
(its schedule's items as runs: fused programs, waits, sends) and performed.

A call, in one process (the module docstring of :mod:`.group` tells the whole story):

1. its plan cut into schedules (:mod:`.schedule`), its buffers laid out in the node's
   arenas, its runs made: compiled once per signature and kept;
2. the user's buffers that another process of the node reads or writes are copied into
   this process's arena ("mirrors"; symmetric buffers are used in place; where the
   schedule allows, staged range by range, :mod:`.staging`);
3. the call's signature and buffer locations published (the control block within the
   node, a small MPI message to every process of another node); this process arrives;
4. every signature compared with this process's own: a mismatch raises ``ValueError``
   on every process before any buffer is written;
5. the runs performed (host: the executor's programs inline, MPI messages between
   nodes; GPU: on the group's stream, :mod:`.gpu`); the mirrors copied back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from ... import _native
from ..._errors import CommError
from ...backends.base import Array, Device
from .._args import Prepared
from ..collectives import COLLECTIVES
from ..executor import Buffers
from ..flight import Entry
from ..plan import IN, OUT, STAGE, TMP
from .compiler import BASE, Compiled, Compiler, PlanFn, Run, in_place_shape
from .mpi_collectives import mpi_type
from .node_memory import MAX_LOCAL_RANKS, SIG_BYTES, Mem
from .schedule import RECV, Item
from .staging import MIRROR

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from ...backends.host import HostDevice
    from .core import Core
    from .placement import Placement

_Requests = dict[tuple[int, int], "_MPI.Request"]


def _mismatch(pl: Placement, sig: str, bad: dict[int, str]) -> str:
    lines = [f"collective arguments differ between processes: ranks {list(pl.ranks)} call {sig}"]
    for p, s in sorted(bad.items()):
        lines.append(f"  ranks {pl.ranks_of(p)} call {s}")
    return "\n".join(lines)


NOTHING = np.empty(0, np.uint8)  # the payload of a notify


@dataclass
class _Placed:
    """Where this process's ranks' buffers are for one call: the locations published
    (symmetric buffers; None when there are none), the copies back to the user's buffers
    (in order), each rank's input and output as the call uses them, the staged call's
    mirror views (roles ``m:in``/``m:out``), and whether the call is staged."""

    loc: np.ndarray | None
    copy_back: list[tuple[np.ndarray, np.ndarray]]
    mine_in: dict[int, np.ndarray]
    mine_out: dict[int, np.ndarray]
    extra: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    staged: bool = False


@dataclass
class EngineContext:
    """What the engine needs of its group: the shared core, the control communicator
    (signatures to other nodes; None without MPI, where a GPU group's processes of
    other nodes agree first, :mod:`.agreement`), the devices (this process's ranks'; every rank's, as the executor
    names them), the host threads for copies and programs, and the plan hook."""

    core: Core
    ctl_comm: _MPI.Intracomm | None
    devices: list[Device]
    all_devices: list[Device]
    threads: int
    plan: PlanFn


class Engine:
    """Compiles and performs the calls of one group (see the module docstring).
    ``sent_bytes``: payload this process sent to other nodes (its own count)."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.pl = ctx.core.placement
        self.mem = ctx.core.mem
        self.waits = ctx.core.waits
        self.gpu = ctx.core.gpu
        self.sent_bytes = 0
        # MPI's communicator and module: used only for messages to other nodes, which a
        # group started without MPI never has (its host groups span one node)
        self._comm = cast("_MPI.Intracomm", ctx.core.comm)
        self._mpi = cast("ModuleType", ctx.core.mpi)
        self.compiler = Compiler(
            ctx.core.placement,
            ctx.plan,
            ctx.all_devices,
            ctx.core.gpu is not None and ctx.core.gpu.sync_mode,
        )
        self._arrivals = 0  # collectives that arrive through shared memory (not "mpi")
        self._base = dict.fromkeys(self.pl.node_procs, 0)  # steps completed before this call

    def count_arrival(self) -> None:
        """A call that arrived through the node's arrival counter outside the engine (the
        small path, :mod:`.small`): the engine's numbering of arrivals follows it."""
        self._arrivals += 1

    def run(self, algorithm: str, prep: Prepared, entry: Entry) -> None:
        """One call of this process's ranks with ``algorithm``'s plan (the module
        docstring's steps)."""
        coll = COLLECTIVES[prep.collective]
        # a rooted call whose output is the root's only: in place there is planned as out of
        # place (the root's output is made distinct memory, then copied back)
        in_place = prep.in_place and not coll.root_output
        c = self.compiler.compile(algorithm, prep, in_place)
        g = self.gpu
        if g is not None:
            if g.ipc_problem:
                raise CommError(g.ipc_problem)
            g.begin()
        self._arrivals += 1
        seq = self._arrivals
        dt = prep.array_dtype  # the arrays' (uint16 CuPy arrays that carry bfloat16)
        # 1. this process's arena, grown (a new segment) when the call needs more
        self.mem.ensure_arena(c.layouts[self.pl.proc][1])
        arena = self.mem.arenas.get(self.pl.proc)
        if c.mirrors[0] is not arena:
            c.mirrors = (arena, {})
        # 2. where this process's ranks' buffers are, and the mirrors filled
        placed = self._place(c, prep, in_place, arena)
        # 3. publish the signature and the locations, arrive; 4. everybody's signature
        parity = seq & 1
        reqs, recv = self._arrive(c, seq, placed.loc, entry, dt)
        if g is not None:
            g.after([p for p in self.pl.node_procs if p != self.pl.proc])
        # 5. the buffers of every rank this process touches
        bufs = self._buffers(c, prep, placed.mine_in, placed.mine_out, parity, recv, placed.extra)
        runs = c.staged_runs if placed.staged and c.staged_runs is not None else c.runs
        if g is not None:
            self._execute_gpu(c, runs, bufs, recv)
        else:
            self._execute(runs, bufs, reqs)
        for dst, src in placed.copy_back:
            self.copy(dst, src)
        if g is not None:
            g.end(c.sig, (prep, bufs, recv))
        for q in self.pl.node_procs:
            self._base[q] += c.scheds[q].n_steps
        self.mem.settle_arenas()

    def _place(self, c: Compiled, prep: Prepared, in_place: bool, arena: Mem | None) -> _Placed:
        """Step 2: where this process's ranks' buffers are for the call (the user's, a
        symmetric buffer, or a mirror), the mirrors filled, the copies back queued."""
        coll = COLLECTIVES[prep.collective]
        dt = prep.array_dtype
        mirrors = c.mirrors[1]
        heaps = bool(self.mem.heaps)
        ins = {r: prep.ins[i] for i, r in enumerate(self.pl.ranks)}
        outs = {r: prep.outs[i] for i, r in enumerate(self.pl.ranks)}
        if coll.root_output and prep.in_place and prep.root in ins:
            i = self.pl.ranks.index(prep.root)
            outs[prep.root] = self.ctx.devices[i].empty(prep.outs[i].shape, dt)
        lay = c.layouts[self.pl.proc][0]
        loc = np.full((MAX_LOCAL_RANKS, 4), -1, np.int64) if heaps else None
        copy_back: list[tuple[np.ndarray, np.ndarray]] = []
        mine_in: dict[int, np.ndarray] = {}
        mine_out: dict[int, np.ndarray] = {}
        own_heap = heaps and any(
            self.mem.heap_of(a) is not None for r in self.pl.ranks for a in (ins[r], outs[r])
        )
        # user buffers staged range by range where the schedule allows (staging.py);
        # symmetric buffers are used in place; else whole buffers are mirrored
        staged = c.staging is not None and not own_heap
        placed = _Placed(loc, copy_back, mine_in, mine_out, {}, staged)
        if staged:
            self._stage(c, prep, ins, outs, mirrors, arena, copy_back, mine_in, mine_out,
                        placed.extra)  # fmt: skip
            return placed
        for i, r in enumerate(self.pl.ranks):
            user_in, user_out = ins[r], outs[r]
            if user_out is not prep.outs[i]:  # the root's output made distinct (see above)
                copy_back.append((prep.outs[i], user_out))
            if in_place:
                base_user = user_out if user_out.size >= user_in.size else user_in
                hin = self.mem.heap_of(user_in) if heaps else None
                hout = self.mem.heap_of(user_out) if heaps else None
                if hin is not None and hout is not None:
                    assert loc is not None
                    loc[i] = (*hin, *hout)
                    mine_in[r], mine_out[r] = user_in, user_out
                elif (r, IN) in lay:
                    m = self._base_mirror(prep, r, lay, arena, mirrors)
                    mine_in[r], mine_out[r] = mirrors[(r, IN)], mirrors[(r, OUT)]
                    self.copy(mine_in[r], user_in)
                    if (r, IN) in c.writes or (r, OUT) in c.writes:
                        copy_back.insert(0, (base_user, m))
                else:
                    mine_in[r], mine_out[r] = user_in, user_out
                continue
            for j, role in enumerate((IN, OUT)):
                arr = user_in if role == IN else user_out
                table = mine_in if role == IN else mine_out
                heap = self.mem.heap_of(arr) if heaps else None
                if heap is not None:
                    assert loc is not None
                    loc[i, 2 * j], loc[i, 2 * j + 1] = heap
                    table[r] = arr
                elif (r, role) in lay:
                    m = self._role_mirror(prep, r, role, arr.size, lay, arena, mirrors)
                    table[r] = m
                    if role == IN:
                        self.copy(m, arr)
                    if (r, role) in c.writes:
                        # before the de-aliased root output's own copy back
                        copy_back.insert(0, (arr, m))
                else:
                    table[r] = arr
        return placed

    def _arrive(
        self, c: Compiled, seq: int, loc: np.ndarray | None, entry: Entry, dt: np.dtype
    ) -> tuple[_Requests, Array | None]:
        """Steps 3 and 4: this call's signature and buffer locations published, its
        receives posted, this process arrived; every process's signature compared with
        its own (``ValueError`` on a mismatch, the receives cancelled). Returns the
        receives and the receive arena."""
        g = self.gpu
        mem = self.mem
        sig = c.sig
        parity = seq & 1
        d, head, dloc = mem.own_desc[parity]
        raw = c.sig_raw
        if mem.desc_written[parity] is not raw:  # the same signature as last time: as is
            d[16 : 16 + len(raw)] = raw
            head[1] = len(raw)
            mem.desc_written[parity] = raw
        head[0] = seq
        if loc is not None:
            dloc[:] = loc.reshape(-1)
            mem.desc_written[parity] = None  # rewrite the locations next time
        elif mem.desc_loc_set[parity]:
            dloc[:] = -1
        mem.desc_loc_set[parity] = loc is not None
        mem.publish_gen()
        reqs, recv = self._post_receives(c, dt)
        ctl = self._exchange_signatures(sig, seq)
        if g is not None:
            g.published()  # the copies into the arena, before anybody reads them
        mem.arrive[self.pl.proc].add(1)
        entry.state = "arrived"
        for p in self.pl.node_procs:
            if p == self.pl.proc:
                continue
            self.waits.counter(mem.arrive[p], seq, p, "arrival")
        theirs = self._finish_signatures(ctl)
        try:
            mem.refresh_arenas()
        except CommError:
            # a process that failed frees its new arenas' names, having told the node
            # first: its failure is the error, not the name found missing
            self.waits.check_peers()
            raise
        for p in self.pl.node_procs:
            if p != self.pl.proc:
                pd, phead, _ = mem.peer_desc[p][parity]
                n = int(phead[1])
                if bytes(pd[16 : 16 + n]) != raw:
                    theirs[p] = bytes(pd[16 : 16 + n]).decode(errors="replace")
        bad = {p: s for p, s in theirs.items() if s != sig}
        if bad:
            for req in reqs.values():
                req.Cancel()
                req.Wait()
            raise ValueError(_mismatch(self.pl, sig, bad))
        entry.state = "running"
        return reqs, recv

    def refuse(self, sig: str) -> None:
        """A call this process's own checks refused: its arrival all the same, with
        ``sig`` (which says so) as its signature, so that every other process raises
        ``ValueError`` naming it instead of waiting for a call that never comes; raises
        ``ValueError`` here too when the others differ (the caller raises its own error).
        Also the agreement of a group without MPI on one transport node
        (:mod:`.agreement`), host or GPU: only the control block is used."""
        self._arrivals += 1
        seq = self._arrivals
        parity = seq & 1
        mem = self.mem
        raw = sig.encode()[:SIG_BYTES]
        d, head, dloc = mem.own_desc[parity]
        d[16 : 16 + len(raw)] = raw
        head[1] = len(raw)
        head[0] = seq
        mem.desc_written[parity] = None
        if mem.desc_loc_set[parity]:
            dloc[:] = -1
            mem.desc_loc_set[parity] = False
        mem.publish_gen()
        ctl = self._exchange_signatures(sig, seq)
        mem.arrive[self.pl.proc].add(1)
        for p in self.pl.node_procs:
            if p != self.pl.proc:
                self.waits.counter(mem.arrive[p], seq, p, "arrival")
        theirs = self._finish_signatures(ctl)
        for p in self.pl.node_procs:
            if p != self.pl.proc:
                pd, phead, _ = mem.peer_desc[p][parity]
                theirs[p] = bytes(pd[16 : 16 + int(phead[1])]).decode(errors="replace")
        if any(t != sig for t in theirs.values()):
            raise ValueError(_mismatch(self.pl, sig, {p: t for p, t in theirs.items() if t != sig}))

    def copy(self, dst: Array, src: Array) -> None:
        """A staging copy: on a GPU, on the group's stream; on the host, the library's
        copy (streaming stores, the process's threads) from 64 KiB, numpy's below, where
        a call costs more than the copy."""
        if self.gpu is not None:
            self.gpu.copy(dst, src)
        elif dst.nbytes >= 1 << 16 and dst.dtype in _native.DTYPES:
            _native.copy_checked(dst, src, self.ctx.threads)
        else:
            np.copyto(dst, src)

    def _base_mirror(
        self,
        prep: Prepared,
        r: int,
        lay: dict[tuple[int, str], int],
        arena: Mem | None,
        mirrors: dict[tuple[int, str], np.ndarray],
    ) -> np.ndarray:
        """In place: rank ``r``'s one mirror, with its input and output views (cached in
        ``mirrors`` under ``(r, BASE)``, ``(r, IN)``, ``(r, OUT)``)."""
        m = mirrors.get((r, BASE))
        if m is None:
            assert arena is not None
            coll = COLLECTIVES[prep.collective]
            nin, nout = (
                coll.in_count(prep.count, self.pl.size),
                coll.out_count(prep.count, self.pl.size),
            )
            shift, base = in_place_shape(prep.collective, r, prep.count, self.pl.size)
            m = mirrors[(r, BASE)] = arena.view(prep.array_dtype, base, lay[(r, BASE)])
            mirrors[(r, IN)] = m[max(shift, 0) : max(shift, 0) + nin]
            mirrors[(r, OUT)] = m[max(-shift, 0) : max(-shift, 0) + nout]
        return m

    @staticmethod
    def _role_mirror(
        prep: Prepared,
        r: int,
        role: str,
        size: int,
        lay: dict[tuple[int, str], int],
        arena: Mem | None,
        mirrors: dict[tuple[int, str], np.ndarray],
    ) -> np.ndarray:
        """Rank ``r``'s mirror of its ``role`` buffer (cached in ``mirrors``)."""
        m = mirrors.get((r, role))
        if m is None:
            assert arena is not None
            m = mirrors[(r, role)] = arena.view(prep.array_dtype, size, lay[(r, role)])
        return m

    def _stage(
        self,
        c: Compiled,
        prep: Prepared,
        ins: dict[int, np.ndarray],
        outs: dict[int, np.ndarray],
        mirrors: dict[tuple[int, str], np.ndarray],
        arena: Mem | None,
        copy_back: list[tuple[np.ndarray, np.ndarray]],
        mine_in: dict[int, np.ndarray],
        mine_out: dict[int, np.ndarray],
        extra: dict[int, dict[str, np.ndarray]],
    ) -> None:
        """The staged call's buffers: the user's as the ranks' own, the mirrors beside
        them (roles ``m:in``/``m:out``), the ranges the staging plan copies in done now
        and those it copies back queued."""
        staging = c.staging
        assert staging is not None
        lay = c.layouts[self.pl.proc][0]
        pairs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for i, r in enumerate(self.pl.ranks):
            user_in, user_out = ins[r], outs[r]
            if user_out is not prep.outs[i]:  # the root's output made distinct
                copy_back.append((prep.outs[i], user_out))
            mine_in[r], mine_out[r] = user_in, user_out
            views: dict[str, np.ndarray] = {}
            if (r, BASE) in lay:
                m = self._base_mirror(prep, r, lay, arena, mirrors)
                views = {MIRROR[IN]: mirrors[(r, IN)], MIRROR[OUT]: mirrors[(r, OUT)]}
                pairs[(r, 0)] = (user_out if user_out.size >= user_in.size else user_in, m)
            else:
                for bid, (role, arr) in enumerate(((IN, user_in), (OUT, user_out))):
                    if (r, role) not in lay:
                        continue
                    got = self._role_mirror(prep, r, role, arr.size, lay, arena, mirrors)
                    views[MIRROR[role]] = got
                    pairs[(r, bid)] = (arr, got)
            extra[r] = views
        for r, bid, lo, cnt in staging.copy_in:
            u, m = pairs[(r, bid)]
            self.copy(m[lo : lo + cnt], u[lo : lo + cnt])
        for r, bid, lo, cnt in staging.copy_out:
            u, m = pairs[(r, bid)]
            copy_back.insert(0, (u[lo : lo + cnt], m[lo : lo + cnt]))

    def _buffers(self, c: Compiled, prep: Prepared, mine_in: dict[int, np.ndarray],
                 mine_out: dict[int, np.ndarray], parity: int, recv: np.ndarray | None,
                 extra: dict[int, dict[str, np.ndarray]]) -> Buffers:  # fmt: skip
        """Every rank's buffers for this call: this process's ranks' from the call, the
        node's other ranks' from their arenas (or their symmetric buffers), kept from the
        last call while the arenas are the same and no symmetric buffer is in use."""
        key: tuple[object, ...] = (
            tuple(self.mem.arena_gen[q] for q in self.pl.node_procs),
            parity if self.mem.heaps else -1,
        )
        arrays = c.arrays
        if arrays is None or c.arrays_for != key:
            arrays = self._remote_arrays(c, prep, parity)
            c.arrays, c.arrays_for = arrays, key
        for r in self.pl.ranks:
            a = arrays[r]
            a[IN], a[OUT] = mine_in[r], mine_out[r]
            views = extra.get(r)
            if views:
                a.update(views)
        if recv is not None:
            for a in arrays:
                a[RECV] = recv
        b = Buffers.__new__(Buffers)
        b.arrays = arrays
        return b

    def _remote_arrays(
        self, c: Compiled, prep: Prepared, parity: int
    ) -> list[dict[str, np.ndarray]]:
        n = self.pl.size
        dt = prep.array_dtype
        coll = COLLECTIVES[prep.collective]
        nin, nout = coll.in_count(prep.count, n), coll.out_count(prep.count, n)
        empty = np.empty(0, dt)
        arrays: list[dict[str, np.ndarray]] = [
            {IN: empty, OUT: empty, TMP: empty, STAGE: empty, RECV: empty} for _ in range(n)
        ]
        for q in self.pl.node_procs:
            lay, _ = c.layouts[q]
            seg = self.mem.arenas.get(q)
            for r in range(n):
                if self.pl.proc_of_rank[r] != q:
                    continue
                a = arrays[r]
                for role, cnt in ((TMP, c.plan.scratch.get(r, 0)), (STAGE, c.plan.stage.get(r, 0))):
                    if cnt and seg is not None:
                        a[role] = seg.view(dt, cnt, lay[(r, role)])
                if q == self.pl.proc:
                    continue
                loc = self.mem.peer_desc[q][parity][2]
                i = r - self.pl.first_rank_of_proc[q]
                for j, (role, cnt) in enumerate(((IN, nin), (OUT, nout))):
                    h, off = int(loc[4 * i + 2 * j]), int(loc[4 * i + 2 * j + 1])
                    if h >= 0 and self.mem.heaps:
                        a[role] = self.mem.heaps[h][q].view(dt, cnt, off)
                    elif (r, role) in lay and seg is not None:
                        a[role] = seg.view(dt, cnt, lay[(r, role)])
        return arrays

    def _execute(self, runs: list[Run], bufs: Buffers, reqs: _Requests) -> None:
        mine = self.mem.progress[self.pl.proc]
        sends: list[_MPI.Request] = []
        self.waits.inflight = sends
        MPI = self._mpi
        for run in runs:
            if run.program is not None:
                run.program.run_inline(
                    bufs, cast("list[HostDevice]", self.ctx.all_devices), self.ctx.threads
                )
                mine.add(run.count)
                continue
            it = run.item
            assert it is not None
            if it.kind != "notify":
                self._wait_steps(it)
            if run.kind == "wait":
                for q, tag in it.recvs:
                    self.waits.request(reqs[(q, tag)], q, "a message")
                continue
            dest = self.pl.mpi_rank_of_proc[it.peer]
            if it.kind == "send":
                assert it.src is not None
                src = bufs.view(it.src)
                sends.append(
                    self._comm.Isend([src, mpi_type(MPI, src.dtype)], dest, it.tag % 32768)
                )
                self.sent_bytes += src.nbytes
            else:
                sends.append(self._comm.Isend([NOTHING, MPI.BYTE], dest, it.tag % 32768))
        self.waits.inflight = []
        for req in sends:
            self.waits.request(req, -1, "a send to finish")
        for (q, _), req in reqs.items():
            self.waits.request(req, q, "a message")

    def _wait_steps(self, it: Item) -> None:
        """The steps of the node's other processes that ``it`` needs, done."""
        for q, k in it.waits:
            self.waits.counter(self.mem.progress[q], self._base[q] + k, q, "a step")

    def _execute_gpu(self, c: Compiled, runs: list[Run], bufs: Buffers,
                     recv: Array | None) -> None:  # fmt: skip
        """This process's runs on the group's stream (gpu.py: the two ordering modes)."""
        g = self.gpu
        assert g is not None
        mine = self.mem.progress[self.pl.proc]
        streams = [g.stream] * self.pl.size
        for run in runs:
            if run.program is not None:
                run.program.enqueue(bufs, streams, run.program.call_events(False))
                g.published()
                mine.add(run.count)
                continue
            if run.kind == "recv":
                assert recv is not None
                for j in run.recvs:
                    q, _, count, off = c.mine.recvs[j]
                    if count:
                        g.recv(recv[off : off + count], q)
                    else:
                        g.notify(q, receive=True)
                continue
            it = run.item
            assert it is not None
            if it.kind != "notify":
                self._wait_steps(it)
                g.after([q for q, _ in it.waits])
            if run.kind == "wait":
                continue  # its messages were received in order, on the stream
            if it.kind == "send":
                assert it.src is not None
                src = bufs.view(it.src)
                g.send(src, it.peer)
                self.sent_bytes += src.nbytes
            else:
                g.notify(it.peer, receive=False)

    def _post_receives(self, c: Compiled, dt: np.dtype) -> tuple[_Requests, Array | None]:
        """Every message this process will receive in the call, posted at once (GPU
        groups: only the receive arena; the receives are issued in order)."""
        reqs: _Requests = {}
        if not c.mine.recvs:
            return reqs, None
        if self.gpu is not None:
            if c.recv_arena is None:
                c.recv_arena = self.ctx.devices[0].empty(max(1, c.mine.arena), dt)
            return reqs, c.recv_arena
        arena = c.recv_arena
        if arena is None:
            arena = c.recv_arena = np.empty(max(1, c.mine.arena), dt)
        MPI = self._mpi
        for q, tag, count, off in c.mine.recvs:
            src = self.pl.mpi_rank_of_proc[q]
            if count:
                view = arena[off : off + count]
                reqs[(q, tag)] = self._comm.Irecv([view, mpi_type(MPI, dt)], src, tag % 32768)
            else:
                reqs[(q, tag)] = self._comm.Irecv([NOTHING, MPI.BYTE], src, tag % 32768)
        return reqs, arena

    def _exchange_signatures(
        self, sig: str, seq: int
    ) -> list[tuple[int, _MPI.Request, np.ndarray]]:
        """Non-blocking: this call's signature to every process of another node (over
        MPI; without MPI the call agreed first instead)."""
        ctl_comm = self.ctx.ctl_comm
        if not self.pl.remote_procs or ctl_comm is None:
            return []
        MPI = self._mpi
        raw = np.frombuffer(sig.encode()[:SIG_BYTES].ljust(SIG_BYTES, b"\0"), np.uint8).copy()
        tag = 0
        out = []
        for p in self.pl.remote_procs:
            dest = self.pl.mpi_rank_of_proc[p]
            box = np.zeros(SIG_BYTES, np.uint8)
            out.append((p, ctl_comm.Irecv([box, MPI.BYTE], dest, tag), box))
            out.append((p, ctl_comm.Isend([raw, MPI.BYTE], dest, tag), raw))
        return out

    def _finish_signatures(self, ctl: list[tuple[int, _MPI.Request, np.ndarray]]) -> dict[int, str]:
        got: dict[int, str] = {}
        for i, (p, req, box) in enumerate(ctl):
            self.waits.request(req, p, "its signature")
            if i % 2 == 0:
                got[p] = bytes(box).rstrip(b"\0").decode(errors="replace")
        return got
