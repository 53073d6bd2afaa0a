"""The collective benchmark driver, in the style of nccl-tests.

One driver; each collective plugs in its row of the collectives table
(:mod:`nccltree.comm.collectives`): how a byte count becomes element counts, the bytes
``S`` the bandwidth figures use, the expected result, the bus-bandwidth factor, where input
and output sit in place, and which arguments its method takes. The driver adds
what every collective shares: seeded data that differ per rank and per element, warm-up
iterations, timed iterations each on a synchronised clock (``time.perf_counter`` around a
synchronous call on the host backend, device events on CUDA), the median, and a ``#wrong``
check of every rank's result.

Figures mean what nccl-tests' mean: ``algbw = S / t`` and ``busbw = algbw * factor`` with
``S = count * itemsize`` (for all_gather and reduce_scatter the whole gathered array) and
factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and reduce_scatter, ``1``
for broadcast and reduce. GB = 1e9 bytes.

Over a process group (``Benchmark(..., group=pg)``, the command line under MPI), each
process makes and checks only its own ranks' buffers and calls the group's collectives
(``pg.call``, under each algorithm in turn); as in nccl-tests' MPI mode every rank times its calls and the
reported time aggregates every rank's (the slowest by default), and ``#wrong`` sums every
rank's count, both gathered through the group.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import DTypeLike

from .._validate import check_call_timeout, check_choice, check_index, check_int, check_real, is_int
from ..backends.base import CARRIERS, FLOAT_DTYPES
from . import _ops
from ._args import Array
from ._ops import reference, widen
from .collectives import COLLECTIVES, Collective, collective_name
from .plan import ALIGN_BYTES, CHUNK_BYTES
from .trace import Span

if TYPE_CHECKING:
    from ..backends.base import Device
    from ..topology import Topology
    from .group import ProcessGroup
    from .world import World

__all__ = [
    "Benchmark",
    "BenchRecord",
    "MemoryNeed",
    "available_memory",
    "cpu_name",
    "reference",
    "run_benchmark",
]

PLACEMENTS = ("out-of-place", "in-place")
# How one time is made of the ranks' times, by nccl-tests' ``-a`` number: rank 0's, the
# mean, the fastest rank's, the slowest rank's.
AGGREGATES = ("rank0", "mean", "min", "max")
# Users may write dtypes as nccl-tests does.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "int": "int32"}
_SIZE_RE = re.compile(r"(\d+)\s*([kmgt]?)(i?b)?", re.IGNORECASE)

WorldFactory = Callable[[Sequence["Device"], str], "World"]

# The share of the available memory a sweep may plan to use: the rest is for what the
# estimate leaves out (the interpreter, numpy's temporaries, other processes' growth).
MEMORY_HEADROOM = 0.8
# Bytes per element of the expected results: float64 (int64 for integers), see widen().
_WIDE = 8


# -- data ---------------------------------------------------------------------------------


def init_data(
    rank: int, n: int, count: int, dtype: DTypeLike, op: str = "sum", seed: int = 0
) -> np.ndarray:
    """Rank ``rank``'s input: seeded, different per rank and per element, small integers
    (as nccl-tests uses) so that sums over up to 64 ranks stay exact even in float16.
    For ``prod`` the values are +-1 with one rank contributing +-2 per element, so the
    product stays +-2 however many ranks there are."""
    rng = np.random.default_rng([seed, rank, n])
    if op == "prod":
        v = rng.integers(0, 2, count, dtype=np.int8) * 2 - 1
        v[(rank % n) :: n] *= 2
    else:
        v = rng.integers(-4, 5, count, dtype=np.int8)
    return v.astype(dtype)


def _poison(count: int, dtype: np.dtype) -> np.ndarray:
    """What output buffers hold before a call: a value no correct result has, so that an
    element the collective forgot to write counts as wrong: NaN for floats, the most
    negative integer of the dtype's width for integers (for uint8 its image, 128, which
    no result of :func:`init_data` reaches below 32 ranks)."""
    if dtype in FLOAT_DTYPES:
        return np.full(count, np.nan, dtype)
    low = np.iinfo(np.dtype(f"i{dtype.itemsize}")).min
    return np.full(count, low, np.dtype(f"i{dtype.itemsize}")).view(dtype)


def tolerance(dtype: DTypeLike) -> float:
    """Relative tolerance of the check: integers are exact; floats may round a mean (or a
    float16 or bfloat16 result accumulated in float32) by an ulp or so."""
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        return 0.0
    import ml_dtypes  # a float dtype here is numpy's or (bfloat16) ml_dtypes' own

    return 4 * float(ml_dtypes.finfo(dtype).eps)


def count_wrong(actual: np.ndarray, expected: np.ndarray, dtype: DTypeLike) -> int:
    """Elements of ``actual`` outside the tolerance of ``expected`` (NaN counts)."""
    if actual.size != expected.size:
        return max(actual.size, expected.size)
    if not actual.size:
        return 0
    a = widen(np.asarray(actual).reshape(-1))
    tol = tolerance(dtype)
    if tol == 0.0:
        # integer sums and products wrap around in the dtype (int8 past 127, say)
        return int(np.count_nonzero(a != widen(expected.astype(dtype))))
    ok = np.abs(a - expected) <= tol * np.maximum(1.0, np.abs(expected))
    return int(a.size - np.count_nonzero(ok))


# -- results ------------------------------------------------------------------------------


@dataclass
class BenchRecord:
    """One line of a benchmark: a size x algorithm x placement, with every column."""

    collective: str
    algorithm: str
    placement: str  # "out-of-place" | "in-place"
    size: int  # S in bytes (nccl-tests' definition)
    count: int  # S / itemsize
    dtype: str
    op: str  # "none" for collectives without a reduction
    root: int  # -1 for collectives without a root
    ranks: int
    time_us: float  # median of the timed iterations
    algbw: float  # GB/s
    busbw: float  # GB/s
    wrong: int | None  # None: not checked
    iters: int
    warmup: int
    bus_factor: float
    devices: str
    machine: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bandwidths(size: int, seconds: float, factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for ``size`` bytes in ``seconds``."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size / seconds / 1e9
    return algbw, algbw * factor


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says: recorded
    with every measurement (the benchmarks' tables and JSON)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(devices: Sequence[Device]) -> dict[str, object]:
    """The machine and devices a result was measured on."""
    cpu = cpu_name()
    import nccltree

    backend = devices[0].backend if devices else "none"
    desc: dict[str, object] = {
        "backend": backend,
        "device_names": [d.name for d in devices],
        "device_threads": [getattr(d, "threads", None) for d in devices],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "nccltree": nccltree.__version__,
    }
    if backend == "cuda":
        desc["gpus"] = _gpu_models(devices)
    return desc


def _gpu_models(devices: Sequence[Device]) -> list[str]:
    """The model name of each device's GPU (CuPy is there: the devices are CUDA ones)."""
    import cupy as cp

    names = []
    for d in devices:
        name = cp.cuda.runtime.getDeviceProperties(d.physical_id)["name"]
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


