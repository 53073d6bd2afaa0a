"""The collective benchmark driver, in the style of nccl-tests.

One driver; each collective plugs in a small :class:`CollectiveSpec`: how a byte count
becomes element counts, the bytes ``S`` the bandwidth figures use, the expected result,
the bus-bandwidth factor, and how to call it out of place and in place. The driver adds
what every collective shares: seeded data that differ per rank and per element, warm-up
iterations, timed iterations each on a synchronised clock (``time.perf_counter`` around a
synchronous call on the host backend, device events on CUDA), the median, and a ``#wrong``
check of every rank's result.

Figures mean what nccl-tests' mean: ``algbw = S / t`` and ``busbw = algbw * factor`` with
``S = count * itemsize`` (for all_gather and reduce_scatter the whole gathered array) and
factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and reduce_scatter, ``1``
for broadcast and reduce. GB = 1e9 bytes.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import _ops

PLACEMENTS = ("out-of-place", "in-place")
# Users may write dtypes as nccl-tests does.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "int": "int32"}
_SIZE_RE = re.compile(r"(\d+)\s*([kmgt]?)(i?b)?", re.IGNORECASE)

WorldFactory = Callable[[Sequence[Any], str], Any]


# -- the per-collective part --------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveSpec:
    """What one collective plugs into the driver.

    ``in_count``/``out_count``: elements of each rank's input and output for a message of
    ``elements`` elements on ``n`` ranks; ``in_place_offsets(rank, count_in, count_out)``:
    where input and output sit in the one buffer of an in-place call; ``expected``: each
    rank's expected ``(which buffer, values)`` given the inputs; ``call``: the collective,
    ``call(world, inputs, outputs or None, op, root)``.
    """

    name: str
    reduces: bool
    rooted: bool
    one_buffer: bool  # in place means "no outputs" (all_reduce, reduce, broadcast)
    factor: Callable[[int], float]
    in_count: Callable[[int, int], int]
    out_count: Callable[[int, int], int]
    in_place_offsets: Callable[[int, int, int], tuple[int, int]]
    expected: Callable[[list[np.ndarray], str, int], list[tuple[str, np.ndarray]]]
    call: Callable[[Any, list[Any], list[Any] | None, str, int], Any]

    def nbytes(self, elements: int, n: int, itemsize: int) -> int:
        """nccl-tests' ``S``: the larger of the input and output of one rank, in bytes."""
        return max(self.in_count(elements, n), self.out_count(elements, n)) * itemsize

    def bus_factor(self, n: int) -> float:
        return self.factor(n)


def _wide(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64 if a.dtype.kind == "f" else np.int64)


_NP_OPS = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """``op`` over ``arrays`` in float64 (int64 for integers), accumulated one array at a
    time so that 64 MiB per rank does not need an N-high stack in memory."""
    acc = _wide(arrays[0])
    for a in arrays[1:]:
        _NP_OPS[op](acc, a, out=acc, casting="unsafe")
    if op == "mean":
        acc = acc / len(arrays)
    return acc


def _exp_all_reduce(ins, op, root):
    ref = reference(op, ins)
    return [("out", ref)] * len(ins)


def _exp_reduce(ins, op, root):
    ref = reference(op, ins)
    # reduce leaves every non-root input unchanged (nccl semantics, checked too)
    return [("out", ref) if r == root else ("in", _wide(x)) for r, x in enumerate(ins)]


def _exp_broadcast(ins, op, root):
    return [("out", _wide(ins[root]))] * len(ins)


def _exp_all_gather(ins, op, root):
    return [("out", _wide(np.concatenate(ins)))] * len(ins)


def _exp_reduce_scatter(ins, op, root):
    ref = reference(op, ins)
    k = ref.size // len(ins)
    return [("out", ref[r * k : (r + 1) * k]) for r in range(len(ins))]


def _same(elements: int, n: int) -> int:
    return elements


def _per_rank(elements: int, n: int) -> int:
    return elements // n


