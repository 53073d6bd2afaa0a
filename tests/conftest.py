"""Shared fixtures: the ``backend`` parametrisation, device factories, the fake CuPy.

``backend`` runs a test body on the host backend always and on the CUDA backend where a GPU
is usable; ``gpu`` and ``multi_gpu(n)`` tests are skipped cleanly without enough GPUs. A
GPU test declares its expected seconds on the GPU with ``gpu_seconds(n)`` (the GPU check's
plan, :func:`gpu_seconds`; a test that starts processes bounds them with
:func:`gpu_own_timeout`).
``fake_cupy`` runs nccltree's CUDA code on a fake of CuPy's layer (wiring only, never GPU
verification; see ``tests/fakecupy``).

``--quick`` (``./dev test --quick``) is the fast inner loop: see :func:`quick_selection`.
A run fails if its tests leave files behind in ``/dev/shm`` or the temporary folder: see
:class:`Leftovers`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccltree as nt


@functools.cache
def gpu_count() -> int:
    """GPUs usable through CuPy here (0 without CuPy, a driver or a GPU)."""
    try:
        from nccltree.backends import gpu_count as count

        return count()
    except nt.BackendUnavailable:
        return 0


# -- GPU tests' declared durations (the GPU check's plan; bench/gpu_check.py) ---------------

#: a GPU test's expected seconds on the check's GPU when it declares none
#: (``@pytest.mark.gpu_seconds(n)``), and for a ``slow`` one
GPU_SECONDS_DEFAULT = 0.25
GPU_SECONDS_SLOW = 1.5
#: the check stops a test after max(GPU_LIMIT_FLOOR, GPU_LIMIT_FACTOR x its seconds)
GPU_LIMIT_FLOOR = 60.0
GPU_LIMIT_FACTOR = 5.0
#: a test's own waits (an mpiexec job's timeout) end this long before the check's limit,
#: so the test fails first, cleanly, with the job's output
GPU_OWN_MARGIN = 15.0


def gpu_seconds(item: pytest.Item) -> float:
    """A test's expected seconds on the GPU (its ``gpu_seconds`` marker, or the default)."""
    m = item.get_closest_marker("gpu_seconds")
    if m is not None and m.args:
        return float(m.args[0])
    return GPU_SECONDS_SLOW if item.get_closest_marker("slow") else GPU_SECONDS_DEFAULT


def gpu_own_timeout(request: pytest.FixtureRequest) -> float:
    """The timeout for the processes a GPU test starts: its limit in the GPU check less
    ``GPU_OWN_MARGIN`` (the check's rule; bench/gpu_check.py's ``gpu_limit``)."""
    limit = max(GPU_LIMIT_FLOOR, GPU_LIMIT_FACTOR * gpu_seconds(request.node))
    return limit - GPU_OWN_MARGIN


# Test-only libraries a GPU machine may lack (it gets nccltree's runtime dependencies and
# pytest, nothing else). Modules that need them hold no gpu tests, so there they are left
# out of collection instead of failing it; everywhere else the test extra installs them.
_NEEDS = {"hypothesis": ("test_topology.py", "test_tree.py")}
collect_ignore: list[str] = []
for _lib, _modules in _NEEDS.items():
    try:
        __import__(_lib)
    except ImportError:
        collect_ignore.extend(_modules)


# -- the fast inner loop: --quick ------------------------------------------------------------