# -- sizes and arguments ------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """Bytes from ``"8"``, ``"64K"``, ``"64M"``, ``"1G"`` (powers of 1024, as nccl-tests;
    a trailing ``B``/``iB`` is allowed)."""
    if is_int(text):
        value = int(text)
    else:
        m = _SIZE_RE.fullmatch(str(text).strip())
        if not m:
            raise ValueError(
                f"bad size {text!r}; accepted: a byte count with an optional K, M, G or T "
                "suffix (powers of 1024), e.g. 8, 64K, 64M, 1G"
            )
        value = int(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower())
    if value < 0:
        raise ValueError(f"a size must be >= 0 bytes, got {text!r}")
    return value


def size_range(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """``minbytes, minbytes*factor, ...`` up to ``maxbytes`` (nccl-tests' ``-b -e -f``)."""
    if minbytes > maxbytes:
        raise ValueError(f"min size {minbytes} B is larger than max size {maxbytes} B")
    factor = check_real(factor, "the step factor", min=1.0, min_open=True)
    if minbytes == 0:
        return [0] if maxbytes == 0 else [0, *size_range(1, maxbytes, factor)]
    sizes: list[int] = []
    s = float(minbytes)
    while int(s) <= maxbytes:
        if not sizes or int(s) != sizes[-1]:
            sizes.append(int(s))
        s *= factor
    return sizes


def check_dtype(name: DTypeLike) -> np.dtype:
    """The numpy dtype for a name (nccl-tests' ``half``, ``float``, ``double`` too)."""
    key = DTYPE_ALIASES.get(str(name), name)
    dtype: np.dtype | None
    try:
        dtype = np.dtype(key)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in _ops.DTYPES:
        accepted = ", ".join(str(d) for d in _ops.DTYPES)
        raise ValueError(
            f"unknown dtype {name!r}; accepted: {accepted} (also half, float, double, int)"
        )
    return dtype


def default_world(devices: Sequence[Device], algorithm: str, timeout: float = 60.0) -> World:
    """A :class:`~nccltree.comm.World` running ``algorithm`` on ``devices``."""
    from .world import World

    return World(devices, algorithm=algorithm, timeout=timeout)


# -- memory -------------------------------------------------------------------------------


def available_memory() -> int | None:
    """Bytes of host memory new allocations can take without swapping: ``MemAvailable``
    of ``/proc/meminfo`` (Linux), else the free pages ``sysconf`` reports; None when the
    system says neither. The bound of a sweep is this, never the core count."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def device_free_memory(devices: Sequence[Device]) -> dict[int, int]:
    """Free bytes of each physical GPU among ``devices`` (CUDA; empty for host devices)."""
    if not devices or devices[0].backend != "cuda":
        return {}
    import cupy as cp

    free: dict[int, int] = {}
    for d in devices:
        if d.physical_id not in free:
            free[d.physical_id] = int(cp.cuda.Device(d.physical_id).mem_info[0])
    return free


@dataclass(frozen=True)
class MemoryNeed:
    """What one size of a sweep holds at its peak, in bytes (an upper bound).

    ``buffers_per_rank``: a rank's input and output of one call (out of place, the larger
    placement). ``scratch_per_rank[algorithm]``: the scratch and staging memory that
    algorithm's World keeps for a rank (plans allocate at most the message plus a chunk
    of scratch, and two chunks of pinned staging where a link has no peer access).
    ``reference``: the driver's host arrays, every rank's input data and the expected
    results in float64 (one per rank for reduce, whose other inputs must stay unchanged),
    and the check's temporaries. ``host_bytes``: all of it that sits in host memory;
    ``device_bytes``: per physical GPU (CUDA), the buffers and scratch of its ranks.
    """

    size: int
    buffers_per_rank: int
    scratch_per_rank: dict[str, int]
    reference: int
    host_bytes: int
    device_bytes: dict[int, int]


# The chunk of a process group's plans (see ProcessGroup.plan).


def _on_devices(pg: ProcessGroup, host: Sequence[np.ndarray]) -> list[Array]:
    """Host arrays copied to this process's ranks' devices (GPU groups take device
    arrays; on the host backend this is a copy)."""
    return [d.from_host(h) for d, h in zip(pg.devices, host, strict=True)]


def group_barrier(pg: ProcessGroup) -> None:
    """Every rank of the group got here, and this process's devices are idle."""
    pg.call("all_reduce", _on_devices(pg, [np.zeros(1, np.float32) for _ in pg.ranks]))
    for d in pg.devices:
        d.synchronize()


