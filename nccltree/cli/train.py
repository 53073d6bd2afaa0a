"""``nccltree-train``: data-parallel training of a reference model on N devices.

With no arguments it trains an MLP on a built-in synthetic task on the default devices
(every GPU, else two virtual CPU devices) and reports the held-out accuracy it reached.
The work is done by :class:`nccltree.parallel.DataParallel`, set up by
:func:`nccltree.cli._training.build_training`; this module parses, prepares the data,
and prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

import numpy as np

from .._validate import check_call_timeout, check_int, check_real
from ..parallel import COMM_HOOKS
from ..snapshot import (
    history,
    history_name,
    load_snapshot,
    load_weights,
    point_latest,
    prune_history,
    save_arrays,
)
from ._common import (
    EXIT_STATUS_EPILOG,
    ExitStatus,
    Parser,
    Progress,
    RuntimeFailure,
    UsageError,
    checking,
    job_processes,
    job_size,
    make_parser,
    open_devices,
    report_error,
    run_body,
    run_main,
)
from ._training import (
    DriverConfig,
    SolverConfig,
    Training,
    TransformConfig,
    bucket_bytes,
    build_training,
    group_devices,
    make_model,
    open_group,
)

if TYPE_CHECKING:
    from ..comm.group import ProcessGroup
    from ..parallel import DataParallel, FitResult, StepInfo
    from ..params import FlatParams
    from ..snapshot import Snapshot
    from ..solver_file import SolverFile

PROG = "nccltree-train"
# The built-in task: nccltree.data.synthetic's defaults, a held-out quarter, and the
# accuracy the default MLP is expected to pass (its docstring measures about 94%).
SYNTHETIC_FEATURES = 64
SYNTHETIC_CLASSES = 10
SYNTHETIC_TARGET = 90.0
SNAPSHOT_NAME = "snapshot.npz"
FINAL_NAME = "final.npz"
METRICS_NAME = "metrics.jsonl"
# What makes a --out directory hold a run (the built-in data cache alone does not).
RUN_FILES = (METRICS_NAME, FINAL_NAME, SNAPSHOT_NAME)
# SIGTERM (what Slurm, Kubernetes and systemd send first) ends a run as Ctrl-C does
TERMINATED = ExitStatus.TERMINATED
EPILOG = (
    EXIT_STATUS_EPILOG
    + " On Ctrl-C or SIGTERM the iteration reached is snapshotted in --out. Caffe's -solver "
    "FILE is taken as --solver FILE; its -gpu, -weights, -snapshot and -model are answered "
    "with the flags to use instead (status 2). In a job of several processes (mpiexec -n P "
    "nccltree-train ..., nccltree-run --nproc-per-node P --no-python nccltree-train ..., "
    "torchrun's variables, an srun step; detected from PMI_SIZE, OMPI_COMM_WORLD_SIZE, "
    "MV2_COMM_WORLD_SIZE, or SLURM_NTASKS with PMIX_RANK, else WORLD_SIZE, else "
    "SLURM_STEP_NUM_TASKS with SLURM_PROCID, when above 1; or forced with --mpi) the "
    "processes form one process group, over MPI under mpiexec and through a start-up "
    "store otherwise: --devices cpu (one rank "
    "each, the default) or cpu:N (N ranks each), global rank 0 prints and writes --out, each "
    "process reads only its own ranks' records, and the result is that of one process with "
    "the same total ranks. SIGTERM or SIGINT to the processes stops every rank after the "
    "same iteration, snapshotted by rank 0."
)

# The built-in data cache's temporaries: the writer's process id after the prefix.
_CACHE_TMP = re.compile(r"^\.tmp-(?:(?P<pid>\d+)-)?")


def _default_solver() -> SolverConfig:
    return SolverConfig(lr=0.05, momentum=0.9, weight_decay=5e-4)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run is made of, as the flags name it (``--batch-size`` is
    ``batch_size``; the solver's flags are ``solver``'s fields). A snapshot stores it
    flat (:meth:`as_dict`), so a resumed run takes the flags not given on its command line
    from the run it continues.

    The defaults live here rather than in argparse, so that a resumed run can tell the
    flags given on its command line (they win) from those it takes from the snapshot.
    """

    devices: str = "auto"
    data: str | None = None
    val_data: str | None = None
    synthetic: int = 8192
    classes: int | None = None
    scale: float | None = None
    decode: str | None = None  # encoded Datum images: None (as stored), "color" or "gray"
    mean: tuple[float, ...] | str | None = None  # a value per channel, or a mean file
    crop: int | None = None
    mirror: bool = False
    model: str = "mlp"
    hidden: tuple[int, ...] = (256,)
    batch_size: int = 32
    scaling: str = "weak"
    iters: int = 500
    solver: SolverConfig = field(default_factory=_default_solver)
    algorithm: str = "tree"
    update_mode: str = "allreduce"
    bucket_mb: float = 0.0  # gradient buckets of this many MiB during backward; 0: none
    comm_hook: str | None = None  # "float16": the gradients travel as float16
    seed: int = 0
    shuffle: bool = False
    out: str | None = None
    eval_every: int = 100
    snapshot_every: int = 0
    timeout: float = 60.0
    blas_threads: int | None = None
    weights: str | None = None  # a fine-tuning's start: a final.npz or a snapshot
    snapshot_keep: int = 0  # snapshots kept by iteration besides snapshot.npz
    iter_size: int = 1  # Caffe's iter_size: batches whose gradients one iteration sums
    display: int = 0  # a progress line every K iterations (0: every tenth of the run)

    def as_dict(self) -> dict[str, object]:
        """The configuration, flat, as JSON takes it (the snapshot's and metrics.jsonl's
        record): a key per flag."""
        flat: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            parts = dataclasses.asdict(value) if f.name == "solver" else {f.name: value}
            flat.update({k: list(v) if isinstance(v, tuple) else v for k, v in parts.items()})
        return flat

    @classmethod
    def checked(cls, values: Mapping[str, object]) -> TrainConfig:
        """The configuration of ``values`` (flat, as :meth:`as_dict`; a missing or None
        value takes the default), checked by the one argument rule (``nccltree._validate``):
        argparse's ``float`` takes "nan" and "inf", a snapshot may hold anything."""
        defaults = cls().as_dict()

        def get(name: str) -> object:
            value = values.get(name)
            return defaults[name] if value is None else value

        def opt_int(name: str, low: int | None = None) -> int | None:
            value = get(name)
            return None if value is None else check_int(value, _flag(name), min=low)

        def opt_real(name: str) -> float | None:
            # their ranges are the solver's and the reader's to judge
            value = get(name)
            return None if value is None else check_real(value, _flag(name))

        ints = {
            "synthetic": 1,
            "batch_size": 1,
            "iters": 0,
            "eval_every": 0,
            "snapshot_every": 0,
            "snapshot_keep": 0,
            "iter_size": 1,
            "display": 0,
        }
        counts = {k: check_int(get(k), _flag(k), min=low) for k, low in ints.items()}
        classes, blas_threads = opt_int("classes", 2), opt_int("blas_threads", 1)
        seed = check_int(get("seed"), "--seed", min=0)
        bucket_mb = check_real(get("bucket_mb"), "--bucket-mb", min=0.0)
        comm_hook = get("comm_hook")
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise ValueError(
                f"--comm-hook must be one of {', '.join(COMM_HOOKS)}; got {comm_hook!r}"
            )
        timeout = check_call_timeout(get("timeout"), "--timeout")
        lr, momentum, weight_decay = (
            check_real(get(k), _flag(k)) for k in ("lr", "momentum", "weight_decay")
        )
        if comm_hook == "float16" and get("algorithm") == "mpi":
            raise ValueError(
                "--comm-hook float16 cannot go with --algorithm mpi: MPI has no float16 type "
                "to sum the gradients in; use --algorithm tree, ring, direct or auto"
            )
        scale, gamma, power = opt_real("scale"), opt_real("gamma"), opt_real("power")
        out, weights = get("out"), get("weights")
        if out is not None and not str(out).strip():
            # abspath("") is the current directory: an empty value is a mistake
            raise ValueError("--out: an empty path; name a directory (e.g. --out run)")
        if counts["snapshot_every"] and not out:
            raise ValueError("--snapshot-every needs --out DIR (where snapshot.npz goes)")
        hidden = _int_tuple(get("hidden"), "--hidden")
        stepvalue = get("stepvalue")
        solver = SolverConfig(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            lr_policy=str(get("lr_policy")),
            gamma=gamma,
            power=power,
            stepsize=opt_int("stepsize"),
            stepvalue=None if stepvalue is None else _int_tuple(stepvalue, "--stepvalue"),
            max_iter=opt_int("max_iter"),
            clip_gradients=_clip(get("clip_gradients")),
        )
        data, val_data = (_database(get(k), _flag(k)) for k in ("data", "val_data"))
        return cls(
            devices=str(get("devices")),
            data=data,
            val_data=val_data,
            classes=classes,
            scale=scale,
            decode=_decode(get("decode")),
            mean=_mean(get("mean")),
            crop=opt_int("crop", 1),
            mirror=bool(get("mirror")),
            model=str(get("model")),
            hidden=hidden,
            scaling=str(get("scaling")),
            solver=solver,
            algorithm=str(get("algorithm")),
            update_mode=str(get("update_mode")),
            bucket_mb=bucket_mb,
            comm_hook=None if comm_hook is None else str(comm_hook),
            seed=seed,
            shuffle=bool(get("shuffle")),
            out=None if out is None else os.path.abspath(str(out)),
            timeout=timeout,
            blas_threads=blas_threads,
            weights=None if weights is None else os.path.abspath(str(weights)),
            **counts,
        )

    def transform(self) -> TransformConfig:
        """The readers' mean, crop and mirror (random draws seeded by ``--seed``)."""
        mean: np.ndarray | tuple[float, ...] | float | None
        if isinstance(self.mean, str):
            mean = load_mean(self.mean)
        elif self.mean is not None and len(self.mean) == 1:
            mean = self.mean[0]  # one value for every channel, as Caffe's mean_value
        else:
            mean = self.mean
        return TransformConfig(mean=mean, crop=self.crop, mirror=self.mirror, seed=self.seed)

    def driver(self) -> DriverConfig:
        """What :func:`build_training` needs of it."""
        return DriverConfig(
            devices=self.devices,
            model=self.model,
            batch_size=self.batch_size,
            hidden=self.hidden,
            scaling=self.scaling,
            algorithm=self.algorithm,
            update_mode=self.update_mode,
            bucket_bytes=bucket_bytes(self.bucket_mb),
            comm_hook=self.comm_hook,
            seed=self.seed,
            timeout=self.timeout,
            blas_threads=self.blas_threads,
            solver=self.solver,
            iter_size=self.iter_size,
        )


