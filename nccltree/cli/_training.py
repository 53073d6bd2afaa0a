"""The one way the command lines and benchmarks set up data-parallel training.

``nccltree-train``, ``nccltree-bench train`` and ``bench/train_table.py`` all describe a run
with a :class:`DriverConfig` and get the devices, the model, the
:class:`~nccltree.parallel.DataParallel` driver and (given a database) the
:class:`~nccltree.data.DataReader` from :func:`build_training`, which also releases them.

In a job of several processes (:func:`~nccltree.cli._common.job_size`: under mpiexec,
``nccltree-run``, torchrun's variables or an srun step), the command lines make a process
group (:func:`open_group`, started as the environment shows) and pass it to
:func:`build_training`: each process then holds only its own ranks' devices, replicas and
records.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._common import job_size as job_size
from ._common import open_devices

if TYPE_CHECKING:
    import numpy as np

    from ..backends.base import Device
    from ..comm.group import ProcessGroup
    from ..data import DataReader
    from ..models import Model
    from ..parallel import DataParallel
    from ..snapshot import Snapshot


@dataclass(frozen=True)
class SolverConfig:
    """Every rank's SGD (:class:`nccltree.solver.SGD`): Caffe's rule and LR policies."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_policy: str = "fixed"
    gamma: float | None = None
    power: float | None = None
    stepsize: int | None = None
    stepvalue: tuple[int, ...] | None = None
    max_iter: int | None = None
    clip_gradients: float | None = None  # Caffe's: scale gradients to this L2 norm


@dataclass(frozen=True)
class DriverConfig:
    """Devices, model and driver of one data-parallel run.

    ``batch_size`` is per rank (``scaling="weak"``) or global (``"strong"``), as
    :func:`nccltree.parallel.per_rank_batch` reads it; ``hidden`` is the MLP's layer
    widths (other models ignore it); ``comm=False`` turns communication off (a control);
    ``bucket_bytes`` and ``comm_hook`` are :class:`~nccltree.parallel.DataParallel`'s.
    """

    devices: str
    model: str
    batch_size: int
    solver: SolverConfig
    hidden: tuple[int, ...] = (256,)
    scaling: str = "weak"
    algorithm: str = "tree"
    update_mode: str = "allreduce"
    bucket_bytes: int = 0
    comm_hook: str | None = None
    comm: bool = True
    seed: int = 0
    timeout: float = 60.0
    blas_threads: int | None = None
    iter_size: int = 1  # Caffe's iter_size: batches accumulated per iteration


@dataclass(frozen=True)
class TransformConfig:
    """Caffe's ``transform_param`` for the readers beyond the scale: ``mean`` (None, one
    value for all channels, one per channel or an array of the record shape), ``crop`` (None or N: N x N
    windows of (C, H, W) records) and ``mirror``, drawn from ``seed`` (see
    :class:`nccltree.data.DataReader`). Training readers draw random windows and flips;
    evaluation readers take the center window and never flip."""

    mean: np.ndarray | tuple[float, ...] | float | None = None
    crop: int | None = None
    mirror: bool = False
    seed: int = 0


NO_TRANSFORM = TransformConfig()


@dataclass
class Training:
    """What :func:`build_training` made; valid inside its ``with`` block."""

    devices: list[Device]
    model: Model
    driver: DataParallel
    per_rank_batch: int
    reader: DataReader | None = None
    group: ProcessGroup | None = None

    @property
    def ranks(self) -> int:
        """Ranks over every process (this process's devices without a group)."""
        return self.group.size if self.group is not None else len(self.devices)


def group_devices(spec: str, flag: str = "--devices") -> str:
    """The devices of each process of a job: ``cpu`` (one rank), ``cpu:N`` (N ranks),
    ``gpu`` (one GPU: the process's index among its node's processes, modulo the GPUs it
    sees) or ``gpu:K`` (CUDA device K); ``auto`` is ``gpu`` where CuPy sees a GPU, else
    ``cpu``. Anything else is a ValueError."""
    spec = spec.strip()
    if spec == "auto":
        from .._errors import BackendUnavailable
        from ..backends import gpu_count

        try:
            return "gpu" if gpu_count() > 0 else "cpu"
        except BackendUnavailable:
            return "cpu"
    if spec in ("cpu", "gpu") or (
        spec[:4] in ("cpu:", "gpu:")
        and spec[4:].isdigit()
        and (spec.startswith("gpu") or int(spec[4:]) > 0)
    ):
        return spec
    raise ValueError(
        f"{flag} {spec}: in a job of several processes each holds 'cpu' (one rank), "
        "'cpu:N' (N ranks), 'gpu' (one GPU, picked by the process's index on its node) or "
        "'gpu:K' (CUDA device K)"
    )