#: ``--quick`` keeps one in this many tests of each ``slow`` grid (at least one per grid)
QUICK_SAMPLE = 25
#: markers of tests that start processes: left out of ``--quick``
HEAVY_MARKERS = frozenset({"mpi", "subprocess"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="the fast inner loop: no tests that start processes (mpi, subprocess), one in "
        f"{QUICK_SAMPLE} of each slow grid, and at least one test of every module",
    )
    parser.addoption(
        "--part",
        metavar="I/N",
        help="run only part I of N of the selected tests (see split_parts), so that N "
        "processes can run them side by side (./dev test --quick runs two)",
    )


#: with ``--part``, the last part also takes one in this many of the other tests
LAST_PART_SHARE = 3


def deal_parts(tests: list[QuickRecord], n: int) -> list[list[QuickRecord]]:
    """The whole suite in ``n`` parts (``./dev test`` runs two side by side): the tests
    that are expensive one by one dealt out in turn, and so are the others, so that each
    part gets about its share of both kinds."""
    parts: list[list[QuickRecord]] = [[] for _ in range(n)]
    counts = [0, 0]
    for t in tests:
        heavy = bool(t.markers & HEAVY_MARKERS) or ("slow" in t.markers and t.grid == t.nodeid)
        parts[counts[heavy] % n].append(t)
        counts[heavy] += 1
    return parts


def split_parts(tests: list[QuickRecord], n: int) -> list[list[QuickRecord]]:
    """The selected tests in ``n`` parts of about the same cost: the tests that are
    expensive one by one (marked ``mpi``, ``subprocess``, or ``slow`` and not a case of a
    grid) all go to the last part, which also takes one in ``LAST_PART_SHARE`` of the
    others; the rest are dealt out in turn to the other parts. (With ``--quick`` and two
    parts, the two take about as long on an idle machine.)"""
    if n == 1:
        return [list(tests)]
    parts: list[list[QuickRecord]] = [[] for _ in range(n)]
    light = dealt = 0
    for t in tests:
        heavy = bool(t.markers & HEAVY_MARKERS) or ("slow" in t.markers and t.grid == t.nodeid)
        if heavy:
            parts[-1].append(t)
        else:
            light += 1
            if light % LAST_PART_SHARE == 0:
                parts[-1].append(t)
            else:
                parts[dealt % (n - 1)].append(t)
                dealt += 1
    return parts


def _part_option(value: str) -> tuple[int, int]:
    i, _, n = value.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise pytest.UsageError(f"--part takes I/N with 1 <= I <= N, got {value!r}")
    return int(i), int(n)


@dataclass(frozen=True)
class QuickRecord:
    """What :func:`quick_selection` looks at in a collected test."""

    nodeid: str
    module: str  # the file, e.g. "tests/test_plans.py"
    grid: str  # the test function without its parameters, e.g. "tests/test_plans.py::test_x"
    markers: frozenset[str]

    @classmethod
    def of(cls, item: pytest.Item) -> QuickRecord:
        module = item.nodeid.split("::", 1)[0]
        base = item.nodeid.split("[", 1)[0]
        return cls(item.nodeid, module, base, frozenset(m.name for m in item.iter_markers()))


def _stable_key(nodeid: str) -> str:
    """A key that orders tests the same way on every machine and run (unlike ``hash``)."""
    return hashlib.sha1(nodeid.encode()).hexdigest()


def quick_selection(tests: Iterable[QuickRecord]) -> list[QuickRecord]:
    """The tests ``--quick`` runs, in collection order. Deterministic, from the markers:

    - tests marked ``mpi`` or ``subprocess`` (they start processes) are left out;
    - of each ``slow`` grid (one parametrised test function, all its cases) the cases at
      positions 0, ``QUICK_SAMPLE``, 2 * ``QUICK_SAMPLE``, ... in collection order are kept:
      every slow grid keeps at least one case, the same ones on every run and machine, and
      the first (usually the smallest parameters) among them; a ``slow`` test that is not
      parametrised, or whose parametrisation makes only one case, is left out;
    - every other test is kept;
    - a module left with nothing keeps one test: the first by a stable hash of the node id
      among its tests not marked ``slow`` (else among all), so each module still runs
      something.
    """
    tests = list(tests)
    keep: set[str] = set()
    grids: dict[str, list[QuickRecord]] = {}
    for t in tests:
        if t.markers & HEAVY_MARKERS:
            continue
        if "slow" in t.markers:
            if t.grid != t.nodeid:
                grids.setdefault(t.grid, []).append(t)
        else:
            keep.add(t.nodeid)
    for grid in grids.values():
        if len(grid) > 1:  # one case is a single slow test, not a grid to sample
            keep.update(t.nodeid for t in grid[::QUICK_SAMPLE])
    modules: dict[str, list[QuickRecord]] = {}
    for t in tests:
        modules.setdefault(t.module, []).append(t)
    for members in modules.values():
        if not any(t.nodeid in keep for t in members):
            stand_in = min(members, key=lambda t: ("slow" in t.markers, _stable_key(t.nodeid)))
            keep.add(stand_in.nodeid)
    return [t for t in tests if t.nodeid in keep]


def _sigint_default() -> None:
    # a shell without job control starts its background commands with SIGINT ignored
    # (./dev test runs one part in the background), and an ignored signal is inherited
    # by every process started: the tests that send Ctrl-C to a child would wait for
    # ever. Python's own handler here; a child then starts with the default again.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    records = [QuickRecord.of(i) for i in items]
    if config.getoption("quick"):
        records = quick_selection(records)
    if config.getoption("part"):
        i, n = _part_option(config.getoption("part"))
        split = split_parts if config.getoption("quick") else deal_parts
        records = split(records, n)[i - 1]
    if len(records) < len(items):
        chosen = {t.nodeid for t in records}
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in chosen])
        items[:] = [i for i in items if i.nodeid in chosen]
    for item in items:
        need = 0
        if item.get_closest_marker("gpu") is not None:
            need = 1
        multi = item.get_closest_marker("multi_gpu")
        if multi is not None:
            need = max(need, int(multi.args[0]) if multi.args else 2)
        if need and gpu_count() < need:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {gpu_count()} usable")
            )