def _clip(value: object) -> float | None:
    """``--clip-gradients``: an L2 norm >= 0, or None (off; a negative value is off too,
    as Caffe's default -1)."""
    if value is None:
        return None
    clip = check_real(value, "--clip-gradients")
    return None if clip < 0 else clip


def _database(path: object, flag: str) -> str | None:
    """A database flag's path, made absolute; a usage error if there is nothing there."""
    if path is None:
        return None
    if not os.path.exists(str(path)):
        raise ValueError(f"{flag}: no database at {path}")
    return os.path.abspath(str(path))


def _mean(value: object) -> tuple[float, ...] | str | None:
    """``--mean``: comma-separated values (one per channel) or a mean file's path (made
    absolute); a list of values from a snapshot's config."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(check_real(v, "--mean") for v in value)
    text = str(value)
    try:
        return tuple(check_real(float(v), "--mean") for v in text.split(","))
    except ValueError:
        pass
    if not os.path.isfile(text):
        raise ValueError(
            f"--mean: {text!r} is neither comma-separated numbers (one per channel) nor a "
            "mean file (.npy, .npz holding one array, or a Caffe .binaryproto)"
        )
    load_mean(os.path.abspath(text))  # a usage error now rather than at the first batch
    return os.path.abspath(text)


def load_mean(path: str) -> np.ndarray:
    """The array of a mean file: a .npy, a .npz holding one array (or one named
    ``mean``), or a Caffe ``BlobProto`` (``mean.binaryproto``; its leading ``num`` of 1
    dropped, so a 1 x C x H x W mean is C x H x W); a ValueError naming ``--mean``
    otherwise."""
    from ..data.blobproto import read_blobproto

    try:
        with open(path, "rb") as f:
            head = f.read(6)
        if head != b"\x93NUMPY" and head[:2] != b"PK":  # neither .npy nor .npz: a BlobProto
            z = read_blobproto(path)
            return z[0] if z.ndim == 4 and z.shape[0] == 1 else z
        with open(path, "rb") as f:
            z = np.load(f, allow_pickle=False)
            if isinstance(z, np.lib.npyio.NpzFile):
                names = z.files
                name = "mean" if "mean" in names else names[0] if len(names) == 1 else None
                if name is None:
                    raise ValueError(f"it holds {len(names)} arrays and none named 'mean'")
                z = z[name]
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"--mean: cannot read a mean array from {path}: {exc}") from None
    if z.dtype.kind not in "fiu":
        raise ValueError(f"--mean: {path} holds {z.dtype} values, not numbers")
    return np.asarray(z)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    """Comma-separated integers (a flag) or a sequence of them (a snapshot's config)."""
    if not isinstance(value, str):
        if isinstance(value, (list, tuple)):
            return tuple(check_int(v, what) for v in value)
        raise TypeError(f"{what} must list integers, got {value!r}")
    try:
        values = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {value!r}") from None
    if not values:
        raise ValueError(f"{what} must list at least one integer")
    return values


def _d(key: str) -> str:
    """A flag's default as its help shows it."""
    value = TrainConfig().as_dict()[key]
    if value is None:
        return "none"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(
        "nccltree-train",
        (
            "Data-parallel SGD of a reference model on N devices, synchronised by nccltree "
            "collectives. With no arguments: an MLP on a built-in synthetic task (no download), "
            "on every GPU or else two virtual CPU devices, reporting the held-out accuracy."
        ),
        EPILOG,
    )
    g = p.add_argument_group("devices and communication")
    g.add_argument(
        "--devices",
        metavar="SPEC",
        help='"cpu:N" (N virtual CPU devices), "gpu:0,1", "gpu:all", or "auto" '
        f"(every GPU, else cpu:2) (default: {_d('devices')})",
    )
    g.add_argument(
        "--mpi",
        action="store_true",
        help="run as one process of a job of several processes even where no launcher "
        "variable says so (they are read otherwise, above 1 meaning a job: an MPI "
        "launcher's PMI_SIZE, OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_SIZE or SLURM_NTASKS "
        "with PMIX_RANK; torchrun's and nccltree-run's WORLD_SIZE; an srun step's "
        "SLURM_STEP_NUM_TASKS with SLURM_PROCID); the processes meet as the environment "
        "shows, over MPI where no launcher's variables say otherwise",
    )
    g.add_argument(
        "--algorithm",
        choices=["tree", "ring", "direct", "nccl", "mpi", "auto"],
        help="collective algorithm (nccl: GPUs in one process; mpi: MPI's own collectives, "
        f"under MPI only) (default: {_d('algorithm')})",
    )
    g.add_argument(
        "--update-mode",
        choices=["allreduce", "root"],
        help="allreduce: every rank averages the gradients and updates; root: "
        "gradients are summed at rank 0, which updates and broadcasts the "
        f"parameters (Caffe's P2PSync). Same result. (default: {_d('update_mode')})",
    )
    g.add_argument(
        "--bucket-mb",
        type=float,
        metavar="X",
        help="communicate the gradients in buckets of about X MiB while the backward pass "
        "still runs, each as soon as backward has written it (as PyTorch DDP's "
        "bucket_cap_mb); 0: one collective over every gradient after backward. Bitwise "
        "the same parameters with tree and direct, within rounding with ring "
        f"(default: {_d('bucket_mb')})",
    )
    g.add_argument(
        "--comm-hook",
        choices=COMM_HOOKS,
        help="float16: the gradients travel as float16 (half the bytes) and the update "
        "stays float32; changes the result by float16 rounding (default: none)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds a rank may wait in a collective before the run fails "
        f"(default: {_d('timeout')})",
    )
    g.add_argument(
        "--blas-threads",
        type=int,
        metavar="N",
        help="BLAS threads while training (needs threadpoolctl; "
        "default: cores // ranks, at least 1)",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="DB",
        help="training LMDB (nccltree records or Caffe Datum); default: the "
        "built-in synthetic task",
    )
    g.add_argument(
        "--val-data",
        metavar="DB",
        help="held-out LMDB for evaluation (default: the synthetic task's held-out "
        "split with the built-in data, none with --data)",
    )
    g.add_argument(
        "--synthetic",
        type=int,
        metavar="N",
        help="training records of the built-in task; the held-out set is a "
        f"quarter of that (default: {_d('synthetic')})",
    )
    g.add_argument(
        "--classes",
        type=int,
        metavar="K",
        help="number of classes (default: the largest label in --data plus one)",
    )
    g.add_argument(
        "--scale",
        type=float,
        metavar="S",
        help="multiply inputs by S as they are read, as Caffe's transform_param "
        "scale (e.g. 0.00390625 for uint8 images) (default: none)",
    )
    force = g.add_mutually_exclusive_group()
    force.add_argument(
        "--force-color",
        dest="decode",
        action="store_const",
        const="color",
        help="decode encoded Datum images as 3 channels (BGR), as Caffe's force_color "
        "(default: each image as stored, e.g. 4 channels for an RGBA PNG)",
    )
    force.add_argument(
        "--force-gray",
        dest="decode",
        action="store_const",
        const="gray",
        help="decode encoded Datum images as 1 channel, as Caffe's force_gray",
    )
    g.add_argument(
        "--mean",
        metavar="V[,V...]|FILE",
        help="subtract a mean from inputs as they are read, before the crop, as Caffe's "
        "transform_param mean_value (one value per channel, e.g. 104,117,123, or one for "
        "all) or mean_file "
        "(an .npy, an .npz of one array, or Caffe's mean.binaryproto as compute_image_mean "
        "and nccltree-data mean write it, of the record shape) (default: none)",
    )
    g.add_argument(
        "--crop",
        type=int,
        metavar="N",
        help="train on random N x N windows of (C, H, W) records and evaluate on the "
        "center one, as Caffe's crop_size; the model's input is (C, N, N) (default: none)",
    )
    g.add_argument(
        "--mirror",
        action="store_true",
        default=None,
        help="flip training records horizontally at random (seeded by --seed, per "
        "record position), as Caffe's mirror; evaluation never flips",
    )
    g.add_argument(
        "--shuffle",
        action="store_true",
        default=None,
        help="visit records in a seeded random order per epoch (seed from --seed) "
        "instead of key order",
    )

    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        choices=["softmax", "mlp", "cnn"],
        help=f"softmax regression, MLP or a small CNN (default: {_d('model')})",
    )
    g.add_argument(
        "--hidden", metavar="N[,N...]", help=f"MLP hidden layer sizes (default: {_d('hidden')})"
    )
    g.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help=f"seed of the parameter initialisation and of --shuffle (default: {_d('seed')})",
    )
    g.add_argument(
        "--weights",
        metavar="FILE",
        help="start from these parameters instead of the seeded initialisation (Caffe's "
        "-weights, fine-tuning): a final.npz or a snapshot, whose names and shapes must fit "
        "the model; the solver and the data start afresh, unlike --resume",
    )

    g = p.add_argument_group("solver")
    g.add_argument(
        "--solver",
        metavar="FILE",
        help="read the solver settings from a Caffe solver file (solver.prototxt; Caffe's "
        "-solver is accepted too): base_lr, lr_policy, gamma, stepsize, stepvalue, power, "
        "momentum, weight_decay, max_iter (--iters), snapshot (--snapshot-every), "
        "snapshot_prefix (--out), test_interval (--eval-every), display, random_seed "
        "(--seed), iter_size, clip_gradients; flags given beside it win; net, solver_mode "
        "and the like are reported and not used (needs protobuf: the caffe extra)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help=f"batch size, per rank or global, see --scaling (default: {_d('batch_size')})",
    )
    g.add_argument(
        "--scaling",
        choices=["weak", "strong"],
        help="weak: --batch-size per rank, effective batch N x B (Caffe's -gpu); "
        "strong: --batch-size is the global batch, split evenly across ranks "
        f"(default: {_d('scaling')})",
    )
    g.add_argument(
        "--iters",
        type=int,
        metavar="N",
        help="iterations to train in all (a resumed run continues up to N) "
        f"(default: {_d('iters')})",
    )
    g.add_argument("--lr", type=float, help=f"base learning rate (default: {_d('lr')})")
    g.add_argument("--momentum", type=float, help=f"momentum (default: {_d('momentum')})")
    g.add_argument(
        "--weight-decay",
        type=float,
        metavar="WD",
        help=f"L2 weight decay (default: {_d('weight_decay')})",
    )
    g.add_argument(
        "--lr-policy",
        choices=["fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid"],
        help="Caffe's learning-rate policy; step: lr*gamma^floor(iter/stepsize), "
        "exp: lr*gamma^iter, inv: lr*(1+gamma*iter)^-power, multistep: lr*gamma"
        "^(stepvalues passed), poly: lr*(1-iter/max_iter)^power, sigmoid: "
        f"lr/(1+exp(-gamma*(iter-stepsize))) (default: {_d('lr_policy')})",
    )
    g.add_argument("--gamma", type=float, help="gamma of step, exp, inv, multistep, sigmoid")
    g.add_argument("--power", type=float, help="power of inv and poly")
    g.add_argument("--stepsize", type=int, metavar="N", help="stepsize of step and sigmoid")
    g.add_argument(
        "--stepvalue",
        metavar="N[,N...]",
        help="iterations where multistep multiplies the rate by gamma",
    )
    g.add_argument("--max-iter", type=int, metavar="N", help="max_iter of poly")
    g.add_argument(
        "--iter-size",
        type=int,
        metavar="K",
        help="accumulate the gradients of K batches per iteration, as Caffe's iter_size: "
        "each rank reads K batches, one update applies their mean (batch B with K is batch "
        f"K x B, up to rounding) (default: {_d('iter_size')})",
    )
    g.add_argument(
        "--clip-gradients",
        type=float,
        metavar="X",
        help="Caffe's clip_gradients: when the L2 norm of all gradients (summed over "
        "--iter-size passes) is above X, scale them by X / norm; negative: off "
        "(default: off)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="write metrics.jsonl, final.npz (parameters by name) and snapshots "
        "here; the built-in data are cached here too. A directory holding a previous run "
        "is refused unless --resume or --overwrite (default: none)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run held in --out (its metrics.jsonl, final.npz, snapshots) "
        "instead of refusing it",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        metavar="K",
        help="evaluate on the held-out set every K iterations (0: only at the end) "
        f"(default: {_d('eval_every')})",
    )
    g.add_argument(
        "--snapshot-every",
        type=int,
        metavar="K",
        help="write DIR/snapshot.npz every K iterations and at the end (needs --out; "
        f"0: never) (default: {_d('snapshot_every')})",
    )
    g.add_argument(
        "--snapshot-keep",
        type=int,
        metavar="K",
        help="also keep the last K snapshots by iteration, DIR/snapshot_iter_N.npz (Caffe's "
        "snapshot_prefix_iter_N); snapshot.npz is then the latest of them, replaced "
        f"atomically (0: snapshot.npz only) (default: {_d('snapshot_keep')})",
    )
    g.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from a snapshot (a file such as DIR/snapshot_iter_N.npz, or a --out "
        "directory: its latest, snapshot.npz); flags not given are taken from the snapshot; "
        "records of metrics.jsonl after the snapshot's iteration are dropped",
    )
    g.add_argument(
        "--target-accuracy",
        type=float,
        metavar="PCT",
        help=f"exit with status {int(ExitStatus.WRONG)} if the final held-out accuracy is "
        f"below PCT (default: report against {SYNTHETIC_TARGET:g}%% for the built-in "
        "task, without failing)",
    )
    g.add_argument(
        "--display",
        type=int,
        metavar="K",
        help="a progress line every K iterations when not on a terminal, as Caffe's display "
        "(0: every tenth of the run) (default: 0)",
    )
    g.add_argument("--quiet", action="store_true", help="print only the result and errors")

    g = p.add_argument_group("evaluation only (Caffe's caffe test)")
    g.add_argument(
        "--evaluate",
        metavar="FILE",
        help="train nothing: load FILE (a final.npz or a snapshot) onto one device "
        "(--devices names one; default: GPU 0, else cpu:1) and print the loss and accuracy "
        "over --data DB (default: the run's held-out set). The model flags are taken from "
        "the snapshot's configuration, or from metrics.jsonl beside a final.npz, unless "
        "given; exits 3 below --target-accuracy",
    )
    return p


