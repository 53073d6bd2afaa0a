"""Predicting a plan's time on a machine: a link model, and an event-driven simulator that
runs the exact plan nccltree would execute.

**The machine** (:class:`Machine`): a :class:`~nccltree.topology.Topology` (which devices
are linked how), a device model (:class:`DeviceModel`: memory bandwidth, NVLink rate per
link, PCIe generation; :data:`DEVICES` holds data-sheet figures), each node's network
rate, the host's cost of issuing one step, and which host thread issues each rank's steps.
Every directed link and every device's memory is a resource with a bandwidth:

- ``NVLINK`` with n links: n x the model's per-link rate, per direction;
- ``SAME_BOARD``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``: the model's PCIe x16 rate,
  times an efficiency that falls with the distance (:data:`PCIE_EFFICIENCY`);
- ``SAME_DEVICE``: the device's own memory;
- a pair without peer access: half its rate (the copy is staged through the host);
- each GPU's PCIe link to the host, per direction; each node's host memory (staging
  buffers live there); each node's network output and input (``NET`` links between nodes
  are not resources of their own: whatever crosses takes the two nodes' network).

A link that carries its own numbers (``Link.gbps``, ``Link.latency_s``: from a topology
JSON file, or read from NVML by detection) has them in place of the model's rate and the
kind's latency (:meth:`Machine.link_gbps`, :meth:`Machine.latency_s`).

**The simulation** (:func:`simulate`): each rank's stream performs its steps in plan order.
A step starts when its stream is free, the events it waits for are recorded, and its
host thread has issued it (``issuers``: one thread for every rank by default, as an
in-process World; one per rank as process groups run; each issues its ranks' steps in the
plan's order, at ``issue_s`` each: the cost that bounds logical ranks on one GPU). A data
step is a flow with fixed demands on resources: a copy moves its bytes over the link and
reads and writes the two memories; a fused reduce reads each source (over its link when
remote) and writes the destination, on the executing device. Concurrent flows share each
resource max-min fairly (progressive filling), recomputed whenever a flow starts or ends
among the flows joined to it through resources that can bind; every step pays its link's
latency before it moves data. The result is the predicted time and, per resource, the
bytes moved and the time it was busy.

This is a model: it knows nothing of protocols, kernels' occupancy or caches. Its
constants are data-sheet figures, named with their sources in :data:`DEVICES`.

It is pure: plans (``comm.plan``, ``comm.algorithms``) executed on a link model, with no
World, no device and no clock, so ``comm.auto`` can consult it. Measuring the host
backend to give it figures is :mod:`nccltree.sim_calibration`; :mod:`nccltree.sim` names
both.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._validate import check_int, check_real
from .comm.plan import CHUNK_BYTES, STAGE, Plan, Step, chunk_elements, gpu_chunk_bytes
from .topology import Link, LinkKind, Topology

if TYPE_CHECKING:
    pass

GB = 1e9


@dataclass(frozen=True)
class DeviceModel:
    """One device model: memory bandwidth (GB/s, reads + writes), NVLink rate per link
    and direction (GB/s), PCIe generation of its x16 slot, and where the figures come
    from."""

    name: str
    memory_gbps: float
    nvlink_gbps: float
    pcie_gen: int
    source: str


#: Data-sheet figures (NVLink: the aggregate bidirectional figure / links / 2).
DEVICES: dict[str, DeviceModel] = {
    m.name: m
    for m in (
        DeviceModel(
            "v100",
            900.0,
            25.0,
            3,
            "NVIDIA Tesla V100 data sheet: HBM2 900 GB/s, NVLink 300 GB/s over 6 links",
        ),  # fmt: skip
        DeviceModel(
            "a100",
            2039.0,
            25.0,
            4,
            "NVIDIA A100 80GB SXM data sheet: 2,039 GB/s, NVLink 600 GB/s over 12 links",
        ),  # fmt: skip
        DeviceModel(
            "h100",
            3350.0,
            25.0,
            5,
            "NVIDIA H100 SXM data sheet: 3.35 TB/s, NVLink 900 GB/s over 18 links",
        ),  # fmt: skip
        DeviceModel(
            "h200",
            4800.0,
            25.0,
            5,
            "NVIDIA H200 SXM data sheet: 4.8 TB/s, NVLink 900 GB/s over 18 links",
        ),  # fmt: skip
        DeviceModel(
            "rtx4090",
            1008.0,
            0.0,
            4,
            "NVIDIA GeForce RTX 4090 specifications: 1,008 GB/s, no NVLink, PCIe 4.0 x16",
        ),  # fmt: skip
        DeviceModel(
            "h100pcie",
            2000.0,
            25.0,
            5,
            "NVIDIA H100 PCIe data sheet: 2 TB/s, NVLink bridge 600 GB/s over 12 links, PCIe Gen5",
        ),  # fmt: skip
        DeviceModel(
            "h800",
            3350.0,
            25.0,
            5,
            "NVIDIA H800 SXM5 data sheet: 3.35 TB/s, NVLink 400 GB/s over 8 links",
        ),  # fmt: skip
        DeviceModel(
            "rtx2080ti",
            616.0,
            25.0,
            3,
            "NVIDIA GeForce RTX 2080 Ti specifications: 616 GB/s, PCIe 3.0 x16; Turing "
            "architecture whitepaper: TU102 NVLink 100 GB/s over 2 links",
        ),  # fmt: skip
        DeviceModel(
            "host",
            20.0,
            0.0,
            0,
            "a host's copy rate (bytes read + written per second); measure yours with nt_copy",
        ),  # fmt: skip
    )
}
#: PCIe x16 per direction (GB/s), by generation: 8, 16, 32 GT/s x 16 lanes, 128b/130b
PCIE_X16_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}
#: the share of the PCIe rate a transfer gets, by how far it travels
PCIE_EFFICIENCY = {
    LinkKind.SAME_BOARD: 0.85,
    LinkKind.PIX: 0.85,
    LinkKind.PXB: 0.8,
    LinkKind.PHB: 0.75,
    LinkKind.NODE: 0.7,
    LinkKind.SYS: 0.5,
}
#: latency of one step's transfer over a link kind (seconds)
LATENCY_S = {
    LinkKind.SELF: 1e-6,
    LinkKind.SAME_DEVICE: 1e-6,
    LinkKind.NVLINK: 2e-6,
    LinkKind.NET: 5e-6,
}
PCIE_LATENCY_S = 3e-6


@dataclass(frozen=True)
class Machine:
    """What :func:`simulate` runs a plan on (see the module docstring). ``net_gbps``: each
    node's network rate per direction (all its NICs); ``issue_s``: the host's time to
    issue one step (13 us measured through CuPy on an H200; about 1.5 us on the host
    backend); ``sync_steps_cost``: whether records and waits cost it too (on GPUs each is
    a CUDA call; the host backend's inline calls skip them); ``issuers``: the host thread
    issuing each rank's steps (None: one thread for all, an in-process World)."""

    topology: Topology
    device: DeviceModel
    net_gbps: float = 12.5
    issue_s: float = 13e-6
    sync_steps_cost: bool = True
    issuers: tuple[int, ...] | None = None

    def link_gbps(self, link: Link) -> float:
        """The rate of one direction of ``link`` (GB/s). The link's own nominal rate
        (``link.gbps``: from a topology JSON, or filled by detection from NVML) where it
        carries one, else the device model's data-sheet figure; either way a PCIe path
        gets the share of its distance (:data:`PCIE_EFFICIENCY`) and a pair without peer
        access half (staged through the host)."""
        k = link.kind
        if k in (LinkKind.SELF, LinkKind.SAME_DEVICE):
            # a copy reads and writes the one memory
            rate = link.gbps if link.gbps is not None else self.device.memory_gbps / 2
        elif k == LinkKind.NVLINK:
            rate = link.gbps if link.gbps is not None else link.nvlinks * self.device.nvlink_gbps
        elif k == LinkKind.NET:
            rate = link.gbps if link.gbps is not None else self.net_gbps
        else:
            pcie = link.gbps
            if pcie is None:
                pcie = PCIE_X16_GBPS.get(self.device.pcie_gen, self.device.memory_gbps / 2)
            rate = pcie * PCIE_EFFICIENCY[k]
        if not link.p2p and k != LinkKind.NET:
            rate /= 2  # staged through the host: two transfers
        return rate

    def latency_s(self, link: Link) -> float:
        """One transfer's latency over ``link`` (seconds): the link's own
        (``link.latency_s``) where it carries one, else :data:`LATENCY_S` by kind
        (:data:`PCIE_LATENCY_S` for the PCIe kinds)."""
        if link.latency_s is not None:
            return link.latency_s
        return LATENCY_S.get(link.kind, PCIE_LATENCY_S)

    @functools.cached_property
    def _memories(self) -> tuple[int, ...]:
        """Each rank's memory: ranks joined by ``SAME_DEVICE`` links share one (named by
        its lowest rank)."""
        topo = self.topology
        mine = list(range(topo.n))
        for a in range(topo.n):
            for b in range(a):
                if topo.link(a, b).kind == LinkKind.SAME_DEVICE:
                    mine[a] = mine[b]
                    break
        return tuple(mine)

    def memory(self, rank: int) -> int:
        return self._memories[rank]

    @functools.cached_property
    def nodes(self) -> tuple[int, ...]:
        """Each rank's node: ranks joined by any link but ``NET`` share one, numbered in
        order of their lowest rank."""
        topo = self.topology
        node: list[int] = []
        for r in range(topo.n):
            same = [q for q in range(r) if topo.link(r, q).kind != LinkKind.NET]
            node.append(node[same[0]] if same else max(node, default=-1) + 1)
        return tuple(node)


@dataclass
class SimResult:
    """A simulated plan: its time (seconds) and, per resource (``link i->j`` or ``mem
    i``), the bytes it moved and the seconds it was busy."""

    time_s: float
    bytes: dict[str, float] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)


