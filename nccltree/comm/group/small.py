"""The small collectives of a process group within one node, in one native call.

A host group whose processes share one node, one rank each, with ``algorithm="auto"``,
runs its small ``all_reduce``, ``broadcast``, ``reduce`` and ``all_gather`` calls (up
to :data:`THRESHOLD` bytes per rank) through the ``nccltree._small`` extension
(``csrc/nccltree_small.c``): this process's input is copied into its payload slot in the
node's control segment, its call's signature into its call descriptor (the one the
schedule engine publishes), it arrives on its arrival counter and waits for the others
(a short spin, ``sched_yield``, then the futex; the abort word checked; past a budget,
the group's own bounded wait, which names a dead or absent process); every signature is
compared with its own (a mismatch raises the agreement's ``ValueError`` on every
process); the result is computed from the slots with the host library's reduce kernel,
the sources in rank order: bitwise the result of the direct plan, which ``auto`` picks
within a node for larger messages.

Because such a call arrives where the engine's calls arrive, with a signature as theirs,
the processes of such a group agree by arrival: a call of the general path on one
process and a small call on another raise ``ValueError`` on both; calls that ``auto``
gives to MPI agree the same way first (one native call, no payload), instead of an
``MPI_Iallreduce`` of digests.

The fast entries (:meth:`SmallPath.all_reduce`, :meth:`SmallPath.fast`) take plain numpy
arrays as they are: the extension checks their type, contiguity and dtype itself and
looks the call up in its cache of signatures (by collective, dtype, count, op and root); a signature is learnt
only after the general path checked a call of it (:meth:`SmallPath.run`), so the first
call of each signature goes the general way. ``NCCLTREE_SMALL=off`` turns the path off
(``auto`` then hands small messages to MPI, as before); ``NCCLTREE_SMALL=BYTES`` sets
the threshold (at most :data:`MAX_THRESHOLD`). The setting must be the same on every
process (the group checks it at creation).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ... import _native
from .. import debug
from ..flight import Entry
from .agreement import call_signature, mismatch_text
from .node_memory import ABORT_OFFSET, SIG_BYTES
from .shm import address

if TYPE_CHECKING:
    import threading

    from .._args import Prepared
    from ..faces import RankCall
    from ..flight import FlightRecorder
    from .engine import Engine
    from .lifecycle import Lifecycle
    from .node_memory import NodeMemory
    from .placement import Placement
    from .waits import Waits

try:
    from ... import _small as _ext
except ImportError:  # built without Python headers: the general path takes every call
    _ext = None

#: bytes per rank up to which the path takes a call (measured: bench/small_pg.py and
#: docs/performance.md, "Small messages within a node")
THRESHOLD = 256 << 10
#: the largest threshold ``NCCLTREE_SMALL`` may set (the payload slots' size follows it)
MAX_THRESHOLD = 4 << 20
MAX_PROCS = 8  # one reduce pass over every process's slot (the kernels' fan-in)
SPIN_NS = 20_000  # spin this long (only where every process of the node has a core)
YIELD_NS = 200_000  # then yield the core this long
BUDGET_NS = 500_000  # then the futex; past this, the group's own wait (liveness, bound)

_COLLECTIVES = {"all_reduce": 0, "broadcast": 1, "all_gather": 2, "reduce": 3}
_AGREE = 4
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "mean": 4}
_DTYPES = {np.dtype(k): v for k, v in _native.DTYPES.items()}
_SLOT_ALIGN = 4096
_LEN_FIELD, _TEXT = 8, 16  # a call descriptor: its sequence number, text length, text
_BF16 = 5  # the host library's code: numpy exports no buffer of it (viewed as bytes)


def setting(value: str | None = None) -> int:
    """The threshold ``NCCLTREE_SMALL`` sets: 0 (``off``), or bytes per rank (default
    :data:`THRESHOLD`, ``on``); 0 too where the extension was not built."""
    raw = os.environ.get("NCCLTREE_SMALL", "") if value is None else value
    v = raw.strip().lower()
    if v in ("off", "0"):
        return 0
    if v in ("", "on", "1"):
        got = THRESHOLD
    elif v.isdigit() and 0 < int(v) <= MAX_THRESHOLD:
        got = int(v)
    else:
        raise ValueError(
            f"NCCLTREE_SMALL must be 'on', 'off' or a byte count from 1 to {MAX_THRESHOLD}, "
            f"got {raw!r}"
        )
    return got if _ext is not None else 0


def eligible(pl: Placement, gpu: bool, algorithm: str) -> bool:
    """Whether a group runs small calls here: host arrays, ``auto``, 2 to 8 processes
    sharing one node's memory, one rank each, ranks in process order."""
    return (
        not gpu
        and algorithm == "auto"
        and pl.shm
        and 2 <= pl.nprocs <= MAX_PROCS
        and len(pl.node_procs) == pl.nprocs
        and pl.size == pl.nprocs
        and list(pl.proc_of_rank) == list(range(pl.nprocs))
    )