def _whole(elements: int, n: int) -> int:
    return (elements // n) * n


def _spec(
    name, reduces, rooted, one_buffer, factor, in_count, out_count, offsets, expected, call
) -> CollectiveSpec:
    return CollectiveSpec(
        name=name,
        reduces=reduces,
        rooted=rooted,
        one_buffer=one_buffer,
        factor=factor,
        in_count=in_count,
        out_count=out_count,
        in_place_offsets=offsets,
        expected=expected,
        call=call,
    )


def _no_offsets(rank: int, count_in: int, count_out: int) -> tuple[int, int]:
    return 0, 0


# name, reduces, rooted, one_buffer, bus factor, input and output counts, in-place
# offsets (input, output), expected results, the call
SPECS: dict[str, CollectiveSpec] = {
    s.name: s
    for s in (
        _spec(
            "all_reduce",
            True,
            False,
            True,
            lambda n: 2 * (n - 1) / n,
            _same,
            _same,
            _no_offsets,
            _exp_all_reduce,
            lambda w, xs, outs, op, root: w.all_reduce(xs, op=op, outs=outs),
        ),
        _spec(
            "reduce",
            True,
            True,
            True,
            lambda n: 1.0,
            _same,
            _same,
            _no_offsets,
            _exp_reduce,
            lambda w, xs, outs, op, root: w.reduce(xs, root=root, op=op, outs=outs),
        ),
        _spec(
            "broadcast",
            False,
            True,
            True,
            lambda n: 1.0,
            _same,
            _same,
            _no_offsets,
            _exp_broadcast,
            lambda w, xs, outs, op, root: w.broadcast(xs, root=root, outs=outs),
        ),
        # in place, rank r's input is block r of its output (NCCL's layout)
        _spec(
            "all_gather",
            False,
            False,
            False,
            lambda n: (n - 1) / n,
            _per_rank,
            _whole,
            lambda r, ci, co: (r * ci, 0),
            _exp_all_gather,
            lambda w, xs, outs, op, root: w.all_gather(xs, outs),
        ),
        # in place, rank r's output is block r of its input
        _spec(
            "reduce_scatter",
            True,
            False,
            False,
            lambda n: (n - 1) / n,
            _whole,
            _per_rank,
            lambda r, ci, co: (0, r * co),
            _exp_reduce_scatter,
            lambda w, xs, outs, op, root: w.reduce_scatter(xs, outs, op=op),
        ),
    )
}


# -- data ---------------------------------------------------------------------------------


def init_data(
    rank: int, n: int, count: int, dtype: Any, op: str = "sum", seed: int = 0
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
    element the collective forgot to write counts as wrong."""
    fill = np.nan if dtype.kind == "f" else np.iinfo(dtype).min
    return np.full(count, fill, dtype)


def tolerance(dtype: np.dtype) -> float:
    """Relative tolerance of the check: integers are exact; floats may round a mean (or a
    float16 result accumulated in float32) by an ulp or so."""
    dtype = np.dtype(dtype)
    return 0.0 if dtype.kind != "f" else 4 * float(np.finfo(dtype).eps)


def count_wrong(actual: np.ndarray, expected: np.ndarray, dtype: Any) -> int:
    """Elements of ``actual`` outside the tolerance of ``expected`` (NaN counts)."""
    if actual.size != expected.size:
        return max(actual.size, expected.size)
    if not actual.size:
        return 0
    a = _wide(np.asarray(actual).reshape(-1))
    tol = tolerance(dtype)
    if tol == 0.0:
        return int(np.count_nonzero(a != expected))
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
    machine: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def bandwidths(size: int, seconds: float, factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for ``size`` bytes in ``seconds``."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size / seconds / 1e9
    return algbw, algbw * factor


def machine_description(devices: Sequence[Any]) -> dict:
    """The machine and devices a result was measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import nccltree

    backend = devices[0].backend if devices else "none"
    desc = {
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


def _gpu_models(devices: Sequence[Any]) -> list[str]:
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
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
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
    if not factor > 1:
        raise ValueError(f"the step factor must be > 1, got {factor!r}")
    if minbytes == 0:
        return [0] if maxbytes == 0 else [0, *size_range(1, maxbytes, factor)]
    sizes, s = [], float(minbytes)
    while int(s) <= maxbytes:
        if not sizes or int(s) != sizes[-1]:
            sizes.append(int(s))
        s *= factor
    return sizes


def check_dtype(name: str | Any) -> np.dtype:
    """The numpy dtype for a name (nccl-tests' ``half``, ``float``, ``double`` too)."""
    key = DTYPE_ALIASES.get(str(name), name)
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


def default_world(devices: Sequence[Any], algorithm: str, timeout: float = 60.0) -> Any:
    """A :class:`~nccltree.comm.World` running ``algorithm`` on ``devices``."""
    from .world import World

    return World(devices, algorithm=algorithm, timeout=timeout)


# -- the driver ---------------------------------------------------------------------------


class _Timer:
    """Times one synchronous collective: ``perf_counter`` on host; on CUDA events on every
    rank's caller stream, the slowest rank's elapsed time."""

    def __init__(self, devices: Sequence[Any]) -> None:
        self.devices = list(devices)
        self.cuda = bool(devices) and devices[0].backend == "cuda"

    def __call__(self, fn: Callable[[], Any], timeout: float) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        import cupy as cp

        pairs = []
        for d in self.devices:
            with cp.cuda.Device(d.physical_id):
                pairs.append((cp.cuda.Event(), cp.cuda.Event()))
                pairs[-1][0].record(d.current_stream().cupy_stream)
        fn()
        for d, (_, end) in zip(self.devices, pairs):
            with cp.cuda.Device(d.physical_id):
                end.record(d.current_stream().cupy_stream)
        for d, (_, end) in zip(self.devices, pairs):
            with cp.cuda.Device(d.physical_id):
                end.synchronize()
        return max(cp.cuda.get_elapsed_time(s, e) for s, e in pairs) / 1e3


@dataclass
class _SizeData:
    """The inputs and expected results of one message size, shared by every algorithm and
    placement (building them is the slow part of a large check)."""

    elements: int
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
    World of each algorithm (tests inject a broken one); a context manager.
    """

    def __init__(
        self,
        devices: Sequence[Any] | str,
        algorithms: Sequence[str] = ("tree",),
        collectives: Sequence[str] = ("all_reduce",),
        sizes: Sequence[int] = (8,),
        *,
        dtype: Any = "float32",
        op: str = "sum",
        root: int = 0,
        iters: int = 20,
        warmup: int = 5,
        check: int = 1,
        placements: Sequence[str] = PLACEMENTS,
        seed: int = 0,
        timeout: float = 60.0,
        world_factory: WorldFactory | None = None,
        devices_label: str | None = None,
    ) -> None:
        self._own_runtime = None  # the host runtime made here, shut down by close()
        if isinstance(devices, str):
            from ..backends import devices as make_devices

            devices_label = devices_label or devices
            devices = make_devices(devices)
            if devices[0].backend == "host":
                self._own_runtime = devices[0].runtime
        self.worlds: dict[str, Any] = {}
        try:
            self._configure(
                devices,
                algorithms,
                collectives,
                sizes,
                dtype,
                op,
                root,
                iters,
                warmup,
                check,
                placements,
                seed,
                timeout,
                world_factory,
                devices_label,
            )
        except BaseException:
            self.close()  # the Worlds (and a runtime) made so far
            raise
        self.machine = machine_description(self.devices)
        self._timer = _Timer(self.devices)

    def _configure(
        self,
        devices,
        algorithms,
        collectives,
        sizes,
        dtype,
        op,
        root,
        iters,
        warmup,
        check,
        placements,
        seed,
        timeout,
        world_factory,
        devices_label,
    ) -> None:
        """Check every argument, then create the Worlds."""
        self.devices = list(devices)
        if not self.devices:
            raise ValueError("the benchmark needs at least one device")
        n = self.n = len(self.devices)
        self.label = devices_label or ",".join(d.name for d in self.devices)
        self.dtype = check_dtype(dtype)
        self.collectives = [_ops.collective_name(c) for c in collectives]
        if not self.collectives:
            raise ValueError("no collective given; accepted: " + ", ".join(_ops.COLLECTIVES))
        if any(SPECS[c].reduces for c in self.collectives):
            _ops.check_op(op, self.dtype)
        elif op not in _ops.OPS:
            raise ValueError(f"unknown reduction op {op!r}; accepted: {', '.join(_ops.OPS)}")
        self.op = op
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
            raise ValueError(f"root must be a rank in [0, {n}), got {root!r}")
        self.root = int(root)
        for name, value, lo in (("iters", iters, 1), ("warmup", warmup, 0), ("check", check, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
        self.iters, self.warmup, self.check = int(iters), int(warmup), int(check)
        bad = [p for p in placements if p not in PLACEMENTS]
        if bad or not placements:
            raise ValueError(f"unknown placement {bad}; accepted: {', '.join(PLACEMENTS)}")
        self.placements = list(placements)
        self.sizes = [parse_size(s) for s in sizes]
        self.seed = int(seed)
        self.timeout = float(timeout)
        self.algorithms = list(algorithms)
        if not self.algorithms:
            raise ValueError("no algorithm given")
        factory = world_factory or (lambda d, a: default_world(d, a, self.timeout))
        for a in self.algorithms:
            if a not in self.worlds:
                self.worlds[a] = factory(self.devices, a)

    @property
    def total(self) -> int:
        """How many records iterating yields."""
        return len(self.collectives) * len(self.sizes) * len(self.algorithms) * len(self.placements)

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
        for coll in self.collectives:
            spec = SPECS[coll]
            for size in self.sizes:
                data = self._size_data(spec, size)
                for alg in self.algorithms:
                    for placement in self.placements:
                        yield self.measure(spec, alg, data, placement == "in-place")

    # -- one measurement ------------------------------------------------------------------
    def _size_data(self, spec: CollectiveSpec, size: int) -> _SizeData:
        n, elements = self.n, size // self.dtype.itemsize
        cin, cout = spec.in_count(elements, n), spec.out_count(elements, n)
        op = self.op if spec.reduces else "sum"
        inputs = [init_data(r, n, cin, self.dtype, op, self.seed) for r in range(n)]
        expected = spec.expected(inputs, self.op, self.root) if self.check else None
        return _SizeData(elements, cin, cout, inputs, expected)

    def _buffers(self, spec: CollectiveSpec, data: _SizeData, in_place: bool):
        """Device buffers of one call: (inputs, outputs or None, result buffers)."""
        ins, outs = [], []
        for r, dev in enumerate(self.devices):
            x = data.inputs[r]
            if in_place:
                oi, oo = spec.in_place_offsets(r, data.in_count, data.out_count)
                host = _poison(max(data.in_count, data.out_count), self.dtype)
                host[oi : oi + data.in_count] = x
                big = dev.from_host(host)
                ins.append(big[oi : oi + data.in_count])
                outs.append(big[oo : oo + data.out_count])
            else:
                ins.append(dev.from_host(x))
                outs.append(dev.from_host(_poison(data.out_count, self.dtype)))
        call_outs = None if in_place and spec.one_buffer else outs
        return ins, call_outs, outs

    def measure(
        self, spec: CollectiveSpec, algorithm: str, data: _SizeData, in_place: bool
    ) -> BenchRecord:
        """Warm up, time, check one size x algorithm x placement."""
        world = self.worlds[algorithm]
        op, root = self.op, self.root
        ins, call_outs, outs = self._buffers(spec, data, in_place)

        def run() -> None:
            spec.call(world, ins, call_outs, op, root)

        for _ in range(self.warmup):
            run()
        times = [self._timer(run, self.timeout) for _ in range(self.iters)]
        t = statistics.median(times)
        wrong = None
        if self.check:
            wrong = 0
            for _ in range(self.check):
                ins, call_outs, outs = self._buffers(spec, data, in_place)
                spec.call(world, ins, call_outs, op, root)
                world.barrier()
                wrong += self._count_wrong(data, ins, outs)
        size = spec.nbytes(data.elements, self.n, self.dtype.itemsize)
        factor = spec.bus_factor(self.n)
        algbw, busbw = bandwidths(size, t, factor)
        return BenchRecord(
            collective=spec.name,
            algorithm=algorithm,
            placement="in-place" if in_place else "out-of-place",
            size=size,
            count=size // self.dtype.itemsize,
            dtype=str(self.dtype),
            op=self.op if spec.reduces else "none",
            root=self.root if spec.rooted else -1,
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

    def _count_wrong(self, data: _SizeData, ins: list[Any], outs: list[Any]) -> int:
        wrong = 0
        for r, (which, want) in enumerate(data.expected or []):
            dev = self.devices[r]
            got = ins[r] if which == "in" else outs[r]
            host = got if dev.backend == "host" else dev.to_host(got)
            wrong += count_wrong(host, want, self.dtype)
        return wrong


def run_benchmark(devices: Sequence[Any] | str, **kwargs: Any) -> list[BenchRecord]:
    """Run a whole :class:`Benchmark` and return its records."""
    with Benchmark(devices, **kwargs) as bench:
        return list(bench)