# -- leftovers: what the tests leave in /dev/shm and the temporary folder ----------------------

#: this session's process id, inherited by every process a test starts (fakecupy's files in
#: /dev/shm carry it in their names)
SESSION_ENV = "NCCLTREE_TEST_SESSION"
#: a file to which ``tests/mpirun.py`` appends the process id of each rank it starts
PIDS_ENV = "NCCLTREE_TEST_PIDS"
SHM_DIR = "/dev/shm"
#: nccltree's shared-memory segments: ``nccltree-<uid>-<job>-p<creator pid>-<what>``
_SEGMENT = re.compile(r"^nccltree-(\d+|u)-[0-9a-zA-Z]+-p(\d+)-")


@dataclass
class Leftovers:
    """Fails the run if its tests leave files behind, naming the test that made each.

    Other test runs may share the machine and create and remove files in the same places
    at the same time, so a file counts as this run's only by a rule that cannot match
    another run's:

    - The temporary folder is this run's own: ``TMPDIR`` (and ``tempfile.tempdir``) point
      at a fresh ``nccltree-tests-<pid>-*`` folder in the system's, for this process and
      every process a test starts (pytest's own ``tmp_path`` folders stay where they were,
      ``PYTEST_DEBUG_TEMPROOT``; ``NCCLTREE_TEST_TMP`` names it for the tests' processes).
      A ``nccltree-*`` entry left in it is a leftover; the folder and anything else in it
      (an MPI launcher's files, the fake GPUs' per-process kernel caches) are removed at
      the end.
    - ``/dev/shm``: a ``fakecupy-*`` entry whose name carries this run's tag
      (``fakecupy._core.session_tag``: the user and this process's id, which the tests'
      processes inherit in ``NCCLTREE_TEST_SESSION``); and a nccltree segment
      (``nccltree-<uid>-<job>-p<pid>-...``) created by this process or by an MPI rank that
      ``tests/mpirun.py`` started (each rank appends its process id to the file named by
      ``NCCLTREE_TEST_PIDS`` before it runs). Names that carry no creator (MPICH's own
      ``mpich_shm_*``) are not looked at here: they cannot be told apart from another
      run's; ``tests/mpirun.py`` removes those a job of its own leaves behind.

    After each test, the fake CuPy's IPC files of this run whose exporting process is gone are
    removed (``fakecupy.release_dead_exports``), as the CUDA driver frees the exported
    memory of a process that dies: a rank that its test kills, or that its launcher ends,
    runs no exit handlers; an exporter still alive at the end is a leftover.

    Each test's new entries are noted after it (a listing of two folders); an entry still
    there when the session ends fails the run, with the test that made it; it is then
    removed, so a failed run does not leave it to the next.
    """

    session: str
    tmp: str
    system_tmp: str
    pids_file: str
    uid: str = field(default_factory=lambda: str(os.getuid()) if hasattr(os, "getuid") else "u")
    made_by: dict[str, str] = field(default_factory=dict)
    at_start: set[str] = field(default_factory=set)

    @classmethod
    def start(cls) -> Leftovers:
        system_tmp = tempfile.gettempdir()
        session = str(os.getpid())
        tmp = tempfile.mkdtemp(prefix=f"nccltree-tests-{session}-", dir=system_tmp)
        self = cls(session, tmp, system_tmp, os.path.join(tmp, "rank-pids"))
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system_tmp)
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = tmp
        os.environ[SESSION_ENV] = session
        os.environ["NCCLTREE_TEST_TMP"] = tmp
        os.environ[PIDS_ENV] = self.pids_file
        self.at_start = self.listing()
        return self

    def _pids(self) -> set[str]:
        pids = {self.session}
        try:
            with open(self.pids_file) as f:
                pids.update(f.read().split())
        except FileNotFoundError:
            pass
        return pids

    def listing(self) -> set[str]:
        """The paths that are this run's by the rules above."""
        found: set[str] = set()
        try:
            shm = os.listdir(SHM_DIR)
        except OSError:
            shm = []
        fake_tag = f"-{self.uid}-s{self.session}-"
        pids: set[str] | None = None
        for name in shm:
            if name.startswith("fakecupy-") and fake_tag in name:
                found.add(os.path.join(SHM_DIR, name))
            elif (m := _SEGMENT.match(name)) and m.group(1) == self.uid:
                pids = self._pids() if pids is None else pids
                if m.group(2) in pids:
                    found.add(os.path.join(SHM_DIR, name))
        try:
            found.update(
                os.path.join(self.tmp, n) for n in os.listdir(self.tmp) if n.startswith("nccltree")
            )
        except OSError:
            pass
        return found

    def note(self, nodeid: str, before: set[str]) -> None:
        import fakecupy

        fakecupy.release_dead_exports()  # the fake's "driver" frees dead processes' exports
        for path in self.listing() - before:
            self.made_by.setdefault(path, nodeid)

    def finish(self) -> list[str]:
        """Lines naming each leftover and its test (empty: none); removes them all."""
        lines = []
        for path in sorted(self.listing() - self.at_start):
            who = self.made_by.get(path, "outside any test (collection or a fixture)")
            lines.append(f"{path}  (left by {who})")
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        tempfile.tempdir = None
        os.environ.pop("TMPDIR", None)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return lines