@dataclass
class Origins:
    """Where each setting of a run came from: ``sources`` maps every TrainConfig key to
    ``"flag"``, ``"solver file (FIELD)"``, ``"snapshot"`` or ``"default"``; ``solver`` is
    the solver file read (None without ``--solver``)."""

    sources: dict[str, str] = field(default_factory=dict)
    solver: SolverFile | None = None


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, Snapshot | None]:
    """Flags given > the solver file (--solver) > the snapshot's config (with --resume) >
    the defaults."""
    cfg, snap, _ = resolve_with_origins(args)
    return cfg, snap


def resolve_with_origins(
    args: argparse.Namespace,
) -> tuple[TrainConfig, Snapshot | None, Origins]:
    """:func:`resolve_config`, and where each setting came from."""
    snap = None
    if args.resume and args.overwrite:
        raise UsageError("--resume continues a run and --overwrite replaces one: give one")
    if args.resume and args.weights:
        raise UsageError(
            "--resume continues a run (its weights, solver and data position) and --weights "
            "starts a new one from saved weights: give one"
        )
    if args.target_accuracy is not None:
        with checking():
            check_real(args.target_accuracy, "--target-accuracy")
    origins = Origins()
    if args.solver is not None:
        from ..solver_file import read_solver

        with checking():
            origins.solver = read_solver(args.solver)
    if args.resume:
        path = args.resume
        if os.path.isdir(path):
            path = os.path.join(path, SNAPSHOT_NAME)
        if not os.path.isfile(path):
            raise UsageError(f"--resume: no snapshot at {path}")
        try:
            snap = load_snapshot(path)
        except ValueError as exc:
            raise UsageError(f"--resume: {exc}") from exc
    saved = snap.config if snap is not None else {}
    from_file = origins.solver.values if origins.solver is not None else {}
    merged: dict[str, object] = {}
    for k in TrainConfig().as_dict():
        given = getattr(args, k)
        if given is not None:
            merged[k], origins.sources[k] = given, "flag"
        elif k in from_file:
            assert origins.solver is not None
            merged[k] = from_file[k]
            origins.sources[k] = f"solver file ({origins.solver.origin[k]})"
        elif saved.get(k) is not None:
            merged[k], origins.sources[k] = saved[k], "snapshot"
        else:
            merged[k], origins.sources[k] = None, "default"
    with checking():
        try:
            cfg = TrainConfig.checked(merged)
            if origins.solver is not None:  # said now, with the file named
                from ..solver import check_policy

                sv = cfg.solver
                check_policy(sv.lr_policy, gamma=sv.gamma, power=sv.power,
                             stepsize=sv.stepsize, stepvalue=sv.stepvalue,
                             max_iter=sv.max_iter)  # fmt: skip
        except (ValueError, TypeError) as exc:
            if origins.solver is None:
                raise
            raise type(exc)(f"{exc} (settings from {origins.solver.path} included)") from None
    if snap is not None and cfg.iters < snap.iter:
        raise UsageError(
            f"--iters {cfg.iters} is below the snapshot's iteration {snap.iter}: a resumed run "
            f"continues up to --iters (iterations in all); give --iters above {snap.iter}"
        )
    return cfg, snap, origins