@dataclass
class _Flow:
    demands: dict[str, float]  # resource -> bytes per byte of the flow
    left: float  # bytes of the flow still to move, as of ``since``
    solo: float  # its rate alone: the least of its resources' capacity / demand
    since: float = 0.0
    rate: float = 0.0

    def end(self) -> float:
        return self.since + self.left / self.rate if self.rate > 0 else float("inf")


#: where a buffer lives: ("dev", rank), its device's memory, or ("host", rank), the host
#: memory of the rank's node, reached over that rank's PCIe link
_Place = tuple[str, int]


def _flow(m: Machine, step: Step, itemsize: int) -> tuple[dict[str, float], float, float]:
    """A data step as (demands, bytes, latency): its resources and bytes per flow byte.
    Ranks on one memory (``SAME_DEVICE``: logical ranks of a GPU, host devices) share
    that memory's bandwidth. Staging buffers live in the host memory of their rank's node,
    reached over the rank's PCIe link (one resource per direction); whatever crosses
    between nodes also takes the sending node's network output and the receiving node's
    input."""
    topo = m.topology
    e = step.rank
    assert step.dst is not None
    nbytes = float(step.dst.count * itemsize)
    demands: dict[str, float] = {}
    latency = 0.0

    def where(role: str, rank: int) -> _Place:
        return ("host" if role == STAGE else "dev", rank)

    def add(res: str, amount: float = 1.0) -> None:
        demands[res] = demands.get(res, 0.0) + amount

    def mem(x: _Place) -> str:
        return f"mem host {m.nodes[x[1]]}" if x[0] == "host" else f"mem {m.memory(x[1])}"

    def move(src: _Place, dst: _Place) -> None:
        """Bytes from ``src``'s memory to ``dst``'s."""
        nonlocal latency
        if mem(src) == mem(dst):
            add(mem(src), 2.0)  # read and written in the one memory
            latency = max(latency, LATENCY_S[LinkKind.SAME_DEVICE])
            return
        a, b = src[1], dst[1]
        if src[0] == "host" or dst[0] == "host":
            if src[0] == "dev":
                add(f"pcie {a} up")  # from the device to pinned host memory
            if dst[0] == "dev":
                add(f"pcie {b} down")
            latency = max(latency, PCIE_LATENCY_S)
        else:
            link = topo.link(a, b)
            if link.kind != LinkKind.NET or link.gbps is not None:
                add(f"link {a}->{b}")  # a NET pair only where it carries a rate of its own
            latency = max(latency, m.latency_s(link))
        if m.nodes[a] != m.nodes[b]:
            add(f"net out {m.nodes[a]}")
            add(f"net in {m.nodes[b]}")
            latency = max(latency, LATENCY_S[LinkKind.NET])
        add(mem(src))
        add(mem(dst))

    dst = where(step.dst.role, step.dst.rank)
    here: _Place = ("dev", e)
    if step.kind == "scale":
        add(mem(dst), 2.0)
    elif step.kind == "copy":
        move(where(step.srcs[0].role, step.srcs[0].rank), dst)
    else:  # reduce: each source read by the executing device, the result written
        for b in step.srcs:
            s = where(b.role, b.rank)
            if mem(s) == mem(here):
                add(mem(here))
            else:
                move(s, here)
                demands[mem(here)] -= 1.0  # arriving data is consumed, not stored
        if mem(dst) == mem(here):
            add(mem(here))
        else:
            move(here, dst)
            demands[mem(here)] -= 1.0  # the result leaves from registers, not memory
    return {k: v for k, v in demands.items() if v > 0}, nbytes, latency


