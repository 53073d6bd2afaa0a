"""Algorithms: each turns a collective into a :class:`~nccltree.comm.plan.Plan`.

Every builder takes one :class:`~nccltree.comm.builders.PlanRequest` and is registered
per (algorithm, collective) with :func:`~nccltree.comm.builders.builds`;
:func:`build_plan` checks the arguments, makes the request and calls the builder. One
module per algorithm in :mod:`nccltree.comm.builders`:

* ``tree`` — reduce up a topology-aware tree, broadcast down it, chunked and staged
  through pinned memory across links without peer access;
* ``ring`` — reduce-scatter then all-gather around the ring;
* ``direct`` — every rank reduces its 1/N slice reading all peers, then writes it to
  every peer.

Conventions shared by every builder:

* ``count`` is the element count of each rank's *input* for all_reduce, reduce and
  broadcast; of each rank's input *block* for all_gather (output: ``size * count``); and of
  each rank's *output* block for reduce_scatter (input: ``size * count``).
* ``res(r)`` is where rank ``r``'s result goes: its output buffer, or its input buffer
  when the call is in place (``PlanRequest.res_role``).
* Summation order is fixed by the plan (tree shape, ring position, rank order), never by
  arrival, so every run gives bitwise the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._validate import check_choice, check_index, check_int
from ._ops import OPS
from .builders import BUILDERS, MAX_FAN_IN, PlanRequest
from .plan import Plan, align_elements, aligned_chunk

if TYPE_CHECKING:
    from ..tree import Tree

__all__ = ["ALGORITHMS", "MAX_FAN_IN", "build_plan"]

ALGORITHMS = ("tree", "ring", "direct")


def build_plan(
    algorithm: str,
    collective: str,
    *,
    size: int,
    count: int,
    op: str = "sum",
    root: int = 0,
    in_place: bool = False,
    chunk: int = 1 << 18,
    tree_for: Callable[[int], Tree] | None = None,
    itemsize: int | None = None,
) -> Plan:
    """The plan of ``collective`` by ``algorithm`` over ``size`` ranks. ``tree_for(root)``
    gives the tree rooted at ``root`` (only the tree algorithm needs it; a rooted
    collective asks for its root, the others for rank 0); ``chunk`` is in elements.

    ``itemsize`` (bytes per element) makes every offset the plan chooses itself a multiple
    of :data:`~nccltree.comm.plan.ALIGN_BYTES`: the slices of ring and direct, the chunks
    (``chunk`` is rounded down to a multiple, at least one), scratch and staging regions.
    Offsets the call fixes (the blocks of all_gather and reduce_scatter) stay where they
    are. Without it the plan works to the element (the data flow is the same).

    ``size``, ``count``, ``root``, ``chunk`` and ``itemsize`` are checked by the rule of
    :mod:`nccltree._validate` (numpy integers accepted, bool refused)."""
    build = BUILDERS.get((algorithm, collective))
    if build is None:
        raise ValueError(f"no plan for {algorithm!r} {collective!r}")
    check_choice(op, "reduction op", OPS)
    size = check_int(size, "size", min=1)
    align = align_elements(itemsize)
    req = PlanRequest(
        size=size,
        count=check_int(count, "count", min=0),
        op=op,
        root=check_index(root, "root", size),
        in_place=bool(in_place),
        chunk=aligned_chunk(check_int(chunk, "chunk", min=1), align),
        align=align,
        itemsize=itemsize,
        tree_for=tree_for,
    )
    return build(req)