def region_bytes(nprocs: int) -> int:
    """Bytes of the payload slots in a node's control segment (two per process, by call
    parity): nothing where the path is off or cannot serve that many processes."""
    cap = setting()
    if cap == 0 or not 2 <= nprocs <= MAX_PROCS:
        return 0
    return 2 * nprocs * _slot_bytes(cap)


def _slot_bytes(cap: int) -> int:
    return (cap + _SLOT_ALIGN - 1) // _SLOT_ALIGN * _SLOT_ALIGN


class NativePath(Protocol):
    """The extension's ``Path`` (``csrc/nccltree_small.c``)."""

    def learn(self, coll: int, dtype: int, count: int, op: int, root: int, itemsize: int,
              sig: bytes) -> int: ...  # fmt: skip
    def run(self, slot: int, x: object, out: object) -> None: ...
    def all_reduce(self, x: object, out: object, op: object) -> object | None: ...
    def fast(
        self, coll: int, x: object, out: object, op: object, root: object
    ) -> object | None: ...
    def timing(self, on: bool) -> tuple[int, int, int, int]: ...


def _kernel_addresses() -> list[int]:
    lib = _native.library()
    names = ("nt_reduce_n", "nt_reduce_n_scaled", "nt_counter_wait", "nt_counter_add_wake")
    return [int(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value or 0) for n in names]


