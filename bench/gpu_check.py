"""The one-call GPU check: build, every GPU test, a sweep with its physical bound, NCCL
across processes on one GPU attempted, a compact summary.

    bash bench/gpu_check.sh                           # a GPU machine: at most 6 minutes
    bash bench/gpu_check.sh --rerun-failed OLD.json   # only what failed there: 2 minutes
    bash bench/gpu_check.sh --dry-run                 # the same pipeline on the host backend
    bash bench/gpu_check.sh --plan                    # the planned time of each stage, only

``.whl/`` (the lmdb, mpi4py and mpich wheels) is ignored by git: a tool that copies the
working tree to the GPU machine must carry it explicitly (without the MPI wheels the
process groups' GPU tests skip, which fails the check).

Three **stages**, each with its own share of the deadline (``--deadline``, 360 s; 120 s
for a rerun): ``core`` ends at 50% of it, ``ipc`` at 72%, ``rest`` at 100%. A step is
cut at its stage's end, so a deadline costs only the stage that overran, never the ones
before it; every step writes its results as it goes.

1. **core** (by 180 s of 360, install and build included): probe (CuPy, the driver,
   NCCL, the GPUs); install (the wheels in ``.whl/`` under ``build/gpu-check-prefix``,
   then nccltree from source with its CUDA fatbin for the GPUs present); topology; the
   ``gpu``/``multi_gpu`` tests that are neither ``mpi`` nor ``slow`` (backend, kernels,
   Worlds, one-rank NCCL); a check that no process is left on the GPU; the device-to-device
   copy rate and a smaller sweep (every algorithm on the GPUs present, 16 B to 1 MiB, and
   an all_reduce of 256 MiB) with each all_reduce's ratio to its own byte bound and to
   the minimum bound;
2. **ipc**: the ``mpi`` GPU tests (process groups over CUDA IPC, two processes on GPU 0);
3. **rest**: the ``slow`` GPU tests; the rest of the sweep (four logical ranks of GPU 0,
   16 B to 1 MiB and an all_reduce of 256 MiB) with its bound; the issue cost; the
   process groups' benchmark (``bench/pg_gpu_bench.py``); NCCL across two processes on
   one GPU, attempted (``NCCL_HOSTID`` per process, sockets over ``lo``), its acceptance
   or its exact error recorded; the simulator's prediction when time is left.

**Plan.** Every GPU test declares its expected seconds on the GPU
(``@pytest.mark.gpu_seconds(n)``; 0.25 s when it declares none, 1.5 s for a ``slow``
test), and every other step has a planned time here (:data:`PLANNED`). ``--dry-run`` and
``--plan`` collect the GPU tests, print each stage's planned time, and fail if a stage's
plan exceeds 70% of its share of the 360-s deadline or the total reaches it. A test's
*limit* is not its plan: the check stops a test after ``max(60 s, 5 x its seconds)``
(``gpu_limit``, the same rule as ``tests/conftest.py``), and a test's own waits for
the processes it starts end 15 s before that, so they fail first and cleanly.

**No process left behind.** A test that times out takes its whole process tree with it:
every process the check starts carries a run token in its environment
(``NCCLTREE_CHECK_RUN``), and after every pytest run, killed or not, the processes that
carry it are killed (``tests/mpirun.py`` also runs each ``mpiexec`` in a session of its
own and kills that session at its timeout). Before each sweep, ``nvidia-smi`` lists the
compute processes on the GPUs: one of the check's own left there is killed and fails the
check; another program's is noted (the sweep's figures would be shared with it).

A skipped ``gpu`` test FAILS the check (a GPU machine must run them all); ``multi_gpu(n)``
tests skipped for want of n GPUs are reported apart, as expected. The summary is printed
last: tests, the copy rate, busbw and both bound ratios at 1 MiB and 256 MiB, the issue
cost, the process groups' ratio, the NCCL-on-one-GPU attempt, the topology, and PASS or
FAIL. Results go to ``$OUT`` (else ``out/gpu-check``) as they come: ``gpu_check.json`` is
rewritten after every step, ``tests.jsonl`` is appended per test, so a run cut short still
reports. The exit status is 0 only on PASS.

``--dry-run`` runs the same stages on the host backend (``cpu:1`` and ``cpu:4`` for the
GPUs, small sizes, the GPU test file whose host variants run and whose GPU tests skip as
expected there) and only prints the install commands, so CI keeps the script working
between GPU runs. The module is also the pytest plugin of the test steps
(``-p gpu_check``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
MiB = 1 << 20
#: the steps after the install (``--stages`` picks among them)
STAGES = ("topology", "tests", "sweep", "issue_cost", "process_groups", "nccl_one_gpu")
#: the issue's target: a GPU process group over IPC reaches this share of the busbw of the
#: same algorithm on logical ranks of one process, at the largest size
PG_TARGET = 0.8

#: the GPU run's deadline (s): one call on a machine lent for about 15 minutes in all, so
#: that a second run fits
GPU_DEADLINE = 360.0
#: the three stages and where each ends, as a fraction of the deadline
PARTS = ("core", "ipc", "rest")
PART_END = {"core": 0.50, "ipc": 0.72, "rest": 1.0}
#: a stage's planned time may take at most this fraction of its share
PLAN_FRACTION = 0.7
#: the tests of each stage (a pytest marker expression)
PART_TESTS = {
    "core": "(gpu or multi_gpu) and not mpi and not slow",
    "ipc": "(gpu or multi_gpu) and mpi",
    "rest": "(gpu or multi_gpu) and slow and not mpi",
}
#: planned seconds of the steps on the H200 (from the runs on record: the build took 26 s,
#: 179 tests 51 s); the tests' own come from their gpu_seconds markers
PLANNED = {
    "probe": 3.0,
    "install": 35.0,
    "topology": 3.0,
    "pytest_start": 6.0,  # one pytest process: imports, CuPy's context, kernel loading
    "gpu_clean": 1.0,
    "bound": 4.0,  # the copy rate and the ratios of one sweep step
    "issue_cost": 8.0,
    "process_groups": 10.0,
    "nccl_one_gpu": 12.0,
}
#: a GPU test's expected seconds when it declares none (tests/conftest.py has the same)
GPU_SECONDS_DEFAULT = 0.25
GPU_SECONDS_SLOW = 1.5
#: a test's limit: GPU_LIMIT_FACTOR x its expected seconds, at least GPU_LIMIT_FLOOR
GPU_LIMIT_FLOOR = 60.0
GPU_LIMIT_FACTOR = 5.0
#: every process the check starts carries this variable (the run's token): the processes
#: a killed test leaves are found by it
RUN_ENV = "NCCLTREE_CHECK_RUN"


def gpu_seconds(item: Any) -> float:
    """A collected test's expected seconds on the GPU (its ``gpu_seconds`` marker)."""
    m = item.get_closest_marker("gpu_seconds")
    if m is not None and m.args:
        return float(m.args[0])
    return GPU_SECONDS_SLOW if item.get_closest_marker("slow") else GPU_SECONDS_DEFAULT


def gpu_limit(seconds: float) -> float:
    """The longest the check lets a test of ``seconds`` expected seconds run."""
    return max(GPU_LIMIT_FLOOR, GPU_LIMIT_FACTOR * seconds)


# -- the pytest plugin (loaded into the test process with `-p gpu_check`) ------------------
#
# Configured by environment variables, because `-p` takes no arguments. It logs every
# collected test with its GPU markers, every finished test with its outcome, and collection
# errors, one JSON object per line, flushed at once: the orchestrator reads the log while
# the tests run and after a crash.

_ENV_LOG = "NCCLTREE_CHECK_LOG"
_ENV_SOFT = "NCCLTREE_CHECK_SOFT_TIMEOUT"  # seconds: one limit for every test (0: each its own)
_ENV_HARD = "NCCLTREE_CHECK_HARD_TIMEOUT"  # non-zero: kill a test stuck in native code
_ENV_HANG = "NCCLTREE_CHECK_HANG_FILE"  # where the stacks of a killed test are written
_ENV_DESELECT = "NCCLTREE_CHECK_DESELECT"  # file of node ids not to run (already done)
_ENV_TIMER = "NCCLTREE_CHECK_TIMER"  # "alarm": this plugin's SIGALRM timer limits tests


class _Plugin:
    def __init__(self, log: str) -> None:
        self.log = open(log, "a", encoding="utf-8")
        # every test's limit: fixed (--test-timeout), else its own (gpu_limit)
        self.fixed = float(os.environ.get(_ENV_SOFT, "0") or 0)
        self.alarm = os.environ.get(_ENV_TIMER) == "alarm"  # else pytest-timeout's markers
        self.hard_on = float(os.environ.get(_ENV_HARD, "0") or 0) > 0
        hang = os.environ.get(_ENV_HANG)
        self.hang_file: IO[str] | None = open(hang, "w", encoding="utf-8") if hang else None
        self.markers: dict[str, dict[str, Any]] = {}
        self.phases: dict[str, list[Any]] = {}
        self.limits: dict[str, tuple[float, float]] = {}  # node id -> (seconds, limit)
        self.current_limit = 0.0

    def limit_of(self, nodeid: str) -> float:
        return self.limits.get(nodeid, (0.0, self.fixed or GPU_LIMIT_FLOOR))[1]

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        path = os.environ.get(_ENV_DESELECT)
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                done = {line.rstrip("\n") for line in f if line.strip()}
            drop = [it for it in items if it.nodeid in done]
            if drop:
                config.hook.pytest_deselected(items=drop)
                items[:] = [it for it in items if it.nodeid not in done]
        # each test's limit from its own declared time (a limit, not a plan)
        timeout_plugin = config.pluginmanager.hasplugin("timeout") and not self.alarm
        for it in items:
            seconds = gpu_seconds(it)
            limit = self.fixed or gpu_limit(seconds)
            self.limits[it.nodeid] = (seconds, limit)
            if timeout_plugin:
                import pytest

                it.add_marker(pytest.mark.timeout(limit))

    def pytest_collection_finish(self, session: Any) -> None:
        tests = []
        for it in session.items:
            multi = it.get_closest_marker("multi_gpu")
            seconds, limit = self.limits.get(it.nodeid, (gpu_seconds(it), 0.0))
            marks = {
                "gpu": int(it.get_closest_marker("gpu") is not None),
                "multi_gpu": (int(multi.args[0]) if multi.args else 2) if multi else 0,
                "mpi": int(it.get_closest_marker("mpi") is not None),
                "slow": int(it.get_closest_marker("slow") is not None),
                "gpu_seconds": seconds,
                "limit": limit,
            }
            self.markers[it.nodeid] = marks
            tests.append({"id": it.nodeid, **marks})
        self.write({"event": "collected", "rootdir": str(session.config.rootpath), "tests": tests})

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.write(
                {
                    "event": "collect_error",
                    "id": report.nodeid,
                    "message": _tail(report.longreprtext, 1500),
                }
            )

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.write({"event": "start", "id": nodeid})
        self.phases[nodeid] = []
        limit = self.limit_of(nodeid)
        self.current_limit = limit
        if self.alarm:
            signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, limit)
        if self.hard_on and self.hang_file is not None:
            # past the limit, a test stuck in native code (where no Python-level timer
            # fires) is killed with its stacks written out
            hard = limit + min(30.0, max(5.0, limit / 2))
            self.hang_file.seek(0)
            self.hang_file.truncate()
            self.hang_file.write(f"{nodeid}: killed after {hard:g} s\n")
            self.hang_file.flush()
            faulthandler.dump_traceback_later(hard, exit=True, file=self.hang_file)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        import pytest

        pytest.fail(f"Timeout: the test ran longer than {self.current_limit:g} s", pytrace=False)

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.phases.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if self.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self.hard_on:
            faulthandler.cancel_dump_traceback_later()
        reports = self.phases.pop(nodeid, [])
        outcome, message = "passed", ""
        for rep in reports:
            if rep.failed:
                outcome = "failed" if rep.when == "call" else "error"
                message = _tail(rep.longreprtext, 2000)
                break
            if rep.skipped and outcome == "passed":
                outcome = "skipped"
                longrepr = rep.longrepr
                message = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
        self.write(
            {
                "event": "done",
                "id": nodeid,
                "outcome": outcome,
                "seconds": round(sum(r.duration for r in reports), 3),
                "timeout": "Timeout" in message,
                "message": message,
                **self.markers.get(nodeid, {"gpu": 0, "multi_gpu": 0}),
                "limit": self.limit_of(nodeid),
            }
        )


