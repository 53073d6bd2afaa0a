"""The link matrix between devices: kinds of links, presets, the nvidia-smi parser, detection.

A ``Topology`` is pure data — an N×N matrix of ``Link`` values — so that the tree builder
and the collective algorithms never query hardware. Hardware is read in one place,
``Topology.detect``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, cast

from . import _smi
from ._errors import BackendUnavailable
from ._topo_presets import FLAT_DESCRIPTION, PRESETS
from ._validate import check_index, check_int, check_real

if TYPE_CHECKING:
    from .backends.base import Device


class LinkKind(IntEnum):
    """How two devices are connected, ordered from best (fastest) to worst."""

    SELF = 0  #: a device and itself (the diagonal)
    SAME_DEVICE = 1  #: ranks on one physical GPU, or virtual host devices in one memory
    NVLINK = 2  #: NVLink, directly or through NVSwitch (``Link.nvlinks`` says how many)
    SAME_BOARD = 3  #: the two GPUs of a multi-GPU board such as the K80
    PIX = 4  #: through at most one PCIe switch
    PXB = 5  #: through several PCIe switches, not the host bridge
    PHB = 6  #: through a PCIe host bridge
    NODE = 7  #: between host bridges within one NUMA node
    SYS = 8  #: across NUMA nodes / sockets (QPI, UPI); older drivers print SOC
    NET = 9  #: between nodes, over the network; worse than every intra-node kind


# Weight of one link in tree costs: about 1200 / (nominal unidirectional GB/s), kept
# integral so that sums compare exactly. NVLink: ~25 GB/s per link, so 48 / nvlinks.
_COST = {
    LinkKind.SELF: 0,
    LinkKind.SAME_DEVICE: 1,  # a copy within one GPU's memory, ~1 TB/s
    LinkKind.SAME_BOARD: 80,  # the board's own PCIe switch, ~15 GB/s
    LinkKind.PIX: 96,  # ~12.5 GB/s
    LinkKind.PXB: 120,  # ~10 GB/s
    LinkKind.PHB: 160,  # ~7.5 GB/s
    LinkKind.NODE: 200,  # ~6 GB/s
    LinkKind.SYS: 300,  # ~4 GB/s
    # Between nodes. A 100 Gb/s NIC (12.5 GB/s, which alone would be ~96) is slower than
    # any path inside a node once it is shared: every rank of the node goes through it
    # (8 ranks: ~1.6 GB/s each), and each transfer pays the network's latency. So the
    # figure is set well above every intra-node cost (the worst, SYS without peer access,
    # is 600), so that the tree takes any link inside a node before a crossing. A network link
    # never has peer access; this figure already counts the staging, so it is not doubled.
    LinkKind.NET: 1000,
}
# Without peer access a copy is staged through pinned host memory: two transfers.
_NO_PEER_FACTOR = 2

# Spellings in nvidia-smi output. nvidia-smi has no token for "same board" (a K80's
# twins print as PIX), for "same device" nor for "another node" (it sees one machine);
# BRD, DEV and NET are this library's own, so that ``str(topology)`` can be read back.
_TOKEN_KIND = {
    "X": LinkKind.SELF,
    "DEV": LinkKind.SAME_DEVICE,
    "BRD": LinkKind.SAME_BOARD,
    "PIX": LinkKind.PIX,
    "PXB": LinkKind.PXB,
    "PHB": LinkKind.PHB,
    "NODE": LinkKind.NODE,
    "SYS": LinkKind.SYS,
    "SOC": LinkKind.SYS,
    "NET": LinkKind.NET,
}
_KIND_TOKEN = {kind: tok for tok, kind in _TOKEN_KIND.items() if tok != "SOC"}
_NV_TOKEN = re.compile(r"^NV([1-9]\d*)$")
_ACCEPTED = "X, NV#, BRD, DEV, PIX, PXB, PHB, NODE, SYS, SOC, NET"

_LEGEND = {
    LinkKind.SELF: "X    = Self",
    LinkKind.SAME_DEVICE: "DEV  = Same physical device (ranks sharing one GPU, or host memory)",
    LinkKind.NVLINK: "NV#  = Connection traversing a bonded set of # NVLinks",
    LinkKind.SAME_BOARD: "BRD  = Same multi-GPU board (nvidia-smi prints PIX)",
    LinkKind.PIX: "PIX  = Connection traversing at most a single PCIe bridge",
    LinkKind.PXB: "PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
    LinkKind.PHB: "PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    LinkKind.NODE: "NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node",
    LinkKind.SYS: "SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
    LinkKind.NET: "NET  = Between nodes, over the network (nvidia-smi sees one node only)",
}

# `nvidia-smi topo -p2p r` statuses; only OK means peer reads work.
_P2P_TOKENS = frozenset({"X", "OK", "CNS", "GNS", "TNS", "NS", "DR", "U"})


@dataclass(frozen=True)
class Link:
    """One link of the matrix: its ``kind``, NVLink count ``nvlinks`` (NVLINK only) and
    peer access ``p2p``, and
    optionally its numbers: ``gbps``, the link's nominal rate in each direction (GB/s,
    1e9 bytes per second: NVLink links x the rate per link, PCIe lanes x the rate per
    lane, as detection fills it), and ``latency_s``, one transfer's latency (seconds).
    ``None`` (the default) leaves them to the simulator's device model (``nccltree.sim``).
    They are the same in both directions, as the matrix is symmetric."""

    kind: LinkKind
    nvlinks: int = 0
    p2p: bool = True
    gbps: float | None = None
    latency_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LinkKind(self.kind))
        object.__setattr__(self, "nvlinks", check_int(self.nvlinks, "nvlinks", min=0))
        if self.gbps is not None:
            object.__setattr__(self, "gbps", check_real(self.gbps, "gbps", min=0.0, min_open=True))
        if self.latency_s is not None:
            object.__setattr__(self, "latency_s", check_real(self.latency_s, "latency_s", min=0.0))
        if self.kind == LinkKind.SELF and (self.gbps is not None or self.latency_s is not None):
            raise ValueError("a SELF link (a device and itself) carries no rate or latency")
        if (self.kind == LinkKind.NVLINK) != (self.nvlinks > 0):
            raise ValueError(
                f"nvlinks must be >= 1 for an NVLINK link and 0 otherwise, got {self.kind.name} "
                f"with nvlinks={self.nvlinks}"
            )
        if not isinstance(self.p2p, bool):
            raise TypeError(f"p2p must be a bool, got {type(self.p2p).__name__}")
        if self.kind in (LinkKind.SELF, LinkKind.SAME_DEVICE) and not self.p2p:
            raise ValueError(f"a {self.kind.name} link always has peer access")
        if self.kind == LinkKind.NET and self.p2p:
            # no device reads another node's memory: Link(LinkKind.NET, p2p=False)
            raise ValueError("a NET link never has peer access: pass p2p=False")

    @property
    def cost(self) -> int:
        """Tree weight of the link: ~1200 / nominal GB/s, doubled without peer access
        (except NET, which never has it and whose weight already counts that)."""
        if self.kind == LinkKind.NVLINK:
            base = max(2, (48 + self.nvlinks // 2) // self.nvlinks)
        else:
            base = _COST[self.kind]
        return base if self.p2p or self.kind == LinkKind.NET else base * _NO_PEER_FACTOR

    @property
    def rank(self) -> tuple[int, int, int]:
        """Sort key, smaller is better: cost, then kind, then more NVLinks first."""
        return (self.cost, int(self.kind), -self.nvlinks)

    @property
    def token(self) -> str:
        """The nvidia-smi spelling (``X``, ``NV2``, ``PIX``...; ``BRD``/``DEV``/``NET`` are
        ours)."""
        return f"NV{self.nvlinks}" if self.kind == LinkKind.NVLINK else _KIND_TOKEN[self.kind]

    @classmethod
    def from_token(cls, token: str, p2p: bool | None = None) -> Link:
        """The link an nvidia-smi cell ``token`` names; ``p2p=None``: peer access unless ``SYS`` or
        ``NET`` (``NET`` never has it, ``X`` and ``DEV`` always do, whatever ``p2p`` says)."""
        tok = token.upper()
        m = _NV_TOKEN.match(tok)
        if m:
            kind, nvlinks = LinkKind.NVLINK, int(m.group(1))
        elif tok in _TOKEN_KIND:
            kind, nvlinks = _TOKEN_KIND[tok], 0
        else:
            raise ValueError(f"unknown link token {token!r} (accepted: {_ACCEPTED})")
        if p2p is None or kind in (LinkKind.SELF, LinkKind.SAME_DEVICE, LinkKind.NET):
            p2p = kind not in (LinkKind.SYS, LinkKind.NET)
        return cls(kind, nvlinks, p2p)


def _is_link_token(tok: str) -> bool:
    tok = tok.upper()
    return tok in _TOKEN_KIND or bool(_NV_TOKEN.match(tok))


_SELF = Link(LinkKind.SELF)


def _json_matrix(data: dict[str, object], field: str, n: int | None) -> list[list[object]] | None:
    """``data[field]`` as an ``n`` x ``n`` list of lists (square when ``n`` is None), or
    None where the field is absent; a ``ValueError`` naming the field otherwise."""
    rows = data.get(field)
    if rows is None:
        return None
    size = len(rows) if isinstance(rows, list) and n is None else n
    if not (isinstance(rows, list) and len(rows) == size):
        raise ValueError(
            f"'{field}' must be a list of {size if size is not None else 'N'} rows, one per "
            f"device, got {type(rows).__name__}"
            + (f" of {len(rows)}" if isinstance(rows, list) else "")
        )
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == size):
            got = f"{len(row)} entries" if isinstance(row, list) else type(row).__name__
            raise ValueError(
                f"'{field}' row {i} must be a list of {size} entries (the matrix is square, "
                f"one row and column per device), got {got}"
            )
    return rows


class Topology:
    """An N×N matrix of links between devices (pure data, immutable).

    ``Topology(links, names=None)`` takes a square, symmetric matrix of ``Link`` with
    ``SELF`` exactly on the diagonal; ``names`` default to ``GPU0``, ``GPU1``...
    """

    def __init__(self, links: Sequence[Sequence[Link]], names: Sequence[str] | None = None):
        rows = tuple(tuple(row) for row in links)
        n = len(rows)
        if n == 0:
            raise ValueError("a topology needs at least one device")
        for i, row in enumerate(rows):
            if len(row) != n:
                raise ValueError(
                    f"the link matrix must be square: row {i} has {len(row)} entries, expected {n}"
                )
            for j, link in enumerate(row):
                if not isinstance(link, Link):
                    raise TypeError(f"links[{i}][{j}] must be a Link, got {type(link).__name__}")
                if (i == j) != (link.kind == LinkKind.SELF):
                    raise ValueError(
                        f"links[{i}][{j}]: SELF links belong on the diagonal and only there"
                    )
                if j < i and link != rows[j][i]:
                    raise ValueError(
                        f"the link matrix must be symmetric: links[{i}][{j}] != links[{j}][{i}]"
                    )
        if names is None:
            names = [f"GPU{i}" for i in range(n)]
        names = tuple(str(x) for x in names)
        if len(names) != n:
            raise ValueError(f"{len(names)} names for {n} devices")
        self._links = rows
        self._names = names

    @property
    def n(self) -> int:
        """Number of devices."""
        return len(self._links)

    @property
    def names(self) -> tuple[str, ...]:
        """Device names (``GPU0``... unless given)."""
        return self._names

    def link(self, i: int, j: int) -> Link:
        """The link between devices ``i`` and ``j``."""
        return self._links[check_index(i, "device index i", self.n)][
            check_index(j, "device index j", self.n)
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._links == other._links and self._names == other._names

    def __hash__(self) -> int:
        return hash((self._links, self._names))

    def __repr__(self) -> str:
        return f"<Topology n={self.n} {' '.join(self._names)}>"

    # -- construction ------------------------------------------------------------------

    @classmethod
    def uniform(cls, n: int, link: Link) -> Topology:
        """``n`` devices with the same ``link`` between every pair."""
        n = check_int(n, "n", min=1)
        return cls([[_SELF if i == j else link for j in range(n)] for i in range(n)])

    @classmethod
    def cluster(
        cls,
        nodes: Sequence[Hashable],
        intra: Topology | Link | None = None,
        names: Sequence[str] | None = None,
    ) -> Topology:
        """Ranks spread over several nodes: rank ``i`` lives on node ``nodes[i]``.

        Ranks must be node-major (each node's ranks contiguous), as launchers number
        them; a node that reappears after another is a ``ValueError``. Ranks of
        different nodes are linked by ``NET`` (no peer access). Within a node every pair
        has the ``Link`` ``intra`` (default ``SAME_DEVICE``: processes of one node
        sharing host memory), or, when ``intra`` is a ``Topology``, its matrix over the
        node's ranks in order, which needs every node to have ``intra.n`` ranks. Node
        labels are only compared, never printed. ``names`` default to ``GPU0``,
        ``GPU1``..., so that ``str()`` reads back through ``from_smi``.
        """
        if isinstance(nodes, (str, bytes)):
            raise TypeError("nodes must be a sequence of node labels, one per rank, not a str")
        labels = list(nodes)
        if not labels:
            raise ValueError("a cluster needs at least one rank")
        node_of: list[int] = []  # rank -> node index, in order of first appearance
        first: dict[Hashable, int] = {}
        for i, label in enumerate(labels):
            try:
                index = first.setdefault(label, len(first))
            except TypeError:
                raise TypeError(
                    f"nodes[{i}] must be hashable, got {type(label).__name__}"
                ) from None
            if node_of and index != node_of[-1] and index != len(first) - 1:
                raise ValueError(
                    f"ranks must be node-major (each node's ranks contiguous): rank {i} is "
                    f"on node {label!r} again after rank {i - 1} on node {labels[i - 1]!r}"
                )
            node_of.append(index)
        local = [0] * len(labels)  # rank -> its index among its node's ranks
        sizes = [0] * len(first)
        for i, index in enumerate(node_of):
            local[i] = sizes[index]
            sizes[index] += 1
        if intra is None:
            intra = Link(LinkKind.SAME_DEVICE)
        if isinstance(intra, Link):
            if intra.kind in (LinkKind.SELF, LinkKind.NET):
                raise ValueError(f"the link within a node cannot be {intra.kind.name}")
            link = intra

            def within(a: int, b: int) -> Link:
                return link
        elif isinstance(intra, Topology):
            inner = intra
            wrong = sorted({s for s in sizes if s != inner.n})
            if wrong:
                raise ValueError(
                    f"intra is a topology of {inner.n} devices, but nodes have "
                    f"{', '.join(map(str, wrong))} ranks (an intra topology needs every "
                    f"node to have {inner.n})"
                )
            if any(
                inner.link(a, b).kind == LinkKind.NET
                for a in range(inner.n)
                for b in range(inner.n)
            ):
                raise ValueError("the topology within a node cannot contain NET links")

            def within(a: int, b: int) -> Link:
                return inner.link(a, b)
        else:
            raise TypeError(f"intra must be a Topology, a Link or None, got {type(intra).__name__}")
        net = Link(LinkKind.NET, p2p=False)
        n = len(labels)
        links = [
            [
                _SELF if i == j else within(local[i], local[j]) if node_of[i] == node_of[j] else net
                for j in range(n)
            ]
            for i in range(n)
        ]
        return cls(links, names)

    @classmethod
    def presets(cls) -> dict[str, str]:
        """Names of the presets, each with a one-line description."""
        out = {name: desc for name, (desc, _) in PRESETS.items()}
        out["flat:N"] = FLAT_DESCRIPTION
        return out

    @classmethod
    def preset(cls, name: str) -> Topology:
        """A preset by name (see ``presets()``); ``flat:N`` for any N >= 1."""
        if not isinstance(name, str):
            raise TypeError(f"preset name must be a str, got {type(name).__name__}")
        if name.startswith("flat:"):
            count = name[5:]
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"flat:N needs a device count N >= 1, got {name!r}")
            return cls.uniform(int(count), Link(LinkKind.PIX))
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; accepted: {', '.join(cls.presets())}")
        return cls.from_smi(PRESETS[name][1])

    @classmethod
    def from_smi(cls, text: str, p2p: str | None = None) -> Topology:
        """Parse ``text``, what ``nvidia-smi topo -m`` prints (GPU rows and columns; NICs
        ignored).

        ``p2p`` is optionally what ``nvidia-smi topo -p2p r`` prints for the same
        machine; without it, peer access is assumed everywhere except across sockets
        (``SYS``/``SOC``) and between nodes. ``PIX`` stays ``PIX`` (nvidia-smi prints
        twin-board GPUs so too); this library's ``BRD``, ``DEV`` and ``NET`` are read back
        as SAME_BOARD, SAME_DEVICE and NET. Unknown tokens are a ``ValueError`` naming
        the row and column.
        """
        names, grid = _smi.parse_matrix(text, _is_link_token, _ACCEPTED)
        n = len(names)
        peer = None
        if p2p is not None:
            p2p_names, p2p_grid = _smi.parse_matrix(
                p2p, lambda t: t.upper() in _P2P_TOKENS, ", ".join(sorted(_P2P_TOKENS))
            )
            if p2p_names != names:
                raise ValueError(
                    f"the p2p matrix names {' '.join(p2p_names)}, the topology {' '.join(names)}"
                )
            peer = [[tok.upper() in ("OK", "X") for tok in row] for row in p2p_grid]
        links: list[list[Link]] = []
        for i in range(n):
            row = []
            for j in range(n):
                tok = grid[i][j]
                if (i == j) != (tok.upper() == "X"):
                    where = f"row {names[i]}, column {names[j]}"
                    raise ValueError(
                        f"{where}: 'X' belongs on the diagonal and only there, got {tok!r}"
                    )
                if peer is not None and peer[i][j] != peer[j][i]:
                    raise ValueError(f"the p2p matrix is not symmetric at {names[i]}/{names[j]}")
                link = Link.from_token(tok, None if peer is None else peer[i][j])
                if j < i and link != links[j][i]:
                    raise ValueError(
                        f"the matrix is not symmetric: row {names[i]}, column {names[j]} is "
                        f"{tok!r} but row {names[j]}, column {names[i]} is {grid[j][i]!r}"
                    )
                row.append(link)
            links.append(row)
        return cls(links, names)

    def to_json(self) -> str:
        """A JSON text that ``from_json`` reads back to an equal topology.

        An object with ``format`` ``"nccltree.topology"``, ``version`` 1, ``names`` (one
        per device), ``links`` (the N x N matrix of nvidia-smi tokens: ``X``, ``NV4``,
        ``PIX``...) and ``p2p`` (N x N booleans, peer access); where some link carries
        numbers, also ``gbps`` (N x N: GB/s per direction, or null) and ``latency_s``
        (N x N: seconds, or null), each written only when some link has it."""
        data: dict[str, object] = {
            "format": "nccltree.topology",
            "version": 1,
            "names": list(self._names),
            "links": [[link.token for link in row] for row in self._links],
            "p2p": [[link.p2p for link in row] for row in self._links],
        }
        if any(link.gbps is not None for row in self._links for link in row):
            data["gbps"] = [[link.gbps for link in row] for row in self._links]
        if any(link.latency_s is not None for row in self._links for link in row):
            data["latency_s"] = [[link.latency_s for link in row] for row in self._links]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> Topology:
        """Read a topology from ``text``, JSON written by ``to_json`` (or by hand, in the
        same format).

        Malformed input is a ``ValueError`` naming the field and what it expected
        (``names``, ``gbps`` and ``latency_s`` are optional; ``p2p`` is not)."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"expected JSON text, got {type(text).__name__}")
        try:
            data: object = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON topology: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != "nccltree.topology":
            raise ValueError(
                "not a JSON topology: expected an object with format 'nccltree.topology'"
            )
        if data.get("version") != 1:
            raise ValueError(
                f"unsupported topology JSON version {data.get('version')!r} (accepted: 1)"
            )
        tokens = _json_matrix(data, "links", None)
        if tokens is None or not tokens:
            raise ValueError(
                "a JSON topology needs 'links': a non-empty square list of lists of link "
                "tokens (X, NV#, BRD, DEV, PIX, PXB, PHB, NODE, SYS, SOC, NET)"
            )
        n = len(tokens)
        p2p = _json_matrix(data, "p2p", n)
        if p2p is None:
            raise ValueError(
                f"a JSON topology needs 'p2p': {n} x {n} booleans (peer access), like 'links'"
            )
        gbps = _json_matrix(data, "gbps", n)
        latency = _json_matrix(data, "latency_s", n)
        names = data.get("names")
        if names is not None and not (
            isinstance(names, list) and len(names) == n and all(isinstance(x, str) for x in names)
        ):
            raise ValueError(f"'names' must be a list of {n} strings, got {names!r}")
        links = []
        for i in range(n):
            row = []
            for j in range(n):
                where = f"[{i}][{j}]"
                tok, peer = tokens[i][j], p2p[i][j]
                if not isinstance(tok, str):
                    raise ValueError(f"links{where} must be a link token (a string), got {tok!r}")
                if not isinstance(peer, bool):
                    raise ValueError(f"p2p{where} must be true or false, got {peer!r}")
                rate = None if gbps is None else gbps[i][j]
                lat = None if latency is None else latency[i][j]
                for field, value, what in (
                    ("gbps", rate, "a number of GB/s > 0"),
                    ("latency_s", lat, "a number of seconds >= 0"),
                ):
                    if value is None:
                        continue
                    if (
                        isinstance(value, bool)
                        or not isinstance(value, (int, float))
                        or not math.isfinite(value)
                        or value < 0
                        or (value == 0 and field == "gbps")
                    ):
                        raise ValueError(f"{field}{where} must be {what}, or null; got {value!r}")
                try:
                    link = Link.from_token(tok, peer)
                    if rate is not None or lat is not None:
                        link = dataclasses.replace(
                            link,
                            gbps=None if rate is None else float(cast(float, rate)),
                            latency_s=None if lat is None else float(cast(float, lat)),
                        )
                except ValueError as exc:
                    raise ValueError(f"links{where}: {exc}") from None
                row.append(link)
            links.append(row)
        return cls(links, names)

    # -- printing ----------------------------------------------------------------------

    def __str__(self) -> str:
        """The matrix as ``nvidia-smi topo -m`` prints it, then its legend; where some
        pair lacks peer access, also the ``nvidia-smi topo -p2p r`` matrix."""
        kinds = sorted({link.kind for row in self._links for link in row})
        lines = self._matrix([[link.token for link in row] for row in self._links])
        lines += ["", "Legend:", ""] + ["  " + _LEGEND[k] for k in kinds]
        if not all(link.p2p for row in self._links for link in row):
            peer = [
                ["X" if i == j else "OK" if link.p2p else "NS" for j, link in enumerate(row)]
                for i, row in enumerate(self._links)
            ]
            lines += ["", "Peer access (nvidia-smi topo -p2p r):", ""] + self._matrix(peer)
            lines += [
                "",
                "  OK   = peer access",
                "  NS   = none: copies are staged through host memory",
            ]
        return "\n".join(lines) + "\n"

    def _matrix(self, tokens: list[list[str]]) -> list[str]:
        names = self._names
        width = max(4, *(len(x) for x in names), *(len(t) for row in tokens for t in row)) + 2
        label = max(len(x) for x in names) + 2
        lines = [" " * label + "".join(x.ljust(width) for x in names).rstrip()]
        for name, row in zip(names, tokens, strict=True):
            cells = "".join((" X" if t == "X" else t).ljust(width) for t in row)
            lines.append(name.ljust(label) + cells.rstrip())
        return lines

    # -- detection ---------------------------------------------------------------------

    @classmethod
    def detect(cls, devices: Sequence[Device]) -> Topology:
        """The topology of ``devices`` (as ``nt.devices`` returns them, one backend).

        Host devices are ranks in one memory: every pair SAME_DEVICE (``DEV``). CUDA
        devices are read through NVML; logical ranks on one physical GPU are linked as
        SAME_DEVICE. Without NVML, peer access comes from CuPy and the link kinds are
        guessed (``PHB`` with peer access, ``SYS`` without), with a warning.
        """
        devices = list(devices)
        if not devices:
            raise ValueError("detect needs at least one device")
        backends = {getattr(d, "backend", None) for d in devices}
        if len(backends) != 1:
            raise ValueError(
                f"devices must all come from one backend, got {sorted(map(str, backends))}"
            )
        backend = backends.pop()
        names = [str(getattr(d, "name", f"dev{i}")) for i, d in enumerate(devices)]
        if backend == "host":
            topo = cls.uniform(len(devices), Link(LinkKind.SAME_DEVICE))
            return cls([list(row) for row in topo._links], names)
        if backend == "cuda":
            links = _detect_cuda([int(d.physical_id) for d in devices])
            # what the hardware reports is not always what the process got: enabling peer
            # access can fail (too many peers on a large PCIe box); such a pair stages
            # through host memory, so the plans must not read across it (either way: the
            # matrix is symmetric)
            for i, di in enumerate(devices):
                for j in range(i + 1, len(devices)):
                    dj = devices[j]
                    if links[i][j].p2p and not (di.can_access_peer(dj) and dj.can_access_peer(di)):
                        links[i][j] = links[j][i] = dataclasses.replace(links[i][j], p2p=False)
            return cls(links, names)
        raise ValueError(f"unknown backend {backend!r} (accepted: 'host', 'cuda')")


# -- CUDA detection (NVML through nvidia-ml-py, else CuPy peer access) ----------------------

_NVML_LEVEL_KIND = {  # nvmlGpuTopologyLevel_t
    0: LinkKind.SAME_BOARD,  # INTERNAL: the two GPUs of one board
    10: LinkKind.PIX,  # SINGLE
    20: LinkKind.PXB,  # MULTIPLE
    30: LinkKind.PHB,  # HOSTBRIDGE
    40: LinkKind.NODE,  # NODE
    50: LinkKind.SYS,  # SYSTEM
}
# pynvml spells NVML_P2P_CAPS_INDEX_READ with a stray comma (a one-element tuple), which
# ctypes cannot pass; the enum values themselves are fixed by the NVML headers.
_P2P_CAPS_READ = 0
_P2P_CAPS_NVLINK = 2
_P2P_STATUS_OK = 0
_NVLINK_REMOTE_SWITCH = 2

# -- link rates from NVML: nominal, per direction, GB/s = 1e9 B/s --------------------------
#: One NVLink link's rate per direction, by NVLink version: the NVLink bandwidth NVIDIA's
#: data sheets give (both directions, every link) / links / 2. 1.0: Tesla P100, 160 GB/s
#: over 4 links; 2.0: Tesla V100, 300 GB/s over 6; 3.0: A100, 600 GB/s over 12; 4.0:
#: H100 SXM, 900 GB/s over 18; 5.0: B200, 1.8 TB/s over 18. Versions NVML names but no
#: data sheet here pins down (2.2, 3.1, 6.0) are left out: their links get no rate.
NVLINK_LINK_GBPS = {"1.0": 20.0, "2.0": 25.0, "3.0": 25.0, "4.0": 25.0, "5.0": 50.0}
#: What ``nvmlDeviceGetNvLinkVersion`` returns (NVML's ``nvmlNvlinkVersion_t``)
NVML_NVLINK_VERSION = {
    1: "1.0",
    2: "2.0",
    3: "2.2",
    4: "3.0",
    5: "3.1",
    6: "4.0",
    7: "5.0",
    8: "6.0",
}
#: One PCIe lane's rate per direction, by generation, from the PCI Express Base
#: Specification's signalling rate and encoding: 2.5 and 5 GT/s with 8b/10b (1.0, 2.0);
#: 8, 16 and 32 GT/s with 128b/130b (3.0: 0.985, 4.0: 1.969, 5.0: 3.938 GB/s). x16 is 16
#: lanes (``nccltree.sim.PCIE_X16_GBPS``).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938}


def nvlink_gbps(version: int) -> float | None:
    """One NVLink link's rate per direction (GB/s) for the version number NVML reports
    (:data:`NVML_NVLINK_VERSION`); None where it is not known."""
    return NVLINK_LINK_GBPS.get(NVML_NVLINK_VERSION.get(version, ""))


def pcie_gbps(generation: int, width: int) -> float | None:
    """A PCIe link's rate per direction (GB/s): ``width`` lanes of ``generation``
    (:data:`PCIE_LANE_GBPS`); None where either is not known."""
    lane = PCIE_LANE_GBPS.get(generation)
    return None if lane is None or width <= 0 else round(lane * width, 3)


_BUS_ID = re.compile(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])")


