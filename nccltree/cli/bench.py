"""``nccltree-bench``: collective and training benchmarks, and the topology the tree uses.

``collectives`` runs the library's benchmark driver (:mod:`nccltree.comm.bench`) over a
size sweep and prints an nccl-tests style table; ``train`` measures the reference
trainer's examples/s over device sets; ``topo`` prints a topology matrix and its tree.
This module parses, calls the library and prints; the exit statuses are those of
:mod:`nccltree.cli._common` (3: a collective computed a wrong element).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from .._validate import check_call_timeout
from ..comm import bench as drv
from ..comm.collectives import COLLECTIVES, collective_name
from ._common import (
    ExitStatus,
    Progress,
    UsageError,
    approx_bytes,
    check_output,
    checking,
    human_bytes,
    int_at_least,
    job_processes,
    job_rank,
    make_parser,
    open_devices,
    over_mpi,
    run_main,
    write_output,
)
from ._output import (
    bucket_table,
    plot_buckets,
    plot_collectives,
    plot_train,
    require_matplotlib,
    table_footer,
    table_header,
    table_row,
    train_table,
    write_csv,
    write_json,
)
from ._training import (
    DriverConfig,
    SolverConfig,
    bucket_bytes,
    build_training,
    group_devices,
    job_size,
    open_group,
)

if TYPE_CHECKING:
    from ..backends.base import Device
    from ..comm.group import ProcessGroup
    from ..topology import Topology
    from ..tree import Tree

COLLECTIVE_DEFAULTS = {
    "devices": None,
    "algorithm": "tree",
    "collective": "all_reduce",
    "minbytes": "8",
    "maxbytes": "32M",
    "stepfactor": 2.0,
    "iters": 20,
    "warmup": 5,
    "check": 1,
    "op": "sum",
    "dtype": "float32",
    "root": 0,
    "ngpus": None,
    "nthreads": None,
    "stepbytes": None,
    "average": 3,
    "cycles": 1,
    "blocking": 1,
    "timeout": 60.0,
}
# nccl-tests' -a: how the ranks' times of one call make one time
AVERAGE_MODES = {0: "rank0", 1: "mean", 2: "min", 3: "max"}
# nccl-tests' op names; "avg" is nccltree's "mean"
OP_ALIASES = {"avg": "mean"}
# nccl-tests flags that mean nothing here: (flags, the value that turns them off, why)
REFUSED = (
    (
        ("-G", "--cudagraph"),
        "0",
        "nccltree launches no CUDA graphs (and the host backend has no CUDA at all)",
    ),
    (
        ("-p", "--parallel_init"),
        "0",
        "one process creates every rank's communicator; there is nothing to initialise in parallel",
    ),
    (
        ("-m", "--agg_iters"),
        "1",
        "every call is timed on its own; nccltree has no grouped (aggregated) launches",
    ),
    (
        ("-y", "--stream_null"),
        "0",
        "a World call runs on the devices' own streams; there is no NULL-stream mode",
    ),
    (
        ("-C", "--report_cputime"),
        "0",
        "the time reported is already the wall time of a synchronous call",
    ),
    (
        ("-R", "--local_register"),
        "0",
        "nccltree has no user buffer registration",
    ),
)
# the driver's arguments as the collectives command line names them, for its messages
FLAG_NAMES = {
    "root": "-r/--root",
    "iters": "-n/--iters",
    "warmup": "-w/--warmup-iters",
    "check": "-c/--check",
    "cycles": "-N/--run_cycles",
}


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class SweepProgress(Progress):
    """Progress over a sweep of ``total`` measurements: ``[i/total] what (elapsed)``,
    redrawn in place on a terminal, a line every ``every_s`` seconds otherwise."""

    def __init__(self, total: int, quiet: bool, stream: TextIO, every_s: float = 30.0) -> None:
        super().__init__(stream, quiet)
        self.total, self.every_s = total, every_s
        self.done = 0
        self.t0 = self._last_line = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        now = time.monotonic()
        log = now - self._last_line >= self.every_s
        if log:
            self._last_line = now
        self.show(f"[{self.done}/{self.total}] {what}  ({now - self.t0:.0f} s)", log=log)


# -- collectives --------------------------------------------------------------------------


def _step_text(args: argparse.Namespace) -> str:
    if args.stepbytes is not None:
        return f"+{human_bytes(drv.parse_size(args.stepbytes))}"
    return f"x{args.stepfactor:g}"


def using_devices(bench: drv.Benchmark, per_group: int) -> list[str]:
    """nccl-tests' "Using devices" block: a line per rank with its group (nccl-tests'
    thread, ``per_group`` ranks each), process id, host and device."""
    gpus = bench.machine.get("gpus")
    host, pid = socket.gethostname(), os.getpid()
    lines = ["# Using devices"]
    for r, d in zip(bench.local_ranks, bench.devices, strict=True):
        if isinstance(gpus, list) and r < len(gpus):
            what = str(gpus[r])
        else:
            threads = getattr(d, "threads", None)
            what = f"{d.backend} backend" + (
                f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
            )
        lines.append(
            f"#  Rank {r:2d} Group {r // max(1, per_group):2d} Pid {pid:6d} on {host} "
            f"device {d.physical_id:2d} [{d.name}] {what}"
        )
    others = bench.n - len(bench.devices)
    if bench.group is not None and others:
        mpi = "MPI " if over_mpi() else ""
        lines.append(
            f"#  (and {others} more rank{'s' if others > 1 else ''} in the other "
            f"{bench.group.nprocs - 1} {mpi}process{'es' if bench.group.nprocs > 2 else ''})"
        )
    return lines


def _collectives_header(
    bench: drv.Benchmark, args: argparse.Namespace, lowered_from: int | None = None
) -> list[str]:
    m, sizes = bench.machine, bench.sizes
    where = (
        f"{bench.label} ({bench.n} ranks, {m['backend']} backend; {m['cpu']}, "
        f"{m['cpu_count']} cores)"
    )
    step = _step_text(args)
    rng = (
        f"{human_bytes(sizes[0])} .. {human_bytes(sizes[-1])}, step {step}"
        if len(sizes) > 1
        else human_bytes(sizes[0])
    )
    if lowered_from is not None:
        rng += f" (lowered from {human_bytes(lowered_from)} to fit in memory)"
    reduces = any(COLLECTIVES[c].reduces for c in bench.collectives)
    dtypes = ", ".join(dict.fromkeys(str(d) for d, _ in bench.variants))
    ops = ", ".join(dict.fromkeys(o for _, o in bench.variants)) if reduces else "none"
    g, t = args.ngpus or bench.n, args.nthreads or 1
    cycles = f", {bench.cycles} cycles" if bench.cycles > 1 else ""
    return [
        "# nccltree-bench collectives",
        f"# nThread {t} nGpus {g} minBytes {sizes[0]} maxBytes {sizes[-1]} step: "
        + (
            f"{drv.parse_size(args.stepbytes)}(bytes)"
            if args.stepbytes is not None
            else f"{args.stepfactor:g}(factor)"
        )
        + f" warmup iters: {bench.warmup} iters: {bench.iters} agg iters: 1 "
        f"validation: {int(bench.check > 0)} graph: 0",
        "#",
        *using_devices(bench, g),
        "#",
        f"#   devices     {where}",
        f"#   algorithms  {', '.join(bench.algorithms)}",
        f"#   sizes       {rng}; dtype {dtypes}, op {ops}, root {bench.root}",
        f"#   iterations  {bench.iters} timed (median, {bench.aggregate} over ranks), "
        f"{bench.warmup} warm-up, check {bench.check}{cycles}; every call blocking",
        "#   algbw = size / time, busbw = algbw x bus factor (nccl-tests), GB = 1e9 B",
        "#",
    ]


def _sizes(args: argparse.Namespace) -> list[int]:
    lo, hi = drv.parse_size(args.minbytes), drv.parse_size(args.maxbytes)
    if lo > hi:
        raise UsageError(
            f"-b/--minbytes ({args.minbytes}) is larger than -e/--maxbytes "
            f"({args.maxbytes}); accepted: minbytes <= maxbytes"
        )
    if args.stepbytes is not None:
        step = drv.parse_size(args.stepbytes)
        if step < 1:
            raise UsageError(f"-i/--stepbytes must be >= 1 byte, got {args.stepbytes}")
        return list(range(lo, hi + 1, step))
    if not args.stepfactor > 1:
        raise UsageError(f"-f/--stepfactor must be > 1, got {args.stepfactor:g}")
    return drv.size_range(lo, hi, args.stepfactor)


def _refuse_inapplicable(args: argparse.Namespace) -> None:
    """nccl-tests flags with no meaning here: their off value is accepted (a pasted
    command line runs), any other refused with the reason."""
    for flags, off, why in REFUSED:
        value = getattr(args, flags[1].lstrip("-"))
        if value is not None and value != off:
            raise UsageError(f"{flags[0]}/{flags[1]} {value} cannot apply: {why}")


def _spec_count(spec: str) -> int:
    """How many devices a --devices spec names, without creating them."""
    from ..backends import gpu_count

    s = spec.strip().lower().replace(" ", "")
    if s.startswith("cpu:") and s[4:].isdigit():
        return int(s[4:])
    if s in ("auto", "gpu:all"):
        n = _gpus_visible(gpu_count)
        return n if n or s != "auto" else 2
    if s.startswith("gpu:"):
        return len(_split(s[4:]))
    return 0  # a malformed spec: creating the devices says what is wrong


def _gpus_visible(gpu_count: Callable[[], int]) -> int:
    from .._errors import BackendUnavailable

    try:
        return gpu_count()
    except BackendUnavailable:
        return 0


def resolve_devices(args: argparse.Namespace) -> str:
    """The --devices spec the run uses. ``-g N`` (and ``-t T``) ask for N (T x N) local
    ranks in this process: the first GPUs if there are any, else virtual CPU devices;
    with --devices too, the counts must agree."""
    if args.ngpus is None and args.nthreads is None:
        return args.devices or "auto"
    g, t = args.ngpus or 1, args.nthreads or 1
    want = g * t
    asked = f"-g {g}" + (f" -t {t}" if t > 1 else "")
    if args.devices is not None:
        have = _spec_count(args.devices)
        if have != want:
            raise UsageError(
                f"{asked} asks for {want} local rank(s) but --devices {args.devices} names "
                f"{have}; give one of them, or make them agree"
            )
        return str(args.devices)
    from ..backends import gpu_count

    gpus = _gpus_visible(gpu_count)
    if gpus == 0:
        return f"cpu:{want}"
    if want > gpus:
        raise UsageError(f"{asked} asks for {want} GPU(s) but {gpus} are visible")
    return "gpu:" + ",".join(str(i) for i in range(want))


def _variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (dtype, op) pairs of -d and -o; ``all`` takes every one, leaving out the
    pairs that cannot be (mean of integers) unless both were named."""
    from ..backends.base import FLOAT_DTYPES
    from ..comm import _ops

    every_dtype = args.dtype.strip().lower() == "all"
    every_op = args.op.strip().lower() == "all"
    dtypes = [str(d) for d in _ops.DTYPES] if every_dtype else _split(args.dtype)
    ops = list(_ops.OPS) if every_op else [OP_ALIASES.get(o, o) for o in _split(args.op)]
    if not dtypes or not ops:
        raise UsageError("-d/--dtype and -o/--op need a value (or all)")
    pairs = [(d, o) for d in dtypes for o in ops]
    if every_dtype or every_op:
        pairs = [(d, o) for d, o in pairs if o != "mean" or drv.check_dtype(d) in FLOAT_DTYPES]
    return pairs


