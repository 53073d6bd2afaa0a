"""How a World plans its calls: the chunk policy, its trees, the plan builder.

``Planner`` holds what a World's plans follow from besides the call itself: the topology
(a tree per root, built on first use) and the chunk setting, fixed or the GPU policy
(:func:`nccltree.comm.plan.gpu_chunk_bytes`). It builds a call's plan on request and
caches nothing but the trees (the World's program cache keeps the plans).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._validate import check_index, check_int
from ._args import Prepared
from .algorithms import build_plan
from .collectives import COLLECTIVES
from .plan import Plan, chunk_elements, gpu_chunk_bytes

if TYPE_CHECKING:
    from ..topology import Topology
    from ..tree import Tree


class Planner:
    """The plans of a World of ``topology.n`` ranks: cut into ``chunk_bytes`` when
    ``fixed_chunk``, else by the GPU policy (``chunk_bytes`` then its largest chunk)."""

    def __init__(self, topology: Topology, chunk_bytes: int, fixed_chunk: bool) -> None:
        self.topology = topology
        self.size = topology.n
        self.chunk_bytes = chunk_bytes
        self.fixed_chunk = fixed_chunk
        self._trees: dict[int, Tree] = {}

    def tree(self, root: int = 0) -> Tree:
        """The tree the tree algorithm uses for collectives rooted at ``root``."""
        root = check_index(root, "root", self.size)
        if root not in self._trees:
            from ..tree import build_tree

            self._trees[root] = build_tree(self.topology, root=root)
        return self._trees[root]

    def chunk_for(self, nbytes: int) -> int:
        """The chunk (bytes) for a call whose ranks' largest buffer holds ``nbytes``."""
        nbytes = check_int(nbytes, "nbytes", min=0)
        return self.chunk_bytes if self.fixed_chunk else gpu_chunk_bytes(nbytes)

    def chunk_elements(self, prep: Prepared) -> int:
        """The chunk of a call's plan, in elements."""
        coll = COLLECTIVES[prep.collective]
        itemsize = prep.dtype.itemsize
        # the largest buffer a rank passes: the gathered output, the scattered input
        biggest = max(coll.in_count(prep.count, self.size), coll.out_count(prep.count, self.size))
        return chunk_elements(self.chunk_for(biggest * itemsize), itemsize)

    def build(self, algorithm: str, prep: Prepared) -> Plan:
        """The plan for ``prep`` by ``algorithm``. The itemsize lets the plan align the
        slices and chunks it chooses (256 B), so the vector kernels keep their vector
        path."""
        return build_plan(
            algorithm,
            prep.collective,
            size=self.size,
            count=prep.count,
            op=prep.op,
            root=prep.root,
            in_place=prep.in_place,
            chunk=self.chunk_elements(prep),
            tree_for=self.tree,
            itemsize=prep.dtype.itemsize,
        )