def _bus_key(bus_id: str | bytes) -> tuple[int, ...]:
    """A PCI bus id as numbers: CUDA prints a 4-digit domain, NVML an 8-digit one."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    m = _BUS_ID.search(bus_id)
    if not m:
        raise ValueError(f"unreadable PCI bus id {bus_id!r}")
    return tuple(int(g, 16) for g in m.groups())


def _cupy_runtime() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(
            f"CUDA devices need CuPy, which cannot be imported: {exc}"
        ) from exc
    return cupy.cuda.runtime


def _detect_cuda(phys: list[int]) -> list[list[Link]]:
    try:
        runtime = _cupy_runtime()
        # CUDA and NVML number GPUs differently (CUDA fastest-first by default, NVML by
        # PCI address); the PCI bus id is the one name both share.
        buses = {p: runtime.deviceGetPCIBusId(p) for p in sorted(set(phys))}
        return links_by_bus([buses[p] for p in phys])
    except _NvmlUnusable as exc:
        return _detect_by_peer_access(phys, str(exc))


class _NvmlUnusable(BackendUnavailable):
    """NVML cannot be imported, initialised or asked about these GPUs."""


def links_by_bus(buses: Sequence[str]) -> list[list[Link]]:
    """The link matrix of the GPUs with these PCI bus ids, as NVML reports it (NVML sees
    every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` says); equal bus ids are
    one GPU (``SAME_DEVICE``). ``BackendUnavailable`` when NVML cannot answer."""
    try:
        import pynvml
    except ImportError as exc:
        raise _NvmlUnusable(f"cannot import pynvml: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise _NvmlUnusable(f"nvmlInit failed: {exc}") from exc
    try:
        return _detect_by_nvml(pynvml, [str(b) for b in buses])
    except (pynvml.NVMLError, ValueError) as exc:
        # NVML initialised but cannot answer for these GPUs (in some containers it sees
        # none of the GPUs CUDA sees, or cannot read their bus ids)
        raise _NvmlUnusable(f"NVML failed after nvmlInit: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _detect_by_nvml(nvml: Any, buses: list[str]) -> list[list[Link]]:
    def ask(default: Any, fn: Any, *args: Any) -> Any:
        # NVML answers "not supported" for absent features (no NVLink, no board id); an
        # older pynvml lacks the newer functions (fn None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except nvml.NVMLError:
            return default

    def optional(name: str) -> Any:
        return getattr(nvml, name, None)

    phys = [_bus_key(b) for b in buses]  # a GPU is named by its bus id here
    uniq = sorted(set(phys))
    name = {_bus_key(b): b for b in buses}
    handle = {p: nvml.nvmlDeviceGetHandleByPciBusId(name[p]) for p in uniq}
    direct: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    to_switch: dict[tuple[int, ...], int] = {}
    per_link: dict[tuple[int, ...], float | None] = {}  # a GPU's NVLink rate per link
    pcie: dict[tuple[int, ...], float | None] = {}  # a GPU's PCIe rate
    for p in uniq:
        direct[p], to_switch[p] = {}, 0
        rates: set[float | None] = set()
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            if ask(0, nvml.nvmlDeviceGetNvLinkState, handle[p], link) != 1:
                continue
            version = ask(None, optional("nvmlDeviceGetNvLinkVersion"), handle[p], link)
            rates.add(None if version is None else nvlink_gbps(int(version)))
            if (
                ask(-1, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle[p], link)
                == _NVLINK_REMOTE_SWITCH
            ):
                to_switch[p] += 1
                continue
            remote = ask(None, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle[p], link)
            if remote is not None:
                key = _bus_key(remote.busId)
                direct[p][key] = direct[p].get(key, 0) + 1
        # a rate only where every active link's version is known (the slowest if mixed)
        per_link[p] = None if not rates or None in rates else min(cast("set[float]", rates))
        # the most the GPU and its slot agree on (the current figures drop when idle)
        gen = ask(None, optional("nvmlDeviceGetMaxPcieLinkGeneration"), handle[p])
        if gen is None:
            gen = ask(None, optional("nvmlDeviceGetCurrPcieLinkGeneration"), handle[p])
        width = ask(None, optional("nvmlDeviceGetMaxPcieLinkWidth"), handle[p])
        if width is None:
            width = ask(None, optional("nvmlDeviceGetCurrPcieLinkWidth"), handle[p])
        pcie[p] = None if gen is None or width is None else pcie_gbps(int(gen), int(width))
    board = {}
    for p in uniq:
        if ask(0, nvml.nvmlDeviceGetMultiGpuBoard, handle[p]):
            board[p] = ask(None, nvml.nvmlDeviceGetBoardId, handle[p])

    def pair(p: tuple[int, ...], q: tuple[int, ...]) -> Link:
        if p == q:
            return Link(LinkKind.SAME_DEVICE)
        hp, hq = handle[p], handle[q]
        p2p = ask(-1, nvml.nvmlDeviceGetP2PStatus, hp, hq, _P2P_CAPS_READ) == _P2P_STATUS_OK
        nvlinks = direct[p].get(q, 0)
        if not nvlinks and to_switch[p] and to_switch[q]:
            # Through NVSwitch: nvidia-smi counts the links a GPU has into the fabric.
            if ask(-1, nvml.nvmlDeviceGetP2PStatus, hp, hq, _P2P_CAPS_NVLINK) == _P2P_STATUS_OK:
                nvlinks = min(to_switch[p], to_switch[q])
        if nvlinks:
            rp, rq = per_link[p], per_link[q]
            rate = None if rp is None or rq is None else nvlinks * min(rp, rq)
            return Link(LinkKind.NVLINK, nvlinks, p2p, gbps=rate)
        # over PCIe: the narrower end's rate
        ep, eq = pcie[p], pcie[q]
        rate = None if ep is None or eq is None else min(ep, eq)
        if board.get(p) is not None and board.get(p) == board.get(q):
            return Link(LinkKind.SAME_BOARD, 0, p2p, gbps=rate)
        level = ask(50, nvml.nvmlDeviceGetTopologyCommonAncestor, hp, hq)
        return Link(_NVML_LEVEL_KIND.get(level, LinkKind.SYS), 0, p2p, gbps=rate)

    cache = {(p, q): pair(p, q) for p in uniq for q in uniq if p <= q}
    n = len(phys)
    return [
        [_SELF if i == j else cache[min(phys[i], phys[j]), max(phys[i], phys[j])] for j in range(n)]
        for i in range(n)
    ]


def _detect_by_peer_access(phys: list[int], reason: str) -> list[list[Link]]:
    warnings.warn(
        f"NVML is not available ({reason}); link kinds are guessed from CUDA peer access "
        "(PHB with peer access, SYS without)",
        RuntimeWarning,
        stacklevel=4,
    )
    runtime = _cupy_runtime()
    n = len(phys)
    links = [[_SELF] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            p, q = phys[i], phys[j]
            if p == q:
                link = Link(LinkKind.SAME_DEVICE)
            elif runtime.deviceCanAccessPeer(p, q) and runtime.deviceCanAccessPeer(q, p):
                link = Link(LinkKind.PHB)
            else:
                link = Link(LinkKind.SYS, 0, False)
            links[i][j] = links[j][i] = link
    return links
