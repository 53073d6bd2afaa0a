"""The processes of a job agree on how they start, before any of them trains.

``mpiexec -n 1 nccltree-train --lr 0.05 : -n 1 nccltree-train --lr 0.5`` is two processes
that would train one model with two learning rates, every collective matched and the
result silently wrong. So each process brings what it resolved from its command line
(the run's configuration, flag by flag, or the usage error that stopped it) to one
exchange over a process group of its own (one host rank per process, the ``tree``
algorithm, whatever ``--devices`` and ``--algorithm`` say, since those may be what
differs):

1. an ``all_gather`` of a fixed-size digest of that (SHA-256) and the length of its
   text: where every digest is the same, the processes agree (or all failed alike), and
   that is the whole cost, one small collective at start;
2. only where they differ, an ``all_gather`` of the texts padded to the longest, from
   which every process computes the same message: the flags that differ and which
   process holds which value (``--lr: 0.05 on processes [0], 0.5 on processes [1]``),
   or the errors and the processes that found them.

Every process then raises the same error (a :class:`UsageError`, which the job's first
process prints, once), before any training. The processes are named by their launcher
rank (``mpiexec``'s numbering, torchrun's ``RANK``, Slurm's ``SLURM_PROCID``:
:func:`job_rank`). The group is started as the environment shows (MPI under mpiexec,
the store otherwise), so the agreement needs no MPI of its own.

:func:`gather_processes` is the same kind of exchange for anything else the processes
must tell each other (whether each set up its run), over any group.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ._common import RuntimeFailure, UsageError, job_rank, over_mpi
from ._training import ignore_launcher_notices

if TYPE_CHECKING:
    from ..comm.group import ProcessGroup

_DIGEST = 32  # SHA-256
_HEAD = _DIGEST + 8  # and the length of the text, as a uint64


def exchange(pg: ProcessGroup, agreed: str, sent: str) -> list[str] | None:
    """Every process's ``sent`` where their ``agreed`` differ (in group rank order), else
    None: an all_gather of the digest of each ``agreed`` (and the length of ``sent``),
    and only on a mismatch a second one of the ``sent`` texts themselves (padded to the
    longest). Collective: every process of ``pg`` calls it."""
    raw = sent.encode("utf-8")
    head = np.zeros(_HEAD, np.uint8)
    head[:_DIGEST] = np.frombuffer(hashlib.sha256(agreed.encode("utf-8")).digest(), np.uint8)
    head[_DIGEST:] = np.frombuffer(np.uint64(len(raw)).tobytes(), np.uint8)
    heads = _all_gather(pg, head).reshape(pg.size, _HEAD)
    if (heads[:, :_DIGEST] == heads[0, :_DIGEST]).all():
        return None
    lengths = [int(np.frombuffer(row[_DIGEST:].tobytes(), np.uint64)[0]) for row in heads]
    width = max(lengths)
    mine = np.zeros(width, np.uint8)
    mine[: len(raw)] = np.frombuffer(raw, np.uint8)
    every = _all_gather(pg, mine).reshape(pg.size, width)
    return [bytes(every[i, :n]).decode("utf-8") for i, n in enumerate(lengths)]


def _all_gather(pg: ProcessGroup, x: np.ndarray) -> np.ndarray:
    """The group's public all_gather of this process's one rank: every rank's ``x``."""
    return pg.call("all_gather", [x], [np.empty(x.size * pg.size, x.dtype)])[0]


def gather_processes(pg: ProcessGroup, obj: object) -> list[object]:
    """Every process's ``obj`` (picklable; the job's own data only), in the group's
    process order: one ``all_gather_object`` over the group's ranks, each of this
    process's ranks bringing the same (one thread per local rank where it holds
    several). Collective: every process of ``pg`` calls it; bounded by the group's
    timeout."""
    mine = (pg.proc, obj)
    n = len(pg.ranks)
    if n == 1:
        every = pg.all_gather_object(mine)
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="nccltree-gather") as pool:
            calls = [pool.submit(pg.comm(i).all_gather_object, mine) for i in range(n)]
            every = [c.result() for c in calls][0]
    by_proc: dict[int, object] = {}
    for item in every:
        assert isinstance(item, tuple) and len(item) == 2, "each rank sent (proc, obj)"
        by_proc.setdefault(int(item[0]), item[1])
    return [by_proc[p] for p in range(pg.nprocs)]


def agree_on_start(
    config: Mapping[str, object] | None,
    error: BaseException | None,
    timeout: float,
    flag: Mapping[str, str] | None = None,
) -> None:
    """In a job, before anything else: every process brings its ``config`` (a flag's
    key to its value, as JSON takes it) or the ``error`` that stopped it; unless every
    process brought the same configuration, every process raises the same error:
    :class:`UsageError` naming the flags that differ (``flag`` spells a key as the
    command line does; default ``--key-name``) or the usage errors found, else
    :class:`RuntimeFailure`. A process group (host ranks, ``tree``) is opened for the
    exchange and closed again."""
    from ..comm.group import init_process_group

    usage = error is None or isinstance(error, UsageError)
    said = None if error is None else (str(error) or repr(error))
    body = {
        "config": None if error is not None else dict(config or {}),
        "error": said,
        "usage": usage,
    }
    agreed = json.dumps(body, sort_keys=True, default=str)
    sent = json.dumps({"body": json.loads(agreed), "proc": job_rank()}, sort_keys=True)
    pg = init_process_group(devices="cpu", algorithm="tree", timeout=timeout)
    try:
        texts = exchange(pg, agreed, sent)
    finally:
        pg.close()
        ignore_launcher_notices()
    if texts is None:
        if error is not None:  # every process failed alike: the first says it, once
            raise (UsageError if usage else RuntimeFailure)(str(error) or repr(error))
        return
    starts = [json.loads(t) for t in texts]
    raise _disagreement(starts, flag or {})


def _procs(procs: Sequence[int]) -> str:
    return f"process{'es' if len(procs) > 1 else ''} {sorted(procs)}"


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _disagreement(starts: list[dict[str, object]], flag: Mapping[str, str]) -> Exception:
    """The one error every process raises when their starts differ."""
    bodies = [(int(str(s["proc"])), s["body"]) for s in starts]
    failed: dict[str, list[int]] = {}
    usage = True
    for proc, body in bodies:
        assert isinstance(body, dict)
        if body["error"] is not None:
            failed.setdefault(str(body["error"]), []).append(proc)
            usage = usage and bool(body["usage"])
    if failed:
        if len(failed) == 1 and len(next(iter(failed.values()))) == len(bodies):
            message = next(iter(failed))
        else:
            message = "; ".join(f"{_procs(p)}: {e}" for e, p in failed.items())
        return (UsageError if usage else RuntimeFailure)(message)
    configs = [(proc, body["config"]) for proc, body in bodies if isinstance(body, dict)]
    keys: list[str] = []
    for _, cfg in configs:
        assert isinstance(cfg, dict)
        keys += [k for k in cfg if k not in keys]
    diffs = []
    for key in keys:
        held: dict[str, list[int]] = {}
        for proc, cfg in configs:
            assert isinstance(cfg, dict)
            held.setdefault(_show(cfg.get(key)), []).append(proc)
        if len(held) > 1:
            name = flag.get(key, "--" + key.replace("_", "-"))
            diffs.append(f"{name}: " + ", ".join(f"{v} on {_procs(p)}" for v, p in held.items()))
    job = "MPI job" if over_mpi() else "job"
    return UsageError(
        f"the processes of this {job} were given different flags (every process must be "
        "given the same): " + "; ".join(diffs)
    )