_LEFTOVERS = pytest.StashKey[Leftovers]()


def pytest_configure(config: pytest.Config) -> None:
    _sigint_default()
    config.stash[_LEFTOVERS] = Leftovers.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    leftovers = item.config.stash[_LEFTOVERS]
    before = leftovers.listing()
    yield
    leftovers.note(item.nodeid, before)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    lines = session.config.stash[_LEFTOVERS].finish()
    if lines:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "\n".join(["tests left files behind (removed now):", *lines])
        if reporter is not None:
            reporter.write_sep("=", "leftovers", red=True)
            reporter.write_line(text)
        else:
            print(text, file=sys.stderr)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> str:
    """The backend name a test body runs on: "host", and "cuda" where a GPU is usable."""
    return request.param


@pytest.fixture
def make_devices(backend: str):
    """``make_devices(n)`` -> n devices of ``backend``, shut down after the test. On CUDA
    the n logical devices take the visible GPUs in turn (sharing them if n is larger)."""
    runtimes = []

    def make(n: int) -> list[nt.Device]:
        if backend == "host":
            spec = f"cpu:{n}"
        else:
            spec = "gpu:" + ",".join(str(i % gpu_count()) for i in range(n))
        devs = nt.devices(spec)
        runtimes.append(devs[0].runtime)
        return devs

    yield make
    for rt in runtimes:
        rt.shutdown()