def _capacity(m: Machine, res: str) -> float:
    kind, where = res.split(" ", 1)
    if kind == "mem":
        host = where.startswith("host")
        return (DEVICES["host"].memory_gbps if host else m.device.memory_gbps) * GB
    if kind == "pcie":
        return PCIE_X16_GBPS.get(m.device.pcie_gen, DEVICES["host"].memory_gbps) * GB
    if kind == "net":
        return m.net_gbps * GB
    a, b = (int(x) for x in where.split("->"))
    return m.link_gbps(m.topology.link(a, b)) * GB


def _share(flows: Sequence[_Flow], caps: dict[str, float], tight: set[str]) -> None:
    """Max-min fair rates (progressive filling) of ``flows`` over the ``tight`` resources'
    capacities, each flow also held to its ``solo`` rate. Resources that are not tight
    cannot bind (their flows' solo rates fit in them together) and are left out: the
    allocation is the same, and flows joined only through them are independent."""
    active = list(flows)
    left = {}
    for f in active:
        f.rate = 0.0
        for res in f.demands:
            if res in tight:
                left[res] = caps[res]
    level = 0.0
    while active:
        weight: dict[str, float] = {}
        for f in active:
            for res, d in f.demands.items():
                if res in left:
                    weight[res] = weight.get(res, 0.0) + d
        # every active flow rises by the same amount until a resource fills or a flow
        # reaches its solo rate
        step = min(f.solo for f in active) - level
        for res, w in weight.items():
            step = min(step, left[res] / w)
        step = max(step, 0.0)
        level += step
        full = set()
        for res, w in weight.items():
            left[res] -= w * step
            if left[res] <= caps[res] * 1e-12:
                full.add(res)
        still = []
        for f in active:
            if f.solo <= level * (1 + 1e-12) or any(r in full for r in f.demands):
                f.rate = min(level, f.solo)
            else:
                still.append(f)
        if len(still) == len(active):  # nothing froze: rounding; settle at this level
            for f in active:
                f.rate = min(level, f.solo)
            break
        active = still