class SmallPath:
    """The small calls of one group (see the module docstring). ``lock``: the group's; ``fail``:
    what the group does with a failure (closes for good, tells the node)."""

    def __init__(
        self,
        pl: Placement,
        mem: NodeMemory,
        waits: Waits,
        life: Lifecycle,
        flight: FlightRecorder,
        engine: Engine,
        lock: threading.RLock,
        fail: Callable[[BaseException], None],
    ) -> None:
        self.pl, self.mem, self.waits, self.life = pl, mem, waits, life
        self.flight, self.engine, self.lock, self.fail = flight, engine, lock, fail
        self.threshold = setting()
        n = pl.nprocs
        base = address(mem.ctl)
        slot = _slot_bytes(self.threshold)
        arrive, desc, data = [], [], []
        for r in range(n):
            p = pl.proc_of_rank[r]
            arrive.append(mem.arrive[p].addr)
            for parity in (0, 1):
                d = mem.peer_desc[p][parity][0]
                desc.append(ctypes.addressof(ctypes.c_char.from_buffer(d)))
                data.append(base + mem.small_at + (2 * mem.slot_of[p] + parity) * slot)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.path: NativePath = _ext.Path(
            pl.rank, arrive, desc, data, self.threshold, base + ABORT_OFFSET, _kernel_addresses(),
            mem.desc_written, np.ndarray, self._slow_wait, self._mismatch, n > cpus,
            SPIN_NS, YIELD_NS, BUDGET_NS,
        )  # fmt: skip
        self._entry: Entry | None = None  # the flight recorder's line of the fast calls
        # NCCLTREE_DEBUG=TRACE (when the group is made) traces every call: the fast
        # entries are off then, so every call goes through the group's traced dispatch
        self.traced = debug.trace_enabled()

    # -- the calls ------------------------------------------------------------------------
    def takes(self, prep: Prepared) -> bool:
        """Whether a (checked) call runs here: decided by its signature alone, so every
        process whose arguments agree decides alike."""
        return (
            prep.collective in _COLLECTIVES
            and prep.nbytes <= self.threshold
            and prep.dtype in _DTYPES
        )

    def run(self, prep: Prepared) -> None:
        """A checked call that :meth:`takes` accepted (from the group's ``_perform``,
        which records it and handles its failure); learns its signature for the fast
        entry."""
        coll = _COLLECTIVES[prep.collective]
        sig = call_signature(prep).encode()
        slot = self.path.learn(coll, _DTYPES[prep.dtype], prep.count, _OPS[prep.op],
                               prep.root, prep.dtype.itemsize, sig)  # fmt: skip
        x, out = prep.ins[0], prep.outs[0]
        if _DTYPES[prep.dtype] == _BF16 or not isinstance(x, np.ndarray):
            x, out = np.asarray(x).view(np.uint8), np.asarray(out).view(np.uint8)
        self.path.run(slot, x, out)
        self.engine.count_arrival()

    def agree(self, sig: str) -> None:
        """Every process of the node calls alike (``sig``), or every one raises the
        agreement's ``ValueError``: one arrival, no payload (the calls ``auto`` hands to
        MPI, and ``split``/``new_group``)."""
        slot = self.path.learn(_AGREE, 0, 0, 0, 0, 0, sig.encode()[:SIG_BYTES])
        try:
            self.path.run(slot, None, None)
        finally:
            self.engine.count_arrival()

    def all_reduce(self, x: object, out: object, op: str) -> object | None:
        """The fast entry of ``all_reduce``: the result, or None where the general path
        takes the call (nothing was done then)."""
        life = self.life
        if life.failed or life.closed or self.traced:
            return None
        with self.lock:
            life.seq += 1
            try:
                got = self.path.all_reduce(x, out, op)
            except BaseException as exc:
                self.engine.count_arrival()
                self._failed(exc, "all_reduce", x)
                raise
            return self._done(got, "all_reduce", x)

    def fast(self, call: RankCall) -> object | None:
        """The fast entry of ``broadcast``, ``reduce`` and ``all_gather`` (and
        ``all_reduce`` through the group's ``_call``): as :meth:`all_reduce`."""
        code = _COLLECTIVES.get(call.collective)
        life = self.life
        if (code is None or call.stream is not None or call.async_op or call.dtype is not None
                or life.failed or life.closed or self.traced):  # fmt: skip
            return None
        with self.lock:
            life.seq += 1
            try:
                got = self.path.fast(code, call.x, call.out, call.op, call.root)
            except BaseException as exc:
                self.engine.count_arrival()
                self._failed(exc, call.collective, call.x)
                raise
            return self._done(got, call.collective, call.x)

    def _done(self, got: object | None, name: str, x: object) -> object | None:
        """After a fast call: undone (None), or counted and in the flight recorder."""
        life = self.life
        if got is None:
            life.seq -= 1
            return None
        self.engine.count_arrival()
        e = self._entry
        entries = self.flight.entries
        if e is None or not entries or entries[-1] is not e or e.collective != name:
            e = self._entry = Entry(life.seq, name, getattr(x, "size", 0),
                                    getattr(x, "dtype", None), "small", "done", 0.0)  # fmt: skip
            entries.append(e)
        else:
            e.seq = life.seq
        return got

    def _failed(self, exc: BaseException, name: str, x: object) -> None:
        """The flight recorder's line of a fast call that raised; a failure (not an
        argument error) fails the group."""
        arg = isinstance(exc, (ValueError, TypeError))
        state = "argument error" if arg else f"failed: {type(exc).__name__}"
        self.flight.entries.append(
            Entry(
                self.life.seq,
                "all_reduce",
                getattr(x, "size", 0),
                getattr(x, "dtype", None),
                "small",
                state,
                0.0,
            )  # fmt: skip
        )
        if not arg:
            self.fail(exc)

    def breakdown(self, on: bool = True) -> tuple[int, int, int, int]:
        """Turn the per-call timing on (or off); the last call's nanoseconds: (entry
        checks, exchange: the copy in and the arrival, the wait, the result)."""
        got: tuple[int, int, int, int] = self.path.timing(on)
        return got

    # -- called from the extension --------------------------------------------------------
    def _slow_wait(self, rank: int, seq: int) -> None:
        p = self.pl.proc_of_rank[rank]
        self.waits.counter(self.mem.arrive[p], seq, p, "arrival")

    def _mismatch(self, parity: int) -> None:
        """Raise the agreement's ``ValueError``: this process's signature and every other
        that differs (read from their descriptors)."""
        texts = {}
        for p in self.pl.node_procs:
            d = self.mem.peer_desc[p][parity][0]
            n = int(np.frombuffer(d, np.int64, 1, _LEN_FIELD)[0])
            texts[p] = bytes(d[_TEXT : _TEXT + n]).decode(errors="replace")
        mine = texts.pop(self.pl.proc)
        raise ValueError(mismatch_text(self.pl, mine, texts))


def available() -> bool:
    """Whether the extension was built."""
    return _ext is not None


__all__ = ["SmallPath", "THRESHOLD", "available", "eligible", "region_bytes", "setting"]
