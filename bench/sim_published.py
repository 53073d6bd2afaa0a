"""The simulator against published GPU measurements: for every data file in
``bench/published/`` (one public nccl-tests all_reduce run each, with its GPU model, its
topology and, between nodes, its network rate), build the machine, predict the busbw at
each measured size with nccltree's ring plan (``sim.simulate_collective``, chunked as a
GPU World chunks, issued as ``nccltree-bench simulate`` assumes by default: one host
thread on one node, a process per GPU across nodes), with the same plan issued by a
process per GPU everywhere, and with NCCL's own cost model (``sim.nccl_model_time``),
and print them next to the measurement.

    python bench/sim_published.py [--dir DIR] [--only ID,...] [--markdown FILE]

Nothing is fitted: the device models are data-sheet figures (``sim.DEVICES``), the links
and the host's issue cost are the simulator's defaults. A point counts as a hit when
predicted / measured lies within 1 +- 0.35. The sources, and those found but not used,
are listed in docs/sim-published.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nccltree import sim
from nccltree.comm.collectives import COLLECTIVES
from nccltree.topology import Topology

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "published"
CLASSES = ("NVLink", "NVSwitch", "PCIe", "multi-node")
PLACEMENTS = ("out-of-place", "in-place", "unstated")
MIN_BYTES = 64 << 20
TOLERANCE = 0.35
ITEMSIZE = 4  # nccl-tests' default: float
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "url": str,
    "title": str,
    "gpu": str,
    "device": str,
    "nccl_version": (str, type(None)),
    "nodes": int,
    "ranks": int,
    "network": (str, type(None)),
    "network_gbps": (int, float, type(None)),
    "topology": dict,
    "class": str,
    "placement": str,
    "measured": list,
    "notes": str,
}


@dataclass(frozen=True)
class Source:
    """One published run, as its data file records it."""

    id: str
    url: str
    title: str
    gpu: str
    device: str
    nccl_version: str | None
    nodes: int
    ranks: int
    network: str | None
    network_gbps: float | None
    topology: Topology  # one node's
    topology_origin: str
    klass: str
    placement: str
    measured: tuple[tuple[int, float], ...]  # (bytes, busbw GB/s)
    notes: str


@dataclass(frozen=True)
class Row:
    """One measured size: the measurement and the two predictions (busbw, GB/s)."""

    source: Source
    nbytes: int
    measured: float
    ring: float | None  # None: not simulated (over --max-bytes)
    ring_procs: float | None  # the ring plan issued by a process per GPU
    nccl_model: float
    nccl_alg: str

    @property
    def ring_ratio(self) -> float | None:
        return None if self.ring is None else self.ring / self.measured

    @property
    def procs_ratio(self) -> float | None:
        return None if self.ring_procs is None else self.ring_procs / self.measured

    @property
    def model_ratio(self) -> float:
        return self.nccl_model / self.measured


def within(ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1.0) <= TOLERANCE


def load(path: Path) -> Source:
    """Read and check one data file; a ``ValueError`` naming the file says what is wrong."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: not JSON ({exc})") from None
    try:
        return _check(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path.name}: {exc}") from None