def _issue_times(plan: Plan, machine: Machine) -> tuple[list[list[int]], list[float]]:
    """Each stream's steps (indices into the plan), and when each step is issued: each
    host thread issues its ranks' steps (records and waits too, each a CUDA call, where
    they cost) in the plan's order."""
    n = plan.size
    issuers = machine.issuers or (0,) * n
    if len(issuers) != n:
        raise ValueError(f"the machine names {len(issuers)} issuers for {n} ranks")
    per_stream: list[list[int]] = [[] for _ in range(n)]
    issued_at: list[float] = []
    issued: dict[int, int] = {}
    for i, s in enumerate(plan.steps):
        per_stream[s.rank].append(i)
        h = issuers[s.rank]
        if machine.sync_steps_cost or s.kind not in ("record", "wait"):
            issued[h] = issued.get(h, 0) + 1
        issued_at.append(issued.get(h, 0) * machine.issue_s)
    return per_stream, issued_at


@dataclass
class _Resources:
    """The resources during a simulation: each one's capacity, the streams whose flows
    use it, their load (the sum of demand x solo rate), which are saturated (tight), when
    each busy spell began; the bytes and busy time go to ``result``."""

    result: SimResult
    caps: dict[str, float] = field(default_factory=dict)
    users: dict[str, set[int]] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)
    tight: set[str] = field(default_factory=set)
    first_use: dict[str, float] = field(default_factory=dict)

    def occupy(self, r: int, demands: dict[str, float], nbytes: float, solo: float,
               now: float) -> None:  # fmt: skip
        """Stream ``r``'s flow starts at ``now``."""
        for res, d in demands.items():
            self.result.bytes[res] = self.result.bytes.get(res, 0.0) + nbytes * d
            u = self.users.setdefault(res, set())
            if not u:
                self.first_use[res] = now
            u.add(r)
            self.load[res] = self.load.get(res, 0.0) + d * solo
            if self.load[res] > self.caps[res] * (1 + 1e-9):
                self.tight.add(res)

    def vacate(self, r: int, f: _Flow, now: float, seeds: set[int]) -> None:
        """Stream ``r``'s flow ``f`` ended at ``now``; the streams sharing a resource it
        saturated join ``seeds`` (their rates change)."""
        for res, d in f.demands.items():
            if res in self.tight:
                seeds.update(self.users[res])
            self.users[res].discard(r)
            self.load[res] -= d * f.solo
            if not self.users[res]:
                self.result.busy_s[res] = (
                    self.result.busy_s.get(res, 0.0) + now - self.first_use[res]
                )
            if self.load[res] <= self.caps[res] * (1 + 1e-9):
                self.tight.discard(res)

    def joined(self, seeds: set[int], running: dict[int, _Flow]) -> set[int]:
        """The running streams joined to ``seeds`` through tight resources."""
        group: set[int] = set()
        todo = [r for r in seeds if r in running]
        while todo:
            r = todo.pop()
            if r in group:
                continue
            group.add(r)
            for res in running[r].demands:
                if res in self.tight:
                    todo.extend(q for q in self.users[res] if q not in group)
        return group