def gather_values(pg: ProcessGroup, values: Sequence[float]) -> list[float]:
    """Every rank's value (``values``: this process's ranks'), in global rank order."""
    xs = _on_devices(pg, [np.array([v], dtype=np.float64) for v in values])
    outs = _on_devices(pg, [np.empty(pg.size, dtype=np.float64) for _ in values])
    got = pg.devices[0].to_host(pg.call("all_gather", xs, outs)[0])
    return [float(v) for v in got]


def _no_peer_access(topo: Topology) -> bool:
    return any(not topo.link(i, j).p2p for i in range(topo.n) for j in range(topo.n) if i != j)


# -- the driver ---------------------------------------------------------------------------


class _Timer:
    """Times one synchronous collective: ``perf_counter`` on host; on CUDA events on every
    rank's caller stream, the ranks' elapsed times made one by ``aggregate`` (default the
    slowest rank's, see :data:`AGGREGATES`)."""

    def __init__(self, devices: Sequence[Device], aggregate: str = "max") -> None:
        self.devices = list(devices)
        self.cuda = bool(devices) and devices[0].backend == "cuda"
        self.aggregate = aggregate

    def __call__(self, fn: Callable[[], object], timeout: float) -> float:
        return aggregate_times(self.rank_times(fn), self.aggregate)

    def rank_times(self, fn: Callable[[], object]) -> list[float]:
        """Seconds each rank spent in one call. On host the call is one synchronous
        driver-side call: every rank's time is the same clock's."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return [time.perf_counter() - t0] * len(self.devices)
        import cupy as cp

        pairs = []
        for d in self.devices:
            with cp.cuda.Device(d.physical_id):
                pairs.append((cp.cuda.Event(), cp.cuda.Event()))
                pairs[-1][0].record(_cupy_stream(d))
        fn()
        for d, (_, end) in zip(self.devices, pairs):
            with cp.cuda.Device(d.physical_id):
                end.record(_cupy_stream(d))
        for d, (_, end) in zip(self.devices, pairs):
            with cp.cuda.Device(d.physical_id):
                end.synchronize()
        return [cp.cuda.get_elapsed_time(s, e) / 1e3 for s, e in pairs]


def aggregate_times(times: Sequence[float], how: str) -> float:
    """One time of the ranks' ``times`` (see :data:`AGGREGATES`): ``rank0``, ``mean``,
    ``min`` or ``max``, as nccl-tests' ``-a 0..3``."""
    if how == "rank0":
        return times[0]
    if how == "mean":
        return sum(times) / len(times)
    if how == "min":
        return min(times)
    if how == "max":
        return max(times)
    raise ValueError(f"unknown aggregate {how!r}; accepted: {', '.join(AGGREGATES)}")


