"""Point-to-point on a process group (one rank per process): ``pg.send``, ``pg.recv``,
``pg.sendrecv``, ``with pg.batch():`` and ``pg.all_to_all_v`` (a batch of them).

As for a World's ranks (:mod:`nccltree.comm.p2p`), the n-th send from A to B matches the
n-th receive at B from A; a lone send may wait for its receive, so ranks that exchange
post both halves in one batch.

Two transports, chosen per peer:

- **Within a node** (the processes sharing memory), through the staging arena the
  collectives use: the sender writes one table entry per message (where, how many
  bytes) into the node's control segment, moves the pair's ``posted`` counter on and
  copies its messages into its arena (host: shared memory, above 4 MiB in 2 MiB chunks
  counted in the entry as each is in; GPU: device memory exported through CUDA IPC, all
  copied before ``posted`` moves); the receiver waits for that counter, copies the
  message out of the sender's arena (host: chunk by chunk, each once it is counted in,
  so one chunk goes out while the next comes in; GPU: a peer copy on the group's
  stream, after the sender's inter-process event) and moves the pair's ``consumed``
  counter on; the sender returns once its messages are consumed (its arena is then free
  again). Counters are
  the C futex primitive of the collectives; every wait is bounded by the group's timeout
  and watches the node's processes. A receive of another size than its send fails on
  both sides with ``ValueError`` (the receiver marks the entry), once the rest of the
  batch completed; the group goes on.
- **Between nodes**: host arrays as MPI messages on a communicator of their own
  (non-blocking, waited on with the group's bounded, liveness-checking waits); CuPy
  arrays as NCCL sends and receives on the caller's stream (a batch is one NCCL group),
  watched by the group's watchdog. A receive of another size than its send raises
  ``ValueError`` on the receiving rank only (MPI tells only the receiver); a timeout or
  a dead peer fails the group, as in a collective. A GPU group whose processes cannot
  reach each other's GPUs through IPC uses NCCL within the node too.

A batch cannot deadlock: its sends within the node are all published before any of its
waits (the arena is grown to hold them all), its messages to other nodes are all posted
before any wait, and a receiver acknowledges what it consumed before it blocks again.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ... import _native
from ..._errors import CommError
from ...backends.base import data_ptr
from .._args import Array, _device_array
from ..flight import Entry
from ..plan import align_bytes
from .mpi_collectives import mpi_type

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from ...backends.base import Device, Stream
    from ..flight import FlightRecorder
    from .core import Core
    from .lifecycle import Lifecycle

# The node's mailboxes, in its control segment after the processes' slots (see Mailboxes)
_ENTRY = 7  # int64 words per message: offset, bytes, status, receiver's bytes, tag, where,
#            ready (a counter: the message's chunks copied in; read on the host only)
_PAIR = 8  # int64 words per ordered pair: posted, consumed (counters), first seq,
#            first entry, the arena generation the receiver mapped, -
_OFFSET, _NBYTES, _STATUS, _THEIRS, _TAG, _WHERE, _READY = range(7)  # where: 0 arena, h+1 heap h
_FIRST_SEQ, _FIRST_ENTRY, _MAPPED = 2, 3, 4
_OK, _MISMATCH = 1, 2
#: ``all_to_all_v``'s messages carry this tag (``send``/``recv``: 0)
TAG_ALL_TO_ALL = 1
#: a message's tag on the wire (the mailbox entry, the MPI tag) also names its dtype, so
#: that a receive of another dtype fails as one of another size does (a code each; 0:
#: a dtype outside the table, not compared)
_DTYPE_CODES = {
    name: i + 1
    for i, name in enumerate(
        ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16",
         "int32", "uint32", "int64", "uint64", "bool", "complex64", "complex128")
    )
}  # fmt: skip
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}


def wire_tag(tag: int, dtype: np.dtype) -> int:
    """The tag a message travels with: its kind (``tag``, below 256) and its dtype."""
    return tag | _DTYPE_CODES.get(np.dtype(dtype).name, 0) << 8


def _tags_differ(a: int, b: int) -> bool:
    """Whether two wire tags disagree: their kinds, or their dtypes where both are known."""
    if a & 0xFF != b & 0xFF:
        return True
    da, db = a >> 8, b >> 8
    return bool(da and db and da != db)


#: host messages above twice this travel in chunks of it: the receiver copies a chunk out
#: while the sender copies the next one in (two copies overlapped, not one after the other)
CHUNK_BYTES = 2 << 20


def chunks(nbytes: int) -> int:
    """How many chunks a message of ``nbytes`` travels in (0 for an empty one)."""
    if nbytes <= 0:
        return 0
    return 1 if nbytes <= 2 * CHUNK_BYTES else -(-nbytes // CHUNK_BYTES)


def table_entries(nprocs: int) -> int:
    """Messages one process may publish to its node in one batch."""
    return max(1024, 4 * nprocs)


def mailbox_bytes(nprocs: int) -> int:
    """Bytes of the mailboxes of a node of ``nprocs`` processes."""
    return 8 * (nprocs * table_entries(nprocs) * _ENTRY + nprocs * nprocs * _PAIR)


class Mailboxes:
    """The node's point-to-point state in shared memory: per process a table of its
    published messages; per ordered pair (sender, receiver) two counters (``posted`` by
    the sender, ``consumed`` by the receiver), where the sender's current batch to the
    receiver starts (its sequence number and table entry), and the generation of the
    sender's arena the receiver has mapped (which tells the sender when an arena's name
    may go, see ``NodeMemory.settle_arenas``)."""

    def __init__(self, buf: mmap.mmap, offset: int, procs: list[int]) -> None:
        n = len(procs)
        self.slot = {p: i for i, p in enumerate(procs)}
        self.cap = table_entries(n)
        words = n * self.cap * _ENTRY
        tables = np.frombuffer(buf, np.int64, words, offset)
        self.tables = tables.reshape(n, self.cap, _ENTRY)
        at = offset + 8 * words
        self.pairs = np.frombuffer(buf, np.int64, n * n * _PAIR, at).reshape(n, n, _PAIR)
        self._buf = buf
        self._at = at
        self._tables_at = offset
        self._counters: dict[tuple[int, int, int], _native.Counter] = {}
        self._ready: dict[tuple[int, int], _native.Counter] = {}

    def counter(self, sender: int, receiver: int, which: int) -> _native.Counter:
        """``which`` 0: posted, 1: consumed, of the pair (sender, receiver)."""
        key = (sender, receiver, which)
        c = self._counters.get(key)
        if c is None:
            n = len(self.slot)
            i = self.slot[sender] * n + self.slot[receiver]
            c = _native.Counter(self._buf, self._at + 8 * (i * _PAIR + which), shared=True)
            self._counters[key] = c
        return c

    def ready(self, sender: int, k: int) -> _native.Counter:
        """The chunks of ``sender``'s message ``k`` (its table entry) copied in so far."""
        c = self._ready.get((sender, k))
        if c is None:
            at = self._tables_at + 8 * ((self.slot[sender] * self.cap + k) * _ENTRY + _READY)
            c = self._ready[sender, k] = _native.Counter(self._buf, at, shared=True)
        return c

    def pair(self, sender: int, receiver: int) -> np.ndarray:
        return self.pairs[self.slot[sender], self.slot[receiver]]

    def table(self, sender: int) -> np.ndarray:
        return self.tables[self.slot[sender]]

    def mapped(self, owner: int, peer: int) -> int:
        """The generation of ``owner``'s arena that ``peer`` has mapped."""
        return int(self.pair(owner, peer)[_MAPPED])

    def set_mapped(self, owner: int, peer: int, gen: int) -> None:
        self.pair(owner, peer)[_MAPPED] = gen