def simulate(plan: Plan, machine: Machine, itemsize: int = 4) -> SimResult:
    """The predicted time of ``plan`` on ``machine`` (elements of ``itemsize`` bytes)."""
    itemsize = check_int(itemsize, "itemsize", min=1)
    n = plan.size
    if machine.topology.n != n:
        raise ValueError(f"the plan has {n} ranks, the machine's topology {machine.topology.n}")
    per_stream, issued_at = _issue_times(plan, machine)
    steps = plan.steps
    pos = [0] * n
    free_at = [0.0] * n  # when each stream is free (no flow running or pending on it)
    busy = [False] * n  # a flow of the stream is pending or running
    running: dict[int, _Flow] = {}  # stream -> its flow
    pending: list[tuple[float, int, int]] = []  # (start, stream, step index)
    recorded: dict[int, float] = {}
    waiting: dict[int, list[int]] = {}  # event -> streams blocked on it
    result = SimResult(0.0)
    use = _Resources(result)
    caps, tight = use.caps, use.tight
    flows: dict[int, tuple[dict[str, float], float, float]] = {}
    now = 0.0

    def flow_of(i: int) -> tuple[dict[str, float], float, float]:
        f = flows.get(i)
        if f is None:
            f = flows[i] = _flow(machine, steps[i], itemsize)
            for res in f[0]:
                if res not in caps:
                    caps[res] = _capacity(machine, res)
        return f

    def advance(r: int) -> None:
        """Walk stream r's steps from its position while it can (records, satisfied
        waits), until a data step is scheduled or a wait blocks."""
        own = per_stream[r]
        while pos[r] < len(own) and not busy[r]:
            i = own[pos[r]]
            s = steps[i]
            if s.kind == "record":
                recorded[s.event] = max(free_at[r], issued_at[i])
                work.extend(waiting.pop(s.event, ()))
                pos[r] += 1
                continue
            if s.kind == "wait":
                t = recorded.get(s.event)
                if t is None:
                    waiting.setdefault(s.event, []).append(r)
                    return  # its record comes later (another stream)
                free_at[r] = max(free_at[r], t, issued_at[i])
                pos[r] += 1
                continue
            _, _, latency = flow_of(i)
            heapq.heappush(pending, (max(free_at[r], issued_at[i]) + latency, r, i))
            busy[r] = True
            pos[r] += 1
            return

    def settle(seeds: set[int]) -> None:
        """Recompute the rates of the flows joined to ``seeds`` through tight resources."""
        group = use.joined(seeds, running)
        for r in group:  # bring each flow's remaining bytes up to now
            f = running[r]
            f.left -= f.rate * (now - f.since)
            f.since = now
        _share([running[r] for r in group], caps, tight)

    work = list(range(n))
    while work:
        advance(work.pop())
    while pending or running:
        # the next change: a flow ends, or a pending flow starts
        next_end = min((f.end() for f in running.values()), default=float("inf"))
        next_start = pending[0][0] if pending else float("inf")
        t = min(next_end, next_start)
        if t == float("inf"):
            raise AssertionError("the plan cannot progress (a wait without its record)")
        now = t
        seeds: set[int] = set()
        for r, f in list(running.items()):
            if f.end() > now * (1 + 1e-12) + 1e-15:
                continue
            del running[r]
            free_at[r] = now
            busy[r] = False
            work.append(r)
            use.vacate(r, f, now, seeds)
        while pending and pending[0][0] <= now:
            _, r, i = heapq.heappop(pending)
            demands, nbytes, _ = flow_of(i)
            if nbytes <= 0 or not demands:
                free_at[r] = now
                busy[r] = False
                work.append(r)
                continue
            solo = min(caps[res] / d for res, d in demands.items())
            running[r] = _Flow(demands, nbytes, solo, now)
            seeds.add(r)
            use.occupy(r, demands, nbytes, solo, now)
        while work:
            advance(work.pop())
        seeds -= {r for r in seeds if r not in running}
        if seeds:
            settle(seeds)
    if any(pos[r] < len(per_stream[r]) for r in range(n)):
        raise AssertionError("the plan cannot progress (a wait without its record)")
    result.time_s = max([now, *free_at])
    return result