def _check(raw: Any) -> Source:
    if not isinstance(raw, dict):
        raise ValueError("the file must hold one JSON object")
    missing = sorted(set(_REQUIRED) - set(raw))
    extra = sorted(set(raw) - set(_REQUIRED))
    if missing or extra:
        raise ValueError(f"missing fields {missing}, unknown fields {extra}")
    for key, kind in _REQUIRED.items():
        value = raw[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{key!r} has the wrong type ({type(value).__name__})")
    if not raw["url"].startswith("https://github.com/"):
        raise ValueError("'url' must be a https://github.com/ address")
    if raw["device"] not in sim.DEVICES:
        raise ValueError(f"'device' {raw['device']!r} is not in sim.DEVICES")
    if raw["class"] not in CLASSES or raw["placement"] not in PLACEMENTS:
        raise ValueError(f"'class' must be one of {CLASSES}, 'placement' one of {PLACEMENTS}")
    nodes, ranks = raw["nodes"], raw["ranks"]
    if nodes < 1 or ranks < 2:
        raise ValueError("'nodes' must be >= 1 and 'ranks' >= 2")
    if (nodes > 1) != (raw["class"] == "multi-node"):
        raise ValueError("'class' is 'multi-node' exactly when 'nodes' > 1")
    if nodes > 1 and not (raw["network_gbps"] or 0) > 0:
        raise ValueError("a multi-node run needs its stated 'network_gbps' > 0")
    topo = raw["topology"]
    if set(topo) not in ({"smi", "origin"}, {"smi", "p2p", "origin"}, {"preset", "origin"}):
        raise ValueError("'topology' holds 'smi' (and optionally 'p2p') or 'preset', and 'origin'")
    if "preset" in topo:
        intra = Topology.preset(topo["preset"])
    else:
        intra = Topology.from_smi(topo["smi"], topo.get("p2p"))
    if intra.n * nodes != ranks:
        raise ValueError(f"{nodes} node(s) of the {intra.n}-GPU topology are not {ranks} ranks")
    points = []
    for p in raw["measured"]:
        if not isinstance(p, dict) or set(p) != {"bytes", "busbw"}:
            raise ValueError("each 'measured' entry is {'bytes': int, 'busbw': number}")
        b, bw = p["bytes"], p["busbw"]
        if not isinstance(b, int) or isinstance(b, bool) or b < MIN_BYTES or b % ITEMSIZE:
            raise ValueError(f"measured size {b!r}: an int >= 64 MiB, of whole floats")
        if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not bw > 0:
            raise ValueError(f"measured busbw {bw!r} at {b} bytes must be a number > 0")
        points.append((b, float(bw)))
    sizes = [b for b, _ in points]
    if not points or sizes != sorted(set(sizes)):
        raise ValueError("'measured' must list increasing, distinct sizes")
    return Source(raw["id"], raw["url"], raw["title"], raw["gpu"], raw["device"],
                  raw["nccl_version"], nodes, ranks, raw["network"],
                  None if raw["network_gbps"] is None else float(raw["network_gbps"]),
                  intra, topo["origin"], raw["class"], raw["placement"], tuple(points),
                  raw["notes"])  # fmt: skip


def load_all(directory: Path = DATA_DIR) -> list[Source]:
    """Every ``*.json`` of ``directory``, checked, in name order; ids must be unique."""
    sources = [load(p) for p in sorted(directory.glob("*.json"))]
    ids = [s.id for s in sources]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate ids among {ids}")
    return sources


def machine(src: Source) -> sim.Machine:
    """The simulated machine, as ``nccltree-bench simulate`` builds it: the node's
    topology (times ``nodes`` over the stated network rate per node), the data-sheet
    device model, the default issue cost, issued by one host thread on one node (an
    in-process World) or by one per GPU across nodes (a process per GPU)."""
    topo = src.topology
    if src.nodes == 1:
        return sim.Machine(topo, sim.DEVICES[src.device])
    topo = sim.cluster_topology(topo, src.nodes)
    assert src.network_gbps is not None  # checked by load
    return sim.Machine(topo, sim.DEVICES[src.device], net_gbps=src.network_gbps,
                       issuers=tuple(range(topo.n)))  # fmt: skip


def compare(src: Source, max_bytes: float = math.inf) -> list[Row]:
    """Predict every measured size of ``src``: the ring plan (as ``nccltree-bench
    simulate`` builds and chunks it; skipped above ``max_bytes``), the same plan issued
    by a process per GPU (as process groups run it; the same machine across nodes), and
    NCCL's model."""
    m = machine(src)
    procs = dataclasses.replace(m, issuers=tuple(range(m.topology.n)))
    coll = COLLECTIVES["all_reduce"]
    n = m.topology.n
    rows = []
    for nbytes, measured in src.measured:
        count = coll.count_for(nbytes // ITEMSIZE, n)
        size = coll.nbytes(count, n, ITEMSIZE)
        factor = coll.bus_factor(n)
        ring = ring_procs = None
        if size <= max_bytes:
            ring, ring_procs = (
                size / sim.predict(mm, "ring", "all_reduce", size, ITEMSIZE)[0] / 1e9 * factor
                for mm in (m, procs)
            )
        t, alg = sim.nccl_model_time(m, "all_reduce", size)
        rows.append(Row(src, nbytes, measured, ring, ring_procs, size / t / 1e9 * factor, alg))
    return rows


def _fmt_size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _yes(ratio: float | None) -> str:
    return "-" if ratio is None else ("yes" if within(ratio) else "no")


HEADER = ("source", "GPU", "class", "ranks", "size", "measured", "ring plan", "ring / meas.",
          "within", "NCCL model", "model / meas.", "within", "ring, process per GPU",
          "/ meas.")  # fmt: skip


def table_rows(rows: Iterable[Row]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for r in rows:
        s = r.source
        out.append((s.id, s.device, s.klass, str(s.ranks), _fmt_size(r.nbytes),
                    _fmt(r.measured, 2), _fmt(r.ring), _fmt(r.ring_ratio, 2),
                    _yes(r.ring_ratio), f"{r.nccl_model:.1f} ({r.nccl_alg})",
                    f"{r.model_ratio:.2f}", _yes(r.model_ratio), _fmt(r.ring_procs),
                    _fmt(r.procs_ratio, 2)))  # fmt: skip
    return out


def summary(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    """Per class and overall: points, and how many lie within +-35% for each predictor."""
    out: list[tuple[str, ...]] = []
    for klass in (*CLASSES, "all"):
        sel = [r for r in rows if klass in ("all", r.source.klass)]
        if not sel:
            continue
        sims = [r for r in sel if r.ring is not None]
        ring_hits = sum(within(r.ring_ratio) for r in sims)
        model_hits = sum(within(r.model_ratio) for r in sel)
        procs_hits = sum(within(r.procs_ratio) for r in sims)
        srcs = len({r.source.id for r in sel})
        out.append((klass, str(srcs), str(len(sel)), f"{ring_hits} / {len(sims)}",
                    f"{model_hits} / {len(sel)}", f"{procs_hits} / {len(sims)}"))  # fmt: skip
    return out


SUMMARY_HEADER = ("class", "sources", "points", "ring plan within 35%", "NCCL model within 35%",
                  "ring, process per GPU, within 35%")  # fmt: skip


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plain(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in (header, *rows)) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DATA_DIR, help="the data files (*.json)")
    p.add_argument("--only", default="", help="comma-separated source ids")
    p.add_argument("--max-bytes", type=float, default=math.inf,
                   help="simulate the ring plan only up to this size (bytes)")  # fmt: skip
    p.add_argument("--markdown", type=Path, help="also write the tables as Markdown")
    args = p.parse_args(argv)
    sources = load_all(args.dir)
    if args.only:
        wanted = {x.strip() for x in args.only.split(",") if x.strip()}
        unknown = wanted - {s.id for s in sources}
        if unknown:
            p.error(f"--only: unknown ids {sorted(unknown)}")
        sources = [s for s in sources if s.id in wanted]
    rows: list[Row] = []
    for src in sources:
        t0 = time.perf_counter()
        rows += compare(src, args.max_bytes)
        print(f"# {src.id}: simulated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    body, summ = table_rows(rows), summary(rows)
    print("# all_reduce busbw (GB/s): measured (published) against predicted; ratio = "
          "predicted / measured, within = |ratio - 1| <= 0.35")  # fmt: skip
    print(plain(HEADER, body), end="")
    print()
    print(plain(SUMMARY_HEADER, summ), end="")
    if args.markdown:
        args.markdown.write_text(markdown(HEADER, body) + "\n" + markdown(SUMMARY_HEADER, summ),
                                 encoding="utf-8")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
