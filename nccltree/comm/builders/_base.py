"""What every builder shares: the request it gets, the registry it is entered in (which
makes the builder's ``PlanBuilder``), and the steps every reducing algorithm ends its sums
with."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...backends.base import MAX_FUSED, fold_schedule
from .._ops import OPS
from ..collectives import COLLECTIVES
from ..plan import IN, OUT, Buf, Plan, PlanBuilder

if TYPE_CHECKING:
    from ...tree import Tree

MAX_FAN_IN = MAX_FUSED  # sources one native reduce pass takes


@dataclass(frozen=True)
class PlanRequest:
    """One collective call's shape, as every builder takes it (checked by ``build_plan``).

    ``count`` follows the module's conventions (see :mod:`nccltree.comm.algorithms`);
    ``chunk`` is in elements and already a multiple of ``align``, the element count every
    offset the plan chooses itself is a multiple of; ``itemsize`` the bytes per element
    (None: not known, as when a plan is inspected without a dtype). ``tree_for(root)`` gives the tree
    rooted at ``root`` (only the tree algorithm needs one)."""

    size: int
    count: int
    op: str = "sum"
    root: int = 0
    in_place: bool = False
    chunk: int = 1 << 18
    align: int = 1
    itemsize: int | None = None
    tree_for: Callable[[int], Tree] | None = None

    def tree(self, root: int = 0) -> Tree:
        """The tree over the ``size`` ranks rooted at ``root``."""
        if self.tree_for is None:
            raise ValueError("the tree algorithm needs a tree")
        tree = self.tree_for(root)
        if tree.n != self.size:
            raise ValueError(f"the tree spans {tree.n} ranks, the plan {self.size}")
        return tree

    @property
    def res_role(self) -> str:
        """The role of the buffer a rank's result goes to: its input when in place."""
        return IN if self.in_place else OUT

    def gather_input(self, r: int) -> Buf:
        """all_gather: rank ``r``'s block, its input, or its slot of its output when the
        call is in place (NCCL's layout)."""
        if self.in_place:
            return Buf(r, OUT, r * self.count, self.count)
        return Buf(r, IN, 0, self.count)

    def scatter_output(self, r: int) -> Buf:
        """reduce_scatter: where rank ``r``'s block of the result goes, its output, or its
        slot of its input when the call is in place (NCCL's layout)."""
        if self.in_place:
            return Buf(r, IN, r * self.count, self.count)
        return Buf(r, OUT, 0, self.count)

    @property
    def kernel_op(self) -> str:
        """The elementwise op between contributions (a mean is a sum, scaled at the end)."""
        return OPS[self.op]


Builder = Callable[[PlanRequest], Plan]
#: what an algorithm module writes for one collective: the steps of a request, added to
#: the ``PlanBuilder`` that :func:`builds` made for it
Steps = Callable[[PlanRequest, PlanBuilder], None]
BufOf = Callable[[int], Buf]  # rank -> a buffer of that rank (its input, its result...)

#: (algorithm, collective) -> its builder; filled by :func:`builds` as the algorithm
#: modules are imported.
BUILDERS: dict[tuple[str, str], Builder] = {}


def builds(
    algorithm: str, collective: str, *, also: tuple[str, ...] = ()
) -> Callable[[Steps], Steps]:
    """Register the decorated function as the steps of ``collective`` by ``algorithm``
    (and by each algorithm of ``also``, whose plans keep ``algorithm``'s name)."""

    def register(steps: Steps) -> Steps:
        build = functools.partial(_build, algorithm, collective, steps)
        for name in (algorithm, *also):
            if (name, collective) in BUILDERS:
                raise AssertionError(f"two builders for {name} {collective}")
            BUILDERS[(name, collective)] = build
        return steps

    return register


def _build(algorithm: str, collective: str, steps: Steps, req: PlanRequest) -> Plan:
    """The plan of ``req``: a ``PlanBuilder`` named after the call (the op and root where
    the collective has them; in and out one buffer when a one-buffer collective runs in
    place), filled by ``steps``."""
    c = COLLECTIVES[collective]
    name = [algorithm, collective]
    name += [req.op] if c.reduces else []
    name += [f"root={req.root}"] if c.rooted else []
    b = PlanBuilder(
        req.size,
        " ".join([*name, f"count={req.count}"]),
        same_buffer=req.in_place and c.one_buffer,
        align=req.align,
    )
    steps(req, b)
    return b.build()


def reduce_many(b: PlanBuilder, rank: int, dst: Buf, srcs: list[Buf], op: str) -> None:
    """dst = op(srcs) in passes of at most MAX_FAN_IN sources, in a fixed order: the
    backends' fold (:func:`~nccltree.backends.base.fold_schedule`)."""
    if dst in srcs[MAX_FAN_IN:]:
        # A later pass would read dst after the first one overwrote it; rather than a
        # scratch accumulator (as a backend folds), the plan sums dst first.
        srcs = [dst] + [s for s in srcs if s != dst]
    for p in fold_schedule(len(srcs), max_fused=MAX_FAN_IN):
        inputs = [srcs[i] for i in p.sources]
        b.reduce(rank, dst, [dst, *inputs] if p.accumulate else inputs, op)


def finish_mean(b: PlanBuilder, rank: int, buf: Buf, op: str, size: int) -> None:
    """Scale the finished sum in ``buf`` by 1/size when ``op`` is a mean."""
    # the 1/size goes into the sum that has just produced buf when it can, which saves a
    # pass over buf (and rounds float16 once); otherwise, e.g. after a copy, a scale step
    if op == "mean" and size > 1 and not b.fold_scale(rank, buf, 1.0 / size):
        b.scale(rank, buf, 1.0 / size)


def reduce_final(b: PlanBuilder, req: PlanRequest, rank: int, dst: Buf, srcs: list[Buf]) -> None:
    """dst = the request's op over srcs, finished (a mean scaled): a rank's final sum."""
    reduce_many(b, rank, dst, srcs, req.kernel_op)
    finish_mean(b, rank, dst, req.op, req.size)