@dataclass
class _Posted:
    kind: str
    peer: int
    buf: Array
    entry: Entry
    tag: int = 0
    local: bool = False  # within the node: the arena and the mailboxes
    slot: int = -1  # a send within the node: its entry in this process's table
    request: _MPI.Request | None = None  # host, another node: the MPI request
    call: tuple[str, tuple[object, ...]] | None = None  # GPU, NCCL: the method, arguments


@dataclass
class P2pContext:
    """What send/recv need of their group: who is where, the node's memory, the waits,
    the life cycle (the call numbering), the flight recorder, the GPU side (None on the
    host), this process's device, the group's communicator (duplicated for messages),
    the MPI module, the group's lock, and hooks: a staging copy, the group's usability
    and one-rank-per-process checks, its failure, and ``drain`` (the calls in flight on
    the group's own stream finished)."""

    core: Core
    life: Lifecycle
    flight: FlightRecorder
    device: Device
    lock: threading.RLock
    copy: Callable[[Array, Array], None]
    check_usable: Callable[[], None]
    one: Callable[[str], None]
    fail: Callable[[BaseException], None]
    drain: Callable[[], None]


class GroupP2p:
    """The send/recv state of one process group."""

    def __init__(self, ctx: P2pContext) -> None:
        self.ctx = ctx
        self.pl = ctx.core.placement
        self.mem = ctx.core.mem
        # a message space of its own (matched per pair, in order): host messages to other
        # nodes, which a group started without MPI never has
        comm = ctx.core.comm
        self.comm = cast("_MPI.Intracomm", None if comm is None else comm.Dup())
        self._mpi = cast("ModuleType", ctx.core.mpi)
        self._batch = threading.local()
        procs = self.pl.node_procs
        self._sent = dict.fromkeys(procs, 0)  # messages published to each process
        self._received = dict.fromkeys(procs, 0)  # messages consumed from each

    def close(self) -> None:
        if self.comm is None:
            return
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

    # -- which transport ----------------------------------------------------------------
    def local(self, peer: int) -> bool:
        """Whether messages with rank ``peer`` go through the node's arenas (shared
        memory, or CUDA IPC for a GPU group whose processes reach each other's GPUs)."""
        pl = self.pl
        if pl.proc_of_rank[peer] not in self._sent:
            return False
        return self.ctx.core.gpu is None or not self.ctx.core.gpu.ipc_problem

    def drain(self) -> None:
        """The host group's calls in flight on its stream finished (they use the arena)."""
        self.ctx.drain()

    def post(
        self,
        kind: str,
        buf: Array,
        peer: int,
        stream: Stream | None,
        entry: Entry | None = None,
        tag: int = 0,
    ) -> None:
        """Check and issue one send or receive; outside a batch, finish it too."""
        pl = self.pl
        self.ctx.check_usable()
        self.ctx.one(kind)
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < pl.size:
            raise ValueError(f"rank {pl.rank}: peer {peer!r} is not a rank of {pl.size}")
        arr = _device_array(self.ctx.device, buf, f"rank {pl.rank}: {kind} buffer").reshape(-1)
        pending: list[_Posted] | None = getattr(self._batch, "ops", None)
        if pending is None and peer == pl.rank:
            raise ValueError(
                f"rank {pl.rank}: a {kind} with itself needs both halves in one batch "
                "(with pg.batch(): ...)"
            )
        local = self.local(peer)
        if local and kind == "send" and peer != pl.rank and pending is not None:
            cap = self.mem.mail.cap
            if self._batch.sends >= cap:
                raise ValueError(
                    f"rank {pl.rank}: a batch holds at most {cap} sends to the processes of "
                    "its node"
                )
            self._batch.sends += 1
        if entry is None:
            self.ctx.life.seq += 1
            what = f"{kind} {'to' if kind == 'send' else 'from'} {peer}"
            alg = "p2p" if local else "p2p-net"
            entry = self.ctx.flight.start(self.ctx.life.seq, what, arr.size, arr.dtype, alg)
        on_gpu = self.ctx.core.gpu is not None and not local
        op = _Posted(kind, peer, arr, entry, tag if on_gpu else wire_tag(tag, arr.dtype), local)
        if local:
            pass  # moved at the end of the batch
        elif self.ctx.core.gpu is not None:
            from ..nccl import stream_handle
            from .gpu import nccl_move

            if self.ctx.core.gpu.engine is None:
                self.ctx.core.gpu.ensure_nccl()  # raises why there is none (made at bootstrap)

            caller = stream if stream is not None else self.ctx.device.current_stream()
            args = (data_ptr(arr), *nccl_move(arr), peer,
                    stream_handle(caller))  # fmt: skip
            op.call = (kind, args)
        else:
            dest = pl.mpi_rank_of_proc[pl.proc_of_rank[peer]]
            t = mpi_type(self._mpi, arr.dtype)
            send = kind == "send"
            # a receive takes the next message from its peer whatever its tag, which then
            # says whether kind and dtype agree (messages of a pair keep their order)
            if send:
                op.request = self.comm.Isend([arr, t], dest, op.tag)
            else:
                op.request = self.comm.Irecv([arr, t], dest, self._mpi.ANY_TAG)
        if pending is not None:
            pending.append(op)
            self._batch.stream = stream
        else:
            self._finish([op], stream)

    def all_to_all_v(
        self, x: Array, out: Array, sc: list[int], rc: list[int], stream: Stream | None
    ) -> None:
        """One batch: ``x``'s blocks (``sc[q]`` elements for rank q, in rank order) sent,
        ``out``'s blocks (``rc[q]`` from rank q) received, as one flight-recorder entry
        (the arguments checked by the caller)."""
        pl = self.pl
        sd = np.cumsum([0, *sc[:-1]]).tolist()
        rd = np.cumsum([0, *rc[:-1]]).tolist()
        # empty blocks travel too (a size mismatch is then seen), except over NCCL, which
        # orders nothing for them
        nccl = self.ctx.core.gpu is not None
        with self.batch(), self.ctx.lock:
            self.ctx.check_usable()
            self.ctx.life.seq += 1
            where = "p2p" if all(self.local(q) for q in range(pl.size)) else "p2p-net"
            entry = self.ctx.flight.start(self.ctx.life.seq, "all_to_all_v", x.size, x.dtype, where)
            for q in range(pl.size):
                if sc[q] or not (nccl and not self.local(q)):
                    blk = x[sd[q] : sd[q] + sc[q]]
                    self.post("send", blk, q, stream, entry, TAG_ALL_TO_ALL)
            for q in range(pl.size):
                if rc[q] or not (nccl and not self.local(q)):
                    blk = out[rd[q] : rd[q] + rc[q]]
                    self.post("recv", blk, q, stream, entry, TAG_ALL_TO_ALL)

    def _finish(self, ops: list[_Posted], stream: Stream | None) -> None:
        """Move the batch's messages: within the node through the arenas, to other nodes
        as MPI messages (host) or one NCCL group (GPU). Size mismatches within the node
        raise ``ValueError`` once everything else completed."""
        mismatched: list[str] = []
        with self.ctx.lock:
            try:
                self.ctx.check_usable()
                local = [op for op in ops if op.local]
                remote = [op for op in ops if not op.local]
                if self.ctx.core.gpu is not None:
                    self._gpu_finish(local, remote, stream, mismatched)
                else:
                    self._host_finish(local, remote, mismatched)
            except (ValueError, TypeError):
                raise
            except BaseException as exc:
                for op in ops:
                    op.entry.state = f"failed: {type(exc).__name__}"
                self.ctx.fail(exc)
                raise
        now = time.monotonic()
        for op in ops:
            if op.entry.state != "size mismatch":
                op.entry.state = "done"
            op.entry.ended = now
        if mismatched:
            raise ValueError("\n".join(mismatched))

    # -- host ---------------------------------------------------------------------------
    def _host_finish(
        self, local: list[_Posted], remote: list[_Posted], mismatched: list[str]
    ) -> None:
        sends, recvs = self._split_local(local)
        self._publish(sends)
        self._to_self(local, mismatched)
        self.ctx.core.waits.inflight = [
            op.request for op in remote if op.kind == "send" and op.request
        ]
        try:
            self._wait(remote, mismatched)
            self._consume(recvs, mismatched)
            self._await_consumed(sends, mismatched)
        finally:
            self.ctx.core.waits.inflight = []
        self.mem.settle_arenas()

    def _wait(self, ops: list[_Posted], mismatched: list[str]) -> None:
        pl = self.pl
        MPI = self._mpi
        statuses = []
        for op in ops:
            assert op.request is not None
            what = "a message it sends" if op.kind == "recv" else "its receive"
            status = MPI.Status()
            self.ctx.core.waits.request(op.request, pl.proc_of_rank[op.peer], what, status)
            statuses.append(status)
        for op, status in zip(ops, statuses, strict=True):
            if op.kind == "recv":
                got = status.Get_count(mpi_type(MPI, op.buf.dtype))
                theirs = status.Get_tag()
                if _tags_differ(theirs, op.tag):
                    op.entry.state = "size mismatch"
                    mismatched.append(_mismatch_text(pl.rank, op, got * op.buf.itemsize, theirs))
                elif got != op.buf.size:
                    # raised once the batch's messages within the node moved too
                    op.entry.state = "size mismatch"
                    mismatched.append(
                        f"rank {pl.rank}: received {got} {op.buf.dtype} from rank "
                        f"{op.peer}, expected {op.buf.size}"
                    )

    # -- within the node (host and GPU alike; a GPU's copies go on the group's stream) --
    def _split_local(self, local: list[_Posted]) -> tuple[list[_Posted], list[_Posted]]:
        """The sends to and receives from the node's other processes; the batch's
        messages to itself checked to pair up (before anything moves)."""
        me = self.pl.rank
        to_self = sum(op.kind == "send" and op.peer == me for op in local)
        from_self = sum(op.kind == "recv" and op.peer == me for op in local)
        if to_self != from_self:
            raise ValueError(
                f"rank {me}: a batch sends {to_self} messages to this rank and receives "
                f"{from_self} from it; they must pair up"
            )
        sends = [op for op in local if op.kind == "send" and op.peer != me]
        recvs = [op for op in local if op.kind == "recv" and op.peer != me]
        return sends, recvs

    def _publish(self, sends: list[_Posted]) -> None:
        """Describe the sends in this process's table, tell each receiver how many there
        are, and copy them into this process's arena (those in symmetric buffers, which
        the node's processes have mapped, stay where they are: one copy instead of two):
        on a GPU before telling, on the host after, counting each chunk in."""
        if not sends:
            return
        pl = self.pl
        mail = self.mem.mail
        by_proc: dict[int, list[_Posted]] = {}
        for op in sends:
            by_proc.setdefault(pl.proc_of_rank[op.peer], []).append(op)
        heap = {id(op): self.mem.heap_of(op.buf) for op in sends} if self.mem.heaps else {}
        total = sum(align_bytes(op.buf.nbytes) for op in sends if heap.get(id(op)) is None)
        self.mem.ensure_arena(total)
        self.mem.publish_gen()
        arena = self.mem.arenas.get(pl.proc)
        table = mail.table(pl.proc)
        k = 0
        off = 0
        firsts: list[tuple[int, int, int]] = []
        copies: list[tuple[_Posted, int]] = []  # (send, its offset in the arena)
        for q, ops in by_proc.items():
            firsts.append((q, k, len(ops)))
            for op in ops:
                h = heap.get(id(op))
                if h is not None:  # in place: every chunk is there already
                    table[k, :_ENTRY] = (h[1], op.buf.nbytes, 0, 0, op.tag, h[0] + 1,
                                         chunks(op.buf.nbytes))  # fmt: skip
                else:
                    table[k, :_ENTRY] = (off, op.buf.nbytes, 0, 0, op.tag, 0, 0)
                    copies.append((op, off))
                    off += align_bytes(op.buf.nbytes)
                op.slot = k
                k += 1
        g = self.ctx.core.gpu
        if g is not None:  # every copy first, ordered before any receiver's read
            for op, at in copies:
                if op.buf.nbytes:
                    assert arena is not None
                    self.ctx.copy(arena.view(op.buf.dtype, op.buf.size, at), op.buf)
            g.published()
        for q, first, count in firsts:
            pair = mail.pair(pl.proc, q)
            pair[_FIRST_SEQ] = self._sent[q]
            pair[_FIRST_ENTRY] = first
            self._sent[q] += count
            mail.counter(pl.proc, q, 0).add(count)
        if g is None:
            # on the host the receivers read each chunk as soon as it is in (copying never
            # waits, so a batch still publishes everything before its first wait)
            for op, at in copies:
                ready = mail.ready(pl.proc, op.slot)
                done = 0
                for src, dst_at, upto in _pieces(op.buf, at):
                    assert arena is not None
                    self.ctx.copy(arena.view(src.dtype, src.size, dst_at), src)
                    ready.add(upto - done)
                    done = upto

    def _to_self(self, local: list[_Posted], mismatched: list[str]) -> None:
        me = self.pl.rank
        sends = [op for op in local if op.kind == "send" and op.peer == me]
        recvs = [op for op in local if op.kind == "recv" and op.peer == me]
        for s, r in zip(sends, recvs, strict=True):
            if s.buf.nbytes != r.buf.nbytes or _tags_differ(s.tag, r.tag):
                r.entry.state = s.entry.state = "size mismatch"
                mismatched.append(_mismatch_text(me, r, s.buf.nbytes, s.tag))
            else:
                self.ctx.copy(r.buf, s.buf)

    def _consume(self, recvs: list[_Posted], mismatched: list[str]) -> None:
        """Each receive, in order: wait for its message, copy it out of the sender's
        arena, acknowledge it (acknowledgements are flushed before any wait that blocks:
        the sender's next message may wait for them)."""
        pl = self.pl
        mail = self.mem.mail
        g = self.ctx.core.gpu
        unacked: list[int] = []

        def flush() -> None:
            if unacked:
                if g is not None:
                    g.published()  # the copies out, before the sender reuses its arena
                for q in unacked:
                    mail.counter(q, pl.proc, 1).add(1)
                unacked.clear()

        for op in recvs:
            q = pl.proc_of_rank[op.peer]
            n = self._received[q]
            posted = mail.counter(q, pl.proc, 0)
            if not posted.wait(n + 1, 0.0):
                flush()
                self.ctx.core.waits.counter(
                    posted, n + 1, q, f"message #{n} of its sends to this rank"
                )
            self.mem.refresh_arena(q)
            pair = mail.pair(q, pl.proc)
            k = int(pair[_FIRST_ENTRY]) + n - int(pair[_FIRST_SEQ])
            e = mail.table(q)[k]
            off, nbytes, tag, where = int(e[_OFFSET]), int(e[_NBYTES]), int(e[_TAG]), int(e[_WHERE])
            if nbytes != op.buf.nbytes or _tags_differ(tag, op.tag):
                e[_THEIRS] = op.buf.nbytes
                # the receiver's own tag for the sender's message (above the status)
                e[_STATUS] = _MISMATCH | op.tag << 4
                op.entry.state = "size mismatch"
                mismatched.append(_mismatch_text(pl.rank, op, nbytes, tag))
            else:
                if nbytes:
                    mem = self.mem.heaps[where - 1][q] if where else self.mem.arenas[q]
                    if g is not None:
                        g.after([q])
                        self.ctx.copy(op.buf, mem.view(op.buf.dtype, op.buf.size, off))
                    else:
                        ready = mail.ready(q, k)
                        for dst, src_at, upto in _pieces(op.buf, off):
                            if not ready.wait(upto, 0.0):
                                flush()
                                self.ctx.core.waits.counter(
                                    ready, upto, q, f"message #{n}'s chunk {upto}"
                                )
                            self.ctx.copy(dst, mem.view(dst.dtype, dst.size, src_at))
                e[_STATUS] = _OK
            self._received[q] = n + 1
            unacked.append(q)
        flush()

    def _await_consumed(self, sends: list[_Posted], mismatched: list[str]) -> None:
        """This process's messages consumed (its arena is free again); the mismatches
        its receivers found."""
        if not sends:
            return
        pl = self.pl
        mail = self.mem.mail
        procs = list(dict.fromkeys(pl.proc_of_rank[op.peer] for op in sends))
        for q in procs:
            self.ctx.core.waits.counter(
                mail.counter(pl.proc, q, 1), self._sent[q], q, "its receive"
            )
        if self.ctx.core.gpu is not None:
            self.ctx.core.gpu.after(procs)  # later writes to the arena after their copies out
        table = mail.table(pl.proc)
        for op in sends:
            status = int(table[op.slot, _STATUS])
            if status & 0xF == _MISMATCH:
                theirs = int(table[op.slot, _THEIRS])
                their_tag = status >> 4
                op.entry.state = "size mismatch"
                if their_tag & 0xFF != op.tag & 0xFF:
                    why = "which received it as another kind of operation"
                elif _tags_differ(their_tag, op.tag):
                    why = f"whose receive takes {_DTYPE_NAMES[their_tag >> 8]}"
                else:
                    why = f"whose receive takes {theirs} bytes"
                mismatched.append(
                    f"rank {pl.rank}: sent {op.buf.size} {op.buf.dtype} ({op.buf.nbytes} "
                    f"bytes) to rank {op.peer}, {why}"
                )

    # -- GPU ------------------------------------------------------------------------------
    def _gpu_finish(
        self,
        local: list[_Posted],
        remote: list[_Posted],
        stream: Stream | None,
        mismatched: list[str],
    ) -> None:
        g = self.ctx.core.gpu
        assert g is not None
        caller = stream if stream is not None else self.ctx.device.current_stream()
        if not local:
            self._launch(remote, caller)
            return
        sends, recvs = self._split_local(local)
        # the group's stream after the caller's work (the sends' data is written there),
        # the caller's after the group's at the end
        g.caller, g.caller_waits = caller, True
        try:
            g.begin()
            self._publish(sends)
            self._to_self(local, mismatched)
            if remote:
                self._launch(remote, caller)  # on the caller's stream, waits for nobody here
            self._consume(recvs, mismatched)
            self._await_consumed(sends, mismatched)
            g.end("send/recv within the node", [op.buf for op in local])
        finally:
            g.caller, g.caller_waits = None, True

    def _launch(self, ops: list[_Posted], caller: Stream) -> None:
        g = self.ctx.core.gpu
        assert g is not None
        engine = g.ensure_nccl()
        nccl, comm = engine.nccl, engine.comms[0]
        nccl.groupStart()
        error: BaseException | None = None
        try:
            for op in ops:
                assert op.call is not None
                method, args = op.call
                getattr(comm, method)(*args)
        except Exception as exc:  # noqa: BLE001 - groupEnd still balances the group
            error = exc
        try:
            nccl.groupEnd()
        except Exception as exc:  # noqa: BLE001
            error = error or exc
        if error is not None:
            raise CommError(f"rank {self.pl.rank}: NCCL send/recv failed: {error!r}") from error
        g.watch("NCCL send/recv", [caller.record()], [op.buf for op in ops])

    def in_batch(self) -> bool:
        """Whether the calling thread is inside ``with batch():``."""
        return getattr(self._batch, "ops", None) is not None

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Post every send and receive of the block; finish them all at its end."""
        if getattr(self._batch, "ops", None) is not None:
            raise ValueError(f"rank {self.pl.rank}: batches do not nest")
        self.drain()
        self._batch.ops = []
        self._batch.stream = None
        self._batch.sends = 0  # to the node's other processes
        try:
            yield
        except BaseException:
            self._batch.ops = None
            raise
        ops, self._batch.ops = self._batch.ops, None
        self._finish(ops, self._batch.stream)


def _pieces(buf: Array, at: int) -> Iterator[tuple[Array, int, int]]:
    """``buf`` in the chunks of :func:`chunks` (flat views of a contiguous host array),
    each with its byte offset in the arena when the whole message starts at ``at`` and
    the chunks copied in once it is (what the receiver waits for: both sides count by
    the message's bytes alone; an array that cannot be cut is one piece, all its chunks)."""
    n = chunks(buf.nbytes)
    if n <= 1 or not buf.flags.c_contiguous:
        if n:
            yield buf, at, n
        return
    flat = buf.reshape(-1)
    per = CHUNK_BYTES // buf.itemsize
    for c, i in enumerate(range(0, flat.size, per), 1):
        yield flat[i : i + per], at + i * buf.itemsize, c


def _mismatch_text(me: int, op: _Posted, nbytes: int, their_tag: int) -> str:
    """The receiver's error for a message of ``nbytes`` sent with ``their_tag``."""
    if their_tag & 0xFF != op.tag & 0xFF:
        return (
            f"rank {me}: the message from rank {op.peer} is another kind of operation "
            "(send/recv and all_to_all_v meet in one order per pair of ranks)"
        )
    if _tags_differ(their_tag, op.tag):
        return (
            f"rank {me}: received {_DTYPE_NAMES[their_tag >> 8]} from rank {op.peer} "
            f"into its {op.buf.dtype} buffer (a send and its receive have one dtype)"
        )
    item = op.buf.dtype.itemsize
    got = f"{nbytes // item}" if nbytes % item == 0 else f"{nbytes} bytes of"
    return f"rank {me}: received {got} {op.buf.dtype} from rank {op.peer}, expected {op.buf.size}"