def _cupy_stream(device: Device) -> Any:
    """The CuPy stream behind a CUDA device's current stream."""
    from ..backends.cuda import CudaStream

    return cast(CudaStream, device.current_stream()).cupy_stream


@dataclass
class _SizeData:
    """The inputs and expected results of one message size, shared by every algorithm and
    placement (building them is the slow part of a large check). ``count`` is NCCL's."""

    elements: int
    count: int
    in_count: int
    out_count: int
    inputs: list[np.ndarray]
    expected: list[tuple[str, np.ndarray]] | None


class Benchmark:
    """nccl-tests for one device set: ``Benchmark(devices, algorithms, collectives, ...)``.

    Every argument is checked and every World created in the constructor, so a bad
    argument fails before anything runs. Iterating yields a :class:`BenchRecord` per
    collective x size x algorithm x placement, algorithms interleaved at each size so
    that background noise hits them alike. ``world_factory(devices, algorithm)`` makes the
    World of each algorithm (tests inject a broken one); ``names`` renames arguments in
    error messages (a command line's flags: ``{"root": "-r/--root"}``); a context manager.
    ``variants``: (dtype, op) pairs measured in turn (default the one pair ``dtype, op``);
    ``cycles``: how many times the whole sweep runs; ``aggregate``: how the ranks' times
    make one (:data:`AGGREGATES`; on host every rank has the same time).

    ``group`` (a :class:`~nccltree.comm.group.ProcessGroup`): the ranks are the group's,
    over every process; ``devices`` must be ``group.devices`` (this process's ranks) and
    each algorithm a group's (``mpi`` among them). Every process iterates the same sweep;
    the records are the same on all (times and ``#wrong`` gathered over every rank).
    """

    def __init__(
        self,
        devices: Sequence[Device] | str,
        algorithms: Sequence[str] = ("tree",),
        collectives: Sequence[str] = ("all_reduce",),
        sizes: Sequence[int | str] = (8,),
        *,
        dtype: DTypeLike = "float32",
        op: str = "sum",
        root: int = 0,
        iters: int = 20,
        warmup: int = 5,
        check: int = 1,
        placements: Sequence[str] = PLACEMENTS,
        variants: Sequence[tuple[DTypeLike, str]] | None = None,
        cycles: int = 1,
        aggregate: str = "max",
        seed: int = 0,
        timeout: float = 60.0,
        world_factory: WorldFactory | None = None,
        devices_label: str | None = None,
        names: Mapping[str, str] | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self._own_runtime: Any = None  # the host runtime made here, shut down by close()
        if isinstance(devices, str):
            from ..backends import devices as make_devices

            devices_label = devices_label or devices
            devices = make_devices(devices)
            if devices[0].backend == "host":
                self._own_runtime = devices[0].runtime
        self.worlds: dict[str, World] = {}  # in one process; over a group, none
        self.group = group
        try:
            # check every argument, then create the Worlds
            name = {k: k for k in ("root", "iters", "warmup", "check", "cycles")}
            name.update(names or {})
            self.devices = list(devices)
            if not self.devices:
                raise ValueError("the benchmark needs at least one device")
            if group is not None and len(self.devices) != len(group.ranks):
                raise ValueError("over a process group, the devices are group.devices")
            n = self.n = group.size if group is not None else len(self.devices)
            # the global ranks whose buffers this process makes, in device order
            self.local_ranks = list(group.ranks) if group is not None else list(range(n))
            self.label = devices_label or ",".join(d.name for d in self.devices)
            self.collectives = [collective_name(c) for c in collectives]
            if not self.collectives:
                raise ValueError("no collective given; accepted: " + ", ".join(COLLECTIVES))
            self.variants: list[tuple[np.dtype, str]] = []
            for dt, o in variants or [(dtype, op)]:
                self.variants.append((check_dtype(dt), o))
                if any(COLLECTIVES[c].reduces for c in self.collectives):
                    _ops.check_op(o, self.variants[-1][0])
                elif o not in _ops.OPS:
                    raise ValueError(f"unknown reduction op {o!r}; accepted: {', '.join(_ops.OPS)}")
            # the variant measured now; iterating goes through them all
            self.dtype, self.op = self.variants[0]
            self.cycles = check_int(cycles, name["cycles"], min=1)
            if aggregate not in AGGREGATES:
                raise ValueError(
                    f"unknown aggregate {aggregate!r}; accepted: {', '.join(AGGREGATES)}"
                )
            self.aggregate = aggregate
            self.root = check_index(root, name["root"], n)
            self.iters = check_int(iters, name["iters"], min=1)
            self.warmup = check_int(warmup, name["warmup"], min=0)
            self.check = check_int(check, name["check"], min=0)
            bad = [p for p in placements if p not in PLACEMENTS]
            if bad or not placements:
                raise ValueError(f"unknown placement {bad}; accepted: {', '.join(PLACEMENTS)}")
            self.placements = list(placements)
            self.sizes = [parse_size(s) for s in sizes]
            self.seed = check_int(seed, "seed", min=0)
            self.timeout = check_call_timeout(timeout)
            self.algorithms = list(algorithms)
            if not self.algorithms:
                raise ValueError("no algorithm given")
            if group is not None:
                from .group import GROUP_ALGORITHMS

                for a in self.algorithms:
                    check_choice(a, "algorithm", GROUP_ALGORITHMS)
            for a in self.algorithms if group is None else ():
                if a not in self.worlds:
                    if world_factory is None:
                        self.worlds[a] = default_world(self.devices, a, self.timeout)
                    else:
                        self.worlds[a] = world_factory(self.devices, a)
        except BaseException:
            self.close()  # the Worlds (and a runtime) made so far
            raise
        self.machine = machine_description(self.devices)
        self._timer = _Timer(self.devices, self.aggregate)

    def memory_needed(self, size: int) -> MemoryNeed:
        """An upper bound of the memory the sweep holds while it measures ``size`` bytes
        (see :class:`MemoryNeed`), the largest over its collectives (and dtypes: the
        smallest itemsize has the most elements)."""
        n, item = self.n, min(dt.itemsize for dt, _ in self.variants)
        buffers = reference = 0
        scratch = dict.fromkeys(self.algorithms, 0)
        for name in self.collectives:
            coll = COLLECTIVES[name]
            count = coll.count_for(size // item, n)
            cin, cout = coll.in_count(count, n), coll.out_count(count, n)
            big = max(cin, cout)
            buffers = max(buffers, (cin + cout) * item)
            # inputs of every rank, the expected results, then the temporaries of making a
            # call's buffers (a poisoned host array, the in-place one) and of the check (a
            # result widened, |a - b|, the tolerance, the comparison)
            # the expected results: one array shared by every rank, or one per rank (the
            # root's and the others' unchanged inputs, a block mix per rank...): asked of
            # the table's own reference on one-element blocks
            tiny = [np.zeros(coll.in_count(1, n), self.dtype) for _ in range(n)]
            arrays = {id(v if v.base is None else v.base) for _, v in coll.expected(tiny, "sum", 0)}
            expected = len(arrays) * big * _WIDE if self.check else 0
            temporaries = big * (2 * item + (4 * _WIDE if self.check else 0))
            reference = max(reference, n * cin * item + expected + temporaries)
            for alg in self.algorithms:
                if alg == "nccl":
                    continue  # NCCL's own buffers, outside this process's arrays
                world = self.worlds.get(alg)
                if world is not None:
                    chunk, no_peer = world.chunk_bytes, _no_peer_access(world.topology)
                else:
                    assert self.group is not None
                    chunk = CHUNK_BYTES
                    no_peer = _no_peer_access(self.group.topology)
                # each region rounded up to the plans' alignment
                need = (big * item + (chunk if no_peer else 0)) if coll.reduces else 0
                need += 2 * chunk if no_peer else 0
                need += 4 * ALIGN_BYTES if need else 0
                scratch[alg] = max(scratch[alg], need)
        per_rank = buffers + sum(scratch.values())
        host, device = reference, dict[int, int]()
        if self.devices[0].backend == "host":
            host += n * per_rank
        else:
            for d in self.devices:
                device[d.physical_id] = device.get(d.physical_id, 0) + per_rank
        return MemoryNeed(size, buffers, scratch, reference, host, device)

    def fit_memory(
        self,
        host_available: int | None = None,
        device_available: dict[int, int] | None = None,
    ) -> list[int]:
        """Drop the sizes whose :meth:`memory_needed` exceeds
        :data:`MEMORY_HEADROOM` of the available memory (default: :func:`available_memory`
        and each GPU's free memory), as nccl-tests lowers ``maxBytes``; returns the sizes
        dropped (``self.sizes`` keeps the others). Unknown memory drops nothing."""
        if host_available is None:
            host_available = available_memory()
        if device_available is None:
            device_available = device_free_memory(self.devices)
        kept: list[int] = []
        dropped: list[int] = []
        for size in self.sizes:
            need = self.memory_needed(size)
            fits = host_available is None or need.host_bytes <= MEMORY_HEADROOM * host_available
            for dev, nbytes in need.device_bytes.items():
                free = device_available.get(dev)
                fits = fits and (free is None or nbytes <= MEMORY_HEADROOM * free)
            (kept if fits else dropped).append(size)
        self.sizes = kept
        return dropped

    @property
    def total(self) -> int:
        """How many records iterating yields."""
        per_placement = len(self.sizes) * len(self.algorithms)
        return (
            self.cycles
            * per_placement
            * sum(
                len(self.placements_for(COLLECTIVES[c]))
                for names in self._schedule()
                for c in names
            )
        )

    def _schedule(self) -> list[list[str]]:
        """The collectives measured for each variant: a collective without a reduction
        only with the first op of each dtype (its results do not depend on the op)."""
        seen: set[np.dtype] = set()
        out = []
        for dt, _ in self.variants:
            first = dt not in seen
            seen.add(dt)
            out.append([c for c in self.collectives if first or COLLECTIVES[c].reduces])
        return out

    def close(self) -> None:
        """Close the Worlds, and shut down the devices made from a spec string."""
        for w in self.worlds.values():
            w.close()
        self.worlds = {}
        if self._own_runtime is not None:
            self._own_runtime.shutdown()
            self._own_runtime = None

    def __enter__(self) -> Benchmark:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[BenchRecord]:
        """Records for ``cycles`` runs of the sweep (nccl-tests' ``-N``), each going
        through the (dtype, op) variants, then the collectives, then the sizes."""
        for _ in range(self.cycles):
            for (dtype, op), names in zip(self.variants, self._schedule()):
                self.dtype, self.op = dtype, op
                for name in names:
                    coll = COLLECTIVES[name]
                    for size in self.sizes:
                        yield from self._measure_size(coll, size)
        self.dtype, self.op = self.variants[0]

    def _measure_size(self, coll: Collective, size: int) -> Iterator[BenchRecord]:
        # one size's data at a time: the previous size's are freed before these are made
        data = self._size_data(coll, size)
        for alg in self.algorithms:
            for placement in self.placements_for(coll):
                yield self.measure(coll, alg, data, placement == "in-place")

    def trace(self) -> list[tuple[str, list[str], list[Span]]]:
        """One call of the first collective at the largest size, out of place, traced step
        by step for every algorithm that runs a plan (``World.trace``); NCCL, which runs
        as one call, is left out. In one process only."""
        from .algorithms import ALGORITHMS

        coll = COLLECTIVES[self.collectives[0]]
        data = self._size_data(coll, self.sizes[-1])
        runs = []
        for alg in self.algorithms:
            if self.group is not None:
                raise ValueError("a trace runs in one process (not over a process group)")
            world = self.worlds[alg]
            ins, outs, _ = self._buffers(coll, data, False)
            dtype = self._keywords(coll).get("dtype")
            prep_alg = world._choose_for(coll.name, ins, outs, self.op, self.root,
                                         dtype=cast("DTypeLike | None", dtype))  # fmt: skip
            if prep_alg not in ALGORITHMS:
                continue
            spans = world.trace(coll.name, ins, outs, op=self.op if coll.reduces else "sum",
                                root=self.root, algorithm=prep_alg,
                                dtype=cast("DTypeLike | None", dtype))  # fmt: skip
            title = f"{alg}{f' ({prep_alg})' if alg != prep_alg else ''}: {coll.name} "
            title += f"{coll.nbytes(data.count, self.n, self.dtype.itemsize)} B"
            runs.append((title, [str(getattr(d, "name", d)) for d in self.devices], spans))
        return runs

    def placements_for(self, coll: Collective) -> list[str]:
        """The placements measured for ``coll``: all_to_all has no in-place form."""
        return [p for p in self.placements if coll.in_place_ok or p != "in-place"]

    # -- one measurement ------------------------------------------------------------------
    def _size_data(self, coll: Collective, size: int) -> _SizeData:
        n, elements = self.n, size // self.dtype.itemsize
        count = coll.count_for(elements, n)
        cin, cout = coll.in_count(count, n), coll.out_count(count, n)
        op = self.op if coll.reduces else "sum"
        inputs = [init_data(r, n, cin, self.dtype, op, self.seed) for r in range(n)]
        expected = coll.expected(inputs, self.op, self.root) if self.check else None
        return _SizeData(elements, count, cin, cout, inputs, expected)

    @property
    def carrier(self) -> np.dtype | None:
        """The dtype the device buffers carry the benchmark's dtype in, when the devices'
        array library lacks it (bfloat16 on GPUs: ``uint16`` CuPy arrays, every call
        then naming ``dtype="bfloat16"``); None: the dtype itself."""
        if self.devices[0].backend == "cuda":
            return CARRIERS.get(self.dtype)
        return None

    def _keywords(self, coll: Collective) -> dict[str, object]:
        """The keywords of one call: op and root as the collective takes them, and the
        dtype when the buffers carry it."""
        kw = coll.keywords(self.op, self.root)
        if self.carrier is not None:
            kw["dtype"] = self.dtype.name
        return kw

    def _buffers(
        self, coll: Collective, data: _SizeData, in_place: bool
    ) -> tuple[list[Array], list[Array] | None, list[Array]]:
        """Device buffers of one call: (inputs, outputs or None, result buffers), in the
        :attr:`carrier` dtype where there is one."""
        ins, outs = [], []
        carrier = self.carrier

        def held(a: np.ndarray) -> np.ndarray:
            return a if carrier is None else a.view(carrier)

        for r, dev in zip(self.local_ranks, self.devices, strict=True):
            x = data.inputs[r]
            if in_place:
                oi, oo = coll.in_place(r, data.count, self.n)
                host = _poison(max(data.in_count, data.out_count), self.dtype)
                host[oi : oi + data.in_count] = x
                big = dev.from_host(held(host))
                ins.append(big[oi : oi + data.in_count])
                outs.append(big[oo : oo + data.out_count])
            else:
                ins.append(dev.from_host(held(x)))
                outs.append(dev.from_host(held(_poison(data.out_count, self.dtype))))
        call_outs = None if in_place and coll.one_buffer else outs
        return ins, call_outs, outs

    def measure(
        self, coll: Collective, algorithm: str, data: _SizeData, in_place: bool
    ) -> BenchRecord:
        """Warm up, time, check one size x algorithm x placement."""
        keywords = self._keywords(coll)
        op, root = str(keywords.get("op", "sum")), int(cast("int", keywords.get("root", 0)))
        dtype = cast("DTypeLike | None", keywords.get("dtype"))
        ins, call_outs, outs = self._buffers(coll, data, in_place)
        group, world = self.group, self.worlds.get(algorithm)

        def run() -> None:
            # the collective by its name in the table, as every face calls it
            if group is not None:
                group.algorithm = algorithm  # every process makes the same calls in order
                group.call(coll.name, ins, call_outs, op=op, root=root, dtype=dtype)
            else:
                assert world is not None
                world._driver(coll.name, ins, call_outs, op, root, None, False, dtype)

        for _ in range(self.warmup):
            run()
        if group is not None:
            # each rank's median, then one time over every rank of every process
            per_call = [self._timer.rank_times(run) for _ in range(self.iters)]
            mine = [statistics.median(col) for col in zip(*per_call, strict=True)]
            t = aggregate_times(gather_values(group, mine), self.aggregate)
        else:
            times = [self._timer(run, self.timeout) for _ in range(self.iters)]
            t = statistics.median(times)
        wrong = None
        if self.check:
            wrong = 0
            for _ in range(self.check):
                del ins, call_outs, outs  # one call's buffers at a time
                ins, call_outs, outs = self._buffers(coll, data, in_place)
                run()
                if group is not None:
                    group_barrier(group)
                else:
                    assert world is not None
                    world.barrier()
                wrong += self._count_wrong(data, ins, outs)
            if group is not None:  # every rank's count, summed
                counts = [float(wrong)] + [0.0] * (len(self.devices) - 1)
                wrong = int(sum(gather_values(group, counts)))
        size = coll.nbytes(data.count, self.n, self.dtype.itemsize)
        factor = coll.bus_factor(self.n)
        algbw, busbw = bandwidths(size, t, factor)
        return BenchRecord(
            collective=coll.name,
            algorithm=algorithm,
            placement="in-place" if in_place else "out-of-place",
            size=size,
            count=size // self.dtype.itemsize,
            dtype=str(self.dtype),
            op=self.op if coll.reduces else "none",
            root=self.root if coll.rooted else -1,
            ranks=self.n,
            time_us=t * 1e6,
            algbw=algbw,
            busbw=busbw,
            wrong=wrong,
            iters=self.iters,
            warmup=self.warmup,
            bus_factor=factor,
            devices=self.label,
            machine=self.machine,
        )

    def _count_wrong(self, data: _SizeData, ins: list[Array], outs: list[Array]) -> int:
        wrong = 0
        expected = data.expected or []
        for i, r in enumerate(self.local_ranks if expected else []):
            which, want = expected[r]
            dev = self.devices[i]
            got = ins[i] if which == "in" else outs[i]
            host = got if dev.backend == "host" else dev.to_host(got)
            if host.dtype != self.dtype:  # the bits of a carrier (uint16 for bfloat16)
                host = host.view(self.dtype)
            wrong += count_wrong(host, want, self.dtype)
        return wrong


def run_benchmark(devices: Sequence[Device] | str, **kwargs: Any) -> list[BenchRecord]:
    """Run a whole :class:`Benchmark` and return its records."""
    with Benchmark(devices, **kwargs) as bench:
        return list(bench)
