"""The collectives, one table: everything one collective needs, in one place.

Like nccl-tests' ``struct testColl``, each :class:`Collective` says how big each rank's
input and output are, where they sit in the one buffer of an in-place call, whether it
takes a root or a reduction op, its bus-bandwidth factor, its NCCL call and the result
numpy expects. The argument checks (``_args``), the NCCL engine, ``World``/``Comm`` and
the benchmark driver read these rules here; a new collective is a new row (and its
algorithms).

Counts are NCCL's: ``count`` is the ``count`` argument of the NCCL call, which for
all_gather and reduce_scatter is one rank's block (the send and the receive count
respectively), so every size is ``count`` times a small multiple (1 or the rank count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ._ops import reference, widen

Counts = Callable[[int, int], int]  # (count, ranks) -> elements
Expected = Callable[[Sequence[np.ndarray], str, int], list[tuple[str, np.ndarray]]]
#: one NCCL point-to-point operation of a rank: (``"send"`` or ``"recv"``, the peer, the
#: buffer (``"in"``/``"out"``), offset and count in elements)
P2pOp = tuple[str, int, str, int, int]
#: (rank, count, ranks, root, in place) -> that rank's operations, in issue order
P2p = Callable[[int, int, int, int, bool], list[P2pOp]]


@dataclass(frozen=True)
class Collective:
    """One row of the table.

    ``in_count(count, n)`` / ``out_count(count, n)``: elements of each rank's input and
    output. ``in_place(rank, count, n)``: the offsets (input, output) in elements of the
    two inside the one buffer of an in-place call (NCCL's layouts). ``one_buffer``: in
    place means passing no output at all (the output is the input). ``root_output``: only
    the root's output is written (reduce). ``factor(n)``: nccl-tests' bus-bandwidth factor.
    ``nccl``: the ``NcclCommunicator`` method and the names of its arguments in order
    (``send``, ``recv``, ``count``, ``dtype``, ``op``, ``root``, ``stream``).
    ``expected(inputs, op, root)``: each rank's expected ``(buffer, values)`` in float64
    (int64 for integers), ``buffer`` being ``"out"``, or ``"in"`` for an input that must
    stay unchanged. ``p2p``: for collectives NCCL has no call for, the NCCL send/receive
    operations of each rank (see :func:`p2p_ops`); ``in_place_ok``: whether the call may
    run in place at all.
    """

    name: str
    aliases: tuple[str, ...]
    reduces: bool
    rooted: bool
    one_buffer: bool
    root_output: bool
    in_count: Counts
    out_count: Counts
    in_place: Callable[[int, int, int], tuple[int, int]]
    factor: Callable[[int], float]
    nccl: tuple[str, tuple[str, ...]]
    expected: Expected
    p2p: P2p | None = None
    in_place_ok: bool = True

    def count_for(self, elements: int, n: int) -> int:
        """NCCL's count for a message of ``elements`` elements: the larger buffer fits."""
        return elements // max(self.in_count(1, n), self.out_count(1, n))

    def nbytes(self, count: int, n: int, itemsize: int) -> int:
        """nccl-tests' ``S``, the bytes algbw divides by: the larger of one rank's input
        and output (the whole gathered array for all_gather and reduce_scatter)."""
        return max(self.in_count(count, n), self.out_count(count, n)) * itemsize

    def bus_factor(self, n: int) -> float:
        return self.factor(n)

    def describe(self, op: str, root: int) -> str:
        """The call as a user wrote it, e.g. ``reduce(op=sum, root=1)``."""
        args = ([f"op={op}"] if self.reduces else []) + ([f"root={root}"] if self.rooted else [])
        return f"{self.name}({', '.join(args)})"

    def keywords(self, op: str, root: int) -> dict[str, object]:
        """The ``op``/``root`` keywords the public method of this collective takes."""
        kw: dict[str, object] = {}
        if self.reduces:
            kw["op"] = op
        if self.rooted:
            kw["root"] = root
        return kw


def _same(count: int, n: int) -> int:
    return count


def _times_n(count: int, n: int) -> int:
    return count * n


def _no_offsets(rank: int, count: int, n: int) -> tuple[int, int]:
    return 0, 0


def _exp_all_reduce(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    return [("out", reference(op, ins))] * len(ins)


def _exp_reduce(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    ref = reference(op, ins)
    # reduce leaves every non-root input unchanged (NCCL's semantics, checked too)
    return [("out", ref) if r == root else ("in", widen(x)) for r, x in enumerate(ins)]


def _exp_broadcast(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    return [("out", widen(ins[root]))] * len(ins)


def _exp_all_gather(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    return [("out", widen(np.concatenate(ins)))] * len(ins)


def _exp_reduce_scatter(
    ins: Sequence[np.ndarray], op: str, root: int
) -> list[tuple[str, np.ndarray]]:
    ref = reference(op, ins)
    k = ref.size // len(ins)
    return [("out", ref[r * k : (r + 1) * k]) for r in range(len(ins))]


def _exp_gather(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    every = widen(np.concatenate(ins))
    return [("out", every) if r == root else ("in", widen(x)) for r, x in enumerate(ins)]


def _exp_scatter(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    k = ins[root].size // len(ins)
    return [("out", widen(ins[root][r * k : (r + 1) * k])) for r in range(len(ins))]


def _exp_all_to_all(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    n = len(ins)
    k = ins[0].size // n
    return [("out", widen(np.concatenate([x[r * k : (r + 1) * k] for x in ins])))
            for r in range(n)]  # fmt: skip


def _p2p_gather(r: int, count: int, n: int, root: int, in_place: bool) -> list[P2pOp]:
    """Every rank sends its block to the root, which receives block q at q * count (its
    own too, as a send to itself, unless in place: then it is there already)."""
    src = ("out", r * count) if in_place else ("in", 0)
    ops: list[P2pOp] = []
    if not (in_place and r == root):
        ops.append(("send", root, src[0], src[1], count))
    if r == root:
        ops += [("recv", q, "out", q * count, count) for q in range(n)
                if not (in_place and q == root)]  # fmt: skip
    return ops


def _p2p_scatter(r: int, count: int, n: int, root: int, in_place: bool) -> list[P2pOp]:
    """The root sends block q of its input to every rank q (itself too unless in place),
    which receives it into its output."""
    ops: list[P2pOp] = []
    if r == root:
        ops += [("send", q, "in", q * count, count) for q in range(n)
                if not (in_place and q == root)]  # fmt: skip
    if not (in_place and r == root):
        dst = ("in", r * count) if in_place else ("out", 0)
        ops.append(("recv", root, dst[0], dst[1], count))
    return ops


def _p2p_all_to_all(r: int, count: int, n: int, root: int, in_place: bool) -> list[P2pOp]:
    """Block q of every rank's input goes to block r of rank q's output."""
    return [("send", q, "in", q * count, count) for q in range(n)] + [
        ("recv", q, "out", q * count, count) for q in range(n)
    ]


def _exp_sendrecv(ins: Sequence[np.ndarray], op: str, root: int) -> list[tuple[str, np.ndarray]]:
    n = len(ins)
    return [("out", widen(ins[(r - 1) % n])) for r in range(n)]


def _p2p_sendrecv(r: int, count: int, n: int, root: int, in_place: bool) -> list[P2pOp]:
    """nccl-tests' sendrecv: to the next rank, from the previous one."""
    return [("send", (r + 1) % n, "in", 0, count), ("recv", (r - 1) % n, "out", 0, count)]


_BUFS = ("send", "recv", "count", "dtype")
_P2P = ("", ())  # no NCCL call of its own: point-to-point operations (``p2p``)

COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective(
            name="all_reduce",
            aliases=("allreduce",),
            reduces=True,
            rooted=False,
            one_buffer=True,
            root_output=False,
            in_count=_same,
            out_count=_same,
            in_place=_no_offsets,
            factor=lambda n: 2 * (n - 1) / n,
            nccl=("allReduce", (*_BUFS, "op", "stream")),
            expected=_exp_all_reduce,
        ),
        Collective(
            name="reduce",
            aliases=(),
            reduces=True,
            rooted=True,
            one_buffer=True,
            root_output=True,
            in_count=_same,
            out_count=_same,
            in_place=_no_offsets,
            factor=lambda n: 1.0,
            nccl=("reduce", (*_BUFS, "op", "root", "stream")),
            expected=_exp_reduce,
        ),
        Collective(
            name="broadcast",
            aliases=("bcast",),
            reduces=False,
            rooted=True,
            one_buffer=True,
            root_output=False,
            in_count=_same,
            out_count=_same,
            in_place=_no_offsets,
            factor=lambda n: 1.0,
            nccl=("broadcast", (*_BUFS, "root", "stream")),
            expected=_exp_broadcast,
        ),
        # in place, rank r's input is block r of its output
        Collective(
            name="all_gather",
            aliases=("allgather",),
            reduces=False,
            rooted=False,
            one_buffer=False,
            root_output=False,
            in_count=_same,
            out_count=_times_n,
            in_place=lambda r, count, n: (r * count, 0),
            factor=lambda n: (n - 1) / n,
            nccl=("allGather", (*_BUFS, "stream")),
            expected=_exp_all_gather,
        ),
        # in place, rank r's output is block r of its input
        Collective(
            name="reduce_scatter",
            aliases=("reducescatter",),
            reduces=True,
            rooted=False,
            one_buffer=False,
            root_output=False,
            in_count=_times_n,
            out_count=_same,
            in_place=lambda r, count, n: (0, r * count),
            factor=lambda n: (n - 1) / n,
            nccl=("reduceScatter", (*_BUFS, "op", "stream")),
            expected=_exp_reduce_scatter,
        ),
        # every rank's block into the root's output, block r at r * count; in place, as
        # all_gather, rank r's input is block r of its output (only the root's is written)
        Collective(
            name="gather",
            aliases=(),
            reduces=False,
            rooted=True,
            one_buffer=False,
            root_output=True,
            in_count=_same,
            out_count=_times_n,
            in_place=lambda r, count, n: (r * count, 0),
            factor=lambda n: (n - 1) / n,
            nccl=_P2P,
            expected=_exp_gather,
            p2p=_p2p_gather,
        ),
        # block r of the root's input into rank r's output; in place, as reduce_scatter,
        # rank r's output is block r of its input (only the root's input is read)
        Collective(
            name="scatter",
            aliases=(),
            reduces=False,
            rooted=True,
            one_buffer=False,
            root_output=False,
            in_count=_times_n,
            out_count=_same,
            in_place=lambda r, count, n: (0, r * count),
            factor=lambda n: (n - 1) / n,
            nccl=_P2P,
            expected=_exp_scatter,
            p2p=_p2p_scatter,
        ),
        # block q of rank r's input into block r of rank q's output (equal blocks)
        Collective(
            name="all_to_all",
            aliases=("alltoall",),
            reduces=False,
            rooted=False,
            one_buffer=False,
            root_output=False,
            in_count=_times_n,
            out_count=_times_n,
            in_place=_no_offsets,
            factor=lambda n: (n - 1) / n,
            nccl=_P2P,
            expected=_exp_all_to_all,
            p2p=_p2p_all_to_all,
            in_place_ok=False,
        ),
        # nccl-tests' sendrecv: every rank's input to the next rank's output (a ring shift)
        Collective(
            name="sendrecv",
            aliases=("send_recv",),
            reduces=False,
            rooted=False,
            one_buffer=False,
            root_output=False,
            in_count=_same,
            out_count=_same,
            in_place=_no_offsets,
            factor=lambda n: 1.0,
            nccl=_P2P,
            expected=_exp_sendrecv,
            p2p=_p2p_sendrecv,
            in_place_ok=False,
        ),
    )
}

# Spellings accepted from users (nccl-tests and MPI write them without underscores).
_ALIASES = {a: c.name for c in COLLECTIVES.values() for a in (c.name, *c.aliases)}


def collective(name: str) -> Collective:
    """The row of ``name`` (``allreduce``, ``All-Reduce``, ``bcast`` ... accepted)."""
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else name
    if key not in _ALIASES:
        others = sorted(a for a in _ALIASES if a not in COLLECTIVES)
        raise ValueError(
            f"unknown collective {name!r}; accepted: {', '.join(COLLECTIVES)} "
            f"(also {', '.join(others)})"
        )
    return COLLECTIVES[_ALIASES[key]]


def collective_name(name: str) -> str:
    """The canonical name of ``name`` (see :func:`collective`)."""
    return collective(name).name
