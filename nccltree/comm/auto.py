"""``algorithm="auto"``: which algorithm a call runs, as one table.

Rows are keyed by backend and topology class; each row lists rules in order, and the
first whose size range holds the message (bytes per rank) and whose algorithm is usable
wins; the last rule of a row takes every size. Whether an algorithm is usable is asked
only once its size range matched (asking whether NCCL is usable creates communicators).

Why these shapes: small messages are latency-bound, and the tree has the fewest dependent
steps (log2 N); large messages are bandwidth-bound, and on fully connected devices with
uniform links (one host, NVSwitch) the direct algorithm moves the fewest bytes, while
elsewhere the topology-aware tree keeps the slow links for the few top-level transfers.
NCCL, where usable, takes large messages on GPUs. On one host a synchronous call runs its
whole plan in one native call, so dependent steps cost nothing and direct takes every
size (measured: docs/performance.md#algorithm-choice-per-size-auto); the GPU thresholds
are not measured yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..topology import Topology

UNIFORM_PEER = "uniform-peer"  # every pair of devices has the same link, with peer access
OTHER = "other"


@dataclass(frozen=True)
class Rule:
    """``algorithm`` for messages of ``min_bytes`` to ``max_bytes`` per rank (both
    inclusive; ``None``: no upper bound), for the reason ``why``."""

    algorithm: str
    why: str
    min_bytes: int = 0
    max_bytes: int | None = None

    def holds(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes and (self.max_bytes is None or nbytes <= self.max_bytes)


_NCCL = Rule(
    "nccl",
    "NCCL's kernels beat the hand-built copy plans once the message is bandwidth-bound",
    min_bytes=256 << 10,
)
# measured: see docs/performance.md#algorithm-choice-per-size-auto
_HOST_DIRECT = Rule(
    "direct",
    "measured on the host backend: a synchronous call runs the whole plan in one native "
    "call, so the plan's steps cost nothing in Python and the fewest bytes win at every "
    "size; direct moves the fewest and led or tied the tree and ring from 8 B to 64 MiB "
    "on 2 and 4 ranks (docs/performance.md#algorithm-choice-per-size-auto)",
)
_CUDA_TREE = Rule(
    "tree",
    "latency-bound: fewest dependent steps; GPUs not measured yet",
    max_bytes=64 << 10,
)
_DIRECT = Rule("direct", "uniform links with peer access: direct moves the fewest bytes")
_TREE = Rule("tree", "mixed links: the topology-aware tree keeps slow links for few transfers")

AUTO: dict[tuple[str, str], tuple[Rule, ...]] = {
    ("host", UNIFORM_PEER): (_HOST_DIRECT,),
    ("host", OTHER): (_TREE,),
    ("cuda", UNIFORM_PEER): (_NCCL, _CUDA_TREE, _DIRECT),
    ("cuda", OTHER): (_NCCL, _TREE),
}


def topology_class(topology: Topology) -> str:
    """``UNIFORM_PEER`` when every pair of distinct devices has one link kind with peer
    access (one host, NVSwitch), else ``OTHER`` (a single device included).

    A topology with ``NET`` links (ranks on several nodes) is ``OTHER``, as a ``NET`` link
    never has peer access: the topology-aware tree, which crosses between nodes as
    rarely as it can and at the top, is the hand-built algorithm for it. In-process
    worlds never detect ``NET``, so their choices do not change."""
    n = topology.n
    links = {
        (topology.link(i, j).kind, topology.link(i, j).p2p)
        for i in range(n)
        for j in range(n)
        if i != j
    }
    return UNIFORM_PEER if len(links) == 1 and next(iter(links))[1] else OTHER


def choose(backend: str, topo_class: str, nbytes: int, usable: Callable[[str], bool]) -> str:
    """The algorithm of the first rule of ``AUTO[backend, topo_class]`` that holds
    ``nbytes`` and whose algorithm is ``usable``."""
    return choose_rule(backend, topo_class, nbytes, usable).algorithm


def choose_rule(backend: str, topo_class: str, nbytes: int, usable: Callable[[str], bool]) -> Rule:
    """The rule :func:`choose` takes (its ``why`` says the reason)."""
    for rule in AUTO[backend, topo_class]:
        if rule.holds(nbytes) and usable(rule.algorithm):
            return rule
    raise AssertionError(f"no auto rule for {nbytes} B on {backend}/{topo_class}")