@contextlib.contextmanager
def open_group(devices: str, algorithm: str, timeout: float) -> Iterator[ProcessGroup]:
    """The process group of every process of the job (``devices``: each process's, see
    :func:`group_devices`), started as the environment shows (MPI under mpiexec, the
    store under ``nccltree-run``, torchrun's or Slurm's variables), closed when the block
    ends. Every process must hold the same number of ranks (the data are dealt that
    way)."""
    from ..comm.group import init_process_group

    pg = init_process_group(devices=devices, algorithm=algorithm, timeout=timeout)
    try:
        if pg.size != len(pg.ranks) * pg.nprocs:
            raise ValueError(
                f"every process must hold the same number of ranks; this one holds "
                f"{len(pg.ranks)} of {pg.size} over {pg.nprocs} processes"
            )
        yield pg
    finally:
        pg.close()
        ignore_launcher_notices()


def ignore_launcher_notices() -> None:
    """After a process group closed, this process goes on on its own: a notice from the
    launcher that another process ended (SIGUSR1, whose default action would end this one
    too) changes nothing any more (the main thread only sets signal handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def bucket_bytes(mib: float) -> int:
    """``--bucket-mb``'s MiB (2**20 bytes, as PyTorch's ``bucket_cap_mb``) in bytes."""
    return round(mib * (1 << 20))


def make_model(name: str, shape: tuple[int, ...], classes: int, hidden: tuple[int, ...]) -> Model:
    """The reference model ``name`` for examples of ``shape`` and ``classes`` (``hidden``:
    the MLP's layer widths, ignored by the others)."""
    from ..models import build_model

    if name == "mlp":
        return build_model(name, shape, classes, hidden=hidden)
    return build_model(name, shape, classes)


@contextlib.contextmanager
def build_training(
    cfg: DriverConfig,
    shape: tuple[int, ...],
    classes: int,
    *,
    data: str | None = None,
    shuffle: int | None = None,
    scale: float | None = None,
    decode: tuple[bool, bool] = (False, False),
    transform: TransformConfig = NO_TRANSFORM,
    resume: Snapshot | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
    group: ProcessGroup | None = None,
) -> Iterator[Training]:
    """Make the devices of ``cfg.devices``, the model for examples of ``shape`` and
    ``classes``, the driver (restored from ``resume`` if given) and, when ``data`` names a
    database, the reader that serves its ranks from where the driver continues (with
    ``shuffle`` seed, input ``scale`` and the image ``decode`` keywords of the reader,
    ``(force_color, force_gray)``, and the training ``transform``: mean, random crops
    and flips); ``weights`` (parameters by name, a fine-tuning's
    start) replace the initial parameters on every rank, a ValueError naming the
    parameter when one does not fit the model; everything is closed, and the host runtime
    stopped, when the block ends.

    Batches go straight to the devices' memory on GPUs; on virtual CPU devices they stay
    the reader's host arrays.

    With ``group`` (a process group, see :func:`open_group`), ``cfg.devices`` is ignored:
    the devices are the group's ranks in this process, the per-rank batch counts every
    rank of the group, the driver trains over the group and the reader deals this
    process's ranks' records only (``process_rank=group.proc``).
    """
    from ..data import DataReader
    from ..parallel import DataParallel, per_rank_batch

    with contextlib.ExitStack() as stack:
        if group is not None:
            devs: list[Device] = list(group.devices)  # the group releases them
        else:
            devs = stack.enter_context(open_devices(cfg.devices))
        total = group.size if group is not None else len(devs)
        per_rank = per_rank_batch(cfg.batch_size, total, cfg.scaling)
        model = make_model(cfg.model, shape, classes, cfg.hidden)
        s = cfg.solver
        dp = stack.enter_context(
            DataParallel(
                model,
                devs,
                algorithm=cfg.algorithm,
                update_mode=cfg.update_mode,
                bucket_bytes=cfg.bucket_bytes,
                comm_hook=cfg.comm_hook,
                comm=cfg.comm,
                seed=cfg.seed,
                timeout=cfg.timeout,
                blas_threads=cfg.blas_threads,
                lr=s.lr,
                momentum=s.momentum,
                weight_decay=s.weight_decay,
                lr_policy=s.lr_policy,
                gamma=s.gamma,
                power=s.power,
                stepsize=s.stepsize,
                stepvalue=s.stepvalue,
                max_iter=s.max_iter,
                clip_gradients=s.clip_gradients,
                iter_size=cfg.iter_size,
                group=group,
            )
        )
        start = 0
        if weights is not None:
            dp.params[0].load(weights)  # checks names and shapes before writing
            for p in dp.params[1:]:
                p.copy_from(dp.params[0])
        if resume is not None:
            dp.restore(resume)
            start = resume.position or 0
        reader = None
        if data is not None:
            reader = stack.enter_context(
                DataReader(
                    data,
                    per_rank,
                    len(devs),
                    start=start,
                    shuffle=shuffle,
                    process_rank=group.proc if group is not None else 0,
                    process_count=group.nprocs if group is not None else 1,
                    scale=scale,
                    mean=transform.mean,
                    crop=transform.crop,
                    mirror=transform.mirror,
                    train=True,
                    seed=transform.seed,
                    device=devs if devs[0].backend != "host" else None,
                    force_color=decode[0],
                    force_gray=decode[1],
                    log_on_wait=None,
                )
            )
        yield Training(devs, model, dp, per_rank, reader, group)
