"""``nccltree-bench simulate``: the collectives table, predicted on a machine described by
a topology and a device model (:mod:`nccltree.sim`), with the columns of ``collectives``;
and ``nccltree-bench calibrate``: the host backend's costs measured on this machine, for
``simulate --calibration``."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, TextIO

from ..comm import bench as drv
from ..comm.collectives import COLLECTIVES, collective_name
from ._common import ExitStatus, Parser, UsageError, check_output
from ._output import plot_collectives, require_matplotlib, write_json

if TYPE_CHECKING:
    from ..sim import HostCalibration

if TYPE_CHECKING:
    from ..topology import Topology

SIM_ALGORITHMS = ("tree", "ring", "direct", "nccl-model")
NCCL_MODELED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
PROCESSES = {"one": "one process", "node": "a process per node", "gpu": "a process per GPU"}
# The most devices a topology of `simulate` and `topo` may hold (flat:N, --nodes times a
# node's): building and simulating grows with the square of it (flat:256 takes about a
# minute per size on one core, flat:1024 several minutes and gigabytes); far beyond it,
# memory runs out before a line is printed.
MAX_DEVICES = 512


def check_device_count(n: int, what: str) -> None:
    """A :class:`UsageError` when a topology of ``n`` devices (described by ``what``) is
    larger than :data:`MAX_DEVICES`: refused before it is built."""
    if n > MAX_DEVICES:
        raise UsageError(f"{what}: {n} devices; at most {MAX_DEVICES} are accepted")


def check_flat_preset(name: str, flag: str) -> None:
    """``flat:N`` (a preset name) within :data:`MAX_DEVICES`, checked before the
    topology is built; other names pass (the preset itself judges them)."""
    count = name[5:] if name.startswith("flat:") else ""
    if count.isdigit():
        check_device_count(int(count), f"{flag} {name}")


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    s = sub.add_parser(
        "simulate",
        help="predict the collectives table on a machine you do not have",
        description="Build the plans nccltree would run and simulate them on a link model "
        "of a machine (nccltree.sim): each link's rate from the topology and the device "
        "model's data sheet (or the link's own rate, where a topology JSON file carries "
        "one), each device's memory bandwidth, the host's cost of issuing a step, flows "
        "sharing links fairly. Prints predicted time, algbw and busbw, with the columns "
        "of `collectives`. A model, not a measurement: see docs/benchmarks.md. 64 ranks "
        "over 8 nodes take about half a minute for a sweep of 21 sizes and four "
        "algorithms.",
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
        "the file); or cpu:N with --calibration (N host devices of the calibrated "
        "machine)",
    )
    src.add_argument(
        "--smi",
        metavar="FILE",
        help="a saved `nvidia-smi topo -m` output (link kinds only: every rate comes from "
        "the --gpu model)",
    )
    s.add_argument("--gpu", default="h100", help="device model: v100, a100, h100, h200, "
                   "h100pcie, h800, rtx4090, rtx2080ti, host (default: %(default)s)")  # fmt: skip
    s.add_argument("--calibration", metavar="FILE", help="predict the host backend from "
                   "`nccltree-bench calibrate --json FILE` (with --topo cpu:N)")  # fmt: skip
    s.add_argument("--nodes", type=int, default=1, help="copies of the topology, one per "
                   "node, linked by the network (default: %(default)s)")  # fmt: skip
    s.add_argument("--net-gbps", type=float, default=12.5,
                   help="each node's network rate per direction, all its NICs together, "
                   "GB/s (default: %(default)s, one 100 Gb/s NIC)")  # fmt: skip
    s.add_argument("--issue-us", type=float, default=13.0,
                   help="host time to issue one plan step, us (default: %(default)s, "
                   "measured through CuPy on an H200)")  # fmt: skip
    s.add_argument("--processes", choices=tuple(PROCESSES), default=None,
                   help="which host threads issue the plan's steps: one (a World in one "
                   "process issues every rank's steps), node (a process per node), gpu (a "
                   "process per GPU, as process groups run) (default: one on one node, gpu "
                   "on several)")  # fmt: skip
    s.add_argument("--algorithm", default="tree,ring,direct",
                   help="comma-separated: tree, ring, direct, and nccl-model (NCCL's own "
                   "cost model, Simple protocol, from its tuning code: a model of NCCL, "
                   "not NCCL) (default: %(default)s)")  # fmt: skip
    s.add_argument("--collective", default="all_reduce", help="as for `collectives`")
    s.add_argument("-b", "--minbytes", default="1M")
    s.add_argument("-e", "--maxbytes", default="256M")
    s.add_argument("-f", "--stepfactor", type=float, default=16.0)
    s.add_argument("-d", "--dtype", default="float32")
    s.add_argument("--json", metavar="FILE", help="write the predictions as JSON, with the "
                   "record fields of `collectives --json` and predicted: true")  # fmt: skip
    s.add_argument("--plot", metavar="FILE", help="plot predicted busbw against size (needs "
                   "matplotlib)")  # fmt: skip

    c = sub.add_parser(
        "calibrate",
        help="measure this machine's host-backend costs for `simulate --calibration`",
        description="Measure the host backend's costs from microbenchmarks only, never "
        "from the collectives predicted: nt_copy's rate with one thread and with every core "
        "by working set (64 KiB to 64 MiB), the cost of one inline plan step, and a call's "
        "fixed cost per rank count (an out-of-place all_reduce of nothing). Run it on an "
        "idle machine: a loaded one measures the load. `simulate --topo cpu:N "
        "--calibration FILE` then predicts `collectives` on cpu:N.",
    )
    c.add_argument("--ranks", default="2,4", help="rank counts whose call cost to measure "
                   "(default: %(default)s)")  # fmt: skip
    c.add_argument("--repeats", type=int, default=5, help="best of this many copies per "
                   "point (default: %(default)s)")  # fmt: skip
    c.add_argument("--json", metavar="FILE", help="write the calibration as JSON")


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ranks: comma-separated rank counts, got {text!r}") from None
    if not ranks or any(r < 1 for r in ranks):
        raise UsageError(f"--ranks: rank counts >= 1, got {text!r}")
    return ranks


def run_calibrate(args: argparse.Namespace, out: TextIO) -> int:
    import os

    from .. import sim

    ranks = _ranks(args.ranks)
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.json:
        check_output("--json", args.json)
    load = os.getloadavg()[0]
    cal = sim.calibrate_host(ranks, args.repeats)
    print(f"# nccltree-bench calibrate: host backend, {cal.cores} cores, load {load:.2f} "
          "before (an idle machine gives figures that predict; a loaded one does not)",
          file=out)  # fmt: skip
    for threads, curve in sorted(cal.copy_gbps.items()):
        pts = ", ".join(f"{b >> 10} KiB {g:.1f}" for b, g in curve)
        print(f"copy GB/s (read + written) with {threads} thread(s), by working set: {pts}",
              file=out)  # fmt: skip
    print(f"inline plan step: {cal.step_s * 1e6:.3f} us", file=out)
    for n, t in sorted(cal.call_s.items()):
        print(f"a call's fixed cost on {n} ranks: {t * 1e6:.1f} us", file=out)
    if args.json:
        write_json(args.json, {"tool": "nccltree-bench calibrate", "calibration": cal.to_json()})
    return ExitStatus.OK


def _load_calibration(path: str) -> HostCalibration:
    from .. import sim

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise UsageError(f"--calibration {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--calibration {path}: not JSON ({exc})") from None
    if isinstance(data, dict) and "calibration" in data:
        data = data["calibration"]
    try:
        return sim.HostCalibration.from_json(data)
    except ValueError as exc:
        raise UsageError(f"--calibration {path}: {exc}") from None


def run_simulate(args: argparse.Namespace, out: TextIO) -> int:
    import numpy as np

    from .. import sim
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
    _check_numbers(args)
    for flag in ("json", "plot"):
        if getattr(args, flag):
            check_output(f"--{flag}", getattr(args, flag))
    if args.plot:
        require_matplotlib()
    host = args.topo is not None and args.topo.startswith("cpu:")
    if host != (args.calibration is not None):
        raise UsageError("--topo cpu:N and --calibration FILE go together: the host backend "
                         "is predicted from `nccltree-bench calibrate`'s figures")  # fmt: skip
    cal = None
    if host:
        if "nccl-model" in algs or args.nodes > 1:
            raise UsageError("--topo cpu:N predicts one host World: no nccl-model, no --nodes")
        try:
            n_host = int(args.topo[4:])
        except ValueError:
            n_host = 0
        if n_host < 1:
            raise UsageError(f"--topo {args.topo}: cpu:N with N >= 1")
        check_device_count(n_host, f"--topo {args.topo}")
        cal = _load_calibration(args.calibration)
        topo = Topology.preset(f"flat:{n_host}")
    elif args.topo:
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
        check_device_count(topo.n * args.nodes, f"--nodes {args.nodes} x {topo.n} devices")
        topo = sim.cluster_topology(topo, args.nodes)
    n = topo.n
    per_node = n // args.nodes
    processes = args.processes or ("gpu" if args.nodes > 1 else "one")
    issuers = {"one": None, "node": tuple(r // per_node for r in range(n)),
               "gpu": tuple(range(n))}[processes]  # fmt: skip
    machine = sim.Machine(topo, sim.DEVICES[args.gpu], args.net_gbps, args.issue_us * 1e-6,
                          issuers=issuers)  # fmt: skip
    lo, hi = drv.parse_size(args.minbytes), drv.parse_size(args.maxbytes)
    if lo > hi:
        raise UsageError("-b must be <= -e")
    sizes = drv.size_range(lo, hi, args.stepfactor)
    if cal is not None:
        what = f"cpu:{n} (host backend, calibrated: {args.calibration})"
    else:
        what = (f"{args.topo or args.smi}{f' x {args.nodes} nodes' if args.nodes > 1 else ''}"
                f"), device model {args.gpu}, network {args.net_gbps:g} GB/s per node, issue "
                f"{args.issue_us:g} us per step by {PROCESSES[processes]}")  # fmt: skip
        what = f"{n} ranks ({what}"
    print(f"# nccltree-bench simulate: {what}; predicted, not measured", file=out)
    label = (f"cpu:{n}" if cal else f"{args.topo or 'smi'}"
             f"{f' x {args.nodes}' if args.nodes > 1 else ''}, {args.gpu}") + ", predicted"  # fmt: skip
    desc: dict[str, object] = {
        "backend": "simulated", "topology": args.topo or args.smi, "nodes": args.nodes,
        "gpu": "host" if cal else args.gpu, "net_gbps": args.net_gbps,
        "issue_us": args.issue_us, "processes": processes,
        "source": "calibrate" if cal else sim.DEVICES[args.gpu].source,
    }  # fmt: skip
    if numbered:
        print(f"# {numbered} of {topo.n * (topo.n - 1)} links carry their own rates (GB/s "
              f"per direction, from {args.topo}); the others the device model's", file=out)  # fmt: skip
        desc["links_with_rates"] = numbered
    records: list[drv.BenchRecord] = []
    for name in colls:
        coll = COLLECTIVES[name]
        print(f"# {name}", file=out)
        print(f"#{'size':>11} {'count':>12} {'algorithm':>10} {'time(us)':>10} "
              f"{'algbw':>8} {'busbw':>8}", file=out)  # fmt: skip
        for size in sizes:
            for alg in algs:
                if alg == "nccl-model" and name not in NCCL_MODELED:
                    continue
                if cal is None:
                    t, count, nbytes = sim.predict(machine, alg, name, size, itemsize)
                else:
                    count = coll.count_for(size // itemsize, n)
                    nbytes = coll.nbytes(count, n, itemsize)
                    t = sim.predict_host(cal, n, alg, name, count, itemsize)
                algbw, busbw = drv.bandwidths(nbytes, t, coll.bus_factor(n))
                print(f"{nbytes:>12} {count:>12} {alg:>10} {t * 1e6:>10.1f} {algbw:>8.2f} "
                      f"{busbw:>8.2f}", file=out)  # fmt: skip
                records.append(drv.BenchRecord(
                    name, alg, "out-of-place", nbytes, count, args.dtype,
                    "sum" if coll.reduces else "none", 0 if coll.rooted else -1, n, t * 1e6,
                    algbw, busbw, None, 0, 0, coll.bus_factor(n), label, desc))  # fmt: skip
    if args.json:
        write_json(args.json, {"tool": "nccltree-bench simulate", "machine": desc,
                               "records": [dict(r.as_dict(), predicted=True)
                                           for r in records]})  # fmt: skip
    if args.plot:
        plot_collectives(args.plot, records)
    return ExitStatus.OK


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags, before anything is built: argparse's ``float`` takes "nan" and
    "inf", which would predict nonsense (or trip the model's own checks)."""
    from .._validate import check_int, check_real

    try:
        check_int(args.nodes, "--nodes", min=1)
        check_real(args.net_gbps, "--net-gbps", min=0.0, min_open=True)
        check_real(args.issue_us, "--issue-us", min=0.0)
        check_real(args.stepfactor, "-f/--stepfactor", min=1.0, min_open=True)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def load_topology(value: str) -> Topology:
    """``--topo``: a preset by name, else a topology JSON file; a :class:`UsageError`
    saying which of the two failed and why."""
    import os

    from ..topology import Topology

    presets = Topology.presets()
    if value in presets or value.startswith("flat:"):
        check_flat_preset(value, "--topo")
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
        topo = Topology.from_json(text)
    except ValueError as exc:
        hint = ""
        if not text.lstrip().startswith("{"):
            hint = " (a saved `nvidia-smi topo -m` output goes to --smi)"
        raise UsageError(f"--topo {value}: not a topology JSON file: {exc}{hint}") from None
    check_device_count(topo.n, f"--topo {value}")
    return topo