def mpi_devices(args: argparse.Namespace) -> str:
    """Each process's devices under MPI: ``-g N`` (times ``-t T``) host ranks, else
    --devices (``cpu`` or ``cpu:N``; ``auto`` is one rank)."""
    if args.ngpus is None and args.nthreads is None:
        return group_devices(args.devices or "auto")
    want = (args.ngpus or 1) * (args.nthreads or 1)
    if args.devices is not None and _spec_count(group_devices(args.devices)) != want:
        raise UsageError(
            f"-g/-t ask for {want} local rank(s) per process but --devices {args.devices} "
            "names another count; give one of them, or make them agree"
        )
    return f"cpu:{want}"


def make_benchmark(
    args: argparse.Namespace,
    world_factory: drv.WorldFactory | None = None,
    group: ProcessGroup | None = None,
    devices: str | None = None,
) -> drv.Benchmark:
    """Check every collectives flag and create the Worlds; nothing runs yet. Under MPI,
    ``group`` is the process group and ``devices`` each process's spec."""
    from ..comm import ALGORITHM_CHOICES
    from ..comm.group import GROUP_ALGORITHMS

    choices = GROUP_ALGORITHMS if group is not None else ALGORITHM_CHOICES
    sizes = _sizes(args)
    algorithms = _split(args.algorithm)
    if not algorithms:
        raise UsageError(f"--algorithm is empty; accepted: {', '.join(choices)}")
    if world_factory is None:
        bad = [a for a in algorithms if a not in choices]
        if bad:
            extra = "" if group is not None else "; mpi under MPI only"
            raise UsageError(
                f"unknown algorithm {', '.join(bad)}; accepted: "
                f"{', '.join(choices)} (several: tree,ring){extra}"
            )
    collectives = [collective_name(c) for c in _split(args.collective)]
    _refuse_inapplicable(args)
    try:
        check_call_timeout(args.timeout, "-T/--timeout")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    variants = _variants(args)
    if "mpi" in algorithms:
        _refuse_mpi_half(collectives, [d for d, _ in variants])
    _check_outputs(args, ("json", "csv", "plot"))
    if getattr(args, "trace", None):  # written after the sweep: checked before it
        check_output("--trace", args.trace)
    if group is not None:
        assert devices is not None, "under MPI the caller resolves each process's devices"
        if "mpi" in algorithms and len(group.ranks) > 1:
            raise UsageError(
                "--algorithm mpi runs MPI's own collectives, one rank per process: use -g 1 "
                f"(this process holds {len(group.ranks)} ranks)"
            )
        label = f"{devices} x {job_processes(group.nprocs)}"
        devices_used: Sequence[Device] | str = group.devices
    else:
        label = devices_used = resolve_devices(args)
    return drv.Benchmark(
        devices_used,
        algorithms,
        collectives,
        sizes,
        variants=variants,
        root=args.root,
        iters=args.iters,
        warmup=args.warmup,
        check=args.check,
        cycles=args.cycles,
        aggregate=AVERAGE_MODES[args.average],
        timeout=args.timeout,
        devices_label=label,
        names=FLAG_NAMES,
        world_factory=world_factory if group is None else None,
        group=group,
    )