def _brief(failure: str) -> str:
    """One line of a failure: its first line and, when it has more, its last (the error)."""
    lines = [line.strip() for line in failure.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else failure
    return f"{lines[0]} ... {_tail(lines[-1], 150)}"


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def pytest_configure(config: Any) -> None:
    log = os.environ.get(_ENV_LOG)
    if log:
        config.pluginmanager.register(_Plugin(log), "nccltree-gpu-check")


# -- the per-step issue cost (run in a child process: --issue-cost-worker) -----------------


def issue_cost_worker(
    devices: str, algorithms: Sequence[str], sizes: Sequence[int], reps: int, out: Path
) -> int:
    """Host time of a stream-ordered all_reduce call, per plan step; one JSON file."""
    # the checkout first, as for the `python -m nccltree...` children run from it
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import nccltree as nt
    from nccltree.comm.algorithms import ALGORITHMS

    devs = nt.devices(devices)
    n = len(devs)
    records: list[dict[str, Any]] = []
    status = 0

    def save() -> None:
        _write_json(out, {"devices": devices, "backend": devs[0].backend, "records": records})

    warm = 2
    try:
        for alg in algorithms:
            try:
                world = nt.World(devs, algorithm=alg, timeout=60)
            except Exception as exc:  # noqa: BLE001 - reported, the other algorithms go on
                records.append(
                    {"algorithm": alg, "ranks": n, "error": f"{type(exc).__name__}: {exc}"}
                )
                status = 1
                save()
                continue
            with world:
                for size in sizes:
                    rec: dict[str, Any] = {"algorithm": alg, "size": size, "ranks": n}
                    try:
                        count = max(1, size // 4)
                        xs = [d.from_host(np.ones(count, np.float32)) for d in devs]
                        rec["steps"] = (
                            len(world.plan("all_reduce", count, algorithm=alg).steps)
                            if alg in ALGORITHMS
                            else None
                        )
                        times = []
                        for i in range(warm + reps):
                            for d in devs:
                                d.synchronize()  # an idle queue: time the issuing alone
                            t0 = time.perf_counter()
                            world.all_reduce(xs)
                            if i >= warm:
                                times.append(time.perf_counter() - t0)
                        for d in devs:
                            d.synchronize()
                        # ones summed over n ranks, warm + reps times in place
                        want = float(n ** (warm + reps))
                        got = [float(d.to_host(x[:1])[0]) for d, x in zip(devs, xs)]
                        rec["issue_us"] = statistics.median(times) * 1e6
                        rec["per_step_us"] = (
                            rec["issue_us"] / rec["steps"] if rec["steps"] else None
                        )
                        rec["ok"] = all(g == want for g in got)
                        if not rec["ok"]:
                            rec["error"] = f"wrong result: {got} instead of {want}"
                            status = 1
                        del xs
                    except Exception as exc:  # noqa: BLE001 - reported in the record
                        rec["error"] = f"{type(exc).__name__}: {exc}"
                        status = 1
                    records.append(rec)
                    save()
    finally:
        if devs[0].backend == "host":
            devs[0].runtime.shutdown()
    save()
    return status


# -- helpers -------------------------------------------------------------------------------


def _write_json(path: Path, payload: Any) -> None:
    """Write atomically, so a reader (or a run cut short) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


@dataclass
class Ran:
    """How a child process ended."""

    rc: int | None  # None: killed at its time limit
    seconds: float
    tail: str  # the end of its output

    @property
    def timed_out(self) -> bool:
        return self.rc is None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End a child and everything it started (it leads its own process group)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass(frozen=True)
class SweepRun:
    """One nccltree-bench collectives invocation of the sweep."""

    devices: str
    algorithms: tuple[str, ...]
    band: str
    minbytes: str
    maxbytes: str
    factor: int
    iters: int
    warmup: int
    part: str = "core"  # the stage it runs in
    planned_s: float = 5.0  # its planned seconds on the GPU
    collectives: str = "all_reduce,broadcast"

    @property
    def key(self) -> str:
        return f"{self.devices} {self.band}"


@dataclass
class Config:
    """What a mode runs: GPU specs or host ones, sizes, tests."""

    mode: str  # "gpu" | "dry-run"
    present: str  # the devices present: "gpu:0,1,..." or a host stand-in
    logical: str  # four logical ranks of one device
    sweep: list[SweepRun]
    summary_sizes: tuple[int, ...]
    issue_sizes: tuple[int, ...]
    tests: dict[str, list[str]]  # each stage's pytest selection
    topo_devices: str
    nccl_expected: bool  # False on the host backend, where NCCL cannot run
    pg_args: tuple[str, ...] = ()  # bench/pg_gpu_bench.py's arguments
    copy_bytes: int = 256 * MiB  # the size of the copies that measure the copy rate


def make_config(dry_run: bool, gpus: int) -> Config:
    hand = ("tree", "ring", "direct")
    every = (*hand, "nccl")
    if dry_run:
        present, logical = "cpu:1", "cpu:4"
        sweep = [
            SweepRun(present, every, "small", "16K", "1M", 8, 3, 1, "core"),
            SweepRun(present, every, "4M", "4M", "4M", 2, 2, 1, "core", 5.0, "all_reduce"),
            SweepRun(logical, hand, "small", "16K", "1M", 64, 3, 1, "rest"),
            SweepRun(logical, hand, "4M", "4M", "4M", 2, 2, 1, "rest", 5.0, "all_reduce"),
        ]
        sizes: tuple[int, ...] = (8, 64 << 10)
        gpu_file = "tests/test_collectives_gpu.py"
        tests = {
            "core": [gpu_file, "-m", "not slow"],
            "ipc": ["tests/test_process_group_gpu.py", "-m", "gpu and mpi"],
            "rest": [gpu_file, "-m", "slow and not (gpu or multi_gpu)"],
        }
        topo = "cpu:4"
        return Config("dry-run", present, logical, sweep, (MiB, 256 * MiB), sizes, tests,
                      topo, False, ("--devices", "cpu", "--sizes", "64K,1M", "--reps", "1",
                                    "--iters", "2"), 4 * MiB)  # fmt: skip
    present = "gpu:" + ",".join(str(i) for i in range(max(gpus, 1)))
    logical = "gpu:0,0,0,0"
    # core: every algorithm on the GPUs present, 16 B .. 1 MiB by 4, and an all_reduce of
    # 256 MiB; rest: four logical ranks, 16 B .. 1 MiB by 16, and an all_reduce of 256 MiB.
    # The large points are where the time goes (fresh data and a full check per algorithm
    # and placement: about a second each at 256 MiB in the runs on record), so only the
    # all_reduce, whose bound the check measures, runs there.
    sweep = [
        SweepRun(present, every, "small", "16", "1M", 4, 10, 3, "core", 8.0),
        SweepRun(present, every, "256M", "256M", "256M", 2, 5, 2, "core", 8.0, "all_reduce"),
        SweepRun(logical, hand, "small", "16", "1M", 16, 10, 3, "rest", 5.0),
        SweepRun(logical, hand, "256M", "256M", "256M", 2, 5, 2, "rest", 8.0, "all_reduce"),
    ]
    tests = {part: ["-m", expr, "tests"] for part, expr in PART_TESTS.items()}
    return Config("gpu", present, logical, sweep, (MiB, 256 * MiB), (8, MiB, 256 * MiB), tests,
                  "gpu:all", True, ("--devices", "gpu:0", "--sizes", "16M,256M", "--reps", "3",
                                    "--iters", "5"))  # fmt: skip


# -- NCCL across two processes on one GPU (attempted) ------------------------------------------

#: what makes NCCL treat two processes on one GPU as two hosts talking over sockets (NCCL
#: 2.28: the duplicate-GPU check compares the host hash, taken from NCCL_HOSTID, and the
#: bus id; peer and shared-memory transports then refuse, so the network transport
#: carries the data; more than one "host" starts a multi-node NVLink probe, turned off)
NCCL_ONE_GPU_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_NET": "Socket",
    "NCCL_MNNVL_ENABLE": "0",
    "NCCL_DEBUG": "WARN",
    "NCCLTREE_TEST_NCCL_SHARED_GPU": "1",  # test-only: nccltree's own refusal lifted
}


def nccl_one_gpu_attempts(devices: str, extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The attempts of the NCCL-on-one-GPU step: (name, worker, its arguments, each of the
    two processes' own environment). Small sizes: two contexts share the GPU by time
    slices."""
    hosts = [{"NCCL_HOSTID": "nccltree-check-a"}, {"NCCL_HOSTID": "nccltree-check-b"}]
    nodes = [{**h, "NCCLTREE_NODE": f"node{c}"} for h, c in zip(hosts, "ab", strict=True)]
    mpi = ROOT / "tests" / "mpi"
    return [
        {"name": "collectives (algorithm nccl)", "worker": mpi / "pg_gpu.py", "procs": hosts,
         "args": [*extra, "--devices", devices, "--algorithms", "nccl", "--counts", "1,1000,70001",
                  "--dtypes", "float32"]},
        {"name": "two simulated nodes (NCCL send/recv between them)", "worker": mpi / "pg_gpu.py",
         "procs": nodes, "args": [*extra, "--devices", devices, "--algorithms", "tree,ring",
                                  "--counts", "1,70001", "--dtypes", "float32"]},
        {"name": "send/recv between two simulated nodes", "worker": mpi / "pg_p2p.py",
         "procs": nodes, "args": [*extra, "--devices", devices, "--big", "4096"]},
    ]  # fmt: skip


def nccl_one_gpu_argv(exe: str, attempt: dict[str, Any]) -> list[str]:
    """``mpiexec`` with one part per process (MPMD), each with its own environment."""
    argv = [exe]
    for i, penv in enumerate(attempt["procs"]):
        if i:
            argv.append(":")
        argv += ["-n", "1"]
        for k, v in {**NCCL_ONE_GPU_ENV, **penv}.items():
            argv += ["-env", k, v]
        argv += [sys.executable, str(attempt["worker"]), *map(str, attempt["args"])]
    return argv


def nccl_errors(output: str) -> list[str]:
    """The lines of an attempt's output that say what NCCL (or nccltree) refused."""
    keys = ("NCCL WARN", "NcclError", "ncclInvalid", "ncclSystem", "ncclInternal",
            "nccltree:", "Duplicate GPU", "Error")  # fmt: skip
    lines = [ln.strip() for ln in output.splitlines() if any(k in ln for k in keys)]
    return list(dict.fromkeys(lines))[:12]


# -- the physical bound (run in a child process: --bound-worker) --------------------------------


def one_memory(devices: str) -> bool:
    """Whether every rank of ``devices`` uses one memory (one GPU, or the host)."""
    kind, _, ids = devices.partition(":")
    if kind == "cpu":
        return True
    return kind == "gpu" and len(set(ids.split(","))) == 1 and ids not in ("", "all")


def bound_worker(devices: str, copy_bytes: int, inputs: Sequence[Path], out: Path) -> int:
    """The device-to-device copy rate of the first device of ``devices`` (bytes read plus
    written per second, copies of ``copy_bytes``, the median of 5 batches of 10), and for
    every all_reduce of the sweep's JSON ``inputs`` its time over its own byte bound
    (``Plan.bytes_moved`` / rate; nccl has no plan) and over the minimum bound (2 N S
    bytes / rate, out of place: every rank reads its input and writes its output once).
    Ratios only where the ranks share one memory (one GPU, or the host)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import nccltree as nt
    from nccltree.comm.algorithms import ALGORITHMS

    devs = nt.devices(devices)
    dev = devs[0]
    runtimes = [dev.runtime]
    result: dict[str, Any] = {"device": devices, "backend": dev.backend}
    try:
        n = max(1, copy_bytes // 4)
        src = dev.from_host(np.ones(n, np.float32))
        dst = dev.empty(n, np.float32)
        stream = dev.new_stream()
        samples = []
        for i in range(2 + 5):
            dev.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                stream.copy(dst, src)
            stream.synchronize(120)
            if i >= 2:
                samples.append((time.perf_counter() - t0) / 10)
        rate = 2 * n * 4 / statistics.median(samples)
        result["copy"] = {"bytes": n * 4, "rate_gbs": rate / 1e9,
                          "samples_us": [t * 1e6 for t in samples]}  # fmt: skip
        del src, dst
        worlds: dict[str, Any] = {}
        rows = []
        for path in inputs:
            for r in json.loads(Path(path).read_text())["records"]:
                if r["collective"] != "all_reduce":
                    continue
                row = {k: r[k] for k in ("devices", "algorithm", "placement", "size", "ranks",
                                         "time_us", "dtype")}  # fmt: skip
                rows.append(row)
                if not one_memory(r["devices"]):
                    row["note"] = "ranks on several GPUs: no one-memory bound"
                    continue
                t = r["time_us"] * 1e-6
                if r["placement"] == "out-of-place":
                    least = 2 * r["ranks"] * r["size"]
                    row.update(min_bytes=least, min_ratio=t / (least / rate) if least else None)
                if r["algorithm"] not in ALGORITHMS or not r["size"]:
                    continue  # nccl: no plan of ours
                w = worlds.get(r["devices"])
                if w is None:
                    wdevs = nt.devices(r["devices"])
                    runtimes.append(wdevs[0].runtime)
                    w = worlds[r["devices"]] = nt.World(wdevs, algorithm="tree")
                plan = w.plan("all_reduce", r["count"], in_place=r["placement"] == "in-place",
                              dtype=r["dtype"], algorithm=r["algorithm"])  # fmt: skip
                moved = plan.bytes_moved(np.dtype(r["dtype"]).itemsize)
                row.update(bytes_moved=moved, own_ratio=t / (moved / rate) if moved else None)
        result["records"] = rows
        for w in worlds.values():
            w.close()
    finally:
        _write_json(out, result)
        for rt in runtimes:
            rt.shutdown()
    return 0


# -- the check ------------------------------------------------------------------------------

PROBE = r"""
import json
out = {}
try:
    import cupy
    from cupy.cuda import runtime
    out["cupy"] = cupy.__version__
    out["driver"] = runtime.driverGetVersion()
    out["runtime"] = runtime.runtimeGetVersion()
    n = runtime.getDeviceCount()
    gpus = []
    for i in range(n):
        name = runtime.getDeviceProperties(i)["name"]
        gpus.append({"name": name.decode() if isinstance(name, bytes) else str(name),
                     "cc": cupy.cuda.Device(i).compute_capability})
    out["gpus"] = gpus
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
try:
    from cupy.cuda import nccl
    out["nccl"] = nccl.get_version() if getattr(nccl, "available", False) else None
except Exception as exc:
    out["nccl_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


class TestLog:
    """The plugin's JSON-lines log, read as it grows: every test collected (with its GPU
    markers) and its outcome once done, collection errors, and the test running now."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")
        self.offset = 0
        self.tests: dict[str, dict[str, Any]] = {}  # node id -> its latest record
        self.collect_errors: dict[str, str] = {}
        self.running: str | None = None
        self.rootdir: str | None = None

    def read(self) -> bool:
        """Take in the whole lines written since the last call; True if there were any."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written comes next time
        self.offset += end
        lines = chunk[:end].decode("utf-8", errors="replace").splitlines()
        for line in lines:
            rec = json.loads(line)
            event = rec.pop("event")
            if event == "collected":
                self.rootdir = rec["rootdir"]  # node ids are relative to it
                for t in rec["tests"]:
                    self.tests.setdefault(t["id"], {"outcome": "not run", **t})
            elif event == "collect_error":
                self.collect_errors[rec["id"]] = rec["message"]
            elif event == "start":
                self.running = rec["id"]
                self.tests.setdefault(rec["id"], {"outcome": "not run"})
            elif event == "done":
                self.tests[rec["id"]] = rec
                self.running = None
        return bool(lines)


class Interrupted(Exception):
    """SIGTERM/SIGINT: stop, report what there is."""


@dataclass
class Check:
    args: argparse.Namespace
    out: Path
    deadline_s: float
    t0: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpus: int = 0
    child: subprocess.Popen[bytes] | None = None
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    config: Config = field(init=False)  # set once the probe knows the GPUs
    plan: dict[str, Any] = field(default_factory=dict)  # what runs after the install
    part: str = "core"  # the stage running now
    token: str = field(default_factory=lambda: f"{os.getpid()}-{time.time_ns()}")
    test_log: TestLog | None = None
    reported: set[str] = field(default_factory=set)  # tests whose failure was reported
    schedule: list[tuple[str, str, float, Callable[[], None]]] = field(default_factory=list)
    step_index: int = 0  # the schedule's step running now

    # -- time and records -------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.deadline_s - self.elapsed()

    def part_end(self, part: str | None = None) -> float:
        """When the stage ``part`` (the current one by default) must be over (s)."""
        return PART_END[part or self.part] * self.deadline_s

    def left(self, cap: float = 1e9) -> float:
        """Seconds the current step may take: at most ``cap``, and within its stage's
        end, leaving the planned time of the stage's later steps."""
        reserve = sum(
            planned
            for part, _, planned, _ in self.schedule[self.step_index + 1 :]
            if part == self.part
        )
        if self.args.dry_run:
            reserve = 0.0  # the plan is a GPU run's
        return max(0.0, min(cap, self.part_end() - self.elapsed() - reserve, self.remaining()))

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        self.results["failures"] = self.failures
        self.results["notes"] = self.notes
        _write_json(self.out / "gpu_check.json", self.results)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"FAIL: {what}", flush=True)

    def stage(self, name: str) -> dict[str, Any]:
        """The record of step ``name``: made by its first call; a step that runs in
        several stages (tests, sweep) keeps one record and is marked running again."""
        stages = self.results.setdefault("stages", {})
        st: dict[str, Any] | None = stages.get(name)
        if st is None:
            st = stages[name] = {"status": "running", "started_s": round(self.elapsed(), 1)}
        else:
            st["status"] = "running"
        st.setdefault("parts", [])
        if self.part not in st["parts"]:
            st["parts"].append(self.part)
        print(
            f"\n== {self.part}: {name} ({self.elapsed():.0f} s; stage ends at "
            f"{self.part_end():.0f} s)",
            flush=True,
        )
        self.save()
        return st

    def run(
        self,
        argv: Sequence[str],
        log: Path,
        timeout: float,
        env: dict[str, str] | None = None,
        poll: Callable[[], None] | None = None,
    ) -> Ran:
        """Run ``argv`` with stdout and stderr into ``log``, at most ``timeout`` seconds
        (then it and its children are killed); ``poll()`` is called every second."""
        t = time.monotonic()
        with open(log, "wb") as f:
            # the command on one line: the output starts after the first newline
            f.write(("$ " + shlex.join(argv).replace("\n", "\\n") + "\n").encode())
            f.flush()
            proc = subprocess.Popen(
                list(argv),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env={**(env or self.env), RUN_ENV: self.token},
                start_new_session=True,
            )
            self.child = proc
            rc: int | None = None
            try:
                while True:
                    left = timeout - (time.monotonic() - t)
                    if left <= 0:
                        _kill(proc)
                        break
                    try:
                        rc = proc.wait(min(1.0, left))
                        break
                    except subprocess.TimeoutExpired:
                        if poll is not None:
                            poll()
            except BaseException:
                _kill(proc)
                raise
            finally:
                self.child = None
        output = log.read_text(encoding="utf-8", errors="replace").split("\n", 1)[1]
        return Ran(rc, round(time.monotonic() - t, 1), _tail(output, 3000))

    def kill_leftovers(self) -> list[str]:
        """Kill the processes of this check still running (those whose environment
        carries its run token, ``RUN_ENV``: whatever a killed test or job started, in
        any session); what was killed, as "pid command" lines."""
        mark = f"{RUN_ENV}={self.token}".encode()
        found: list[str] = []
        me = os.getpid()
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return found
        for pid in pids:
            if pid == me:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                os.kill(pid, signal.SIGKILL)
                found.append(f"{pid} {cmd[:200]}")
            except (OSError, ProcessLookupError):
                continue
        return found

    # -- stages -----------------------------------------------------------------------
    def probe(self) -> None:
        st = self.stage("probe")
        if self.args.dry_run:
            st.update(status="ok", backend="host", gpus=[])
            self.results["machine"] = {"backend": "host", "python": sys.version.split()[0]}
            return
        ran = self.run([sys.executable, "-c", PROBE], self.out / "probe.txt", 60)
        info: dict[str, Any] = {}
        for line in reversed(ran.tail.splitlines()):
            if line.startswith("{"):
                info = json.loads(line)
                break
        info["python"] = sys.version.split()[0]
        self.results["machine"] = info
        self.gpus = len(info.get("gpus", []))
        for name, argv in (
            ("gpus.txt", ["nvidia-smi", "-L"]),
            ("nvidia-smi-topo.txt", ["nvidia-smi", "topo", "-m"]),
        ):
            try:
                self.run(argv, self.out / name, 20)
            except OSError:
                pass
        if self.gpus == 0:
            st["status"] = "failed"
            self.fail(f"probe: CuPy sees no GPU ({info.get('error', 'no error given')})")
        else:
            st["status"] = "ok"
            names = ", ".join(f"{g['name']} (sm_{g['cc']})" for g in info["gpus"])
            print(
                f"{self.gpus} GPU(s): {names}; CuPy {info.get('cupy')}, driver "
                f"{info.get('driver')}, NCCL {info.get('nccl')}",
                flush=True,
            )
        self.save()

    def install(self) -> None:
        st = self.stage("install")
        # the wheels go under a prefix of their own: their modules, and the programs and
        # shared libraries some bring (mpich: mpiexec and libmpi, for the process groups'
        # tests), reached through PYTHONPATH, PATH and LD_LIBRARY_PATH
        prefix = ROOT / "build" / "gpu-check-prefix"
        site = Path(
            sysconfig.get_path("purelib", "posix_prefix", vars={"base": str(prefix),
                                                                 "platbase": str(prefix)})
        )  # fmt: skip
        wheels_dir = Path(self.args.wheels) if self.args.wheels else ROOT / ".whl"
        wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
        archs = sorted({g["cc"] for g in self.results.get("machine", {}).get("gpus", [])})
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(BENCH), *filter(None, [self.env.get("PYTHONPATH")])]
        )
        self.env["PATH"] = os.pathsep.join([str(prefix / "bin"), self.env.get("PATH", "")])
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(prefix / "lib"), *filter(None, [self.env.get("LD_LIBRARY_PATH")])]
        )
        build_env = dict(self.env)
        if archs:
            # the fatbin for the GPUs present only: one architecture compiles in seconds.
            # CMAKE_ARGS, not SKBUILD_CMAKE_DEFINE, which splits its value on ";"
            define = "-DNCCLTREE_CUDA_ARCHS=" + ";".join(archs)
            build_env["CMAKE_ARGS"] = " ".join(filter(None, [self.env.get("CMAKE_ARGS"), define]))
        build_env["PIP_BREAK_SYSTEM_PACKAGES"] = "1"  # a system Python without a venv
        pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
        wheel_cmd = [*pip, "-q", "--no-compile", "--upgrade", "--prefix", str(prefix)]
        wheel_cmd += map(str, wheels)
        # -v: CMake's messages go to the log (whether the fatbin was built, and for what)
        build_cmd = [*pip, "-v", "--no-build-isolation", "-e", "."]
        st.update(
            wheels=[w.name for w in wheels],
            cuda_archs=archs,
            commands=[shlex.join(wheel_cmd) if wheels else None, shlex.join(build_cmd)],
        )
        if self.args.dry_run or self.args.no_install:
            st["skipped"] = "dry run" if self.args.dry_run else "--no-install"
            print("not run here:\n  " + "\n  ".join(c for c in st["commands"] if c), flush=True)
        else:
            if wheels:
                ran = self.run(wheel_cmd, self.out / "install-wheels.txt", self.left(60))
                st["wheels_rc"] = ran.rc
                if ran.rc != 0:
                    self.fail(f"install: the wheels in {wheels_dir} did not install:\n{ran.tail}")
            ran = self.run(
                build_cmd,
                self.out / "install-build.txt",
                self.left(150),
                env=build_env,
            )
            st.update(build_rc=ran.rc, build_s=ran.seconds)
            log = (self.out / "install-build.txt").read_text(errors="replace")
            st["fatbin"] = (
                "built"
                if "building the CUDA fatbin" in log
                else "not built (runtime compilation)"
                if "nvcc not found" in log
                else "unknown (see install-build.txt)"
            )
            if ran.rc != 0:
                self.fail(f"install: building nccltree failed (rc {ran.rc}):\n{ran.tail}")
        check = (
            "import nccltree, nccltree._native as n; n.library(); "
            "print('host kernel library:', n.library_path())\n"
            "try:\n import lmdb; print('lmdb', getattr(lmdb, '__version__', '?'))\n"
            "except ImportError: print('lmdb: missing')"
        )
        ran = self.run([sys.executable, "-c", check], self.out / "install-check.txt", 60)
        st["import"] = ran.tail.strip().splitlines()
        if ran.rc != 0:
            self.fail(f"install: nccltree does not import:\n{ran.tail}")
        elif "lmdb: missing" in ran.tail:
            self.fail("install: lmdb is missing (put an lmdb wheel for this Python in .whl/)")
        st["status"] = "ok" if ran.rc == 0 and st.get("build_rc", 0) == 0 else "failed"
        self.save()

    def topology(self) -> None:
        st = self.stage("topology")
        argv = [
            sys.executable,
            "-m",
            "nccltree.cli.bench",
            "topo",
            "--devices",
            self.config.topo_devices,
        ]
        ran = self.run(argv, self.out / "topology.txt", self.left(60))
        lines = ran.tail.splitlines()
        matrix: list[str] = []
        for line in lines:
            if line.startswith("# topology") or (matrix and line.strip()):
                matrix.append(line)
            elif matrix:
                break
        st.update(status="ok" if ran.rc == 0 else "failed", rc=ran.rc, matrix=matrix)
        if ran.rc != 0:
            self.fail(f"topology: nccltree-bench topo failed (rc {ran.rc}):\n{ran.tail}")
        self.save()

    # -- tests ------------------------------------------------------------------------
    def _pytest_timeout_installed(self) -> bool:
        if self.args.fallback_timeout:
            return False
        ran = self.run(
            [sys.executable, "-c", "import pytest_timeout"], self.out / "pytest-timeout.txt", 60
        )
        return ran.rc == 0

    def tests(self, selection: list[str]) -> None:
        """The tests ``selection`` picks, in one pytest process (started again after a
        crash, without what already ran); one record and one log for every stage."""
        st = self.stage("tests")
        fixed = self.args.test_timeout  # None: each test's own limit (gpu_limit)
        if self.test_log is None:
            via = "pytest-timeout" if self._pytest_timeout_installed() else "SIGALRM (gpu_check)"
            st.update(test_timeout_s=fixed, timeout_via=via, selection={})
            self.test_log = TestLog(self.out / "tests.jsonl")
        via = st["timeout_via"]
        st["selection"][self.part] = selection
        log = self.test_log
        done_file = self.out / "tests-done.txt"
        hang_file = self.out / "tests-hang.txt"
        env = dict(self.env)
        env.update(
            {
                _ENV_LOG: str(log.path),
                _ENV_HARD: "1",
                _ENV_HANG: str(hang_file),
                _ENV_DESELECT: str(done_file),
                _ENV_SOFT: str(fixed or 0),
                _ENV_TIMER: "pytest-timeout" if via == "pytest-timeout" else "alarm",
            }
        )
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "gpu_check",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            "-o",
            "console_output_style=classic",
        ]

        def progress() -> None:
            if log.read():
                self._count_tests(st, log)
                self.save()

        runs: list[dict[str, Any]] = st.setdefault("runs", [])
        before = set(log.tests)
        while True:
            # a resumed run leaves out what already finished (and the test that crashed)
            done_file.write_text(
                "".join(f"{t}\n" for t, r in log.tests.items() if r["outcome"] != "not run")
            )
            limit = self.left()
            if limit < 5:
                st["cut_short"] = f"the {self.part} stage ended before every test ran"
                break
            ran = self.run(
                [*argv, *selection],
                self.out / f"tests-{self.part}-{len(runs) + 1}.txt",
                limit,
                env=env,
                poll=progress,
            )
            log.read()
            left_over = self.kill_leftovers()
            runs.append({"part": self.part, "rc": ran.rc, "seconds": ran.seconds,
                         "killed_after": left_over})  # fmt: skip
            running, log.running = log.running, None
            if left_over and not ran.timed_out and running is None:
                self.fail(
                    "tests: processes left running after pytest ended (killed): "
                    + "; ".join(left_over[:5])
                )
            if ran.timed_out:
                if running:
                    log.tests[running].update(
                        outcome="not finished", message=f"still running at the end of the "
                        f"{self.part} stage"
                    )  # fmt: skip
                st["cut_short"] = f"the {self.part} stage ended before every test ran"
                break
            if running is not None:
                # the interpreter died inside a test: a crash, or the hard timeout
                why = hang_file.read_text(errors="replace") if hang_file.exists() else ""
                # the stacks list the innermost frames first: keep the head of the dump
                message = why.strip()[:3000] if why.strip() else _tail(ran.tail, 3000)
                log.tests[running].update(outcome="crashed", message=message)
                if any(r["outcome"] == "not run" for r in log.tests.values()):
                    print(f"{running} crashed; resuming after it", flush=True)
                    continue
            elif ran.rc not in (0, 1, 5) and not log.collect_errors:
                self.fail(f"tests: pytest stopped with exit status {ran.rc}:\n{ran.tail}")
                st["pytest_error"] = ran.tail
            break
        self._count_tests(st, log)
        c = st["counts"]
        mine = [t for t in log.tests if t not in before]
        st.setdefault("by_part", {})[self.part] = {
            "tests": len(mine),
            "seconds": round(sum(log.tests[t].get("seconds", 0) or 0 for t in mine), 1),
            "planned_s": round(sum(log.tests[t].get("gpu_seconds", 0) or 0 for t in mine), 1),
        }
        bad = [t for t, r in log.tests.items() if r["outcome"] in ("failed", "error", "crashed")]
        for t in bad:
            if t in self.reported:
                continue
            self.reported.add(t)
            r = log.tests[t]
            self.fail(f"test {r['outcome']}: {t}\n{_tail(r.get('message', ''), 800)}")
        for t, msg in log.collect_errors.items():
            if t not in self.reported:
                self.reported.add(t)
                self.fail(f"tests: {t} could not be collected:\n{_tail(msg, 800)}")
        new_skips = [t for t in st["unexpected_skips"] if t not in self.reported]
        if new_skips:
            self.reported.update(new_skips)
            self.fail(
                f"tests: {len(new_skips)} gpu test(s) skipped on a GPU machine: "
                + ", ".join(new_skips[:10])
            )
        not_run = [t for t, r in log.tests.items() if r["outcome"] in ("not run", "not finished")]
        if not_run and not any(t in self.reported for t in not_run):
            self.reported.update(not_run)
            self.fail(f"tests: {len(not_run)} test(s) did not run or finish (stage's end)")
        if not log.tests and not log.collect_errors:
            self.fail("tests: no test was collected")
        clean = not (
            bad
            or log.collect_errors
            or c["unexpected_skips"]
            or c["not_run"]
            or st.get("pytest_error")
        )
        st["status"] = "ok" if clean and log.tests else "failed"
        self.save()

    def _count_tests(self, st: dict[str, Any], log: TestLog) -> None:
        counts = dict.fromkeys(
            (
                "collected",
                "passed",
                "failed",
                "error",
                "crashed",
                "skipped",
                "expected_skips",
                "unexpected_skips",
                "other_skips",
                "not_run",
                "timeouts",
            ),
            0,
        )
        unexpected = []
        for t, r in log.tests.items():
            counts["collected"] += 1
            o = r["outcome"]
            counts[o if o in counts else "not_run"] += 1
            counts["timeouts"] += bool(r.get("timeout"))
            if o != "skipped":
                continue
            if not (r.get("gpu") or r.get("multi_gpu")):
                counts["other_skips"] += 1
            elif self.args.dry_run or r.get("multi_gpu", 0) > max(self.gpus, 1):
                counts["expected_skips"] += 1  # no GPU in a dry run; too few for multi_gpu(n)
            else:
                counts["unexpected_skips"] += 1
                unexpected.append(t)
        counts["collect_errors"] = len(log.collect_errors)
        st.update(
            counts=counts,
            unexpected_skips=unexpected,
            tests=log.tests,
            collect_errors=log.collect_errors,
            rootdir=log.rootdir,
        )

    # -- sweep ------------------------------------------------------------------------
    def sweep(self, runs: list[SweepRun]) -> None:
        st = self.stage("sweep")
        done: list[dict[str, Any]] = st.setdefault("runs", [])
        for i, sr in enumerate(runs):
            name = f"sweep-{len(done) + 1}"
            rec: dict[str, Any] = {
                "key": sr.key,
                "devices": sr.devices,
                "band": sr.band,
                "algorithms": list(sr.algorithms),
                "part": self.part,
                "planned_s": sr.planned_s,
            }
            done.append(rec)
            later = 0.0 if self.args.dry_run else sum(r.planned_s for r in runs[i + 1 :])
            limit = self.left() - later
            if limit < 5:
                rec["status"] = "not run (stage's end)"
                self.fail(f"sweep {sr.key}: not run (the {self.part} stage's end)")
                continue
            algs = list(sr.algorithms)
            ran, path = self._bench(sr, algs, name, limit)
            nccl_failed = False
            if ran.rc == 2 and "nccl" in algs:
                # Every World is made before anything runs, so an NCCL that cannot start
                # stops the whole run: run the others again and report NCCL on its own.
                first = ran
                algs = [a for a in algs if a != "nccl"]
                ran, path = self._bench(sr, algs, name, self.left() - later)
                if ran.rc == 0:
                    rec["nccl_error"] = first.tail
                    nccl_failed = self.config.nccl_expected
                    if nccl_failed:
                        self.fail(f"sweep {sr.key}: NCCL did not start:\n{_tail(first.tail, 800)}")
                    else:
                        self.notes.append(
                            f"sweep {sr.key}: no NCCL on the host backend (expected in a dry run)"
                        )
            rec.update(rc=ran.rc, seconds=ran.seconds, ran=algs, log=f"{name}.txt")
            if path.exists():
                records = json.loads(path.read_text())["records"]
                rec.update(
                    json=path.name,
                    records=len(records),
                    wrong=sum(r["wrong"] or 0 for r in records),
                )
            if ran.timed_out:
                rec["status"] = "timed out (stage's end)"
                self.fail(f"sweep {sr.key}: cut at the {self.part} stage's end after "
                          f"{ran.seconds:.0f} s")  # fmt: skip
            elif ran.rc != 0:
                rec["status"] = f"failed (rc {ran.rc})"
                self.fail(
                    f"sweep {sr.key}: nccltree-bench failed (rc {ran.rc}):\n{_tail(ran.tail, 1200)}"
                )
            else:
                rec["status"] = "failed (NCCL did not start)" if nccl_failed else "ok"
            self.save()
        st["status"] = "ok" if all(r["status"] == "ok" for r in done) else "failed"
        self.save()

    # -- the physical bound -----------------------------------------------------------
    def bound(self) -> None:
        """The copy rate, and each all_reduce of this stage's sweep runs against its own
        byte bound and the minimum bound (``bound_worker``, in a child process)."""
        st = self.stage("bound")
        sweep = self.results.get("stages", {}).get("sweep", {})
        files = [r["json"] for r in sweep.get("runs", [])
                 if r.get("part") == self.part and r.get("json")]  # fmt: skip
        dev = self.config.logical.split(",")[0]  # GPU 0 (or a host device): one memory
        path = self.out / f"bound-{self.part}.json"
        path.unlink(missing_ok=True)
        argv = [sys.executable, str(Path(__file__).resolve()), "--bound-worker", "--devices",
                dev, "--copy-bytes", str(self.config.copy_bytes), "--json", str(path),
                "--inputs", ",".join(str(self.out / f) for f in files)]  # fmt: skip
        ran = self.run(argv, self.out / f"bound-{self.part}.txt", self.left(120))
        got = json.loads(path.read_text()) if path.exists() else {}
        runs: list[dict[str, Any]] = st.setdefault("runs", [])
        runs.append({"part": self.part, "rc": ran.rc, "seconds": ran.seconds, "json": path.name,
                     "copy": got.get("copy"), "records": len(got.get("records", []))})  # fmt: skip
        if got.get("copy"):
            st["copy"] = got["copy"]  # the latest measurement
        if ran.rc != 0 or "copy" not in got:
            self.fail(f"bound ({self.part}): the copy rate or the ratios failed (rc {ran.rc}):"
                      f"\n{ran.tail}")  # fmt: skip
            st["status"] = "failed"
        elif st.get("status") != "failed":
            st["status"] = "ok"
        self.save()

    def bound_rows(self) -> dict[tuple[str, str, str, int], dict[str, Any]]:
        """The bound's rows of every stage, by (devices, algorithm, placement, size)."""
        rows: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        for run in self.results.get("stages", {}).get("bound", {}).get("runs", []):
            path = self.out / run["json"]
            if not path.exists():
                continue
            for r in json.loads(path.read_text()).get("records", []):
                rows[(r["devices"], r["algorithm"], r["placement"], r["size"])] = r
        return rows

    # -- no process left on the GPU ---------------------------------------------------
    def gpu_clean(self) -> None:
        """Before a sweep: nothing of this check still runs (killed, and a failure if
        anything was), and ``nvidia-smi`` lists no compute process on the GPUs (another
        program's is noted: the sweep would share the GPU with it)."""
        st = self.stage("gpu_clean")
        killed = self.kill_leftovers()
        check: dict[str, Any] = {"part": self.part, "killed": killed}
        st.setdefault("checks", []).append(check)
        if killed:
            self.fail("processes of the check were still running before the sweep (killed): "
                      + "; ".join(killed[:5]))  # fmt: skip
        smi = shutil.which("nvidia-smi")
        if smi is None:
            check["nvidia_smi"] = "not found" + (" (dry run)" if self.args.dry_run else "")
        else:
            query = [smi, "--query-compute-apps=pid,process_name,used_memory",
                     "--format=csv,noheader"]  # fmt: skip
            ran = self.run(query, self.out / f"gpu-clean-{self.part}.txt", self.left(20))
            apps = [ln.strip() for ln in ran.tail.splitlines() if ln.strip()]
            check["compute_apps"] = apps
            if ran.rc != 0:
                self.notes.append(f"gpu_clean: nvidia-smi failed (rc {ran.rc})")
            elif apps:
                self.notes.append(
                    f"before the {self.part} sweep, other compute processes on the GPU: "
                    + "; ".join(apps[:5])
                )
        st["status"] = "failed" if killed else "ok"
        self.save()

    # -- NCCL across two processes on one GPU (attempted) -----------------------------
    def nccl_one_gpu(self) -> None:
        """Two processes on GPU 0, each claiming a host of its own (``NCCL_HOSTID``),
        sockets over ``lo``: whether NCCL accepts them, and if so whether the groups'
        NCCL paths (collectives, NCCL send/recv between two simulated nodes) match numpy.
        An attempt, reported either way; NVIDIA does not support it, so it fails nothing."""
        st = self.stage("nccl_one_gpu")
        where = os.pathsep.join([self.env.get("PATH", ""), str(Path(sys.executable).parent)])
        exe = shutil.which("mpiexec", path=where) or "mpiexec"
        attempts = nccl_one_gpu_attempts("gpu:0")
        st["env"] = NCCL_ONE_GPU_ENV
        done: list[dict[str, Any]] = st.setdefault("attempts", [])
        if self.args.dry_run:
            st.update(status="not run (dry run: no NCCL on the host backend)",
                      commands=[shlex.join(nccl_one_gpu_argv(exe, a)) for a in attempts])  # fmt: skip
            print("not run here:\n  " + "\n  ".join(st["commands"]), flush=True)
            self.save()
            return
        for i, attempt in enumerate(attempts):
            rec: dict[str, Any] = {"name": attempt["name"]}
            done.append(rec)
            limit = self.left(60)
            if limit < 5:
                rec["status"] = "not run (stage's end)"
                continue
            outdir = self.out / f"nccl-one-gpu-{i + 1}"
            shutil.rmtree(outdir, ignore_errors=True)
            outdir.mkdir()
            env = {**self.env, "NCCLTREE_TEST_OUT": str(outdir)}
            argv = nccl_one_gpu_argv(exe, attempt)
            ran = self.run(argv, self.out / f"nccl-one-gpu-{i + 1}.txt", limit, env=env)
            self.kill_leftovers()
            reports = [json.loads(f.read_text()) for f in sorted(outdir.glob("*.json"))]
            fails = sum(len(r.get("failures", [])) + int(r.get("nfail", 0) or 0) for r in reports)
            checked = sum(int(r.get("checked", 0) or 0) for r in reports)
            rec.update(rc=ran.rc, seconds=ran.seconds, reports=len(reports), checked=checked,
                       failures=fails, command=shlex.join(argv))  # fmt: skip
            if ran.rc == 0 and len(reports) == 2 and not fails:
                rec["status"] = "accepted: results match numpy"
            elif ran.timed_out:
                rec["status"] = "timed out"
                rec["errors"] = nccl_errors(ran.tail)
            else:
                rec["status"] = "refused or failed"
                rec["errors"] = nccl_errors(ran.tail) or [_tail(ran.tail, 600)]
            self.save()
        verdicts = {r["status"] for r in done}
        st["status"] = "ok"  # an attempt: its outcome is the record, not a failure
        st["verdict"] = (
            "NCCL accepted two processes on one GPU"
            if verdicts == {"accepted: results match numpy"}
            else "NCCL did not run two processes on one GPU everywhere: see the attempts"
        )
        self.notes.append(f"NCCL on one GPU: {st['verdict']}")
        self.save()

    def _bench(self, sr: SweepRun, algs: list[str], name: str, limit: float) -> tuple[Ran, Path]:
        path = self.out / f"{name}.json"
        path.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "nccltree.cli.bench",
            "collectives",
            "--devices",
            sr.devices,
            "--algorithm",
            ",".join(algs),
            "--collective",
            sr.collectives,
            "-b",
            sr.minbytes,
            "-e",
            sr.maxbytes,
            "-f",
            str(sr.factor),
            "-n",
            str(sr.iters),
            "-w",
            str(sr.warmup),
            "-c",
            "1",
            "--json",
            str(path),
        ]
        return self.run(argv, self.out / f"{name}.txt", limit), path

    # -- issue cost -------------------------------------------------------------------
    def issue_cost(self, sets: list[tuple[str, tuple[str, ...]]]) -> None:
        st = self.stage("issue_cost")
        done: list[dict[str, Any]] = st.setdefault("runs", [])
        for i, (devices, algs) in enumerate(sets):
            rec: dict[str, Any] = {"devices": devices, "algorithms": list(algs)}
            done.append(rec)
            limit = self.left(60)
            if limit < 5:
                rec["status"] = "not run (stage's end)"
                self.fail(f"issue cost {devices}: not run (the {self.part} stage's end)")
                continue
            path = self.out / f"issue-{i + 1}.json"
            path.unlink(missing_ok=True)
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--issue-cost-worker",
                "--devices",
                devices,
                "--algorithms",
                ",".join(algs),
                "--sizes",
                ",".join(map(str, self.config.issue_sizes)),
                "--json",
                str(path),
            ]
            ran = self.run(argv, self.out / f"issue-{i + 1}.txt", limit)
            rec.update(rc=ran.rc, seconds=ran.seconds, json=path.name)
            records = json.loads(path.read_text())["records"] if path.exists() else []
            rec["records"] = records
            errors = [r for r in records if r.get("error")]
            nccl_only = errors and all(r["algorithm"] == "nccl" for r in errors)
            if ran.timed_out:
                rec["status"] = "timed out (stage's end)"
                self.fail(f"issue cost {devices}: cut at the {self.part} stage's end")
            elif ran.rc != 0 and not (nccl_only and not self.config.nccl_expected):
                rec["status"] = f"failed (rc {ran.rc})"
                what = "; ".join(f"{r['algorithm']}: {r['error']}" for r in errors) or ran.tail
                self.fail(f"issue cost {devices}: {_tail(what, 800)}")
            else:
                rec["status"] = "ok"
            self.save()
        st["status"] = "ok" if all(r["status"] == "ok" for r in done) else "failed"
        self.save()

    # -- process groups ----------------------------------------------------------------
    def process_groups(self) -> None:
        st = self.stage("process_groups")
        # on PATH (the wheels' prefix comes first), else beside the interpreter (a venv)
        where = os.pathsep.join([self.env.get("PATH", ""), str(Path(sys.executable).parent)])
        exe = shutil.which("mpiexec", path=where)
        if exe is None:
            st["status"] = "failed"
            self.fail("process groups: no mpiexec (put mpich and mpi4py wheels in .whl/)")
            self.save()
            return
        path = self.out / "pg_gpu.json"
        path.unlink(missing_ok=True)
        argv = [exe, "-n", "2", sys.executable, str(BENCH / "pg_gpu_bench.py"),
                *self.config.pg_args, "--json", str(path)]  # fmt: skip
        ran = self.run(argv, self.out / "pg_gpu.txt", self.left(150))
        self.kill_leftovers()
        got = json.loads(path.read_text()) if path.exists() else {}
        ratios = got.get("ratio_pg_to_world", {})
        biggest = max((int(k.rsplit("/", 1)[1]) for k in ratios), default=0)
        at_top = {k.rsplit("/", 1)[0]: v for k, v in ratios.items() if k.endswith(f"/{biggest}")}
        st.update(rc=ran.rc, seconds=ran.seconds, json=path.name, wrong=got.get("wrong"),
                  size=biggest, ratios=at_top,
                  busbw={k: v for k, v in got.get("cases", {}).items()})  # fmt: skip
        sym = [v for k, v in at_top.items() if k.endswith("/sym")]
        st["target"] = (
            None
            if not sym or self.args.dry_run
            else f"{'met' if min(sym) >= PG_TARGET else 'missed'}: worst symmetric "
            f"{min(sym):.2f} (target {PG_TARGET})"
        )
        if ran.rc != 0 or not got:
            st["status"] = "failed"
            self.fail(f"process groups: pg_gpu_bench failed (rc {ran.rc}):\n{ran.tail}")
        else:
            st["status"] = "ok"
        self.save()

    # -- the simulator against what the sweep measured (CPU only, seconds) -------------
    def prediction(self) -> None:
        """``bench/sim_vs_gpu_check.py`` over this run's results: every measured
        out-of-place all_reduce against nccltree.sim's prediction, in
        ``sim_vs_measured.md``. Post-processing: a failure here is a note, not a failed
        check."""
        if self.part_end() - self.elapsed() < 10 or "sweep" not in self.stages:
            self.notes.append("prediction: not run (no time left in the last stage)")
            return
        md = self.out / "sim_vs_measured.md"
        md.unlink(missing_ok=True)
        argv = [sys.executable, str(BENCH / "sim_vs_gpu_check.py"), str(self.out),
                "--markdown", str(md)]  # fmt: skip
        ran = self.run(argv, self.out / "sim_vs_measured.txt", self.left(60))
        if ran.rc != 0 or not md.exists():
            self.notes.append(f"prediction: sim_vs_gpu_check.py failed (rc {ran.rc})")
            return
        last = [ln for ln in md.read_text().splitlines() if ln.startswith("median |")]
        self.results["prediction"] = {"markdown": md.name, "summary": last[0] if last else None}
        self.save()

    # -- summary ----------------------------------------------------------------------
    def busbw_table(self) -> list[dict[str, Any]]:
        """busbw/algbw of every (collective, devices, algorithm) at the summary sizes,
        out of place, read from the sweep's JSON records (None where no record)."""
        stage = self.results.get("stages", {}).get("sweep", {})
        found: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
        bounds = self.bound_rows()
        for run in stage.get("runs", []):
            if not run.get("json"):
                continue
            recs = json.loads((self.out / run["json"]).read_text())["records"]
            for r in recs:
                key = (r["collective"], r["devices"], r["algorithm"])
                cells = found.setdefault(key, {})
                if r["placement"] == "out-of-place" and r["size"] in self.config.summary_sizes:
                    cells[r["size"]] = {
                        "busbw": r["busbw"],
                        "algbw": r["algbw"],
                        "time_us": r["time_us"],
                        "ranks": r["ranks"],
                        "wrong": r["wrong"],
                    }
                    b = bounds.get((r["devices"], r["algorithm"], r["placement"], r["size"]))
                    if r["collective"] == "all_reduce" and b is not None:
                        cells[r["size"]]["own_ratio"] = b.get("own_ratio")
                        cells[r["size"]]["min_ratio"] = b.get("min_ratio")
        # the sweep's own order: collectives, then device sets, then algorithms as given
        order = sorted(found, key=lambda k: (k[0], list(found).index(k)))
        return [
            {
                "collective": c,
                "devices": d,
                "algorithm": a,
                "sizes": {str(s): found[(c, d, a)].get(s) for s in self.config.summary_sizes},
            }
            for c, d, a in order
        ]

    def summary(self) -> int:
        for name, st in self.results.get("stages", {}).items():
            if st.get("status") == "running":  # cut short: by a signal or an error
                st["status"] = "not finished"
            for run in st.get("runs", []) if name in ("sweep", "issue_cost") else []:
                run.setdefault("status", "not finished")
        self.kill_leftovers()
        table = self.busbw_table()
        self.results["summary"] = {"busbw": table}
        ok = not self.failures
        self.results["result"] = "pass" if ok else "fail"
        self.save()
        m = self.results.get("machine", {})
        gpus = m.get("gpus") or []
        where = (
            "host backend (dry run)"
            if self.args.dry_run
            else f"{len(gpus)} GPU(s): " + ", ".join(f"{g['name']} sm_{g['cc']}" for g in gpus)
        )
        stages = self.results.get("stages", {})
        lines = [
            "",
            "=" * 78,
            f"nccltree GPU check: {'PASS' if ok else 'FAIL'}   mode {self.config.mode}"
            f"{' (rerun of failures)' if self.args.rerun_failed else ''}, {where}",
            f"commit {self.results.get('commit')}, {self.elapsed():.0f} s of "
            f"{self.deadline_s:.0f} s; CuPy {m.get('cupy', '-')}, NCCL "
            f"{m.get('nccl', '-')}, Python {m.get('python')}",
        ]
        ins = stages.get("install")
        if ins:
            if ins.get("skipped"):
                how = f"build not run ({ins['skipped']})"
            else:
                how = (
                    f"built in {ins.get('build_s', 0):.0f} s, fatbin {ins.get('fatbin')}, "
                    f"CUDA archs {','.join(ins.get('cuda_archs', [])) or '-'}"
                )
            lines.append(
                f"install   {ins['status']}: {how}; wheels: "
                f"{', '.join(ins.get('wheels', [])) or 'none'}"
            )
        tst = stages.get("tests")
        if tst and "counts" in tst:
            c = tst["counts"]
            fixed = tst.get("test_timeout_s")
            limits = f"{fixed:g} s each" if fixed else "each test's own limit"
            parts = "; ".join(
                f"{k} {v['tests']} in {v['seconds']:.0f} s (planned {v['planned_s']:.0f} s)"
                for k, v in tst.get("by_part", {}).items()
            )
            lines.append(
                f"tests     {tst.get('status')}: {c['passed']} passed, {c['failed']} failed, "
                f"{c['error']} errors, {c['crashed']} crashed, {c['not_run']} not run, "
                f"{c['skipped']} skipped ({c['expected_skips']} expected"
                f"{' (dry run)' if self.args.dry_run else ' multi_gpu'}, "
                f"{c['unexpected_skips']} gpu: must be 0, {c['other_skips']} other), "
                f"{c['collect_errors']} collection errors; {c['timeouts']} timeouts "
                f"({limits} via {tst['timeout_via']})" + (f"; {parts}" if parts else "")
            )
        sw = stages.get("sweep")
        if sw:
            runs = sw.get("runs", [])
            wrong = sum(r.get("wrong", 0) for r in runs)
            lines.append(
                f"sweep     {sw['status']}: {sum(r.get('status') == 'ok' for r in runs)}"
                f"/{len(runs)} runs ok, {wrong} wrong elements; busbw (algbw) GB/s "
                "out of place:"
            )
            sizes = self.config.summary_sizes
            lines.append(
                f"  {'collective':<11}{'devices':<14}{'algorithm':<10}"
                + "".join(f"{human(s):>20}" for s in sizes)
            )
            for row in table:
                cells = []
                for s in sizes:
                    v = row["sizes"][str(s)]
                    cells.append("not run" if v is None else f"{v['busbw']:.2f} ({v['algbw']:.2f})")
                lines.append(
                    f"  {row['collective']:<11}{row['devices']:<14}{row['algorithm']:<10}"
                    + "".join(f"{c:>20}" for c in cells)
                )
        bd = stages.get("bound")
        if bd:
            cp = bd.get("copy") or {}
            lines.append(
                f"bound     {bd['status']}: copy rate "
                + (f"{cp['rate_gbs']:.0f} GB/s read + written ({human(cp['bytes'])} copies, "
                   "median)" if cp else "not measured")
                + "; all_reduce time / own byte bound, / minimum bound (2 N S), out of place:"
            )  # fmt: skip

            def ratio(v: dict[str, Any] | None) -> str:
                if v is None:
                    return "not run"
                own, least = v.get("own_ratio"), v.get("min_ratio")
                if own is None and least is None:
                    return "-"
                return (f"{own:.2f}" if own is not None else "-") + " / " + (
                    f"{least:.2f}" if least is not None else "-")  # fmt: skip

            for row in table:
                if row["collective"] != "all_reduce":
                    continue
                cells = [ratio(row["sizes"][str(s)]) for s in self.config.summary_sizes]
                lines.append(f"  {row['devices']:<14}{row['algorithm']:<10}"
                             + "".join(f"{c:>20}" for c in cells))  # fmt: skip
        ic = stages.get("issue_cost")
        if ic:
            lines.append(
                f"issue     {ic['status']}: host time of a stream-ordered all_reduce "
                "call, per plan step (us)"
            )
            for run in ic.get("runs", []):
                by_alg: dict[str, list[str]] = {}
                for r in run.get("records", []):
                    if r.get("error"):
                        by_alg.setdefault(r["algorithm"], []).append("error")
                    elif "issue_us" in r:
                        per = r.get("per_step_us")
                        by_alg.setdefault(r["algorithm"], []).append(
                            f"{human(r['size'])} {r['issue_us']:.0f}"
                            + (f" = {r['steps']} x {per:.1f}" if per is not None else "")
                        )
                for alg, cells in by_alg.items():
                    lines.append(f"  {run['devices']:<14}{alg:<8}" + "; ".join(cells))
        pgs = stages.get("process_groups")
        if pgs:
            cells = ", ".join(f"{k} {v:.2f}" for k, v in (pgs.get("ratios") or {}).items())
            lines.append(
                f"groups    {pgs['status']}: 2 processes over IPC / 2 logical ranks of one "
                f"process, busbw at {human(pgs.get('size') or 0)}: {cells or '-'}"
                + (f"; target {pgs['target']}" if pgs.get("target") else "")
            )
        n1 = stages.get("nccl_one_gpu")
        if n1:
            lines.append(f"nccl/1gpu {n1['status']}: two processes on GPU 0, NCCL_HOSTID each, "
                         f"sockets over lo: {n1.get('verdict', '-')}")  # fmt: skip
            for a in n1.get("attempts", []):
                err = "; ".join(a.get("errors", [])[:2])
                lines.append(f"  {a['name']}: {a.get('status')}" + (f" ({_tail(err, 300)})"
                                                                      if err else ""))  # fmt: skip
        timing = self.results.get("timing", {})
        if timing:
            lines.append(
                "stages    "
                + "; ".join(
                    f"{k} ended at {v['ended_s']:.0f} s (share ends {v['end_s']:.0f} s)"
                    for k, v in timing.items()
                )  # fmt: skip
            )
        topo = stages.get("topology")
        if topo:
            lines.append(f"topology  {topo['status']}:")
            lines += [f"  {t}" for t in topo.get("matrix", [])[:12]]
        pred = self.results.get("prediction")
        if pred:
            lines.append(
                f"predicted nccltree.sim against the sweep's all_reduce: "
                f"{pred.get('summary') or 'no point'} ({pred['markdown']})"
            )
        for n in self.notes:
            lines.append(f"note: {n}")
        if self.failures:
            lines.append(f"{len(self.failures)} failure(s):")
            lines += [f"  - {_brief(f)}" for f in self.failures[:30]]
        lines.append(f"results: {self.out / 'gpu_check.json'}")
        print("\n".join(lines), flush=True)
        return 0 if ok else 1

    # -- the plan: each stage's planned time against its share ------------------------
    def collect_gpu_tests(self) -> list[dict[str, Any]]:
        """Every ``gpu``/``multi_gpu`` test with its markers (pytest --collect-only with
        this plugin), as the GPU run would select them."""
        log = self.out / "plan-collect.jsonl"
        log.write_text("")
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join([str(BENCH), *filter(None, [env.get("PYTHONPATH")])])
        env[_ENV_LOG] = str(log)
        argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "gpu_check",
                "-p", "no:cacheprovider", "-m", "gpu or multi_gpu", "tests"]  # fmt: skip
        ran = self.run(argv, self.out / "plan-collect.txt", 300, env=env)
        tests: list[dict[str, Any]] = []
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "collected":
                tests = rec["tests"]
        if ran.rc not in (0, 5) or not tests:
            raise RuntimeError(f"collecting the GPU tests failed (rc {ran.rc}):\n{ran.tail}")
        return tests

    def plan_time(self, tests: list[dict[str, Any]], gpus: int = 1) -> dict[str, Any]:
        """Each stage's planned seconds in a GPU run (``gpus`` GPUs, the deadline
        ``GPU_DEADLINE``): its steps' planned times and its tests' declared ones (a
        ``multi_gpu(n)`` test that needs more GPUs skips: 0.05 s)."""
        cfg = make_config(False, gpus)
        by_part: dict[str, list[float]] = {p: [] for p in PARTS}
        for t in tests:
            part = "ipc" if t.get("mpi") else "rest" if t.get("slow") else "core"
            skips = t.get("multi_gpu", 0) > gpus
            by_part[part].append(0.05 if skips else float(t.get("gpu_seconds", 0.25)))
        steps: dict[str, list[tuple[str, float]]] = {p: [] for p in PARTS}
        steps["core"] += [(k, PLANNED[k]) for k in ("probe", "install", "topology")]
        for part in PARTS:
            if by_part[part]:
                label = f"tests ({len(by_part[part])})"
                steps[part].append((label, PLANNED["pytest_start"] + sum(by_part[part])))
            runs = [r for r in cfg.sweep if r.part == part]
            if runs:
                steps[part].append(("gpu_clean", PLANNED["gpu_clean"]))
                steps[part].append((f"sweep ({len(runs)} runs)", sum(r.planned_s for r in runs)))
                steps[part].append(("bound", PLANNED["bound"]))
        steps["rest"] += [(k, PLANNED[k]) for k in ("issue_cost", "process_groups",
                                                     "nccl_one_gpu")]  # fmt: skip
        out: dict[str, Any] = {"deadline_s": GPU_DEADLINE, "fraction": PLAN_FRACTION, "parts": {}}
        start = 0.0
        for part in PARTS:
            end = PART_END[part] * GPU_DEADLINE
            planned = sum(v for _, v in steps[part])
            allowed = PLAN_FRACTION * (end - start)
            out["parts"][part] = {"from_s": start, "end_s": end, "planned_s": round(planned, 1),
                                  "allowed_s": round(allowed, 1), "ok": planned <= allowed,
                                  "steps": [(k, round(v, 2)) for k, v in steps[part]]}  # fmt: skip
            start = end
        out["total_s"] = round(sum(v["planned_s"] for v in out["parts"].values()), 1)
        out["ok"] = out["total_s"] < GPU_DEADLINE and all(v["ok"] for v in out["parts"].values())
        return out

    def check_plan(self) -> bool:
        """Collect the GPU tests, print each stage's plan, and fail where it does not fit."""
        plan = self.plan_time(self.collect_gpu_tests())
        self.results["plan_time"] = plan
        lines = [f"planned time of a GPU run (deadline {GPU_DEADLINE:.0f} s; a stage's plan "
                 f"may take {PLAN_FRACTION:.0%} of its share):"]  # fmt: skip
        for part, v in plan["parts"].items():
            lines.append(
                f"  {part:<5} {v['from_s']:>4.0f}-{v['end_s']:<4.0f}s  planned {v['planned_s']:6.1f}"
                f" s of {v['allowed_s']:6.1f} allowed  {'ok' if v['ok'] else 'OVER'}:  "
                + ", ".join(f"{k} {x:g}" for k, x in v["steps"])
            )
        lines.append(f"  total planned {plan['total_s']:.1f} s (under {GPU_DEADLINE:.0f} s: "
                     f"{'yes' if plan['total_s'] < GPU_DEADLINE else 'NO'})")  # fmt: skip
        print("\n".join(lines), flush=True)
        for part, v in plan["parts"].items():
            if not v["ok"]:
                self.fail(f"plan: the {part} stage plans {v['planned_s']:.1f} s, over "
                          f"{PLAN_FRACTION:.0%} of its share ({v['allowed_s']:.1f} s)")  # fmt: skip
        if plan["total_s"] >= GPU_DEADLINE:
            self.fail(f"plan: {plan['total_s']:.1f} s in all, not under {GPU_DEADLINE:.0f} s")
        self.save()
        return bool(plan["ok"])

    # -- the whole check --------------------------------------------------------------
    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        prev: dict[str, Any] | None = None
        if self.args.rerun_failed:
            prev = json.loads(Path(self.args.rerun_failed).read_text())
        self.results.update(
            tool="nccltree gpu_check",
            version=2,
            commit=_commit(),
            mode="dry-run" if self.args.dry_run else "gpu",
            rerun_of=self.args.rerun_failed,
            deadline_s=self.deadline_s,
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            result="incomplete",
        )
        self.config = make_config(self.args.dry_run, 0)
        try:
            if self.args.dry_run and not self.args.rerun_failed:
                # the plan of the GPU run: collected before this run's clock starts
                self.check_plan()
                self.t0 = time.monotonic()
            self.probe()
            self.config = make_config(self.args.dry_run, self.gpus)
            self.plan = plan = self._plan(prev)
            self.results["plan"] = {
                k: (v if k != "sweep" else [s.key for s in v]) for k, v in plan.items()
            }
            if not any(plan[k] for k in STAGES):
                print("nothing failed in the previous run: nothing to rerun", flush=True)
            self.install()
            self.schedule = self._schedule(plan)
            timing: dict[str, Any] = self.results.setdefault("timing", {})
            for i, (part, _name, _planned, fn) in enumerate(self.schedule):
                if part != self.part:
                    timing[self.part] = {"ended_s": round(self.elapsed(), 1),
                                         "end_s": self.part_end()}  # fmt: skip
                    self.part = part
                self.step_index = i
                fn()
            timing[self.part] = {"ended_s": round(self.elapsed(), 1), "end_s": self.part_end()}
            skipped = [k for k in STAGES if k not in self.stages]
            if skipped:
                self.notes.append(f"steps left out (--stages): {', '.join(skipped)}")
        except Interrupted as exc:
            self.fail(f"interrupted ({exc}) at {self.elapsed():.0f} s")
        except Exception as exc:  # noqa: BLE001 - the summary must still come out
            self.fail(f"the check itself failed: {type(exc).__name__}: {exc}")
        if self.remaining() < 0:
            self.fail(f"over the deadline: {self.elapsed():.0f} s of {self.deadline_s:.0f} s")
        return self.summary()

    def _schedule(self, plan: dict[str, Any]) -> list[tuple[str, str, float, Callable[[], None]]]:
        """The steps in order: (stage, step, planned seconds, what runs it)."""
        out: list[tuple[str, str, float, Callable[[], None]]] = []
        if plan["topology"]:
            out.append(("core", "topology", PLANNED["topology"], self.topology))
        for part in PARTS:
            sel = plan["tests"].get(part)
            if sel:
                out.append((part, "tests", 0.0, lambda sel=sel: self.tests(sel)))
            runs = [r for r in plan["sweep"] if r.part == part]
            if runs:
                out.append((part, "gpu_clean", PLANNED["gpu_clean"], self.gpu_clean))
                out.append((part, "sweep", sum(r.planned_s for r in runs),
                            lambda runs=runs: self.sweep(runs)))  # fmt: skip
                out.append((part, "bound", PLANNED["bound"], self.bound))
        if plan["issue_cost"]:
            sets = plan["issue_cost"]
            out.append(("rest", "issue_cost", PLANNED["issue_cost"],
                        lambda: self.issue_cost(sets)))  # fmt: skip
        if plan["process_groups"]:
            out.append(("rest", "process_groups", PLANNED["process_groups"], self.process_groups))
        if plan["nccl_one_gpu"]:
            out.append(("rest", "nccl_one_gpu", PLANNED["nccl_one_gpu"], self.nccl_one_gpu))
        if plan["sweep"] or plan["issue_cost"]:
            out.append(("rest", "prediction", 0.0, self.prediction))
        return out

    def _plan(self, prev: dict[str, Any] | None) -> dict[str, Any]:
        """What to run: everything, or what failed in ``prev``."""
        cfg = self.config
        issue_sets = [
            (cfg.present, ("tree", "ring", "direct", "nccl")),
            (cfg.logical, ("tree", "ring", "direct")),
        ]
        tests = {"core": shlex.split(self.args.tests)} if self.args.tests else cfg.tests
        if prev is None:
            plan = {"topology": True, "tests": tests, "sweep": cfg.sweep, "issue_cost": issue_sets,
                    "process_groups": True, "nccl_one_gpu": True}  # fmt: skip
        else:
            plan = self._failed_in(prev, tests, issue_sets)
        for k in STAGES:
            if k not in self.stages:
                plan[k] = {"tests": {}, "topology": False, "process_groups": False,
                           "nccl_one_gpu": False}.get(k, [])  # fmt: skip
        return plan

    def _failed_in(
        self,
        prev: dict[str, Any],
        tests: dict[str, list[str]],
        issue_sets: list[tuple[str, tuple[str, ...]]],
    ) -> dict[str, Any]:
        """The parts of ``prev`` that did not pass (the tests again in one run, in the
        core stage)."""
        cfg = self.config
        stages = prev.get("stages", {})
        topo = stages.get("topology", {}).get("status") != "ok"
        t = stages.get("tests", {})
        again = [
            tid
            for tid, r in t.get("tests", {}).items()
            if r["outcome"] not in ("passed", "skipped")
            or (r["outcome"] == "skipped" and tid in t.get("unexpected_skips", []))
        ]
        again += sorted({e.split("::")[0] for e in t.get("collect_errors", {}) if e})
        root = Path(t.get("rootdir") or ROOT)
        if root != ROOT:  # pytest takes paths relative to where it runs
            again = [str(root / a) for a in again]
        rerun: dict[str, list[str]] = {"core": again} if again else {}
        if "tests" not in stages or (not t.get("tests") and not t.get("collect_errors")):
            rerun = tests  # the tests never ran
        elif again and not self.args.tests and cfg.mode == "gpu":
            # a module named again: its GPU tests only
            rerun = {"core": ["-m", "gpu or multi_gpu", *again]}
        sweep_ok = {
            r["key"] for r in stages.get("sweep", {}).get("runs", []) if r.get("status") == "ok"
        }
        ic_ok = {
            r["devices"]
            for r in stages.get("issue_cost", {}).get("runs", [])
            if r.get("status") == "ok"
        }
        return {
            "topology": topo,
            "process_groups": stages.get("process_groups", {}).get("status") != "ok",
            "nccl_one_gpu": "nccl_one_gpu" not in stages,
            "tests": rerun,
            "sweep": [s for s in cfg.sweep if s.key not in sweep_ok],
            "issue_cost": [s for s in issue_sets if s[0] not in ic_ok],
        }


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown (no git)"
    return head.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu_check",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the same pipeline on the host backend, small sizes, no install",
    )
    p.add_argument(
        "--rerun-failed",
        metavar="JSON",
        help="rerun only what failed in a previous gpu_check.json (deadline 120 s)",
    )
    p.add_argument(
        "--out", metavar="DIR", help="results directory (default: $OUT, else out/gpu-check)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        help=f"global deadline in seconds (default {GPU_DEADLINE:g}; 120 with --rerun-failed); "
        "the stages end at 50%%, 72%% and 100%% of it",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="collect the GPU tests, print each stage's planned time and exit (non-zero if "
        "a stage does not fit)",
    )
    p.add_argument(
        "--test-timeout",
        type=float,
        help="one limit in seconds for every test (default: each test's own, "
        f"max({GPU_LIMIT_FLOOR:g}, {GPU_LIMIT_FACTOR:g} x its gpu_seconds))",
    )
    p.add_argument(
        "--tests",
        metavar="ARGS",
        help="pytest arguments selecting the tests, run in the core stage (default: each "
        "stage's GPU tests; in a dry run tests/test_collectives_gpu.py and the GPU tests of "
        "tests/test_process_group_gpu.py)",
    )
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="steps to run after the probe and install (default: %(default)s)",
    )
    p.add_argument("--wheels", metavar="DIR", help="wheels to install (default: .whl/)")
    p.add_argument(
        "--no-install",
        action="store_true",
        help="use the nccltree already installed (no wheel, no build)",
    )
    p.add_argument(
        "--fallback-timeout",
        action="store_true",
        help="time tests with this file's plugin even where pytest-timeout exists",
    )
    p.add_argument("--issue-cost-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devices", help=argparse.SUPPRESS)
    p.add_argument("--algorithms", help=argparse.SUPPRESS)
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--bound-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--copy-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--inputs", default="", help=argparse.SUPPRESS)
    return p


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.issue_cost_worker:
        return issue_cost_worker(
            args.devices,
            args.algorithms.split(","),
            [int(s) for s in args.sizes.split(",")],
            5,
            Path(args.json),
        )
    if args.bound_worker:
        return bound_worker(
            args.devices,
            args.copy_bytes,
            [Path(f) for f in args.inputs.split(",") if f],
            Path(args.json),
        )
    out = Path(args.out or os.environ.get("OUT") or ROOT / "out" / "gpu-check").resolve()
    deadline = args.deadline or (120.0 if args.rerun_failed else GPU_DEADLINE)
    if args.plan:
        out.mkdir(parents=True, exist_ok=True)
        check = Check(args, out, deadline)
        try:
            return 0 if check.check_plan() else 1
        except RuntimeError as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 1
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(
            f"gpu_check: unknown stage {', '.join(bad)}; accepted: {', '.join(STAGES)}",
            file=sys.stderr,
        )
        return 2
    check = Check(args, out, deadline, stages=stages)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    return check.main()


if __name__ == "__main__":
    sys.exit(main())
