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

Process groups read the same table, on rows of their own: their placement is known by
node (one node, or several), and their ``auto`` also has MPI's own collectives for small
messages where MPI can run the call (see :func:`choose_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..backends.base import Device
    from ..topology import Topology
    from .plan import Plan

UNIFORM_PEER = "uniform-peer"  # every pair of devices has the same link, with peer access
OTHER = "other"
# process groups: every process on one node, or on several
GROUP_ONE_NODE = "group-one-node"
GROUP_NODES = "group-nodes"

#: ``auto`` hands a process group's messages of at most this many bytes per rank to MPI
AUTO_MPI_BYTES = 256 << 10


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
# measured: see docs/performance.md#process-groups
_GROUP_MPI = Rule(
    "mpi",
    "a call through the shared-memory engine pays a signature handshake and a few Python "
    "steps, tens of microseconds, where MPICH's shared-memory collectives take a few "
    "(docs/performance.md#process-groups)",
    max_bytes=AUTO_MPI_BYTES,
)
_GROUP_NCCL = Rule("nccl", "a GPU group takes NCCL wherever NCCL can serve it")
_GROUP_DIRECT = Rule("direct", "within one node: direct moves the fewest bytes")
_GROUP_TREE = Rule("tree", "across nodes: the tree crosses each node boundary once")

AUTO: dict[tuple[str, str], tuple[Rule, ...]] = {
    ("host", UNIFORM_PEER): (_HOST_DIRECT,),
    ("host", OTHER): (_TREE,),
    ("cuda", UNIFORM_PEER): (_NCCL, _CUDA_TREE, _DIRECT),
    ("cuda", OTHER): (_NCCL, _TREE),
    # process groups (choose_group)
    ("host", GROUP_ONE_NODE): (_GROUP_MPI, _GROUP_DIRECT),
    ("host", GROUP_NODES): (_GROUP_MPI, _GROUP_TREE),
    ("cuda", GROUP_ONE_NODE): (_GROUP_NCCL, _GROUP_DIRECT),
    ("cuda", GROUP_NODES): (_GROUP_NCCL, _GROUP_TREE),
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


def choose_group(
    *,
    gpu: bool,
    nccl_usable: bool,
    nodes: int,
    ranks_per_process: int,
    mpi_order: bool,
    nbytes: int,
    reduces: bool,
    mpi_reduces: bool,
) -> str:
    """``auto`` for a process group, from its facts: whether it runs on GPUs and NCCL can
    serve it, its number of nodes and of ranks per process, whether MPI's rank order is
    the group's, the message's bytes per rank, whether the collective reduces and whether
    MPI can reduce the dtype. MPI's own collectives run a call only with one rank per
    process, in MPI's rank order, and no reduction of a dtype MPI has no type for
    (float16, bfloat16)."""

    def usable(algorithm: str) -> bool:
        if algorithm == "nccl":
            return nccl_usable
        if algorithm == "mpi":
            return ranks_per_process == 1 and mpi_order and (mpi_reduces or not reduces)
        return True

    row = GROUP_NODES if nodes > 1 else GROUP_ONE_NODE
    return choose_rule("cuda" if gpu else "host", row, nbytes, usable).algorithm


# -- consulting the simulator (NCCLTREE_AUTO=model) ------------------------------------------
#
# The GPU rules above are guesses nobody measured. With NCCLTREE_AUTO=model a CUDA World
# asks the simulator (nccltree.sim_model) instead wherever the table picks a hand-built
# algorithm: it simulates the tree, ring and direct plans of the call on a Machine made of
# the World's topology (with the link rates detection read) and the GPU's device model,
# and takes the fastest. Where the table picks NCCL, NCCL stays. Off by default until a GPU
# run has confirmed the model's choices.

AUTO_ENV = "NCCLTREE_AUTO"
AUTO_MODES = ("table", "model")
#: the device model taken where no model's name matches the GPU's
DEFAULT_DEVICE_MODEL = "h100"


def auto_mode(value: str | None = None) -> str:
    """``table`` or ``model``: ``value``, else ``NCCLTREE_AUTO`` (unset: ``table``). An
    unknown value warns and counts as ``table`` (not worth failing a training run for)."""
    import os

    raw = os.environ.get(AUTO_ENV, "") if value is None else value
    mode = raw.strip().lower() or "table"
    if mode not in AUTO_MODES:
        import warnings

        warnings.warn(
            f"{AUTO_ENV}={raw!r}: accepted values are {', '.join(AUTO_MODES)} (or unset); "
            "using table",
            RuntimeWarning,
            stacklevel=3,
        )
        return "table"
    return mode


def device_model_for(gpu_name: str) -> tuple[str, str]:
    """(the key of ``nccltree.sim_model.DEVICES`` whose model the GPU's name names, a note):
    ``"NVIDIA H100 80GB HBM3"`` is ``h100``, ``"Tesla V100-SXM2-16GB"`` ``v100``,
    ``"NVIDIA GeForce RTX 4090"`` ``rtx4090``, ``"NVIDIA H100 PCIe"`` ``h100pcie``; where none matches, ``h100`` and a note
    saying so (the note is empty otherwise)."""
    import re

    from ..sim_model import DEVICES

    low = gpu_name.lower()
    # the most specific key first: "h100pcie" before "h100"
    for key in sorted((k for k in DEVICES if k != "host"), key=len, reverse=True):
        # letters and digits, a space or a dash allowed between: "rtx2080ti" is
        # "RTX 2080 Ti", "h100pcie" "H100 PCIe"
        body = "[ -]?".join(re.findall(r"[a-z]+|\d+", key))
        # a whole model number: "a100" is not in "A1000"
        if re.search(rf"(?<![a-z0-9]){body}(?![0-9])", low):
            return key, ""
    known = ", ".join(k for k in DEVICES if k != "host")
    return DEFAULT_DEVICE_MODEL, (
        f"no device model matches GPU {gpu_name!r} (known: {known}); the "
        f"{DEFAULT_DEVICE_MODEL} model's figures stand in"
    )


def gpu_name(devices: Sequence[Device]) -> str:
    """The model name of the first device's GPU, as CUDA reports it (``""`` where it
    cannot be asked)."""
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(int(getattr(devices[0], "physical_id", 0)))
    except Exception:  # noqa: BLE001 - a name is only a hint; the default model stands in
        return ""
    name = props.get("name", b"")
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def size_class(nbytes: int) -> int:
    """The size class of a message of ``nbytes`` per rank: the smallest power of two
    holding it (0 for an empty one)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class ModelChoice:
    """What the model chose for one (collective, size class): the algorithm, every
    candidate's predicted time (seconds), and the device model used."""

    algorithm: str
    predicted_s: dict[str, float]
    device: str
    nbytes: int  # the call simulated: bytes per rank

    @property
    def why(self) -> str:
        times = ", ".join(f"{a} {t * 1e6:.1f} us" for a, t in self.predicted_s.items())
        return (
            f"the simulator's prediction on the {self.device} device model for "
            f"{self.nbytes} B per rank: {times} (NCCLTREE_AUTO=model)"
        )


class ModelChooser:
    """``auto`` consulting the simulator, for one World: the fastest of the hand-built
    plans on a ``Machine`` of ``topology`` and the GPU's device model, decided once per
    (collective, size class) by simulating that class's first call, then cached."""

    CANDIDATES = ("tree", "ring", "direct")

    def __init__(self, topology: Topology, gpu_name: str) -> None:
        from .. import sim_model

        self.device, self.note = device_model_for(gpu_name)
        self.machine = sim_model.Machine(topology, sim_model.DEVICES[self.device])
        self._cache: dict[tuple[str, int], ModelChoice | None] = {}

    def cached(self, collective: str, nbytes: int) -> bool:
        return (collective, size_class(nbytes)) in self._cache

    def choose(
        self, collective: str, nbytes: int, itemsize: int, plan_for: Callable[[str], Plan]
    ) -> ModelChoice | None:
        """The model's choice for a call of ``collective`` with ``nbytes`` per rank;
        ``plan_for(algorithm)`` builds the call's plan. None where no candidate has a
        plan (the table decides then)."""
        from .. import sim_model

        key = (collective, size_class(nbytes))
        if key not in self._cache:
            times: dict[str, float] = {}
            for alg in self.CANDIDATES:
                try:
                    plan = plan_for(alg)
                except ValueError:  # no plan of this algorithm for this collective
                    continue
                times[alg] = sim_model.simulate(plan, self.machine, itemsize).time_s
            best = min(times, key=lambda a: (times[a], self.CANDIDATES.index(a)), default=None)
            self._cache[key] = (
                None if best is None else ModelChoice(best, times, self.device, nbytes)
            )
        return self._cache[key]
