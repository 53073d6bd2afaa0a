"""Calibrating the simulator on the host backend: its copy rates, the cost of one step
and of one call measured by microbenchmarks on this machine (:func:`calibrate_host`),
and the machine of the model (:mod:`nccltree.sim_model`) they make
(:func:`host_machine`, :func:`predict_host`). Unlike the model this measures: it runs the
native kernels, a plan's program and Worlds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from ._validate import check_int, check_real
from .comm.plan import CHUNK_BYTES
from .sim_model import GB, DeviceModel, Machine, simulate_collective
from .topology import Link, LinkKind, Topology

if TYPE_CHECKING:
    from .backends.host import HostDevice


@dataclass(frozen=True)
class HostCalibration:
    """The host backend's costs, measured by microbenchmarks only (:func:`calibrate_host`):
    the copy rate (bytes read + written per second) by thread count and by the bytes
    copied (caches make small copies faster), the cost of one step of an inline call,
    and a call's fixed cost by rank count (a call that moves nothing)."""

    cores: int
    copy_gbps: dict[int, tuple[tuple[int, float], ...]]  # threads -> ((bytes, GB/s), ...)
    step_s: float
    call_s: dict[int, float]  # ranks -> seconds

    def rate(self, threads: int, nbytes: int) -> float:
        """The copy rate of ``threads`` threads for a working set of ``nbytes``:
        interpolated between the two measurements around it, linearly in log2 of the
        size (the first or the last beyond them)."""
        import math

        curve = self.copy_gbps[min(self.copy_gbps, key=lambda t: abs(t - threads))]
        if nbytes <= curve[0][0]:
            return curve[0][1]
        for (s0, g0), (s1, g1) in zip(curve, curve[1:]):
            if nbytes <= s1:
                f = (math.log2(nbytes) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return g0 + f * (g1 - g0)
        return curve[-1][1]

    def to_json(self) -> dict[str, object]:
        """A JSON-ready record (what ``nccltree-bench calibrate --json`` writes)."""
        return {"cores": self.cores, "step_s": self.step_s,
                "call_s": {str(n): t for n, t in self.call_s.items()},
                "copy_gbps": {str(t): [list(p) for p in c] for t, c in self.copy_gbps.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, data: object) -> HostCalibration:
        """The calibration :meth:`to_json` wrote; ``ValueError`` naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a calibration is a JSON object")
        missing = [k for k in ("cores", "step_s", "call_s", "copy_gbps") if k not in data]
        if missing:
            raise ValueError(f"the calibration lacks {', '.join(missing)}")
        try:
            cores = check_int(data["cores"], "cores", min=1)
            step_s = check_real(data["step_s"], "step_s", min=0)
            call_s = {int(n): float(check_real(t, "call_s", min=0))
                      for n, t in dict(data["call_s"]).items()}  # fmt: skip
            copy = {int(t): tuple((int(b), float(check_real(g, "copy_gbps", min=1e-9)))
                                  for b, g in curve)
                    for t, curve in dict(data["copy_gbps"]).items()}  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the calibration is malformed: {exc}") from None
        if not call_s or not copy or any(not c for c in copy.values()):
            raise ValueError("the calibration has no call costs or no copy rates")
        return cls(cores, copy, float(step_s), call_s)


def predict_host(
    cal: HostCalibration, n: int, algorithm: str, collective: str, count: int,
    itemsize: int = 4,
) -> float:  # fmt: skip
    """The predicted time (seconds) of one out-of-place call on ``n`` host devices of the
    calibrated machine: the call's fixed cost (measured for ``n`` ranks, else the nearest
    rank count's) plus its plan simulated on :func:`host_machine`."""
    from .comm.collectives import COLLECTIVES

    coll = COLLECTIVES[collective]
    cin, cout = coll.in_count(count, n), coll.out_count(count, n)
    machine = host_machine(n, cal, count * itemsize, n * (cin + cout) * itemsize)
    fixed = cal.call_s[min(cal.call_s, key=lambda k: abs(k - n))]
    return fixed + simulate_collective(machine, algorithm, collective, count,
                                       itemsize=itemsize, chunk_bytes=CHUNK_BYTES).time_s  # fmt: skip


def calibrate_host(
    ranks: Sequence[int] = (2, 4), repeats: int = 5, cores: int | None = None
) -> HostCalibration:
    """Measure this machine's host backend: ``nt_copy`` of 64 KiB to 64 MiB with one
    thread and with every core (the best of ``repeats``), an inline program of 2,000
    one-element copies (per step), and for each rank count in ``ranks`` an out-of-place
    all_reduce of no elements (a call's fixed cost, the median of 101: nothing moves).
    Never the collectives predicted."""
    import os
    import time

    import numpy as np

    from . import _native
    from .backends import devices as make_devices
    from .comm.executor import Buffers, Program
    from .comm.plan import IN, OUT, TMP, Buf, PlanBuilder
    from .comm.world import World

    cores = check_int(cores or os.cpu_count() or 1, "cores", min=1)
    curves: dict[int, tuple[tuple[int, float], ...]] = {}
    for threads in sorted({1, cores}):
        points = []
        for size in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
            src = np.ones(size // 4, np.float32)
            dst = np.empty_like(src)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                _native.copy_checked(dst, src, threads)
                best = min(best, time.perf_counter() - t0)
            points.append((2 * size, 2 * size / best / GB))  # working set: read + written
        curves[threads] = tuple(points)
    devs = make_devices("cpu:2")
    b = PlanBuilder(2, "calibration")
    for k in range(2000):
        b.copy(k % 2, Buf(1 - k % 2, OUT, k % 8, 1), Buf(k % 2, IN, k % 8, 1))
    plan = b.build()
    prog = Program(plan, devs, {IN: [8, 8], OUT: [8, 8], TMP: [0, 0], "stage": [0, 0]})
    bufs = Buffers([np.ones(8, np.float32)] * 2, [np.zeros(8, np.float32) for _ in range(2)],
                   [None, None])  # fmt: skip
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        prog.run_inline(bufs, cast("list[HostDevice]", devs))
        best = min(best, time.perf_counter() - t0)
    step_s = best / len(plan.data_steps())
    call_s = {}
    for n in ranks:
        with World(make_devices(f"cpu:{n}")) as w:
            # out of place, as the benchmark calls: the median, as it reports
            xs = [np.ones(0, np.float32) for _ in range(n)]
            outs = [np.ones(0, np.float32) for _ in range(n)]
            w.all_reduce(xs, outs=outs)
            times = []
            for _ in range(101):
                t0 = time.perf_counter()
                w.all_reduce(xs, outs=outs)
                times.append(time.perf_counter() - t0)
        call_s[n] = sorted(times)[len(times) // 2]
    return HostCalibration(cores, curves, step_s, call_s)


def host_machine(n: int, cal: HostCalibration, call_bytes: int, working_set: int) -> Machine:
    """``n`` virtual host devices in one memory, with ``cal``'s figures for a call of
    ``call_bytes`` per rank touching ``working_set`` bytes: its kernels use every core
    from 512 KiB (as a World's inline calls do), else each device's share, at the copy
    rate measured for that working set."""
    from .comm.issuer import INLINE_EVERY_CORE_FROM

    threads = cal.cores if call_bytes >= INLINE_EVERY_CORE_FROM[False] else max(
        1, cal.cores // n)  # fmt: skip
    gbps = cal.rate(threads, working_set)
    host = DeviceModel("host (calibrated)", gbps, 0.0, 0,
                       f"calibrate_host: nt_copy with {threads} threads")  # fmt: skip
    topo = Topology.uniform(n, Link(LinkKind.SAME_DEVICE))
    return Machine(topo, host, issue_s=cal.step_s, sync_steps_cost=False)


__all__: Sequence[str] = ["HostCalibration", "calibrate_host", "host_machine", "predict_host"]
