"""The fast inner loop (``./dev test --quick``) and the leftovers check of every run.

``--quick`` must stay a fast loop over the whole suite, not a smaller suite: every test
module keeps at least one test, every ``slow`` grid a sample, and nothing that starts a
process runs unless a module has nothing else. A run whose tests leave files in
``/dev/shm`` or the temporary folder fails and names the test (``conftest.Leftovers``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    LAST_PART_SHARE,
    QUICK_SAMPLE,
    QuickRecord,
    collect_ignore,
    deal_parts,
    quick_selection,
    split_parts,
)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _record(module: str, name: str, *markers: str, case: str | None = None) -> QuickRecord:
    grid = f"tests/{module}::{name}"
    nodeid = grid if case is None else f"{grid}[{case}]"
    return QuickRecord(nodeid, f"tests/{module}", grid, frozenset(markers))


def test_the_rule_samples_slow_grids_and_keeps_every_module() -> None:
    grid = [_record("test_a.py", "test_grid", "slow", case=str(i)) for i in range(60)]
    tests = [
        _record("test_a.py", "test_unit"),
        _record("test_a.py", "test_forks", "subprocess"),
        _record("test_a.py", "test_one_slow", "slow"),
        _record("test_a.py", "test_one_case", "slow", case="fixture0"),
        *grid,
        # a module of process tests only keeps one of them, not a slow one
        _record("test_b.py", "test_mpi_slow", "mpi", "slow"),
        _record("test_b.py", "test_mpi_1", "mpi"),
        _record("test_b.py", "test_mpi_2", "mpi"),
        # a module of slow tests only keeps one of them
        _record("test_c.py", "test_heavy", "slow"),
    ]
    chosen = quick_selection(tests)
    ids = [t.nodeid for t in chosen]
    assert ids == [t.nodeid for t in tests if t.nodeid in ids]  # collection order
    assert "tests/test_a.py::test_unit" in ids
    assert "tests/test_a.py::test_forks" not in ids
    assert "tests/test_a.py::test_one_slow" not in ids  # not a grid: left to the full run
    assert "tests/test_a.py::test_one_case[fixture0]" not in ids  # nor is a grid of one
    kept = [t for t in grid if t.nodeid in ids]
    assert kept == grid[::QUICK_SAMPLE] and len(kept) == math.ceil(60 / QUICK_SAMPLE)
    assert [t.nodeid for t in quick_selection(tests)] == ids  # the same on every run
    b = [i for i in ids if i.startswith("tests/test_b.py")]
    assert len(b) == 1 and b[0] in ("tests/test_b.py::test_mpi_1", "tests/test_b.py::test_mpi_2")
    assert [i for i in ids if i.startswith("tests/test_c.py")] == ["tests/test_c.py::test_heavy"]


def test_parts_hold_every_test_once_with_the_expensive_ones_apart() -> None:
    units = [_record("test_a.py", f"test_unit_{i}") for i in range(2 * LAST_PART_SHARE)]
    expensive = [_record("test_a.py", "test_golden", "slow"), _record("test_b.py", "t", "mpi")]
    case = _record("test_b.py", "test_grid", "slow", case="0")
    tests = [*units[:3], expensive[0], case, *units[3:], expensive[1]]
    assert split_parts(tests, 1) == [tests]
    first, second = split_parts(tests, 2)
    light = [t for t in tests if t not in expensive]
    assert second == [
        t for t in tests if t in expensive or t in light[LAST_PART_SHARE - 1 :: LAST_PART_SHARE]
    ]
    assert first == [t for t in tests if t not in second]  # the rest, in order
    three = split_parts(tests, 3)
    assert sorted(t.nodeid for part in three for t in part) == sorted(t.nodeid for t in tests)
    assert set(expensive) <= set(three[2]) and abs(len(three[0]) - len(three[1])) <= 1


DUMP = """
import json, os
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    with open(os.environ["DUMP_TO"], "w") as f:
        json.dump([[i.nodeid, sorted({m.name for m in i.iter_markers()})] for i in items], f)
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_quick_runs_every_test_module_and_a_sample_of_every_slow_grid(tmp_path: Path) -> None:
    (tmp_path / "dump_items.py").write_text(DUMP)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "dump_items", "--quick"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "DUMP_TO": str(tmp_path / "all.json")},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    quick = [line for line in r.stdout.splitlines() if "::" in line]
    every = json.loads((tmp_path / "all.json").read_text())
    modules = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")} - {
        f"tests/{name}" for name in collect_ignore
    }
    assert {nodeid.split("::", 1)[0] for nodeid in quick} == modules
    # every slow grid of tests that start no process keeps a sample
    cases: dict[str, int] = {}
    for nodeid, markers in every:
        if "[" in nodeid and "slow" in markers and not {"mpi", "subprocess"} & set(markers):
            grid = nodeid.split("[", 1)[0]
            cases[grid] = cases.get(grid, 0) + 1
    grids = {grid for grid, n in cases.items() if n > 1}  # one case is a single slow test
    assert grids and grids <= {nodeid.split("[", 1)[0] for nodeid in quick}
    # nothing that starts a process, except one test of a module that has nothing else
    marked = dict(every)
    heavy = [n for n in quick if {"mpi", "subprocess"} & set(marked[n])]
    for nodeid in heavy:
        module = nodeid.split("::", 1)[0]
        assert [n for n in quick if n.startswith(module + "::")] == [nodeid], nodeid
    assert len(quick) < len(every) * 0.75, "--quick is no longer much smaller than the suite"