def _refuse_mpi_half(collectives: Sequence[str], dtypes: Sequence[str]) -> None:
    """``--algorithm mpi`` cannot reduce float16 or bfloat16 (MPI has no such types): a
    usage error before the sweep, rather than a failure in its middle."""
    from ..comm.group.mpi_collectives import mpi_reduces

    if not any(COLLECTIVES[c].reduces for c in collectives):
        return  # moved as 16-bit words: MPI can
    bad = []
    for d in dtypes:
        try:
            dt = drv.check_dtype(d)
        except (TypeError, ValueError):
            continue  # an unknown name: the benchmark's own check names it
        if not mpi_reduces(dt) and dt.name not in bad:
            bad.append(dt.name)
    if bad:
        raise UsageError(
            f"--algorithm mpi cannot reduce {' or '.join(bad)} (MPI has no such type): "
            "leave it out of -d, or use --algorithm tree, ring, direct or auto"
        )


def _check_outputs(args: argparse.Namespace, flags: Sequence[str]) -> None:
    """Every output file can be written, and something is shown or written: checked
    before the work, which may take an hour."""
    given = [f for f in flags if getattr(args, f)]
    if args.quiet and not given:
        raise UsageError(
            "--quiet with no "
            + " or ".join(f"--{f}" for f in flags)
            + " would run and keep nothing; add --json FILE, or drop --quiet"
        )
    if "plot" in given:
        require_matplotlib()
    for f in given:
        check_output(f"--{f}", getattr(args, f))


def fit_sweep(bench: drv.Benchmark, args: argparse.Namespace, err: TextIO) -> dict[str, object]:
    """Lower the sweep to the sizes whose memory fits (as nccl-tests lowers maxBytes),
    saying so on ``err``; refuse if not even the smallest fits. Returns what the JSON
    output records of it."""
    asked = list(bench.sizes)
    maxbytes = drv.parse_size(args.maxbytes)
    dropped = bench.fit_memory()
    host = drv.available_memory()
    memory: dict[str, object] = {"available_bytes": host, "dropped_sizes": dropped}
    if not dropped:
        return memory
    need = bench.memory_needed(dropped[0])
    have = f"{approx_bytes(host)} of host memory available" if host is not None else "free memory"
    if need.device_bytes:
        free = drv.device_free_memory(bench.devices)
        have += ", GPU free: " + ", ".join(
            f"{d}: {approx_bytes(b)}" for d, b in sorted(free.items())
        )
    what = (
        f"{approx_bytes(need.host_bytes)} of host memory"
        if not need.device_bytes
        else f"{approx_bytes(max(need.device_bytes.values()))} on one GPU"
    )
    if not bench.sizes:
        raise UsageError(
            f"-b/--minbytes {human_bytes(asked[0])} needs about {what} for "
            f"{bench.n} ranks ({have}, {int(drv.MEMORY_HEADROOM * 100)}% of it usable); "
            "lower -b/--minbytes or use fewer devices"
        )
    print(
        f"nccltree-bench collectives: note: -e/--maxbytes {human_bytes(maxbytes)} needs about "
        f"{approx_bytes(bench.memory_needed(asked[-1]).host_bytes)} for {bench.n} ranks "
        f"({have}); the sweep stops at {human_bytes(bench.sizes[-1])}, as nccl-tests lowers "
        "maxBytes",
        file=err,
        flush=True,
    )
    memory["lowered_from"] = maxbytes
    return memory


def run_collectives(
    bench: drv.Benchmark,
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    memory: dict[str, object] | None = None,
) -> int:
    quiet = args.quiet
    lowered = (memory or {}).get("lowered_from")
    if not quiet:
        header = _collectives_header(bench, args, lowered if isinstance(lowered, int) else None)
        print("\n".join(header), file=out, flush=True)
    progress = SweepProgress(bench.total, quiet, err)
    records: list[drv.BenchRecord] = []
    group: list[drv.BenchRecord] = []
    current = None
    for rec in bench:
        progress.step(f"{rec.collective} {human_bytes(rec.size)} {rec.algorithm} {rec.placement}")
        if rec.collective != current:
            if current is not None and not quiet:
                progress.clear()
                print(
                    "\n".join(table_footer([r for r in records if r.collective == current])),
                    file=out,
                )
            current = rec.collective
            if not quiet:
                progress.clear()
                print("\n".join(table_header(current)), file=out, flush=True)
        records.append(rec)
        group.append(rec)
        if len(group) == len(bench.placements_for(COLLECTIVES[rec.collective])):
            if not quiet:
                progress.clear()
                print(table_row(group), file=out, flush=True)
            group = []
    progress.clear()
    if current is not None and not quiet:
        print(
            "\n".join(table_footer([r for r in records if r.collective == current])),
            file=out,
            flush=True,
        )
    if args.json:
        write_json(
            args.json,
            {
                "tool": "nccltree-bench collectives",
                # the devices as run: what -g/-t resolved to
                "config": {k: getattr(args, k) for k in COLLECTIVE_DEFAULTS}
                | {"devices": bench.label},
                "machine": bench.machine,
                "memory": memory or {},
                "records": [r.as_dict() for r in records],
            },
        )
    if args.csv:
        write_csv(args.csv, records)
    if args.plot:
        plot_collectives(args.plot, records)
    if getattr(args, "trace", None):
        from ..comm.trace import write_chrome_trace

        with checking():
            runs = bench.trace()
        write_chrome_trace(args.trace, runs)
        if not quiet:
            print(f"# trace of one call per algorithm written to {args.trace}", file=out)
    wrong = sum(r.wrong or 0 for r in records)
    if wrong:
        print(f"nccltree-bench: {wrong} wrong element(s) in the results", file=err, flush=True)
        return ExitStatus.WRONG
    return ExitStatus.OK


