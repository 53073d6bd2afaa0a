"""The one-call GPU check: build, every GPU test, a short sweep, a compact summary.

    bash bench/gpu_check.sh                           # a GPU machine: at most 7 minutes
    bash bench/gpu_check.sh --rerun-failed OLD.json   # only what failed there: 2 minutes
    bash bench/gpu_check.sh --dry-run                 # the same pipeline on the host backend

Stages, each bounded by one global deadline (``--deadline``, 420 s; 120 s for a rerun):

1. probe: CuPy, the driver, NCCL and the GPUs present (one small Python process);
2. install: the wheels in ``.whl/`` (an lmdb wheel for the machine's Python, see
   docs/performance.md) into ``build/gpu-check-site``, then nccltree from source with
   ``pip install --no-build-isolation --no-deps --no-index -e .``, its CUDA fatbin limited
   to the architectures of the GPUs present;
3. topology: ``nccltree-bench topo`` on every GPU;
4. tests: every ``gpu``/``multi_gpu`` test, at most ``--test-timeout`` (60 s) each, through
   pytest-timeout where it is installed and a SIGALRM timer of this file's pytest plugin
   where not; a test that hangs in native code or crashes the interpreter is killed, named,
   and the run resumes after it. A skipped ``gpu`` test FAILS the check (a GPU machine
   must run them all); ``multi_gpu(n)`` tests skipped for want of n GPUs are reported
   apart, as expected;
5. sweep: ``nccltree-bench collectives`` (all_reduce and broadcast, 8 B to 256 MiB,
   results checked) with tree, ring, direct and NCCL on the GPUs present (NCCL with one
   rank too) and tree, ring, direct on four logical ranks of GPU 0;
6. issue cost: the host time a stream-ordered all_reduce takes to return, per plan step,
   at 8 B, 1 MiB and 256 MiB (the bench tool times the devices, not the issuing);
7. process groups: ``bench/pg_gpu_bench.py`` under ``mpiexec -n 2`` (both processes on GPU
   0, CUDA IPC between them) against the same algorithms on two logical ranks of GPU 0 in
   one process, 1 MiB to 256 MiB; the ratio at 256 MiB is the process groups' target
   (``PG_TARGET``: reported, not a failure). ``mpiexec`` and mpi4py come from wheels in
   ``.whl/`` (mpich and mpi4py), like lmdb.

The summary is printed last: tests passed/failed/skipped, busbw of every algorithm at
1 MiB and 256 MiB read from the sweep's JSON records, the issue cost, the topology, and
PASS or FAIL. Results go to ``$OUT`` (else ``out/gpu-check``) as they come:
``gpu_check.json`` is rewritten after every step, the per-test log ``tests.jsonl`` is
appended per test, so a run cut short still reports. The exit status is 0 only on PASS.

``--dry-run`` runs the same stages on the host backend (``cpu:1`` and ``cpu:4`` for the
GPUs, small sizes, the GPU test file whose host variants run and whose GPU tests skip as
expected there) and only prints the install commands, so CI keeps the script working
between GPU runs. The module is also the pytest plugin of stage 4 (``-p gpu_check``).
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
STAGES = ("topology", "tests", "sweep", "issue_cost", "process_groups")  # after the install
#: the issue's target: a GPU process group over IPC reaches this share of the busbw of the
#: same algorithm on logical ranks of one process, at the largest size
PG_TARGET = 0.8

# -- the pytest plugin (loaded into the test process with `-p gpu_check`) ------------------
#
# Configured by environment variables, because `-p` takes no arguments. It logs every
# collected test with its GPU markers, every finished test with its outcome, and collection
# errors, one JSON object per line, flushed at once: the orchestrator reads the log while
# the tests run and after a crash.

_ENV_LOG = "NCCLTREE_CHECK_LOG"
_ENV_SOFT = "NCCLTREE_CHECK_SOFT_TIMEOUT"  # seconds; the SIGALRM timer, when no pytest-timeout
_ENV_HARD = "NCCLTREE_CHECK_HARD_TIMEOUT"  # seconds; kill a test stuck in native code
_ENV_HANG = "NCCLTREE_CHECK_HANG_FILE"  # where the stacks of a killed test are written
_ENV_DESELECT = "NCCLTREE_CHECK_DESELECT"  # file of node ids not to run (already done)


class _Plugin:
    def __init__(self, log: str) -> None:
        self.log = open(log, "a", encoding="utf-8")
        self.soft = float(os.environ.get(_ENV_SOFT, "0") or 0)
        self.hard = float(os.environ.get(_ENV_HARD, "0") or 0)
        hang = os.environ.get(_ENV_HANG)
        self.hang_file: IO[str] | None = open(hang, "w", encoding="utf-8") if hang else None
        self.markers: dict[str, dict[str, int]] = {}
        self.phases: dict[str, list[Any]] = {}

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        path = os.environ.get(_ENV_DESELECT)
        if not path or not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            done = {line.rstrip("\n") for line in f if line.strip()}
        drop = [it for it in items if it.nodeid in done]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [it for it in items if it.nodeid not in done]

    def pytest_collection_finish(self, session: Any) -> None:
        tests = []
        for it in session.items:
            multi = it.get_closest_marker("multi_gpu")
            marks = {
                "gpu": int(it.get_closest_marker("gpu") is not None),
                "multi_gpu": (int(multi.args[0]) if multi.args else 2) if multi else 0,
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
        if self.soft > 0:
            signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.soft)
        if self.hard > 0 and self.hang_file is not None:
            self.hang_file.seek(0)
            self.hang_file.truncate()
            self.hang_file.write(f"{nodeid}: killed after {self.hard:g} s\n")
            self.hang_file.flush()
            faulthandler.dump_traceback_later(self.hard, exit=True, file=self.hang_file)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        import pytest

        pytest.fail(f"Timeout: the test ran longer than {self.soft:g} s", pytrace=False)

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.phases.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if self.soft > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self.hard > 0:
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
    tests: list[str]
    marker: str | None  # the marker expression of the default test selection
    topo_devices: str
    nccl_expected: bool  # False on the host backend, where NCCL cannot run
    pg_args: tuple[str, ...] = ()  # bench/pg_gpu_bench.py's arguments


def make_config(dry_run: bool, gpus: int) -> Config:
    hand = ("tree", "ring", "direct")
    if dry_run:
        present, logical = "cpu:1", "cpu:4"
        bands = [("small", "16K", "1M", 8, 3, 1)]
        sizes: tuple[int, ...] = (8, 64 << 10)
        tests = ["tests/test_collectives_gpu.py"]
        topo = "cpu:4"
    else:
        present = "gpu:" + ",".join(str(i) for i in range(max(gpus, 1)))
        logical = "gpu:0,0,0,0"
        # 8 B .. 1 MiB in powers of two is cheap; the two large points are where the time
        # goes (fresh data and a full check per size and algorithm)
        bands = [("small", "8", "1M", 2, 20, 5), ("large", "16M", "256M", 16, 10, 3)]
        sizes = (8, MiB, 256 * MiB)
        tests = ["-m", "gpu or multi_gpu", "tests"]
        topo = "gpu:all"
    sweep = []
    for band, lo, hi, f, n, w in bands:  # the small sizes of every set first
        sweep.append(SweepRun(present, (*hand, "nccl"), band, lo, hi, f, n, w))
        sweep.append(SweepRun(logical, hand, band, lo, hi, f, n, w))
    marker = None if dry_run else "gpu or multi_gpu"
    return Config(
        "dry-run" if dry_run else "gpu",
        present,
        logical,
        sweep,
        (MiB, 256 * MiB),
        sizes,
        tests,
        marker,
        topo,
        not dry_run,
        ("--devices", "cpu", "--sizes", "64K,1M", "--reps", "1", "--iters", "2")
        if dry_run
        else ("--devices", "gpu:0", "--sizes", "1M,16M,256M", "--reps", "5", "--iters", "10"),
    )


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

    # -- time and records -------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.deadline_s - self.elapsed()

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        self.results["failures"] = self.failures
        self.results["notes"] = self.notes
        _write_json(self.out / "gpu_check.json", self.results)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"FAIL: {what}", flush=True)

    def stage(self, name: str) -> dict[str, Any]:
        st: dict[str, Any] = {"status": "running", "started_s": round(self.elapsed(), 1)}
        self.results.setdefault("stages", {})[name] = st
        print(f"\n== {name} ({self.elapsed():.0f} s, {self.remaining():.0f} s left)", flush=True)
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
                env=env or self.env,
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

    def budget(self, cap: float, reserve: float) -> float:
        """Seconds a step may take: at most ``cap``, leaving ``reserve`` for what follows."""
        return max(0.0, min(cap, self.remaining() - reserve))

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
                ran = self.run(wheel_cmd, self.out / "install-wheels.txt", self.budget(60, 60))
                st["wheels_rc"] = ran.rc
                if ran.rc != 0:
                    self.fail(f"install: the wheels in {wheels_dir} did not install:\n{ran.tail}")
            ran = self.run(
                build_cmd,
                self.out / "install-build.txt",
                self.budget(150, self.reserve_after_install),
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
        ran = self.run(argv, self.out / "topology.txt", self.budget(60, 60))
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
        st = self.stage("tests")
        timeout = self.args.test_timeout
        via = "pytest-timeout" if self._pytest_timeout_installed() else "SIGALRM (gpu_check)"
        st.update(selection=selection, test_timeout_s=timeout, timeout_via=via)
        log = TestLog(self.out / "tests.jsonl")
        done_file = self.out / "tests-done.txt"
        hang_file = self.out / "tests-hang.txt"
        env = dict(self.env)
        # past the per-test timeout, a test stuck in native code (where no Python-level
        # timer fires) is killed with its stacks written out, and the run resumes after it
        hard = timeout + min(30.0, max(5.0, timeout / 2))
        env.update(
            {
                _ENV_LOG: str(log.path),
                _ENV_HARD: str(hard),
                _ENV_HANG: str(hang_file),
                _ENV_DESELECT: str(done_file),
                _ENV_SOFT: "0" if via == "pytest-timeout" else str(timeout),
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
        if via == "pytest-timeout":
            argv.append(f"--timeout={timeout:g}")

        def progress() -> None:
            if log.read():
                self._count_tests(st, log)
                self.save()

        runs: list[dict[str, Any]] = []
        while True:
            # a resumed run leaves out what already finished (and the test that crashed)
            done_file.write_text(
                "".join(f"{t}\n" for t, r in log.tests.items() if r["outcome"] != "not run")
            )
            limit = self.budget(1e9, self.reserve_after_tests)
            if limit < 5:
                st["cut_short"] = "the deadline came before every test ran"
                break
            ran = self.run(
                [*argv, *selection],
                self.out / f"tests-{len(runs) + 1}.txt",
                limit,
                env=env,
                poll=progress,
            )
            log.read()
            runs.append({"rc": ran.rc, "seconds": ran.seconds})
            st["runs"] = runs
            running, log.running = log.running, None
            if ran.timed_out:
                if running:
                    log.tests[running].update(
                        outcome="not finished", message="still running at the deadline"
                    )
                st["cut_short"] = "the deadline came before every test ran"
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
        bad = [t for t, r in log.tests.items() if r["outcome"] in ("failed", "error", "crashed")]
        for t in bad:
            r = log.tests[t]
            self.fail(f"test {r['outcome']}: {t}\n{_tail(r.get('message', ''), 800)}")
        for t, msg in log.collect_errors.items():
            self.fail(f"tests: {t} could not be collected:\n{_tail(msg, 800)}")
        if c["unexpected_skips"]:
            self.fail(
                f"tests: {c['unexpected_skips']} gpu test(s) skipped on a GPU machine: "
                + ", ".join(st["unexpected_skips"][:10])
            )
        if c["not_run"]:
            self.fail(f"tests: {c['not_run']} test(s) did not run or finish (deadline)")
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
            name = f"sweep-{i + 1}"
            rec: dict[str, Any] = {
                "key": sr.key,
                "devices": sr.devices,
                "band": sr.band,
                "algorithms": list(sr.algorithms),
            }
            done.append(rec)
            limit = self.budget(1e9, self.reserve_after_sweep)
            if limit < 5:
                rec["status"] = "not run (deadline)"
                self.fail(f"sweep {sr.key}: not run (deadline)")
                continue
            algs = list(sr.algorithms)
            ran, path = self._bench(sr, algs, name, limit)
            nccl_failed = False
            if ran.rc == 2 and "nccl" in algs:
                # Every World is made before anything runs, so an NCCL that cannot start
                # stops the whole run: run the others again and report NCCL on its own.
                first = ran
                algs = [a for a in algs if a != "nccl"]
                ran, path = self._bench(sr, algs, name, self.budget(1e9, self.reserve_after_sweep))
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
                rec["status"] = "timed out (deadline)"
                self.fail(f"sweep {sr.key}: cut at the deadline after {ran.seconds:.0f} s")
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
            "all_reduce,broadcast",
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
            limit = self.budget(60, 3)
            if limit < 5:
                rec["status"] = "not run (deadline)"
                self.fail(f"issue cost {devices}: not run (deadline)")
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
                rec["status"] = "timed out (deadline)"
                self.fail(f"issue cost {devices}: cut at the deadline")
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
        ran = self.run(argv, self.out / "pg_gpu.txt", self.budget(150, 3))
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
        if self.remaining() < 10 or "sweep" not in self.stages:
            return
        md = self.out / "sim_vs_measured.md"
        md.unlink(missing_ok=True)
        argv = [sys.executable, str(BENCH / "sim_vs_gpu_check.py"), str(self.out),
                "--markdown", str(md)]  # fmt: skip
        ran = self.run(argv, self.out / "sim_vs_measured.txt", min(60.0, self.remaining() - 5))
        if ran.rc != 0 or not md.exists():
            self.notes.append(f"prediction: sim_vs_gpu_check.py failed (rc {ran.rc})")
            return
        last = [ln for ln in md.read_text().splitlines() if ln.startswith("median |")]
        self.results["prediction"] = {"markdown": md.name, "summary": last[0] if last else None}
        self.save()

    # -- reserves: time kept for the stages still to come (those planned) ------------
    def _share(self, stage: str, fraction: float) -> float:
        planned = bool(self.plan.get(stage))
        return fraction * self.deadline_s if planned and not self.args.dry_run else 0.0

    @property
    def reserve_after_sweep(self) -> float:
        return self._share("issue_cost", 0.06) + self._share("process_groups", 0.22)

    @property
    def reserve_after_tests(self) -> float:
        return self.reserve_after_sweep + self._share("sweep", 0.25)

    @property
    def reserve_after_install(self) -> float:
        return self.reserve_after_tests + self._share("tests", 0.15)

    # -- summary ----------------------------------------------------------------------
    def busbw_table(self) -> list[dict[str, Any]]:
        """busbw/algbw of every (collective, devices, algorithm) at the summary sizes,
        out of place, read from the sweep's JSON records (None where no record)."""
        stage = self.results.get("stages", {}).get("sweep", {})
        found: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
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
            lines.append(
                f"tests     {tst.get('status')}: {c['passed']} passed, {c['failed']} failed, "
                f"{c['error']} errors, {c['crashed']} crashed, {c['not_run']} not run, "
                f"{c['skipped']} skipped ({c['expected_skips']} expected"
                f"{' (dry run)' if self.args.dry_run else ' multi_gpu'}, "
                f"{c['unexpected_skips']} gpu: must be 0, {c['other_skips']} other), "
                f"{c['collect_errors']} collection errors; {c['timeouts']} timeouts "
                f"({tst['test_timeout_s']:g} s each via {tst['timeout_via']})"
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

    # -- the whole check --------------------------------------------------------------
    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        prev: dict[str, Any] | None = None
        if self.args.rerun_failed:
            prev = json.loads(Path(self.args.rerun_failed).read_text())
        self.results.update(
            tool="nccltree gpu_check",
            version=1,
            commit=_commit(),
            mode="dry-run" if self.args.dry_run else "gpu",
            rerun_of=self.args.rerun_failed,
            deadline_s=self.deadline_s,
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            result="incomplete",
        )
        self.config = make_config(self.args.dry_run, 0)
        try:
            self.probe()
            self.config = make_config(self.args.dry_run, self.gpus)
            self.plan = plan = self._plan(prev)
            self.results["plan"] = {
                k: (v if k != "sweep" else [s.key for s in v]) for k, v in plan.items()
            }
            if not any(plan[k] for k in STAGES):
                print("nothing failed in the previous run: nothing to rerun", flush=True)
            self.install()
            if plan["topology"]:
                self.topology()
            if plan["tests"]:
                self.tests(plan["tests"])
            if plan["sweep"]:
                self.sweep(plan["sweep"])
            if plan["issue_cost"]:
                self.issue_cost(plan["issue_cost"])
            if plan["process_groups"]:
                self.process_groups()
            self.prediction()
            skipped = [k for k in STAGES if k not in self.stages]
            if skipped:
                self.notes.append(f"stages left out (--stages): {', '.join(skipped)}")
        except Interrupted as exc:
            self.fail(f"interrupted ({exc}) at {self.elapsed():.0f} s")
        except Exception as exc:  # noqa: BLE001 - the summary must still come out
            self.fail(f"the check itself failed: {type(exc).__name__}: {exc}")
        if self.remaining() < 0:
            self.fail(f"over the deadline: {self.elapsed():.0f} s of {self.deadline_s:.0f} s")
        return self.summary()

    def _plan(self, prev: dict[str, Any] | None) -> dict[str, Any]:
        """What to run: everything, or what failed in ``prev``."""
        cfg = self.config
        issue_sets = [
            (cfg.present, ("tree", "ring", "direct", "nccl")),
            (cfg.logical, ("tree", "ring", "direct")),
        ]
        tests = shlex.split(self.args.tests) if self.args.tests else cfg.tests
        if prev is None:
            plan = {"topology": True, "tests": tests, "sweep": cfg.sweep, "issue_cost": issue_sets,
                    "process_groups": True}  # fmt: skip
        else:
            plan = self._failed_in(prev, tests, issue_sets)
        for k in STAGES:
            if k not in self.stages:
                plan[k] = [] if k not in ("topology", "process_groups") else False
        return plan

    def _failed_in(
        self, prev: dict[str, Any], tests: list[str], issue_sets: list[tuple[str, tuple[str, ...]]]
    ) -> dict[str, Any]:
        """The parts of ``prev`` that did not pass."""
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
        if "tests" not in stages or (not t.get("tests") and not t.get("collect_errors")):
            again = tests  # the tests never ran
        elif again and cfg.marker and not self.args.tests:
            again = ["-m", cfg.marker, *again]  # a module named again: its GPU tests only
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
            "tests": again,
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
        help="global deadline in seconds (default 420; 120 with --rerun-failed)",
    )
    p.add_argument(
        "--test-timeout", type=float, default=60.0, help="seconds per test (default %(default)g)"
    )
    p.add_argument(
        "--tests",
        metavar="ARGS",
        help="pytest arguments selecting the tests (default: -m 'gpu or "
        "multi_gpu' tests; in a dry run tests/test_collectives_gpu.py)",
    )
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="stages to run after the probe and install (default: %(default)s)",
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
    out = Path(args.out or os.environ.get("OUT") or ROOT / "out" / "gpu-check").resolve()
    deadline = args.deadline or (120.0 if args.rerun_failed else 420.0)
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