def read_weights(path: str, flag: str) -> dict[str, np.ndarray]:
    """The parameters saved in ``path`` (a final.npz or a snapshot); a ValueError (a usage
    error) naming ``flag`` when it holds none."""
    try:
        return load_weights(path)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def fitting_weights(
    path: str, shapes: Mapping[str, tuple[int, ...]], flag: str
) -> dict[str, np.ndarray]:
    """The parameters saved in ``path``, checked against the model's ``shapes``: a
    ValueError (a usage error) naming the first that does not fit."""
    weights = read_weights(path, flag)
    for name, dims in shapes.items():
        if name not in weights:
            raise ValueError(
                f"{flag}: {path} has no parameter {name!r}, which the model needs "
                f"(it holds {', '.join(weights)}); check --model and --hidden"
            )
        if weights[name].shape != dims:
            raise ValueError(
                f"{flag}: parameter {name!r} has shape {weights[name].shape} in {path}, "
                f"but {dims} in the model; check --model, --hidden, --classes and the data"
            )
    extra = [n for n in weights if n not in shapes]
    if extra:
        raise ValueError(
            f"{flag}: {path} holds parameter {extra[0]!r}, which the model lacks; "
            "check --model and --hidden"
        )
    return weights


# -- data ----------------------------------------------------------------------------------


@dataclass
class Dataset:
    """Where the training records are and what the held-out arrays are."""

    train_path: str
    val: tuple[np.ndarray, np.ndarray] | None
    shape: tuple[int, ...]
    classes: int
    description: str


def _synthetic(cfg: TrainConfig, stack: contextlib.ExitStack) -> Dataset:
    from .. import data as ntdata

    n = cfg.synthetic
    n_val = max(1, n // 4)
    shape = (1, 8, 8) if cfg.model == "cnn" else (SYNTHETIC_FEATURES,)
    if cfg.out:
        root = os.path.join(cfg.out, "data")
        where = f"cached in {root}"
    else:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="nccltree-train-"))
        where = "in a temporary LMDB"
    path = os.path.join(root, f"synthetic-{SYNTHETIC_FEATURES}x{SYNTHETIC_CLASSES}-{n}")
    if cfg.out:
        _remove_stale_cache_temporaries(root)
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        x, y = ntdata.synthetic(n, shape=(SYNTHETIC_FEATURES,), classes=SYNTHETIC_CLASSES)
        try:
            # all or nothing, and a killed writer's leftovers are removed by the next one
            ntdata.write_lmdb(path, x, y)
        except FileExistsError:
            pass  # another run built it meanwhile: the same seed, the same records
    xv, yv = _synthetic_held_out(n_val, shape)
    desc = (
        f"built-in synthetic task: {n} training / {n_val} held-out records, "
        f"{SYNTHETIC_FEATURES} features, {SYNTHETIC_CLASSES} classes ({where})"
    )
    return Dataset(path, (xv, yv), shape, SYNTHETIC_CLASSES, desc)