# -- train --------------------------------------------------------------------------------


def _train_dataset(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> tuple[str, tuple[int, ...], int]:
    """(LMDB path, example shape, classes) of the data the trainer reads."""
    from .. import data as ntdata

    if args.data:
        info = ntdata.db_info(args.data)
        return args.data, tuple(info["shape"]), int(info["label_max"]) + 1
    root = stack.enter_context(tempfile.TemporaryDirectory(prefix="nccltree-bench-"))
    shape = _synthetic_shape(args)
    x, y = ntdata.synthetic(args.records, shape=shape, classes=10)
    path = os.path.join(root, "synthetic")
    ntdata.write_lmdb(path, x, y)
    return path, shape, 10


def _synthetic_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """The synthetic task's example shape: ``--features`` values, as one-channel square
    images for the convolutional model."""
    if args.model != "cnn":
        return (args.features,)
    side = math.isqrt(args.features)
    if side * side != args.features:
        raise UsageError(
            f"--model cnn on the synthetic task needs a square --features (its examples "
            f"are 1 x side x side images), got {args.features}; e.g. 256 (16 x 16)"
        )
    return (1, side, side)


def train_point(
    spec: str,
    scaling: str,
    args: argparse.Namespace,
    dataset: tuple[str, tuple[int, ...], int],
    group: ProcessGroup | None = None,
    bucket_mb: float = 0.0,
) -> dict[str, object]:
    """Train ``args.warmup + args.iters`` iterations on ``spec`` with gradient buckets of
    ``bucket_mb`` MiB; figures over the timed iterations (those after the warm-up), as the
    root sees them, and the machine and devices they were measured on. Over a process
    ``group`` (``spec``: each process's devices) only global rank 0's process has them;
    the others return ``{}``."""
    from ..parallel import StepInfo

    path, shape, classes = dataset
    cfg = DriverConfig(
        devices=spec,
        model=args.model,
        batch_size=args.batch_size,
        scaling=scaling,
        hidden=tuple(int(h) for h in _split(args.hidden)),
        algorithm=args.algorithm,
        blas_threads=args.blas_threads,
        bucket_bytes=bucket_bytes(bucket_mb),
        comm_hook=args.comm_hook,
        solver=SolverConfig(lr=0.01, momentum=0.9),
    )
    steps: list[StepInfo] = []
    with build_training(cfg, shape, classes, data=path, group=group) as t:
        assert t.reader is not None, "build_training makes a reader when given data"
        t.driver.fit(t.reader, args.warmup + args.iters, on_step=steps.append)
        machine = drv.machine_description(t.devices)
        backend = t.devices[0].backend
    if group is not None and group.rank != 0:
        return {}
    n, per_rank = t.ranks, t.per_rank_batch
    if group is not None:
        spec = f"{spec} x {job_processes(group.nprocs)}"
    timed = steps[args.warmup :]
    t0 = steps[args.warmup - 1].elapsed_s if args.warmup else 0.0
    secs = timed[-1].elapsed_s - t0
    step_s = sum(s.step_s for s in timed)
    return {
        "devices": spec,
        "ranks": n,
        "scaling": scaling,
        "per_rank_batch": per_rank,
        "effective_batch": per_rank * n,
        "iters": len(timed),
        "examples_per_s": sum(s.examples for s in timed) / secs if secs > 0 else 0.0,
        "comm_fraction": sum(s.comm_s for s in timed) / step_s if step_s > 0 else 0.0,
        "step_ms": 1e3 * step_s / len(timed),
        # from the end of backward to the update: the communication backward did not hide
        "exposed_ms": 1e3 * sum(s.exposed_s for s in timed) / len(timed),
        "bucket_mb": bucket_mb,
        "comm_hook": args.comm_hook,
        "backend": backend,
        "algorithm": args.algorithm,
        "model": args.model,
        "blas_threads": args.blas_threads,  # None: the trainer's default ("auto")
        "machine": machine,
    }


def add_speedups(points: list[dict]) -> None:
    """Speedup over the first device set of the same scaling mode (and bucket size), and
    efficiency = speedup / (ranks / its ranks)."""
    base: dict[tuple[str, float], dict] = {}
    for p in points:
        b = base.setdefault((p["scaling"], p.get("bucket_mb", 0.0)), p)
        p["speedup"] = p["examples_per_s"] / b["examples_per_s"] if b["examples_per_s"] else 0.0
        p["efficiency"] = p["speedup"] / (p["ranks"] / b["ranks"])


#: the figures of a training point that repetitions take the median of
_MEDIANS = ("examples_per_s", "comm_fraction", "step_ms", "exposed_ms")


def median_points(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """One point per position of ``runs`` (each run a list of points in the same order):
    the first run's point with the median of each figure of ``_MEDIANS`` over the runs,
    and the runs' examples/s under ``examples_per_s_runs``."""
    points = []
    for same in zip(*runs, strict=True):
        p = dict(same[0])
        for key in _MEDIANS:
            p[key] = statistics.median(float(q[key]) for q in same)
        p["examples_per_s_runs"] = [q["examples_per_s"] for q in same]
        points.append(p)
    return points


def add_overlap(points: list[dict]) -> None:
    """``overlap``: the share of the unbucketed point's exposed communication (same
    devices and scaling, ``--bucket-mb 0`` in the same sweep) that buckets hid behind
    backward, ``1 - exposed / exposed without buckets``; None without that point."""
    base = {(p["devices"], p["scaling"]): p for p in points if p["bucket_mb"] == 0}
    for p in points:
        b = base.get((p["devices"], p["scaling"]))
        ok = b is not None and b["exposed_ms"] > 0
        p["overlap"] = 1.0 - p["exposed_ms"] / b["exposed_ms"] if ok and b else None


def check_train_args(args: argparse.Namespace, *, mpi: bool = False) -> None:
    """Every train flag, before the first device set trains (``mpi``: each device set is
    every process's, see :func:`group_devices`)."""
    from ..comm import ALGORITHM_CHOICES
    from ..comm.group import GROUP_ALGORITHMS
    from ..models import MODELS
    from ..parallel import per_rank_batch

    choices = GROUP_ALGORITHMS if mpi else ALGORITHM_CHOICES
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; accepted: {', '.join(MODELS)}")
    if args.algorithm not in choices:
        raise UsageError(f"unknown algorithm {args.algorithm!r}; accepted: {', '.join(choices)}")
    if mpi and args.algorithm == "mpi" and not over_mpi():
        raise UsageError(
            "--algorithm mpi runs MPI's own collectives, and this job was not started by "
            "an MPI launcher (mpiexec): use tree, ring, direct or auto"
        )
    if args.algorithm == "mpi" and args.comm_hook == "float16":
        raise UsageError(
            "--comm-hook float16 cannot go with --algorithm mpi: MPI has no float16 type to "
            "sum the gradients in; use --algorithm tree, ring, direct or auto"
        )
    for flag, v, lo in (
        ("--iters", args.iters, 1),
        ("-w/--warmup-iters", args.warmup, 0),
        ("--batch-size", args.batch_size, 1),
        ("--records", args.records, 1),
        ("--features", args.features, 1),
        ("--blas-threads", 1 if args.blas_threads is None else args.blas_threads, 1),
        ("--repeat", args.repeat, 1),
    ):
        if v < lo:
            raise UsageError(f"{flag} must be >= {lo}, got {v}")
    for mb in args.bucket_mb:
        if not math.isfinite(mb) or mb < 0:
            raise UsageError(f"--bucket-mb takes sizes >= 0 (MiB), got {mb:g}")
    if len(set(args.bucket_mb)) != len(args.bucket_mb):
        raise UsageError(f"--bucket-mb lists a size twice: {' '.join(map(str, args.bucket_mb))}")
    try:
        hidden = [int(h) for h in _split(args.hidden)]
    except ValueError:
        hidden = [0]
    if any(h < 1 for h in hidden):
        raise UsageError(f"--hidden takes comma-separated layer widths >= 1, got {args.hidden!r}")
    _check_outputs(args, ("json", "plot"))
    if mpi:
        args.devices = [group_devices(spec) for spec in args.devices]
        _check_model(args, hidden)
        return
    for spec in args.devices:
        with open_devices(spec) as devs:
            for mode in args.scaling:
                per_rank_batch(args.batch_size, len(devs), mode)
    _check_model(args, hidden)


def _check_model(args: argparse.Namespace, hidden: list[int]) -> None:
    """The model takes the data's examples (a convolutional model needs images)."""
    from .. import data as ntdata
    from ..models import build_model

    if args.data:
        if not os.path.exists(args.data):
            raise UsageError(f"--data {args.data}: no such database")
        info = ntdata.db_info(args.data)
        shape, where = tuple(info["shape"]), f"--data {args.data} holds"
    else:
        shape, where = _synthetic_shape(args), "the synthetic task has"
    kw = {"hidden": hidden} if args.model == "mlp" else {}
    try:
        build_model(args.model, shape, 10, **kw)  # a description: nothing is allocated
    except ValueError as exc:
        raise UsageError(
            f"--model {args.model} does not take the examples: {where} examples of "
            f"shape {shape} ({exc})"
        ) from None


def run_train(args: argparse.Namespace, out: TextIO, err: TextIO, *, mpi: bool = False) -> int:
    """The training sweep; ``mpi``: each device set is every process's of the job (a
    process group per set), and global rank 0 alone reports."""
    runs: list[list[dict]] = []
    total = len(args.devices) * len(args.scaling) * len(args.bucket_mb) * args.repeat
    root = True
    progress = SweepProgress(total, args.quiet, err, every_s=0.0)
    with contextlib.ExitStack() as stack:
        dataset = _train_dataset(args, stack)
        # repetitions interleaved: a change in the machine's load hits every point alike
        for _ in range(args.repeat):
            points: list[dict] = []
            for spec in args.devices:
                for mode in args.scaling:
                    for mb in args.bucket_mb:
                        if mpi:
                            with open_group(spec, args.algorithm, 60.0) as group:
                                if root and group.rank != 0:  # global rank 0 reports
                                    root = False
                                    progress.quiet = args.quiet = True
                                    args.json, args.plot = None, None
                                point = train_point(spec, mode, args, dataset, group, mb)
                        else:
                            point = train_point(spec, mode, args, dataset, bucket_mb=mb)
                        if root:
                            points.append(point)
                            buckets = f", buckets {mb:g} MiB" if len(args.bucket_mb) > 1 else ""
                            progress.step(
                                f"{spec} {mode}{buckets}: {point['examples_per_s']:,.0f} examples/s"
                            )
            runs.append(points)
    progress.clear()
    if not root:
        return ExitStatus.OK
    points = median_points(runs)
    add_speedups(points)
    add_overlap(points)
    sweep = len(args.bucket_mb) > 1
    if not args.quiet:
        print(
            f"# nccltree-bench train: model {args.model}, algorithm {args.algorithm}, "
            f"batch size {args.batch_size} ({', '.join(args.scaling)} scaling), "
            f"{args.iters} timed iterations after {args.warmup} warm-up"
            + (f", median of {args.repeat} interleaved runs" if args.repeat > 1 else "")
            + (f", gradients sent as {args.comm_hook}" if args.comm_hook else ""),
            file=out,
        )
        table = bucket_table(points) if sweep else train_table(points)
        print("\n".join(table), file=out, flush=True)
    if args.json:
        config = {
            k: getattr(args, k)
            for k in (
                "devices",
                "scaling",
                "batch_size",
                "model",
                "hidden",
                "algorithm",
                "iters",
                "warmup",
                "data",
                "records",
                "features",
                "blas_threads",
                "bucket_mb",
                "comm_hook",
                "repeat",
            )
        }
        write_json(
            args.json,
            {
                "tool": "nccltree-bench train",
                "config": config,
                "points": points,
                # the devices measured: those of the largest device set (each point
                # carries its own set's description)
                "machine": max(points, key=lambda p: int(p["ranks"]))["machine"],
            },
        )
    if args.plot:
        (plot_buckets if sweep else plot_train)(args.plot, points)
    return ExitStatus.OK


# -- topo ---------------------------------------------------------------------------------


def topology_dot(topo: Topology, tree: Tree) -> str:
    """Graphviz: every link labelled with its kind; the tree's edges bold, pointing from
    parent to child."""
    tree_edges = {(p, c): lvl for p, c, lvl in tree.edges}
    names = topo.names
    lines = ["digraph topology {", "  node [shape=box];", "  edge [arrowhead=none];"]
    for i, name in enumerate(names):
        root = ", style=bold" if i == tree.root else ""
        lines.append(f'  n{i} [label="{name}\\nrank {i}"{root}];')
    for i in range(topo.n):
        for j in range(i + 1, topo.n):
            link = topo.link(i, j)
            label = link.token + ("" if link.p2p else " (no p2p)")
            edge = next(((p, c) for p, c in ((i, j), (j, i)) if (p, c) in tree_edges), None)
            if edge:
                p, c = edge
                lines.append(
                    f'  n{p} -> n{c} [label="{label}, level {tree_edges[edge]}", '
                    'penwidth=3, color="firebrick", arrowhead=normal];'
                )
            else:
                lines.append(
                    f'  n{i} -> n{j} [label="{label}", color="gray60", fontcolor="gray40"];'
                )
    lines.append("}")
    return "\n".join(lines) + "\n"


def resolve_topology(args: argparse.Namespace) -> tuple[Topology, str, Tree]:
    """(topology, where it came from, its tree) for the topo flags."""
    from ..topology import Topology
    from ..tree import build_tree

    if args.dot:
        check_output("--dot", args.dot)
    if args.json:
        check_output("--json", args.json)
    if args.preset:
        from ._simulate import check_flat_preset

        check_flat_preset(args.preset, "--preset")
        topo, where = Topology.preset(args.preset), f"preset {args.preset}"
    elif args.smi:
        with open(args.smi, encoding="utf-8") as f:
            topo, where = Topology.from_smi(f.read()), f"parsed from {args.smi}"
    else:
        with open_devices(args.devices) as devs:
            topo, where = Topology.detect(devs), f"detected on {args.devices}"
    if args.root is not None and not 0 <= args.root < topo.n:
        raise UsageError(f"--root must be a rank in [0, {topo.n}), got {args.root}")
    return topo, where, build_tree(topo, root=args.root)


def run_topo(topo: Topology, where: str, tree: Tree, args: argparse.Namespace, out: TextIO) -> int:
    print(f"# topology ({where}, {topo.n} devices)", file=out)
    print(str(topo), file=out)
    print("", file=out)
    rates = [[topo.link(i, j).gbps for j in range(topo.n)] for i in range(topo.n)]
    if any(r is not None for row in rates for r in row):
        print("Link rates (GB/s per direction; -: none known, the simulator's device model "
              "decides):", file=out)  # fmt: skip
        width = max(6, *(len(x) for x in topo.names)) + 2
        print(" " * width + "".join(x.ljust(width) for x in topo.names).rstrip(), file=out)
        for i, (name, row) in enumerate(zip(topo.names, rates, strict=True)):
            cells = [" X" if i == j else "-" if r is None else f"{r:g}" for j, r in enumerate(row)]
            print(name.ljust(width) + "".join(c.ljust(width) for c in cells).rstrip(), file=out)
        print("", file=out)
    print(str(tree), file=out, flush=True)
    if args.dot:
        with write_output(args.dot) as f:
            f.write(topology_dot(topo, tree))
    if args.json:
        with write_output(args.json) as f:
            f.write(topo.to_json() + "\n")
    return ExitStatus.OK


# -- parser and entry point ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(
        "nccltree-bench", "Collective and training benchmarks, and the topology the tree uses."
    )
    sub = p.add_subparsers(dest="command", metavar="{collectives,train,topo,simulate,calibrate}")
    sub.required = True
    d = COLLECTIVE_DEFAULTS
    c = sub.add_parser(
        "collectives",
        help="nccl-tests style bandwidth sweep of collectives",
        description="Time collectives over a size sweep and check every result. Figures "
        "mean what nccl-tests' mean: algbw = size / time, busbw = algbw x 2(n-1)/n "
        "(all_reduce), (n-1)/n (all_gather, reduce_scatter, gather, scatter, all_to_all), "
        "1 (broadcast, reduce, sendrecv); "
        f"GB = 1e9 bytes. Exit status {int(ExitStatus.WRONG)} if any element was wrong. "
        "A sweep whose largest sizes do not fit in memory stops at the largest that "
        "does, and says so.",
    )
    c.add_argument(
        "--devices",
        default=d["devices"],
        help='device spec: "cpu:N", "gpu:0,1", "gpu:all" or "auto" (default: auto, or '
        "what -g asks for)",
    )
    c.add_argument(
        "-g",
        "--ngpus",
        type=int_at_least(1),
        default=d["ngpus"],
        help="local ranks per process, as nccl-tests' devices per process: with one "
        "process, the first N devices of the default kind (GPUs if there are any, else N "
        "virtual CPU devices); with --devices, an error unless the counts agree",
    )
    c.add_argument(
        "-t",
        "--nthreads",
        type=int_at_least(1),
        default=d["nthreads"],
        help="nccl-tests' threads per process, each driving -g devices: mapped to -t x -g "
        "local ranks, since every rank here already runs on its own thread (default 1)",
    )
    c.add_argument(
        "--algorithm",
        default=d["algorithm"],
        help="comma-separated algorithms compared side by side: tree, ring, "
        "direct, nccl, auto; in a job of several processes: tree, ring, direct, auto "
        "and, under mpiexec, mpi (MPI's own collectives, a peer line; left out with a "
        "note in a job started without MPI) (default: %(default)s)",
    )
    c.add_argument(
        "--mpi",
        action="store_true",
        help="MPI mode (a job of several processes) even where no launcher variable says "
        "so. Under mpiexec (PMI_SIZE, OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_SIZE, or "
        "SLURM_NTASKS with PMIX_RANK), nccltree-run or torchrun (WORLD_SIZE) and srun "
        "(SLURM_STEP_NUM_TASKS with SLURM_PROCID), above 1, it is on by itself: every "
        "process is part of one process group, -g N gives "
        "each N host ranks (--devices cpu or cpu:N), and global rank 0 prints one table, "
        "as nccl-tests' MPI mode: each rank times its calls, the time shown is the slowest "
        "rank's (-a), and #wrong sums every rank's",
    )
    c.add_argument(
        "--collective",
        default=d["collective"],
        help="comma-separated: all_reduce, broadcast, reduce, all_gather, "
        "reduce_scatter, gather, scatter, all_to_all, sendrecv (allreduce, allgather, "
        "reducescatter, alltoall too; default: %(default)s)",
    )
    c.add_argument(
        "-b",
        "--minbytes",
        default=d["minbytes"],
        help="smallest size, bytes with K/M/G suffixes (default: %(default)s)",
    )
    c.add_argument(
        "-e", "--maxbytes", default=d["maxbytes"], help="largest size (default: %(default)s)"
    )
    step = c.add_mutually_exclusive_group()
    step.add_argument(
        "-i",
        "--stepbytes",
        default=d["stepbytes"],
        help="add this many bytes between steps instead of multiplying (K/M/G suffixes; "
        "exclusive with -f, as in nccl-tests)",
    )
    step.add_argument(
        "-f",
        "--stepfactor",
        type=float,
        default=d["stepfactor"],
        help="multiply the size by this between steps, > 1 (default: %(default)g)",
    )
    c.add_argument(
        "-n",
        "--iters",
        type=int_at_least(1),
        default=d["iters"],
        help="timed iterations per size; the median is reported (default: %(default)s)",
    )
    c.add_argument(
        "-w",
        "--warmup-iters",
        "--warmup_iters",
        dest="warmup",
        type=int_at_least(0),
        default=d["warmup"],
        help="untimed iterations before timing (default: %(default)s)",
    )
    c.add_argument(
        "-c",
        "--check",
        type=int_at_least(0),
        default=d["check"],
        help="check runs per size on fresh data, counted in #wrong; 0 turns the "
        "check off (default: %(default)s)",
    )
    c.add_argument(
        "-o",
        "--op",
        default=d["op"],
        help="reduction op: sum, mean (avg), max, min, prod; comma-separated, or all "
        "(every op; with integer dtypes mean is left out) (default: %(default)s)",
    )
    c.add_argument(
        "-d",
        "--dtype",
        "--datatype",
        default=d["dtype"],
        help="float16, float32, float64, int32, int64, bfloat16, int8, uint8 (half, "
        "float, double, int too); comma-separated, or all (every dtype) (default: %(default)s)",
    )
    c.add_argument(
        "-a",
        "--average",
        type=int,
        choices=sorted(AVERAGE_MODES),
        default=d["average"],
        help="how the ranks' times of a call make one, as nccl-tests: 0 rank 0's, 1 the "
        "mean, 2 the fastest, 3 the slowest (default: %(default)s; on the host backend "
        "every rank has the same time)",
    )
    c.add_argument(
        "-N",
        "--run_cycles",
        "--run-cycles",
        dest="cycles",
        type=int_at_least(1),
        default=d["cycles"],
        help="run the whole sweep this many times (nccl-tests' 0, forever, is not "
        "offered; default: %(default)s)",
    )
    c.add_argument(
        "-z",
        "--blocking",
        type=int,
        choices=(0, 1),
        default=d["blocking"],
        help="accepted for nccl-tests command lines: every call here is blocking (it "
        "returns when every rank's result is in place), so 0 and 1 time the same",
    )
    c.add_argument(
        "-T",
        "--timeout",
        type=float,
        default=d["timeout"],
        help="seconds a call may take before the run fails (default: %(default)g)",
    )
    for flags, off, why in REFUSED:
        c.add_argument(
            *flags,
            dest=flags[1].lstrip("-"),
            metavar="N",
            default=None,
            help=f"nccl-tests' flag, accepted only as {off}: {why}",
        )
    c.add_argument(
        "-r",
        "--root",
        type=int,
        default=d["root"],
        help="root rank of reduce and broadcast (default: %(default)s)",
    )
    c.add_argument("--json", metavar="FILE", help="write every record as JSON")
    c.add_argument("--csv", metavar="FILE", help="write every record as CSV")
    c.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw busbw against size, a line per algorithm (needs matplotlib)",
    )
    c.add_argument(
        "--trace",
        metavar="FILE.json",
        help="after the sweep, perform one call of the first collective at the largest "
        "size with each algorithm step by step, timing every step, and write a Chrome "
        "trace (chrome://tracing or ui.perfetto.dev: a process per algorithm, a lane per "
        "rank; on the host backend the steps run one after another in plan order)",
    )
    c.add_argument(
        "--quiet",
        action="store_true",
        help="print no table or progress (for scripts; needs --json, --csv or --plot)",
    )

    t = sub.add_parser(
        "train",
        help="examples/s of the reference trainer over device sets",
        description="Train the reference model on each device set and report examples/s, "
        "speedup and efficiency over the first set, and the fraction of step time spent "
        "in communication.",
    )
    t.add_argument(
        "--devices",
        nargs="+",
        default=["cpu:1", "cpu:2"],
        help="device sets, space-separated, e.g. cpu:1 cpu:2 or gpu:0 gpu:0,1 "
        "(default: %(default)s)",
    )
    t.add_argument(
        "--scaling",
        nargs="+",
        choices=("weak", "strong"),
        default=["weak"],
        help="weak: --batch-size per rank; strong: global, split across ranks "
        "(one or both; default: weak)",
    )
    t.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="batch size (per rank or global, see --scaling; default: %(default)s)",
    )
    t.add_argument("--model", default="mlp", help="softmax, mlp, cnn (default: %(default)s)")
    t.add_argument(
        "--hidden",
        default="512,512",
        help="mlp hidden layer widths, comma-separated (default: %(default)s)",
    )
    t.add_argument(
        "--algorithm",
        default="tree",
        help="collective algorithm: tree, ring, direct, nccl, auto; in a job of several "
        "processes tree, ring, direct, auto, and mpi under mpiexec (default: %(default)s)",
    )
    t.add_argument(
        "--mpi",
        action="store_true",
        help="MPI mode (a job of several processes) even where no launcher variable says "
        "so (under mpiexec, nccltree-run, torchrun or srun it is on by itself): each "
        "--devices set (cpu or cpu:N) is every process's, the ranks of all processes "
        "train together, and global rank 0 reports",
    )
    t.add_argument(
        "--blas-threads",
        type=_blas_threads,
        default=1,
        help="BLAS threads per rank, or 'auto' for the trainer's default (cores // "
        "ranks). Default 1, so every device set gets the same per-rank compute "
        "and the speedups compare like with like (on a 2-core machine two BLAS "
        "threads on small matrices make 1 rank several times slower)",
    )
    t.add_argument(
        "--iters",
        type=int,
        default=30,
        help="timed iterations per device set (default: %(default)s)",
    )
    t.add_argument(
        "-w",
        "--warmup-iters",
        dest="warmup",
        type=int,
        default=5,
        help="untimed iterations first (default: %(default)s)",
    )
    t.add_argument(
        "--bucket-mb",
        nargs="+",
        type=float,
        default=[0.0],
        metavar="X",
        help="gradient bucket sizes to compare, in MiB (0: one all-reduce after backward), "
        "e.g. 0 1 4 16; with more than one, the table reports per size the step time, the "
        "communication share, the exposed communication (from the end of backward to the "
        "update, per step) and the overlap (the share of the size-0 run's exposed "
        "communication hidden behind backward), and --plot draws step time against bucket "
        "size (default: 0)",
    )
    t.add_argument(
        "--comm-hook",
        choices=["float16"],
        help="float16: the gradients travel as float16, the update stays float32 (default: none)",
    )
    t.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the whole sweep this many times, interleaved, and report the median of "
        "each figure (default: %(default)s)",
    )
    t.add_argument("--data", metavar="DB", help="an LMDB to train on (default: a synthetic task)")
    t.add_argument(
        "--records",
        type=int,
        default=4096,
        help="records of the synthetic task (default: %(default)s)",
    )
    t.add_argument(
        "--features",
        type=int,
        default=256,
        help="features per record of the synthetic task (default: %(default)s)",
    )
    t.add_argument("--json", metavar="FILE", help="write the results as JSON")
    t.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw examples/s and efficiency against device count (with several --bucket-mb: "
        "step time and exposed communication against bucket size)",
    )
    t.add_argument(
        "--quiet", action="store_true", help="print no table or progress (needs --json or --plot)"
    )

    g = sub.add_parser(
        "topo",
        help="the topology matrix and the tree built from it",
        description="Print the detected topology (or a preset, or one "
        "parsed from `nvidia-smi topo -m` output) and the tree build_tree "
        "makes of it.",
    )
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--devices",
        default="auto",
        help="detect the topology of these devices (default: %(default)s)",
    )
    src.add_argument(
        "--preset",
        metavar="NAME",
        help="a built-in topology: dgx1, nvswitch8, k80x4, pcie2s8, flat:N",
    )
    src.add_argument("--smi", metavar="FILE", help="a saved `nvidia-smi topo -m` output")
    g.add_argument("--root", type=int, default=None, help="root the tree at this rank")
    g.add_argument("--dot", metavar="FILE", help="also write the graph as Graphviz dot")
    g.add_argument(
        "--json",
        metavar="FILE",
        help="also write the topology as JSON (Topology.to_json: link kinds, peer access "
        "and the link rates detection read from NVML), for `simulate --topo FILE`",
    )
    from ._simulate import add_parser as add_simulate

    add_simulate(sub)
    return p