def simulate_collective(
    machine: Machine,
    algorithm: str,
    collective: str,
    count: int,
    *,
    op: str = "sum",
    root: int = 0,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
) -> SimResult:
    """The predicted time of one call of ``collective`` with ``algorithm`` (tree, ring,
    direct) on ``machine``: the plan a World builds for it, simulated."""
    from .comm.algorithms import build_plan
    from .tree import build_tree

    topo = machine.topology
    check_real(chunk_bytes, "chunk_bytes", min=1)
    plan = build_plan(
        algorithm, collective, size=topo.n, count=count, op=op, root=root,
        chunk=chunk_elements(int(chunk_bytes), itemsize),
        tree_for=lambda r: build_tree(topo, root=r), itemsize=itemsize,
    )  # fmt: skip
    return simulate(plan, machine, itemsize)


def predict(
    machine: Machine, algorithm: str, collective: str, size: int, itemsize: int = 4
) -> tuple[float, int, int]:
    """One point of the collectives table on ``machine``: ``(seconds, count, bytes)`` of
    a call of ``size`` bytes as nccl-tests counts them, by ``algorithm`` (``tree``,
    ``ring``, ``direct``: the plan a World builds, chunked as a GPU World chunks it;
    ``nccl-model``: NCCL's cost model, not NCCL)."""
    from .comm.collectives import COLLECTIVES

    coll = COLLECTIVES[collective]
    n = machine.topology.n
    count = coll.count_for(size // itemsize, n)
    nbytes = coll.nbytes(count, n, itemsize)
    if algorithm == "nccl-model":
        return nccl_model_time(machine, collective, nbytes)[0], count, nbytes
    biggest = max(coll.in_count(count, n), coll.out_count(count, n)) * itemsize
    t = simulate_collective(machine, algorithm, collective, count, itemsize=itemsize,
                            chunk_bytes=gpu_chunk_bytes(biggest)).time_s  # fmt: skip
    return t, count, nbytes


def cluster_topology(intra: Topology, nodes: int) -> Topology:
    """``nodes`` copies of ``intra`` linked by the network."""
    nodes = check_int(nodes, "nodes", min=1)
    return Topology.cluster([k for k in range(nodes) for _ in range(intra.n)], intra=intra)


# -- NCCL's own cost model, for comparison ----------------------------------------------------
#
# From NCCL's src/graph/tuning.cc (Simple protocol): a call takes latency + bytes / algbw,
# with algbw = busbw x n / nsteps for the ring and busbw / 2 for the tree, and
#   ring latency = base + nsteps x hw   (intra-node steps; inter-node steps pay the NET one)
#   tree latency = base + 2 x ((ranks per node - 1) x hw + log2(nodes) x NET hw)
# busbw is what NCCL's topology search finds (channels x bandwidth per channel); here it is
# estimated from the links: a GPU's NVLink bandwidth (all its links, which NCCL's channels
# spread over), else the slowest PCIe hop of a ring, and between nodes the network.

NCCL_BASE_US = {"ring": 8.4, "tree": 8.4}
NCCL_HW_US = {  # (hardware, algorithm) -> us per step, Simple protocol
    ("nvlink", "tree"): 4.0, ("nvlink", "ring"): 3.4,
    ("pci", "tree"): 4.0, ("pci", "ring"): 5.7,
    ("net", "tree"): 14.0, ("net", "ring"): 14.0,
}  # fmt: skip
#: NCCL's static correction of the tree's bandwidth at medium sizes (Simple protocol), by
#: log2(bytes / 64)
NCCL_TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7,
                        .8, .7, .7, .8, .9, .9, .9)  # fmt: skip


