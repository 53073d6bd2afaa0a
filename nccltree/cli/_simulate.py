"""``nccltree-bench simulate``: the collectives table, predicted on a machine described by
a topology and a device model (:mod:`nccltree.sim`), with the columns of ``collectives``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TextIO

from ..comm import bench as drv
from ..comm.collectives import COLLECTIVES, collective_name
from ._common import ExitStatus, Parser, UsageError

if TYPE_CHECKING:
    from ..topology import Topology

SIM_ALGORITHMS = ("tree", "ring", "direct", "nccl-model")
NCCL_MODELED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    s = sub.add_parser(
        "simulate",
        help="predict the collectives table on a machine you do not have",
        description="Build the plans nccltree would run and simulate them on a link model "
        "of a machine (nccltree.sim): each link's rate from the topology and the device "
        "model's data sheet (or the link's own rate, where a topology JSON file carries "
        "one), each device's memory bandwidth, the host's cost of issuing a step, flows "
        "sharing links fairly. Prints predicted time, algbw and busbw, with the columns "
        "of `collectives`. A model, not a measurement: see docs/benchmarks.md.",
    )
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--topo",
        metavar="PRESET|FILE",
        help="a preset (dgx1, nvswitch8, k80x4, pcie2s8, flat:N), or a topology JSON "
        "file: the format of Topology.to_json, which `nccltree-bench topo --json FILE` "
        "writes (with the link rates GPU detection read from NVML). Its optional 'gbps' "
        "(GB/s per direction) and 'latency_s' (seconds) matrices give links their own "
        "numbers, which replace the --gpu model's data-sheet figures for those links "
        "(null: the model's). A preset name wins over a file of that name (./NAME for "
        "the file)",
    )
    src.add_argument(
        "--smi",
        metavar="FILE",
        help="a saved `nvidia-smi topo -m` output (link kinds only: every rate comes from "
        "the --gpu model)",
    )
    s.add_argument("--gpu", default="h100", help="device model: v100, a100, h100, h200, "
                   "rtx4090, host (default: %(default)s)")  # fmt: skip
    s.add_argument("--nodes", type=int, default=1, help="copies of the topology, one per "
                   "node, linked by the network (default: %(default)s)")  # fmt: skip
    s.add_argument("--net-gbps", type=float, default=12.5,
                   help="network rate per direction between nodes, GB/s (default: "
                   "%(default)s, a 100 Gb/s NIC)")  # fmt: skip
    s.add_argument("--issue-us", type=float, default=13.0,
                   help="host time to issue one plan step, us (default: %(default)s, "
                   "measured through CuPy on an H200; about 1.5 on the host backend)")  # fmt: skip
    s.add_argument("--algorithm", default="tree,ring,direct",
                   help="comma-separated: tree, ring, direct, and nccl-model (NCCL's own "
                   "cost model, Simple protocol, from its tuning code: a model of NCCL, "
                   "not NCCL) (default: %(default)s)")  # fmt: skip
    s.add_argument("--collective", default="all_reduce", help="as for `collectives`")
    s.add_argument("-b", "--minbytes", default="1M")
    s.add_argument("-e", "--maxbytes", default="256M")
    s.add_argument("-f", "--stepfactor", type=float, default=16.0)
    s.add_argument("-d", "--dtype", default="float32")
    s.add_argument("--json", metavar="FILE", help="write the predictions as JSON")


def run_simulate(args: argparse.Namespace, out: TextIO) -> int:
    import numpy as np

    from .. import sim
    from ..comm.world import gpu_chunk_bytes
    from ..topology import Topology

    if args.gpu not in sim.DEVICES:
        raise UsageError(f"--gpu {args.gpu}: accepted: {', '.join(sim.DEVICES)}")
    algs = [a.strip() for a in args.algorithm.split(",") if a.strip()]
    bad = [a for a in algs if a not in SIM_ALGORITHMS]
    if bad or not algs:
        raise UsageError(f"--algorithm: accepted: {', '.join(SIM_ALGORITHMS)}, got {bad}")
    try:
        colls = [collective_name(c) for c in args.collective.split(",")]
        itemsize = np.dtype(args.dtype).itemsize
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if args.nodes < 1 or args.net_gbps <= 0 or args.issue_us < 0:
        raise UsageError("--nodes >= 1, --net-gbps > 0 and --issue-us >= 0 are needed")
    if args.topo:
        topo = load_topology(args.topo)
    else:
        try:
            with open(args.smi, encoding="utf-8") as f:
                topo = Topology.from_smi(f.read())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--smi {args.smi}: {exc}") from None
    numbered = sum(
        topo.link(i, j).gbps is not None for i in range(topo.n) for j in range(topo.n) if i != j
    )
    if args.nodes > 1:
        topo = sim.cluster_topology(topo, args.nodes)
    machine = sim.Machine(topo, sim.DEVICES[args.gpu], args.net_gbps, args.issue_us * 1e-6)
    lo, hi = drv.parse_size(args.minbytes), drv.parse_size(args.maxbytes)
    if lo > hi or args.stepfactor <= 1:
        raise UsageError("-b must be <= -e and -f > 1")
    sizes = drv.size_range(lo, hi, args.stepfactor)
    n = topo.n
    print(f"# nccltree-bench simulate: {n} ranks ({args.topo or args.smi}"
          f"{f' x {args.nodes} nodes' if args.nodes > 1 else ''}), device model {args.gpu}, "
          f"network {args.net_gbps:g} GB/s, issue {args.issue_us:g} us per step; predicted, "
          "not measured", file=out)  # fmt: skip
    if numbered:
        print(f"# {numbered} of {topo.n * (topo.n - 1)} links carry their own rates (GB/s "
              f"per direction, from {args.topo}); the others the device model's", file=out)  # fmt: skip
    records = []
    for name in colls:
        coll = COLLECTIVES[name]
        print(f"# {name}", file=out)
        print(f"#{'size':>11} {'count':>12} {'algorithm':>10} {'time(us)':>10} "
              f"{'algbw':>8} {'busbw':>8}", file=out)  # fmt: skip
        for size in sizes:
            count = coll.count_for(size // itemsize, n)
            nbytes = coll.nbytes(count, n, itemsize)
            biggest = max(coll.in_count(count, n), coll.out_count(count, n)) * itemsize
            for alg in algs:
                if alg == "nccl-model":
                    if name not in NCCL_MODELED:
                        continue
                    t, _ = sim.nccl_model_time(machine, name, nbytes)
                else:
                    r = sim.simulate_collective(machine, alg, name, count, itemsize=itemsize,
                                                chunk_bytes=gpu_chunk_bytes(biggest))  # fmt: skip
                    t = r.time_s
                algbw = nbytes / t / 1e9 if t > 0 else 0.0
                busbw = algbw * coll.bus_factor(n)
                print(f"{nbytes:>12} {count:>12} {alg:>10} {t * 1e6:>10.1f} {algbw:>8.2f} "
                      f"{busbw:>8.2f}", file=out)  # fmt: skip
                records.append({"collective": name, "algorithm": alg, "size": nbytes,
                                "count": count, "dtype": args.dtype, "ranks": n,
                                "time_us": t * 1e6, "algbw": algbw, "busbw": busbw,
                                "predicted": True})  # fmt: skip
    if args.json:
        from .bench import write_json

        write_json(args.json, {"tool": "nccltree-bench simulate", "machine": {
            "topology": args.topo or args.smi, "nodes": args.nodes, "gpu": args.gpu,
            "net_gbps": args.net_gbps, "issue_us": args.issue_us, "links_with_rates": numbered,
            "source": sim.DEVICES[args.gpu].source}, "records": records})  # fmt: skip
    return ExitStatus.OK


def load_topology(value: str) -> Topology:
    """``--topo``: a preset by name, else a topology JSON file; a :class:`UsageError`
    saying which of the two failed and why."""
    import os

    from ..topology import Topology

    presets = Topology.presets()
    if value in presets or value.startswith("flat:"):
        try:
            return Topology.preset(value)
        except ValueError as exc:
            raise UsageError(f"--topo {value}: {exc}") from None
    if not os.path.exists(value):
        raise UsageError(
            f"--topo {value}: neither a preset ({', '.join(presets)}) nor a file (no such file)"
        )
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--topo {value}: cannot read the file: {exc}") from None
    try:
        return Topology.from_json(text)
    except ValueError as exc:
        hint = ""
        if not text.lstrip().startswith("{"):
            hint = " (a saved `nvidia-smi topo -m` output goes to --smi)"
        raise UsageError(f"--topo {value}: not a topology JSON file: {exc}{hint}") from None