def _blas_threads(text: str) -> int | None:
    """``--blas-threads``: a positive count, or ``auto`` (None: the trainer's default)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a thread count or 'auto', got {text!r}"
        ) from None


def main(argv: list[str] | None = None, *, world_factory: drv.WorldFactory | None = None) -> int:
    """Entry point of ``nccltree-bench``; returns the exit status.

    ``world_factory(devices, algorithm)`` replaces how the collectives benchmark makes
    the World of each algorithm (tests inject a deliberately broken one).
    """

    def body(args: argparse.Namespace) -> int:
        if args.command == "simulate":
            from ._simulate import run_simulate

            with checking():
                return run_simulate(args, sys.stdout)
        if args.command == "calibrate":
            from ._simulate import run_calibrate

            with checking():
                return run_calibrate(args, sys.stdout)
        if args.command != "topo" and (args.mpi or job_size() > 1):
            return _in_job(args)
        # first every flag is checked (and Worlds created): errors here run nothing
        with checking():
            if args.command == "collectives":
                bench = make_benchmark(args, world_factory)
                try:
                    memory = fit_sweep(bench, args, sys.stderr)
                except BaseException:
                    bench.close()
                    raise
            elif args.command == "train":
                check_train_args(args)
            else:
                topo, where, tree = resolve_topology(args)
        if args.command == "collectives":
            with bench:
                return run_collectives(bench, args, sys.stdout, sys.stderr, memory)
        if args.command == "train":
            return run_train(args, sys.stdout, sys.stderr)
        return run_topo(topo, where, tree, args, sys.stdout)

    return run_main(build_parser(), argv, body, prog=lambda a: f"nccltree-bench {a.command}")


def _in_job(args: argparse.Namespace) -> int:
    """``collectives`` or ``train`` as one process of a job (mpiexec, nccltree-run,
    torchrun's or srun's variables): a process group over every process, started as the
    environment shows; global rank 0 prints and writes the outputs."""
    with contextlib.ExitStack() as stack:
        with checking():
            if args.command == "collectives":
                if args.trace:
                    raise UsageError("--trace runs in one process, not in a job of several")
                _leave_out_mpi(args)
                spec = mpi_devices(args)
                first = _split(args.algorithm)[:1] or ["auto"]
                group = stack.enter_context(open_group(spec, first[0], args.timeout))
                bench = stack.enter_context(make_benchmark(args, group=group, devices=spec))
            else:
                check_train_args(args, mpi=True)
        if args.command == "train":
            return run_train(args, sys.stdout, sys.stderr, mpi=True)
        if group.rank != 0:  # one table, from global rank 0
            args.quiet, args.json, args.csv, args.plot = True, None, None, None
        # no memory fitting: every process must run the same sweep
        return run_collectives(bench, args, sys.stdout, sys.stderr, {})


def _leave_out_mpi(args: argparse.Namespace) -> None:
    """In a job started without MPI (nccltree-run, torchrun's or srun's variables),
    ``--algorithm mpi`` (MPI's own collectives, the peer line) cannot run: it is left out
    of the comparison with a note on stderr from the job's first process (a usage error
    when it was the only one)."""
    algorithms = _split(args.algorithm)
    if "mpi" not in algorithms or over_mpi():
        return
    rest = [a for a in algorithms if a != "mpi"]
    if not rest:
        raise UsageError(
            "--algorithm mpi runs MPI's own collectives, and this job was not started by an "
            "MPI launcher (mpiexec): use tree, ring, direct or auto"
        )
    if job_rank() == 0 and not args.quiet:
        print(
            "nccltree-bench collectives: note: --algorithm mpi left out (MPI's own "
            "collectives need a job started by mpiexec; this one started without MPI)",
            file=sys.stderr,
            flush=True,
        )
    args.algorithm = ",".join(rest)


if __name__ == "__main__":
    sys.exit(main())