def _best_ring(m: Machine, ranks: Sequence[int]) -> tuple[float, list[int]]:
    """The ring over ``ranks`` whose slowest hop is fastest (what NCCL's ring search
    looks for): (that hop's rate in GB/s, the order). Exhaustive up to 9 ranks; beyond,
    the ranks in order."""
    import itertools

    topo = m.topology
    first, rest = ranks[0], list(ranks[1:])
    best: tuple[float, list[int]] = (0.0, list(ranks))
    orders = itertools.permutations(rest) if len(ranks) <= 9 else iter([tuple(rest)])
    for perm in orders:
        ring = [first, *perm]
        rate = min(m.link_gbps(topo.link(a, ring[(i + 1) % len(ring)]))
                   for i, a in enumerate(ring))  # fmt: skip
        if rate > best[0]:
            best = (rate, ring)
    return best


def _node_busbw(m: Machine, ranks: Sequence[int]) -> tuple[float, str]:
    """(busbw in GB/s, hardware) within one node, as NCCL's search would find it: where a
    ring over NVLink alone exists, a GPU's whole NVLink bandwidth (NCCL spreads channels
    over every link; the same count to every peer is a switch, counted once), the least
    over the GPUs; otherwise the slowest hop of the best ring."""
    topo = m.topology
    if len(ranks) == 1:
        return m.device.memory_gbps / 2, "nvlink"
    rate, ring = _best_ring(m, ranks)
    hops = [topo.link(a, ring[(i + 1) % len(ring)]) for i, a in enumerate(ring)]
    if not all(h.kind == LinkKind.NVLINK for h in hops):
        return rate, "pci"
    per_gpu = []
    for a in ranks:
        counts = [topo.link(a, b).nvlinks for b in ranks
                  if b != a and topo.link(a, b).kind == LinkKind.NVLINK]  # fmt: skip
        links = (
            counts[0] if len(set(counts)) == 1 and len(counts) == len(ranks) - 1 else sum(counts)
        )
        per_gpu.append(links * _nvlink_per_link_gbps(m, a, ranks))
    return min(per_gpu), "nvlink"