def _synthetic_held_out(n: int, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The built-in task's ``n`` held-out examples, in the model's input ``shape``."""
    from .. import data as ntdata

    x, y = ntdata.synthetic(n, shape=(SYNTHETIC_FEATURES,), classes=SYNTHETIC_CLASSES, split="test")
    return x.reshape(n, *shape), y


def _decode(value: object) -> str | None:
    if value is None or value in ("color", "gray"):
        return None if value is None else str(value)
    raise ValueError(f"decode must be 'color' or 'gray', got {value!r}")


def decode_flags(decode: str | None) -> tuple[bool, bool]:
    """``(force_color, force_gray)`` of the reader for ``TrainConfig.decode``."""
    return decode == "color", decode == "gray"


def _remove_stale_cache_temporaries(root: str) -> None:
    """Remove the half-written databases that killed runs left in the data cache (those
    of a writer still running are kept)."""
    from ..snapshot import process_alive

    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = _CACHE_TMP.match(name)
        if m is not None and not (m["pid"] and process_alive(int(m["pid"]))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _record_key(path: str, index: int) -> str:
    """The key of record ``index`` (in key order) of the database at ``path``."""
    from ..data import open_db
    from ..data.format import keyname

    with open_db(path) as db, db.env.begin() as txn:
        for i, key in enumerate(txn.cursor().iternext(values=False)):
            if i == index:
                return keyname(key)
    return "?"


def _check_labels(labels: np.ndarray, classes: int, flag: str, path: str | None) -> None:
    """Every label must be a class index, in ``[0, classes)``: -1 would silently train
    as the last class, one too large would fail only in the middle of training. The
    message names the first record that is not."""
    bad = np.flatnonzero((labels < 0) | (labels >= classes))
    if bad.size == 0:
        return
    i = int(bad[0])
    where = f"record {i}" + (f" (key {_record_key(path, i)})" if path else "")
    more = f" and {bad.size - 1} more" if bad.size > 1 else ""
    raise ValueError(
        f"{flag}: {where}{more} has label {int(labels[i])}, outside the {classes} classes "
        f"0..{classes - 1}" + ("" if flag == "--val-data" else "; see --classes")
    )


def _held_out(
    path: str, cfg: TrainConfig, shape: tuple[int, ...], classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """The held-out arrays of ``path``, checked against the training records before any
    training: the same example size (then taken in the training shape) and labels within
    the classes."""
    x, y = _read_all(path, cfg, "--val-data")
    if math.prod(x.shape[1:]) != math.prod(shape):
        raise ValueError(
            f"--val-data: {path} holds records of shape {tuple(x.shape[1:])}, but the "
            f"training records have shape {shape}"
        )
    _check_labels(y, classes, "--val-data", path)
    return x.reshape(len(x), *shape), y


def _read_all(path: str, cfg: TrainConfig, flag: str) -> tuple[np.ndarray, np.ndarray]:
    """Every record of ``path`` as the configuration reads held-out data: scaled, the
    mean subtracted, the center window of a crop, never flipped."""
    from ..data import DataError, DataReader

    xs, ys = [], []
    color, gray = decode_flags(cfg.decode)
    tf = cfg.transform()
    with DataReader(
        path,
        1024,
        1,
        prefetch=2,
        epochs=1,
        scale=cfg.scale,
        mean=tf.mean,
        crop=tf.crop,
        mirror=tf.mirror,
        train=False,
        log_on_wait=None,
        force_color=color,
        force_gray=gray,
    ) as r:
        try:
            for b in r.batches(0):
                xs.append(np.array(b.x_host))
                ys.append(np.array(b.y_host))
        except DataError as exc:  # a record that cannot be read: the data, not the flags
            raise RuntimeFailure(f"{flag}: {exc}") from exc
    return np.concatenate(xs), np.concatenate(ys)


def input_shape(cfg: TrainConfig, shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    """The model's input shape for records of ``shape``: the cropped one with --crop; a
    ValueError naming the flag when --crop, --mirror or --mean do not fit the records."""
    from ..data.decode import Transform

    tf = cfg.transform()
    try:
        t = Transform(shape, dtype, None, cfg.scale, tf.mean, crop=tf.crop, mirror=tf.mirror)
    except ValueError as exc:
        flag = "--crop" if cfg.crop else "--mirror" if "mirror" in str(exc) else "--mean"
        raise ValueError(f"{flag}: {exc}") from None
    return t.out_shape


def load_dataset(cfg: TrainConfig, stack: contextlib.ExitStack) -> Dataset:
    """The training database and held-out arrays the configuration names."""
    from ..data import DataError, open_db

    if cfg.data is None:
        input_shape(cfg, (SYNTHETIC_FEATURES,), np.dtype(np.float32))  # flat: no crop, no mirror
        ds = _synthetic(cfg, stack)
        if cfg.val_data is not None:
            ds.val = _held_out(cfg.val_data, cfg, ds.shape, ds.classes)
        return ds
    color, gray = decode_flags(cfg.decode)
    with open_db(cfg.data, force_color=color, force_gray=gray) as db:  # one pass over labels
        try:
            labels = db.labels()
        except DataError as exc:  # a record that cannot be read: the data, not the flags
            raise RuntimeFailure(f"--data: {exc}") from exc
        records, fmt, shape, dtype = len(db), db.format, db.shape, db.dtype
    classes = cfg.classes or int(labels.max()) + 1
    _check_labels(labels, classes, "--data", cfg.data)
    shape = input_shape(cfg, shape, dtype)
    val = _held_out(cfg.val_data, cfg, shape, classes) if cfg.val_data else None
    crop = f" (cropped from {db.shape})" if cfg.crop else ""
    desc = (
        f"{cfg.data}: {records} {fmt} records of shape {shape}{crop} {dtype.name}, "
        + (f"{classes} classes")
        + (f"; held-out {cfg.val_data} ({len(val[1])} records)" if val else "")
    )
    return Dataset(cfg.data, val, shape, classes, desc)


# -- progress and metrics ------------------------------------------------------------------


class TrainProgress(Progress):
    """The root's progress line: refreshed in place on a terminal (at most ten times a
    second), a line every ``every`` iterations otherwise."""

    WINDOW = 20

    def __init__(self, total: int, every: int, quiet: bool, stream: TextIO | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr, quiet, redraw_s=0.1)
        self.total, self.every = total, max(1, every)
        self._window: list[tuple[int, float, float, float]] = []

    def update(self, info: StepInfo) -> None:
        if self.quiet:
            return
        # Averages over the last few iterations: the current speed rather than the run's
        # average, and a loss smoothed as Caffe's average_loss does (one batch is noisy).
        self._window.append((info.examples, info.step_s, info.comm_s, info.loss))
        del self._window[: -self.WINDOW]
        ex, secs, comm_s, loss = (sum(col) for col in zip(*self._window, strict=True))
        rate = ex / secs if secs > 0 else 0.0
        comm = f"  comm {100 * comm_s / secs:3.0f}%" if secs > 0 else ""
        loss /= len(self._window)
        line = (
            f"iter {info.iter:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  "
            f"lr {info.lr:.4g}  {rate:,.0f} examples/s{comm}"
        )
        self.show(line, log=info.iter % self.every == 0, last=info.iter >= self.total)


class Metrics:
    """JSON lines in DIR/metrics.jsonl (appended to when a run resumes).

    Strict JSON: a number that is not finite (a diverging loss) is written as null, since
    JSON has no NaN or Infinity.
    """

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path else None

    def write(self, **record: object) -> None:
        if self.file is not None:
            clean = {k: _finite_or_none(v) for k, v in record.items()}
            self.file.write(json.dumps(clean, allow_nan=False) + "\n")
            self.file.flush()

    @staticmethod
    def truncate(path: str, after: int) -> None:
        """Drop the records of iterations after ``after`` (those a resumed run computes
        again, whose snapshot was never written) and a line a killed run left unfinished;
        the file is replaced atomically."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # cut short by a kill
            it = record.get("iter") if isinstance(record, dict) else None
            if not line.endswith("\n") or (isinstance(it, int) and it > after):
                continue
            kept.append(line)
        if kept == lines:
            return
        tmp = f"{path}.tmp{os.getpid()}.0"  # a killed writer's is removed as a snapshot's
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _finite_or_none(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# -- the run -------------------------------------------------------------------------------


def _print_header(
    cfg: TrainConfig,
    ds: Dataset,
    t: Training,
    snap: Snapshot | None,
    out: TextIO,
    origins: Origins | None = None,
) -> None:
    dp, n, per_rank = t.driver, t.ranks, t.per_rank_batch
    p = dp.params[0]
    names = ", ".join(d.name for d in t.devices)
    effective = per_rank * n * cfg.iter_size
    lines = [
        "nccltree-train",
        f"  data       {ds.description}",
        f"  model      {t.model!r}: {p.count:,} parameters, {p.dtype}",
        (
            f"  devices    {cfg.devices} -> {names} ({n} rank{'s' if n > 1 else ''})"
            if t.group is None
            else f"  devices    {cfg.devices} in each of {job_processes(t.group.nprocs)} on "
            f"{t.group.nodes} node{'s' if t.group.nodes > 1 else ''} ({n} ranks)"
        ),
        f"  algorithm  {cfg.algorithm}, update mode {cfg.update_mode}"
        + (f", gradient buckets of {cfg.bucket_mb:g} MiB" if cfg.bucket_mb else "")
        + (f", gradients sent as {cfg.comm_hook}" if cfg.comm_hook else ""),
        f"  scaling    {cfg.scaling}: batch {per_rank} per rank, effective batch {effective}"
        + (f" ({per_rank * n} x iter_size {cfg.iter_size})" if cfg.iter_size > 1 else "")
        + (
            f" (global batch {cfg.batch_size} split across {n} ranks)"
            if cfg.scaling == "strong"
            else ""
        ),
        f"  solver     learning rate {dp.solvers[0].learning_rate():g} "
        f"(policy {cfg.solver.lr_policy}), momentum {cfg.solver.momentum:g}, weight decay "
        f"{cfg.solver.weight_decay:g}, {cfg.iters} iterations"
        + (f", iter_size {cfg.iter_size} (batches per update)" if cfg.iter_size > 1 else "")
        + (
            f", gradients clipped to L2 norm {cfg.solver.clip_gradients:g}"
            if cfg.solver.clip_gradients is not None
            else ""
        ),
    ]
    solver = origins.solver if origins is not None else None
    if origins is not None and solver is not None:
        used = sorted({v[len("solver file (") : -1] for v in origins.sources.values()
                       if v.startswith("solver file")})  # fmt: skip
        over = sorted(
            f"--{k.replace('_', '-')}"
            for k, src in origins.sources.items()
            if src == "flag" and k in solver.values
        )
        lines.append(
            f"  solver file {solver.path}: {', '.join(used) or 'nothing'} used"
            + (f"; flags over it: {' '.join(over)}" if over else "")
        )
        lines += [f"              {note}" for name, note in solver.notes.items() if name in used]
        unused = solver.unused_line()
        if unused:
            lines.append(f"  {unused}")
    if snap is not None:
        lines.append(f"  resumed    at iteration {snap.iter}, data position {snap.position}")
    elif cfg.weights:
        lines.append(f"  weights    {cfg.weights}")
    print("\n".join(lines), file=out, flush=True)


class _Outputs:
    """What happens after every iteration, in the root's thread: the metrics line, the
    progress line, evaluations on the held-out set and snapshots."""

    def __init__(
        self, cfg: TrainConfig, ds: Dataset, t: Training, metrics: Metrics, progress: TrainProgress
    ) -> None:
        self.cfg, self.ds, self.t = cfg, ds, t
        self.metrics, self.progress = metrics, progress
        self.snapshot_path = os.path.join(cfg.out, SNAPSHOT_NAME) if cfg.out else None
        self.snapshot_iter: int | None = None  # the iteration the snapshot file holds
        self.accuracy: float | None = None

    def _due(self, every: int, it: int) -> bool:
        return it >= self.cfg.iters or (every > 0 and it % every == 0)

    def on_step(self, info: StepInfo) -> None:
        self.metrics.write(
            event="train",
            iter=info.iter,
            loss=info.loss,
            lr=info.lr,
            examples=info.examples,
            step_s=info.step_s,
            comm_s=info.comm_s,
            exposed_s=info.exposed_s,
            elapsed_s=info.elapsed_s,
        )
        self.progress.update(info)
        if self.ds.val is not None and self._due(self.cfg.eval_every, info.iter):
            acc, loss = self.evaluate(info.params)
            self.metrics.write(event="eval", iter=info.iter, accuracy=acc, loss=loss)
            self.progress.message(
                f"iter {info.iter}: held-out accuracy {100 * acc:.2f}%, loss {loss:.4f}"
            )
        if self.snapshot_path and self.cfg.snapshot_every:
            if self._due(self.cfg.snapshot_every, info.iter):
                self.snapshot()

    def snapshot(self) -> None:
        """Snapshot the driver's state (between iterations) and record it."""
        assert self.snapshot_path is not None and self.cfg.out, "snapshots need --out"
        dp = self.t.driver
        keep = self.cfg.snapshot_keep
        # with a history: the iteration's own file, then snapshot.npz made that one
        path = os.path.join(self.cfg.out, history_name(dp.iter)) if keep else self.snapshot_path
        dp.snapshot(path, self.cfg.as_dict())
        if keep:
            point_latest(path, self.snapshot_path)
            prune_history(self.cfg.out, keep)
        self.snapshot_iter = dp.iter
        self.metrics.write(event="snapshot", iter=dp.iter, path=path, position=dp.position)

    def last_snapshot(self) -> str:
        """Where the last good state is, for a message."""
        if self.snapshot_iter is None:
            return "no snapshot was written"
        return f"the snapshot {self.snapshot_path} holds iteration {self.snapshot_iter}"

    def evaluate(self, params: FlatParams) -> tuple[float, float]:
        """Accuracy and loss of ``params`` on the held-out set; the accuracy is kept."""
        from ..parallel import evaluate

        assert self.ds.val is not None, "evaluated only with held-out data"
        acc, loss = evaluate(self.t.model, params, *self.ds.val)
        self.accuracy = acc
        return acc, loss


def run(
    cfg: TrainConfig,
    snap: Snapshot | None,
    out: TextIO,
    err: TextIO,
    *,
    quiet: bool = False,
    target: float | None = None,
    overwrite: bool = False,
    mpi: bool = False,
    origins: Origins | None = None,
) -> int:
    """Train as ``cfg`` says (continuing ``snap``); returns the exit status.

    ``overwrite`` replaces a run held in ``cfg.out``, which is refused otherwise (unless
    continuing ``snap``). ``origins`` (where each setting came from) goes to the header
    and to the metrics' config record. ``mpi``: this process is one of a job of several
    processes (mpiexec, nccltree-run, torchrun, srun); they train together over a process
    group, global rank 0 alone prints and writes ``cfg.out``.
    """
    from ..parallel import Diverged, RankFailure

    with contextlib.ExitStack() as stack:
        group: ProcessGroup | None = None
        if mpi:
            with _alone(), checking():  # this process's own environment may be the cause
                spec = group_devices(cfg.devices)
                group = stack.enter_context(open_group(spec, cfg.algorithm, cfg.timeout))
        elif cfg.algorithm == "mpi":
            raise UsageError("--algorithm mpi needs MPI mode: run under mpiexec (or --mpi)")
        root = group is None or group.rank == 0
        quiet = quiet or not root
        failure: BaseException | None = None
        try:
            with checking():  # everything before the first iteration: a usage error
                if cfg.out and root:
                    _check_out(cfg.out, resuming=snap is not None, overwrite=overwrite)
                ds = load_dataset(cfg, stack)
                weights = None
                if cfg.weights and snap is None:  # a resumed run has its own
                    shapes = make_model(cfg.model, ds.shape, ds.classes, cfg.hidden).shapes()
                    weights = fitting_weights(cfg.weights, shapes, "--weights")
        except Exception as exc:  # noqa: BLE001 - raised again once the processes agree
            failure = exc
        if group is not None:
            _agree_on_setup(group, failure)
        if failure is not None:
            raise failure
        with checking():
            t = stack.enter_context(
                build_training(
                    cfg.driver(),
                    ds.shape,
                    ds.classes,
                    data=ds.train_path,
                    shuffle=cfg.seed if cfg.shuffle else None,
                    scale=cfg.scale,
                    decode=decode_flags(cfg.decode),  # (force_color, force_gray)
                    transform=cfg.transform(),
                    resume=snap,
                    weights=weights,
                    group=group,
                )
            )
            if cfg.out and root:
                _prepare_out(cfg.out, snap, overwrite=overwrite)
            metrics = Metrics(os.path.join(cfg.out, METRICS_NAME) if cfg.out and root else None)
            stack.callback(metrics.close)
        dp = t.driver
        if not quiet:
            _print_header(cfg, ds, t, snap, out, origins)
        origins = origins if origins is not None else Origins()
        metrics.write(
            event="config",
            **cfg.as_dict(),
            ranks=t.ranks,
            per_rank_batch=t.per_rank_batch,
            start_iter=dp.iter,
            solver_file=origins.solver.path if origins.solver is not None else None,
            solver_notes=origins.solver.notes if origins.solver is not None else None,
            sources=origins.sources,
        )
        progress = TrainProgress(cfg.iters, cfg.display or max(1, cfg.iters // 10), quiet, err)
        outputs = _Outputs(cfg, ds, t, metrics, progress)
        if snap is not None and outputs.snapshot_path and os.path.exists(outputs.snapshot_path):
            with contextlib.suppress(ValueError):
                outputs.snapshot_iter = load_snapshot(outputs.snapshot_path).iter
        assert t.reader is not None, "build_training makes a reader when given data"
        try:
            if group is not None:
                with _signals_stop(dp) as received:
                    result = dp.fit(t.reader, cfg.iters, on_step=outputs.on_step)
                if result.stopped:
                    progress.finish()
                    return _stopped_together(received, outputs, err, root=root)
            else:
                result = dp.fit(t.reader, cfg.iters, on_step=outputs.on_step)
        except KeyboardInterrupt as exc:
            progress.finish()
            return _interrupted(exc, outputs, err)
        except RankFailure as exc:
            progress.finish()
            if isinstance(exc.error, Diverged):
                metrics.write(event="diverged", iter=exc.error.iter + 1, message=str(exc.error))
                report_error(
                    PROG,
                    f"{exc.error} (rank {exc.rank}); {outputs.last_snapshot()}; a lower --lr "
                    "may help",
                    err,
                )
            else:
                report_error(PROG, exc, err)
            return ExitStatus.FAILURE
        progress.finish()
        if not root:  # global rank 0 evaluates, writes and reports
            return ExitStatus.OK
        return _finish(cfg, ds, dp, result, outputs, metrics, target, out, quiet=quiet)


def _finish(
    cfg: TrainConfig,
    ds: Dataset,
    dp: DataParallel,
    result: FitResult,
    outputs: _Outputs,
    metrics: Metrics,
    target: float | None,
    out: TextIO,
    *,
    quiet: bool,
) -> int:
    """Global rank 0 after training: evaluates (when nothing trained yet), writes the
    final weights and the last metrics, reports, and checks ``target``."""
    if ds.val is not None and outputs.accuracy is None:  # nothing trained: still report
        outputs.evaluate(dp.params[0])
    if cfg.out:
        save_arrays(os.path.join(cfg.out, FINAL_NAME), dp.state_dict())
    summary = (
        f"done: {result.iter - result.start_iter} iterations in {result.elapsed_s:.1f} s, "
        f"{result.examples_per_s:,.0f} examples/s"
        + (f", final training loss {result.losses[-1]:.4f}" if result.losses else "")
    )
    metrics.write(
        event="final",
        iter=result.iter,
        elapsed_s=result.elapsed_s,
        examples_per_s=result.examples_per_s,
        accuracy=outputs.accuracy,
    )
    if not quiet:
        print(summary, file=out)
        if cfg.out:
            print(
                f"wrote {os.path.join(cfg.out, 'final.npz')} and "
                f"{os.path.join(cfg.out, 'metrics.jsonl')}",
                file=out,
            )
    return _report_accuracy(outputs.accuracy, target, cfg, out)


def _check_out(out: str, *, resuming: bool, overwrite: bool) -> None:
    """``--out`` must be (or become) a directory, and one holding a previous run is
    refused unless the run continues it or replaces it."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} exists and is not a directory")
    parent = os.path.dirname(out)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise ValueError(f"--out: cannot create {out}: {parent} is not a directory")
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    held += [os.path.basename(p) for _, p in history(out)]
    if held and not (resuming or overwrite):
        resume = f"continue it with --resume {out}, " if SNAPSHOT_NAME in held else ""
        raise ValueError(
            f"--out: {out} already holds a run ({', '.join(held)}); {resume}replace it "
            "with --overwrite, or choose another directory"
        )


def _prepare_out(out: str, snap: Snapshot | None, *, overwrite: bool) -> None:
    """Create ``--out``, remove what killed runs left there, and the previous run's files
    with ``overwrite``; a resumed run drops the metrics of iterations after its snapshot
    (they are computed again)."""
    from ..snapshot import remove_stale_temporaries

    os.makedirs(out, exist_ok=True)
    remove_stale_temporaries(out)
    if overwrite:
        for path in [os.path.join(out, n) for n in RUN_FILES] + [p for _, p in history(out)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if snap is not None:
        Metrics.truncate(os.path.join(out, METRICS_NAME), snap.iter)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread to stop a run as Ctrl-C does."""


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated` (in the main thread only, where Python
    runs signal handlers; elsewhere nothing changes)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(exc: KeyboardInterrupt, outputs: _Outputs, err: TextIO) -> int:
    """After Ctrl-C or SIGTERM stopped ``fit``: snapshot the iteration reached (with
    --out, when every rank has stopped), say which iteration the snapshot holds, and
    return the exit status."""
    name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    _record_interruption(outputs, name, err, snapshot=outputs.t.driver.idle)
    return TERMINATED if isinstance(exc, Terminated) else ExitStatus.INTERRUPTED


def _record_interruption(outputs: _Outputs, name: str, err: TextIO, *, snapshot: bool) -> None:
    """Snapshot the iteration reached (with --out, where ``snapshot``), log the stop in
    the metrics and say which iteration the snapshot holds."""
    dp = outputs.t.driver
    if snapshot and outputs.snapshot_path:
        outputs.snapshot()
    outputs.metrics.write(event="interrupted", iter=dp.iter, signal=name)
    print(
        f"interrupted ({name}) at iteration {dp.iter}; {outputs.last_snapshot()}",
        file=err,
        flush=True,
    )


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """Inside, a usage error may be this process's alone (its environment): it prints it
    itself rather than leave it to the job's first process (``UsageError.alone``)."""
    try:
        yield
    except UsageError as exc:
        exc.alone = True
        raise


# Each process of a job may have its own: where rank 0 writes (the others cache the
# built-in data there), how long a wait may take, its BLAS threads. Every other flag must
# be the same on every process (see _agreement.py).
PER_PROCESS = frozenset({"out", "timeout", "blas_threads"})
# How the start agreement names a key that is no flag of its own
_AGREED_FLAGS = {
    "decode": "--force-color/--force-gray",
    "resume_iter": "--resume (the snapshot's iteration)",
}


def agreed_config(cfg: TrainConfig, snap: Snapshot | None) -> dict[str, object]:
    """What every process of a job must agree on: the configuration less
    :data:`PER_PROCESS`, and the iteration of the snapshot it resumes."""
    flat = {k: v for k, v in cfg.as_dict().items() if k not in PER_PROCESS}
    flat["resume_iter"] = None if snap is None else snap.iter
    return flat


def _main_in_job(argv: list[str]) -> int:
    """``nccltree-train`` as one process of a job (mpiexec, nccltree-run, torchrun,
    srun): the flags are checked as alone, but whatever each process resolved (its configuration, or the usage error that
    stopped it) goes to one agreement of every process before anything else
    (:func:`nccltree.cli._agreement.agree_on_start`): a mismatch or an error is the same
    usage error on every process, printed once, by the job's first process."""
    parser = build_parser()
    assert isinstance(parser, Parser)
    found: Exception | None = None
    args: argparse.Namespace | None = None
    hint = caffe_hint(argv)
    if hint is not None:
        found = UsageError(hint)
    else:
        parser.raising = True  # the error goes to the agreement, not to stderr
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, printed by the job's first process
            return exc.code if isinstance(exc.code, int) else ExitStatus.OK
        except UsageError as exc:
            found = exc
        if args is not None and args.evaluate is not None:  # one device, no group
            return run_body(parser, PROG, lambda: evaluate_saved(args, sys.stdout), show_usage=True)
    return run_body(parser, PROG, lambda: _train_in_job(args, found), show_usage=True)


def _train_in_job(args: argparse.Namespace | None, found: Exception | None) -> int:
    from ._agreement import agree_on_start

    try:
        with _sigterm_stops():
            cfg, snap, origins = None, None, None
            if args is not None and found is None:
                try:
                    cfg, snap, origins = resolve_with_origins(args)
                except Exception as exc:  # noqa: BLE001 - every process learns of it
                    found = exc
            timeout = cfg.timeout if cfg is not None else TrainConfig().timeout
            agreed = None if cfg is None else agreed_config(cfg, snap)
            try:
                agree_on_start(agreed, found, timeout, _AGREED_FLAGS)
            except (UsageError, RuntimeFailure):
                raise
            except (ValueError, TypeError, ImportError) as exc:
                # no group for the exchange: this process's own environment (no mpi4py,
                # a bad NCCLTREE_SHM), which it says itself, after its own error if any
                if found is not None and not isinstance(found, UsageError):
                    raise found from exc
                refused = found if isinstance(found, UsageError) else UsageError(str(exc))
                refused.alone = True
                raise refused from exc
            assert cfg is not None and args is not None, "the agreement raised the error"
            return _run(cfg, snap, args, mpi=True, origins=origins)
    except Terminated:  # before or after training: nothing to snapshot
        print("terminated (SIGTERM)", file=sys.stderr, flush=True)
        return TERMINATED


def _agree_on_setup(group: ProcessGroup, failure: BaseException | None) -> None:
    """In a job, before training: every process learns whether any failed to set up, so
    that none waits for the others in the first collective (one exchange over ``group``,
    with or without MPI); a process that did not fail itself raises the same kind of
    error (:class:`UsageError` or :class:`RuntimeFailure`) naming the first that did, by
    its launcher rank."""
    from ._agreement import gather_processes
    from ._common import job_rank, over_mpi

    mine = None if failure is None else (str(failure) or repr(failure))
    usage = isinstance(failure, UsageError)
    said = gather_processes(group, (job_rank(), mine, usage))
    if failure is None:
        for entry in said:
            assert isinstance(entry, tuple), "gather_processes returns what was sent"
            proc, text, was_usage = entry
            if text is not None:  # the same exit status as the process that failed
                error = UsageError if was_usage else RuntimeFailure
                who = "MPI process" if over_mpi() else "process"
                raise error(f"{who} {proc} failed before training: {text}")


@contextlib.contextmanager
def _signals_stop(dp: DataParallel) -> Iterator[list[int]]:
    """In a job, inside: SIGTERM and SIGINT ask ``dp`` to stop (the ranks of every process
    agree on the iteration) instead of raising; yields the signals received."""
    import threading

    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        dp.stop()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _stopped_together(received: list[int], outputs: _Outputs, err: TextIO, *, root: bool) -> int:
    """After a signal stopped every process's ranks at the same iteration: global rank 0
    snapshots it (with --out) and says so; the exit status is the signal's (SIGTERM's
    where this process got none: another process did)."""
    sigint = bool(received) and received[0] == signal.SIGINT
    name = "SIGINT" if sigint else "SIGTERM"
    if root:
        _record_interruption(outputs, name, err, snapshot=True)
    return ExitStatus.INTERRUPTED if sigint else TERMINATED


def _report_accuracy(acc: float | None, target: float | None, cfg: TrainConfig, out: TextIO) -> int:
    """Print the held-out accuracy against the target; a missed ``--target-accuracy`` (or
    none to compare with it) is a wrong result."""
    if acc is None:
        print("no held-out set: pass --val-data DB to measure accuracy", file=out, flush=True)
        return ExitStatus.OK if target is None else ExitStatus.WRONG
    shown = target
    if shown is None and cfg.data is None and cfg.model == "mlp":
        shown = SYNTHETIC_TARGET
    pct = 100 * acc
    if shown is None:
        text = f"reached {pct:.2f}% accuracy on the held-out set"
    elif pct >= shown:
        text = f"reached {pct:.2f}% accuracy on the held-out set (target {shown:g}%)"
    else:
        text = f"reached {pct:.2f}% accuracy on the held-out set, below the target {shown:g}%"
    print(text, file=out, flush=True)
    return ExitStatus.WRONG if target is not None and pct < target else ExitStatus.OK


# -- evaluation only -----------------------------------------------------------------------


def _saved_config(path: str) -> dict[str, object]:
    """The configuration of the run that saved ``path``: a snapshot's own, else the last
    config record of metrics.jsonl beside it (a final.npz), else none."""
    with contextlib.suppress(ValueError):
        return dict(load_snapshot(path).config)
    config: dict[str, object] = {}
    with contextlib.suppress(OSError):
        metrics = os.path.join(os.path.dirname(os.path.abspath(path)), METRICS_NAME)
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") == "config":
                        config = record
    return config


def _one_device(spec: str | None) -> str:
    """``--devices`` of an evaluation: as given, else GPU 0, else one CPU device."""
    if spec is not None:
        return spec
    from .._errors import BackendUnavailable
    from ..backends import gpu_count

    try:
        return "gpu:0" if gpu_count() > 0 else "cpu:1"
    except BackendUnavailable:
        return "cpu:1"


def evaluate_saved(args: argparse.Namespace, out: TextIO) -> int:
    """``--evaluate FILE``: the loss and accuracy of saved parameters over a database, on
    one device (Caffe's ``caffe test``); returns the exit status."""
    from ..parallel import evaluate

    path = args.evaluate
    with contextlib.ExitStack() as stack:
        with checking():
            for flag in ("resume", "weights", "overwrite", "val_data"):
                if getattr(args, flag):
                    raise ValueError(
                        f"--evaluate trains nothing: {_flag(flag)} does not apply"
                        + (" (name the database with --data)" if flag == "val_data" else "")
                    )
            if not os.path.isfile(path):
                raise ValueError(f"--evaluate: no file at {path}")
            saved = _saved_config(path)
            values = {k: getattr(args, k) for k in TrainConfig().as_dict()}
            merged = {k: saved.get(k) if v is None else v for k, v in values.items()}
            db = args.data if args.data is not None else saved.get("val_data")
            if db is None and saved.get("data") is not None:
                raise ValueError(
                    f"--evaluate: {path} was trained on {saved['data']} with no held-out set: "
                    "name the database to evaluate with --data DB"
                )
            # only what the model and the reader need: the run's paths may be gone
            merged.update(data=db, val_data=None, out=None, snapshot_every=0, weights=None)
            cfg = TrainConfig.checked(merged)
            spec = _one_device(args.devices)
            devs = stack.enter_context(open_devices(spec))
            if len(devs) != 1:
                raise ValueError(
                    f"--evaluate loads the model onto one device, but --devices {spec} names "
                    f"{len(devs)} (e.g. cpu:1 or gpu:0)"
                )
            if cfg.data is None:
                shape = (1, 8, 8) if cfg.model == "cnn" else (SYNTHETIC_FEATURES,)
                x, y = _synthetic_held_out(max(1, cfg.synthetic // 4), shape)
                what = "the built-in synthetic task's held-out set"
            else:
                x, y = _read_all(cfg.data, cfg, "--data")
                shape, what = tuple(x.shape[1:]), cfg.data
            classes = cfg.classes or _output_size(read_weights(path, "--evaluate"), y)
            _check_labels(y, classes, "--data", cfg.data)
            model = make_model(cfg.model, shape, classes, cfg.hidden)
            params = model.make_params(device=devs[0])
            params.load(fitting_weights(path, model.shapes(), "--evaluate"))
        acc, loss = evaluate(model, params, x, y)
        print(
            f"{path} on {devs[0].name}: accuracy {100 * acc:.2f}%, loss {loss:.4f} "
            f"over {len(y)} records of {what}",
            file=out,
            flush=True,
        )
        target = args.target_accuracy
        if target is not None and 100 * acc < target:
            print(f"accuracy {100 * acc:.2f}% is below the target {target:g}%", file=out)
            return ExitStatus.WRONG
        return ExitStatus.OK


def _output_size(weights: Mapping[str, np.ndarray], labels: np.ndarray) -> int:
    """The classes of saved parameters: the size of their last bias (the output layer's),
    else the largest label plus one."""
    last = list(weights.values())[-1]
    return int(last.shape[0]) if last.ndim == 1 else int(labels.max()) + 1


def _run(
    cfg: TrainConfig,
    snap: Snapshot | None,
    args: argparse.Namespace,
    mpi: bool,
    origins: Origins | None = None,
) -> int:
    """The training ``args`` describe, with its console and flags, as ``run`` takes them."""
    return run(cfg, snap, sys.stdout, sys.stderr, quiet=args.quiet,
               target=args.target_accuracy, overwrite=args.overwrite, mpi=mpi,
               origins=origins)  # fmt: skip


def _train(args: argparse.Namespace) -> int:
    if args.evaluate is not None:
        return evaluate_saved(args, sys.stdout)
    try:
        with _sigterm_stops():
            cfg, snap, origins = resolve_with_origins(args)
            return _run(cfg, snap, args, mpi=args.mpi or job_size() > 1, origins=origins)
    except Terminated:  # before or after training: nothing to snapshot
        print("terminated (SIGTERM)", file=sys.stderr, flush=True)
        return TERMINATED


# Caffe's ``caffe train`` flags (one dash, argument apart or after "="), answered with
# nccltree's.
def _caffe_hint(flag: str, value: str | None) -> str | None:
    """What nccltree takes instead of Caffe's ``-flag value``, as one line; None when
    ``flag`` is no Caffe flag."""
    if flag == "-gpu":
        if value is None:
            return "Caffe's -gpu takes a value here too: --devices gpu:0,1 or --devices gpu:all"
        ids = value.replace(" ", "")
        return f"Caffe's -gpu {value} is --devices gpu:{'all' if ids == 'all' else ids} here"
    same = {"-weights": "--weights", "-snapshot": "--resume", "-model": "--model"}
    if flag in same:
        return f"Caffe's {flag} is {same[flag]} here"
    return None


def caffe_hint(argv: Sequence[str]) -> str | None:
    """The first of ``argv``'s Caffe spellings, answered with nccltree's flags."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        flag, eq, value = arg.partition("=")
        if not flag.startswith("-") or flag.startswith("--"):
            continue
        given = value if eq else argv[i + 1] if i + 1 < len(argv) else None
        hint = _caffe_hint(flag, given)
        if hint is not None:
            return hint
    return None


def caffe_spellings(argv: Sequence[str]) -> list[str]:
    """``argv`` with Caffe's spellings that mean the same here made nccltree's: ``-solver
    FILE`` (or ``-solver=FILE``) is ``--solver FILE``."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            out += argv[i:]
            break
        flag, eq, value = arg.partition("=")
        out.append(f"--solver{eq}{value}" if flag == "-solver" else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nccltree-train``; returns the exit status."""
    given = caffe_spellings(sys.argv[1:] if argv is None else list(argv))
    argv = given
    try:
        in_job = job_size() > 1 or "--mpi" in given
    except UsageError as exc:  # a launcher's variable that is no number
        report_error(PROG, exc)
        return ExitStatus.USAGE
    if in_job:
        return _main_in_job(given)
    hint = caffe_hint(given)
    if hint is not None:
        report_error(PROG, hint)
        return ExitStatus.USAGE
    return run_main(build_parser(), argv, _train, show_usage=True)


if __name__ == "__main__":
    sys.exit(main())
