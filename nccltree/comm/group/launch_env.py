"""How this process was started, and the bootstrap that follows from it.

:func:`detect` reads which launcher started the process from its environment, by
precedence: an MPI launcher's (``PMI_SIZE``/``PMI_RANK``: MPICH's ``mpiexec``, ``srun
--mpi=pmi2``; ``OMPI_COMM_WORLD_SIZE``/``OMPI_COMM_WORLD_RANK``: Open MPI's;
``MV2_COMM_WORLD_SIZE``: MVAPICH's; ``PMIX_RANK``: ``srun --mpi=pmix``), then
torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; ``nccltree-run`` sets the same), then Slurm's
(``SLURM_STEP_NUM_TASKS`` with ``SLURM_PROCID``: a task of an ``srun`` step; not
``SLURM_NTASKS`` alone, which a one-process script under ``sbatch`` also sees).

:func:`start` turns an ``init_method`` (or, with none, what :func:`detect` saw) into a
:class:`Started`: a bootstrap (:mod:`.bootstrap`) and, over MPI, the communicator.
``"env://"``, ``"tcp://host:port"`` and ``"slurm"`` meet through a :class:`.TCPStore`
hosted by rank 0 (or by ``nccltree-run``'s launcher on node 0, which says so with
``NCCLTREE_STORE_HOSTED=1``), ``"file://path"`` through a :class:`.FileStore`. The
store's port is ``NCCLTREE_STORE_PORT`` where set, else ``MASTER_PORT`` -- plus one
under torchrun, whose agent serves its own store on ``MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``) -- else, for ``"slurm"``, one derived from the
job and step ids. The store
requires the token in ``NCCLTREE_STORE_TOKEN`` when it is set (``nccltree-run`` sets a
random one per job). mpi4py is imported only on the MPI paths.

The silent case is refused: when the environment says the job has several processes
and the group would have one (say torchrun's variables, but MPI started as a singleton),
``start`` raises ``ValueError`` with one line naming the variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..._errors import BackendUnavailable, CommError
from .bootstrap import LocalBootstrap, MpiBootstrap, StoreBootstrap
from .store import HOSTED_VAR, TOKEN_VAR, FileStore, TCPStore

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from .bootstrap import Bootstrap

#: the store's port instead of MASTER_PORT (env:// and slurm)
PORT_VAR = "NCCLTREE_STORE_PORT"
#: where rank 0's store listens instead of its MASTER_ADDR (e.g. 0.0.0.0)
BIND_VAR = "NCCLTREE_STORE_BIND"
#: the key prefix of a group's bootstrap in the store (a launcher uses others)
PREFIX = "pg/"
METHODS = ("env://", "tcp://host:port", "file://path", "slurm", "mpi")


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher told this process. ``launcher``: ``"mpi"``, ``"torchrun"`` or
    ``"slurm"``; ``variables``: the ones that said so, as ``NAME=value``, for messages."""

    launcher: str
    size: int
    rank: int | None
    local_rank: int | None = None
    local_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    variables: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Started:
    """A bootstrap ready for a process group. ``mpi``/``comm``: mpi4py's ``MPI`` and the
    parent communicator when started over MPI, else None; ``method``: a short name for
    messages (``"mpi"``, ``"env://"``, ``"tcp://h:p"``, ``"file://p"``, ``"slurm"``,
    ``"single"``)."""

    boot: Bootstrap
    rank: int
    size: int
    method: str
    mpi: ModuleType | None = None
    comm: _MPI.Intracomm | None = None
    local_rank: int | None = None
    local_size: int | None = None


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None