def _nvlink_per_link_gbps(m: Machine, a: int, ranks: Sequence[int]) -> float:
    """One NVLink link's rate per direction at rank ``a``: from the rates its NVLink
    links carry (the slowest per link), else the device model's."""
    topo = m.topology
    rates = [
        link.gbps / link.nvlinks
        for link in (topo.link(a, b) for b in ranks if b != a)
        if link.kind == LinkKind.NVLINK and link.gbps is not None
    ]
    return min(rates) if rates else m.device.nvlink_gbps


def nccl_model_time(m: Machine, collective: str, nbytes: int) -> tuple[float, str]:
    """NCCL's own model of one call (Simple protocol, the faster of ring and tree for
    all_reduce, the ring otherwise): (seconds, algorithm). A model of NCCL, not NCCL."""
    import math

    topo = m.topology
    n = topo.n
    node_of = m.nodes
    nodes = max(node_of) + 1
    ppn = n // nodes
    intra_bw, hw = _node_busbw(m, [r for r in range(n) if node_of[r] == 0])
    bw = intra_bw if nodes <= 2 else min(intra_bw, m.net_gbps)
    if nodes == 2:
        bw = min(intra_bw, 2 * m.net_gbps)
    nsteps = 2 * (n - 1) if collective == "all_reduce" else (
        n - 1 if collective in ("all_gather", "reduce_scatter") else n)  # fmt: skip
    best = (float("inf"), "ring")
    for alg in ("ring", "tree") if collective == "all_reduce" else ("ring",):
        busbw = bw * (0.92 if alg == "tree" else 1.0)
        algbw = busbw * (n / nsteps if alg == "ring" else 0.5)
        if alg == "tree":
            log_size = int(math.log2(max(1, nbytes >> 6))) if nbytes >= 64 else -1
            if 0 <= log_size < 23:
                algbw *= NCCL_TREE_CORRECTION[log_size]
        hw_us = NCCL_HW_US[(hw, alg)]
        net_us = NCCL_HW_US[("net", alg)]
        lat = NCCL_BASE_US[alg]
        if alg == "ring":
            inter = (
                0 if nodes == 1 else (2 * (nodes - 1) if collective == "all_reduce" else nodes - 1)
            )
            lat += (nsteps - inter) * hw_us + inter * net_us
            if nodes > 1 and collective == "all_reduce":
                lat *= 1.4  # NCCL's ring plateau correction (compute capability >= 8.0)
        else:
            lat += 2 * ((ppn - 1) * hw_us + math.log2(nodes) * net_us)
        t = lat * 1e-6 + nbytes / (algbw * GB)
        if t < best[0]:
            best = (t, alg)
    return best


__all__: Sequence[str] = [
    "DEVICES",
    "DeviceModel",
    "Machine",
    "SimResult",
    "cluster_topology",
    "nccl_model_time",
    "predict",
    "simulate",
    "simulate_collective",
]