@pytest.fixture
def dev(make_devices) -> nt.Device:
    """One device of ``backend``."""
    return make_devices(1)[0]


@pytest.fixture
def devs(make_devices) -> list[nt.Device]:
    """Two devices of ``backend``."""
    return make_devices(2)


@pytest.fixture
def host_devs():
    """``host_devs(n)`` -> n host devices (host-only tests), shut down after the test."""
    runtimes = []

    def make(n: int) -> list[nt.Device]:
        devs = nt.devices(f"cpu:{n}")
        runtimes.append(devs[0].runtime)
        return devs

    yield make
    for rt in runtimes:
        rt.shutdown()


def _one_device(request):
    """None (plain numpy), a virtual host device, or a GPU; shut down afterwards."""
    if request.param == "numpy":
        yield None
        return
    devs = nt.devices("cpu:1" if request.param == "host" else "gpu:0")
    yield devs[0]
    devs[0].runtime.shutdown()


#: parameters on no device (numpy), on a host device, and on a GPU where one is usable
host_device = pytest.fixture(params=["numpy", "host"])(_one_device)
any_device = pytest.fixture(params=["numpy", "host", pytest.param("cuda", marks=pytest.mark.gpu)])(
    _one_device
)


def to_np(a):
    """A numpy view or copy of a numpy or CuPy array."""
    return a if isinstance(a, np.ndarray) else a.get()


# nccltree's per-process caches of what CuPy told it: (module, attribute, fresh value factory)
_CUDA_CACHES: tuple[tuple[str, str, Any], ...] = (
    ("nccltree.backends.cuda", "_peer_state", dict),
    ("nccltree.backends.cuda", "_peer_warned", set),
    ("nccltree._cuda_kernels", "_modules", dict),
    ("nccltree._cuda_kernels", "_origin", dict),
    ("nccltree._cuda_kernels", "_target", dict),
    ("nccltree._cuda_kernels", "_functions", dict),
    ("nccltree._cuda_kernels", "_use_fatbin", lambda: True),
    ("nccltree.memory", "_gpu_usable", lambda: None),
)


@pytest.fixture
def fake_cupy(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Any]:
    """A fake of CuPy's layer installed as ``cupy`` for one test; yields its
    ``fakecupy.FakeCuda`` (fault injection and inspection). Wiring checks only: nothing
    that passes on it is verified on a GPU.

    Configure it by indirect parametrisation with a dict of ``fakecupy.install`` arguments,
    e.g. ``@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 2, "peer": False}],
    indirect=True)``; the default is 4 GPUs with peer access between all of them. nccltree's
    caches of CuPy state are reset for the test and restored after it, compiled kernels go
    to a temporary cache directory, and the test fails if the fake recorded a misuse
    (``fake.misuse``; a test that provokes one on purpose clears the list).
    """
    import importlib

    import fakecupy

    gpu_count()  # the real answer, cached before the fake can be seen
    options: dict[str, Any] = dict(getattr(request, "param", None) or {})
    for module, attr, fresh in _CUDA_CACHES:
        mod = importlib.import_module(module)
        if hasattr(mod, attr):
            monkeypatch.setattr(mod, attr, fresh())
    monkeypatch.setenv("NCCLTREE_CACHE_DIR", str(tmp_path / "kernel-cache"))
    with fakecupy.install(**options) as fake:
        yield fake
        misuse = list(fake.misuse)
    if misuse:
        pytest.fail("the fake CuPy recorded misuse:\n" + "\n".join(misuse))


BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def bench_module(name: str) -> Any:
    """``bench/<name>.py`` imported as a module (the bench scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