LEAKY = """
import os, subprocess, tempfile

def test_leaves_a_temporary_folder():
    tempfile.mkdtemp(prefix="nccltree-left-")

def test_leaves_a_fake_ipc_file():
    tag = f"{os.getuid()}-s{os.environ['NCCLTREE_TEST_SESSION']}"
    open(f"/dev/shm/fakecupy-ipc-{tag}-{os.getpid()}-10", "w").close()

def test_a_dead_exporters_file_is_released_as_the_driver_would():
    gone = subprocess.Popen(["true"])
    gone.wait()
    tag = f"{os.getuid()}-s{os.environ['NCCLTREE_TEST_SESSION']}"
    open(f"/dev/shm/fakecupy-ipc-{tag}-{gone.pid}-20", "w").close()

def test_leaves_a_segment():
    open(f"/dev/shm/nccltree-{os.getuid()}-t3st-p{os.getpid()}-arena0", "w").close()

def test_cleans_up():
    os.rmdir(tempfile.mkdtemp(prefix="nccltree-gone-"))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_run_that_leaves_files_fails_and_names_each_test(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    out = r.stdout
    assert r.returncode == 1 and "5 passed" in out, out + r.stderr
    lines = [line for line in out.splitlines() if "(left by " in line]
    assert len(lines) == 3, out
    for test, what in [
        ("test_leaves_a_temporary_folder", "/nccltree-left-"),
        ("test_leaves_a_fake_ipc_file", "/dev/shm/fakecupy-ipc-"),
        ("test_leaves_a_segment", "/dev/shm/nccltree-"),
    ]:
        assert any(what in line and f"::{test})" in line for line in lines), (test, out)
    # and they were removed: nothing of that run is left
    pid = out.split("/nccltree-tests-", 1)[1].split("-", 1)[0]
    assert not [n for n in os.listdir("/dev/shm") if f"-p{pid}-" in n or f"-s{pid}-" in n]


def test_a_jobs_orphaned_mpich_segments_are_removed_and_mapped_ones_kept() -> None:
    """tests/mpirun.py removes the MPICH segments a killed job leaves (new since the job
    started, mapped by no live process) and keeps one that a live process maps."""
    import mmap

    from tests.mpirun import MPICH_PREFIX, SHM_DIR, mpich_segments, remove_orphaned_mpich_segments

    if not os.path.isdir(SHM_DIR) or not os.path.isdir("/proc"):
        pytest.skip("needs /dev/shm and /proc")
    before = mpich_segments()
    orphan = os.path.join(SHM_DIR, f"{MPICH_PREFIX}test{os.getpid()}_orphan")
    in_use = os.path.join(SHM_DIR, f"{MPICH_PREFIX}test{os.getpid()}_in_use")
    for path in (orphan, in_use):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    with open(in_use, "r+b") as f:
        held = mmap.mmap(f.fileno(), 4096)
    try:
        removed = remove_orphaned_mpich_segments(before, wait=0.2)
        assert removed == [os.path.basename(orphan)]
        assert not os.path.exists(orphan) and os.path.exists(in_use)
    finally:
        held.close()
        for path in (orphan, in_use):
            if os.path.exists(path):
                os.unlink(path)


def test_the_whole_suite_is_dealt_to_both_parts_each_kind_in_turn() -> None:
    tests = [QuickRecord(f"m.py::t{i}", "m.py", f"m.py::t{i}",
                         frozenset({"mpi"} if i % 3 == 0 else set())) for i in range(12)]  # fmt: skip
    first, second = deal_parts(tests, 2)
    assert sorted(t.nodeid for t in first + second) == sorted(t.nodeid for t in tests)
    heavy = [sum("mpi" in t.markers for t in part) for part in (first, second)]
    assert heavy == [2, 2]
    assert abs(len(first) - len(second)) <= 1