def _vars(environ: Mapping[str, str], *names: str) -> tuple[str, ...]:
    return tuple(f"{n}={environ[n]}" for n in names if n in environ)


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launcher that started this process, by precedence (MPI's, torchrun's,
    Slurm's), or None for a process started on its own. ``environ``: default
    ``os.environ``."""
    env = os.environ if environ is None else environ
    for size_var, rank_var in (
        ("PMI_SIZE", "PMI_RANK"),
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
    ):
        size = _int(env, size_var)
        if size is not None:
            return LaunchEnv(
                "mpi", size, _int(env, rank_var), variables=_vars(env, size_var, rank_var)
            )
    if "PMIX_RANK" in env:  # srun --mpi=pmix: the step's size is Slurm's
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        return LaunchEnv(
            "mpi",
            _int(env, size_var) or 1,
            _int(env, "PMIX_RANK"),
            variables=_vars(env, "PMIX_RANK", size_var),
        )
    size = _int(env, "WORLD_SIZE")
    if size is not None:
        return LaunchEnv(
            "torchrun",
            size,
            _int(env, "RANK"),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_WORLD_SIZE"),
            env.get("MASTER_ADDR") or None,
            _int(env, "MASTER_PORT"),
            _vars(env, "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"),
        )
    size = _int(env, "SLURM_STEP_NUM_TASKS")
    rank = _int(env, "SLURM_PROCID")
    if size is not None and rank is not None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or ""
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
        node_id = _int(env, "SLURM_NODEID")
        local_size = (
            per_node[node_id] if node_id is not None and 0 <= node_id < len(per_node) else None
        )
        return LaunchEnv(
            "slurm",
            size,
            rank,
            _int(env, "SLURM_LOCALID"),
            local_size,
            env.get("MASTER_ADDR") or (first_host(nodes) if nodes else None),
            _int(env, "MASTER_PORT") or slurm_port(env),
            _vars(env, "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
        )
    return None


def several_processes(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables (``NAME=value``) by which the environment says the job has more
    than one process (any launcher's, not only the one that wins)."""
    env = os.environ if environ is None else environ
    out = []
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE"):
        n = _int(env, name)
        if n is not None and n > 1:
            out.append(f"{name}={n}")
    n = _int(env, "SLURM_STEP_NUM_TASKS")
    if n is not None and n > 1 and "SLURM_PROCID" in env:
        out.append(f"SLURM_STEP_NUM_TASKS={n}")
    return out


# -- Slurm's host lists ---------------------------------------------------------------------


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"a Slurm host list with an unmatched ']': {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"a Slurm host list with an unmatched '[': {text!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_one(item: str) -> Iterator[str]:
    i = item.find("[")
    if i < 0:
        yield item
        return
    j = item.index("]", i)
    head, body, tail = item[:i], item[i + 1 : j], item[j + 1 :]
    for piece in body.split(","):
        m = _RANGE.match(piece.strip())
        if not m:
            raise ValueError(f"a Slurm host list with a bad range {piece!r} in {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"a Slurm host list with a range that runs down: {piece!r}")
        width = len(lo)
        for n in range(int(lo), int(hi) + 1):
            for rest in _expand_one(tail):
                yield f"{head}{n:0{width}d}{rest}"


def expand_hostlist(text: str) -> Iterator[str]:
    """The hosts of a Slurm host list, in order: ``node[01-03,07],gpu5`` gives node01,
    node02, node03, node07, gpu5 (zero padding kept; several bracket groups in one name
    give every combination)."""
    for item in _split_top(text.strip()):
        yield from _expand_one(item)


def first_host(text: str) -> str:
    """The first host of a Slurm host list (``ValueError`` if it has none)."""
    for host in expand_hostlist(text):
        return host
    raise ValueError(f"a Slurm host list with no host: {text!r}")


def tasks_per_node(text: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_port(environ: Mapping[str, str]) -> int | None:
    """The store's port for a Slurm step, from its job and step ids (in 20000..59999, so
    that two steps of one job, or two jobs, rarely meet); None outside a job."""
    job = _int(environ, "SLURM_JOB_ID")
    if job is None:
        return None
    step = _int(environ, "SLURM_STEP_ID") or 0
    return 20000 + (job * 20 + step % 20) % 40000


# -- start ----------------------------------------------------------------------------------


def default_method(environ: Mapping[str, str] | None = None, seen: LaunchEnv | None = None) -> str:
    """The ``init_method`` :func:`start` takes when given none: ``"mpi"`` under an MPI
    launcher, ``"env://"`` under torchrun's variables, ``"slurm"`` in an srun step, and
    for a process started on its own ``"mpi"`` where mpi4py imports, else ``"single"``.
    ``seen``: :func:`detect`'s answer where the caller has it."""
    if seen is None:
        seen = detect(environ)
    if seen is None:
        return "mpi" if _mpi_importable() else "single"
    return {"mpi": "mpi", "torchrun": "env://", "slurm": "slurm"}[seen.launcher]


def start(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    timeout: float,
    environ: Mapping[str, str] | None = None,
) -> Started:
    """A bootstrap for this process's group (see the module docstring). ``rank`` and
    ``world_size`` override the environment's (``tcp://`` and ``file://`` need them
    there or here). Collective: every process of the job calls it."""
    env = os.environ if environ is None else environ
    seen = detect(env)
    method = init_method if init_method is not None else default_method(env, seen)
    if method == "mpi":
        started = _start_mpi(timeout, rank, world_size, seen)
    elif method == "single":
        started = Started(LocalBootstrap(), 0, 1, "single")
    elif method == "env://":
        started = _start_env(env, rank, world_size, timeout)
    elif method == "slurm":
        started = _start_slurm(env, rank, world_size, timeout)
    elif method.startswith("tcp://"):
        started = _start_tcp(method, env, rank, world_size, timeout)
    elif method.startswith("file://"):
        started = _start_file(method, env, rank, world_size, timeout)
    else:
        raise ValueError(
            f"init_method {init_method!r} is not one of {', '.join(METHODS)} (or None)"
        )
    many = several_processes(env)
    if many and started.size == 1:
        started.boot.abort("refused")
        _close(started.boot)
        raise ValueError(
            f"the environment says this job has several processes ({', '.join(many)}) but "
            f"the process group would have one (started by {started.method}); start every "
            "process the same way, or pass init_method= to match how they were launched"
        )
    return started


def _close(boot: Bootstrap) -> None:
    close = getattr(boot, "close", None)
    if close is not None:
        close()


def _mpi_importable() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _start_mpi(
    timeout: float, rank: int | None, world_size: int | None, seen: LaunchEnv | None
) -> Started:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        how = f" (launched by MPI: {', '.join(seen.variables)})" if seen and seen.variables else ""
        raise BackendUnavailable(
            f"starting over MPI{how} needs mpi4py: pip install 'nccltree[mpi]' (mpi4py, over "
            "this machine's MPI) or 'nccltree[mpich]' (mpi4py and the MPICH wheel, mpiexec "
            "included); without MPI, start the processes with nccltree-run or torchrun "
            "(init_method='env://') or in an srun step ('slurm')"
        ) from exc
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    if (rank is not None and rank != me) or (world_size is not None and world_size != n):
        raise ValueError(
            f"init_method 'mpi': rank={rank}, world_size={world_size} differ from MPI's "
            f"(rank {me} of {n}); leave them out"
        )
    boot = MpiBootstrap(comm, timeout, MPI)
    return Started(boot, me, n, "mpi", MPI, comm)


def _need(value: int | None, what: str) -> int:
    if value is None:
        raise ValueError(f"{what} is not set")
    return value


def _check_rank(rank: int, size: int, method: str) -> None:
    if size < 1:
        raise ValueError(f"{method}: the world size is {size}, not a positive number")
    if not 0 <= rank < size:
        raise ValueError(f"{method}: rank {rank} is not in 0..{size - 1}")


def _token(env: Mapping[str, str]) -> str | None:
    return env.get(TOKEN_VAR) or None


def _tcp(
    method: str,
    host: str,
    port: int,
    rank: int,
    size: int,
    timeout: float,
    env: Mapping[str, str],
    local: tuple[int | None, int | None] = (None, None),
) -> Started:
    _check_rank(rank, size, method)
    if size == 1 and env.get(HOSTED_VAR) != "1":
        return Started(LocalBootstrap(), 0, 1, method, local_rank=0, local_size=1)
    hosts = rank == 0 and env.get(HOSTED_VAR) != "1"
    where = (env.get(BIND_VAR) or host) if hosts else host
    try:
        store = TCPStore(where, port, is_server=hosts, timeout=timeout, token=_token(env))
    except CommError as exc:
        raise type(exc)(f"rank {rank} ({method}): {exc}") from exc
    try:
        boot = StoreBootstrap(store, rank, size, timeout, PREFIX)
    except BaseException:
        store.close()
        raise
    return Started(boot, rank, size, method, local_rank=local[0], local_size=local[1])


def _start_env(
    env: Mapping[str, str], rank: int | None, world_size: int | None, timeout: float
) -> Started:
    r = rank if rank is not None else _need(_int(env, "RANK"), "env://: RANK")
    n = (
        world_size
        if world_size is not None
        else _need(_int(env, "WORLD_SIZE"), "env://: WORLD_SIZE")
    )
    addr = env.get("MASTER_ADDR") or None
    if addr is None:
        raise ValueError("env://: MASTER_ADDR is not set")
    port = _int(env, PORT_VAR)
    if port is None:
        port = _need(_int(env, "MASTER_PORT"), "env://: MASTER_PORT")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get(HOSTED_VAR) != "1":
            port += 1  # torchrun's agent serves its own store on MASTER_PORT
    local = (_int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"))
    return _tcp("env://", addr, port, r, n, timeout, env, local)


def _start_slurm(
    env: Mapping[str, str], rank: int | None, world_size: int | None, timeout: float
) -> Started:
    r = rank if rank is not None else _need(_int(env, "SLURM_PROCID"), "slurm: SLURM_PROCID")
    n = world_size
    if n is None:
        n = _int(env, "SLURM_STEP_NUM_TASKS") or _need(
            _int(env, "SLURM_NTASKS"), "slurm: SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)"
        )
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or ""
    addr = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else None)
    if addr is None:
        raise ValueError("slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_NODELIST is set")
    port = _int(env, PORT_VAR) or _int(env, "MASTER_PORT") or slurm_port(env)
    if port is None:
        raise ValueError(f"slurm: none of {PORT_VAR}, MASTER_PORT, SLURM_JOB_ID is set")
    seen = detect(env)
    local = (_int(env, "SLURM_LOCALID"), seen.local_size if seen else None)
    return _tcp("slurm", addr, port, r, n, timeout, env, local)


def _from_args(
    method: str, env: Mapping[str, str], rank: int | None, world_size: int | None
) -> tuple[int, int]:
    r = rank if rank is not None else _int(env, "RANK")
    n = world_size if world_size is not None else _int(env, "WORLD_SIZE")
    if r is None or n is None:
        raise ValueError(f"{method} needs rank= and world_size= (or RANK and WORLD_SIZE)")
    return r, n


def _start_tcp(
    method: str, env: Mapping[str, str], rank: int | None, world_size: int | None, timeout: float
) -> Started:
    url = urlsplit(method)
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise ValueError(f"init_method {method!r} is not tcp://host:port")
    r, n = _from_args(method, env, rank, world_size)
    return _tcp(f"tcp://{url.hostname}:{port}", url.hostname, port, r, n, timeout, env)


def _start_file(
    method: str, env: Mapping[str, str], rank: int | None, world_size: int | None, timeout: float
) -> Started:
    path = method[len("file://") :]
    if not path:
        raise ValueError(f"init_method {method!r} is not file://path")
    r, n = _from_args(method, env, rank, world_size)
    _check_rank(r, n, method)
    if n == 1:
        return Started(LocalBootstrap(), 0, 1, method)
    store = FileStore(path, timeout=timeout, owner=r == 0)
    try:
        boot = StoreBootstrap(store, r, n, timeout, PREFIX)
    except BaseException:
        store.close()
        raise
    return Started(boot, r, n, method)
