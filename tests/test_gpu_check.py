"""The one-call GPU check (``bench/gpu_check.py``), exercised without a GPU.

Its dry run goes through every stage on the host backend; a GPU-mode run over a small test
file of our own checks how tests are counted (a skipped ``gpu`` test fails the check, a
skipped ``multi_gpu(n)`` test on fewer GPUs does not; failing, hanging and crashing tests
are named and the run goes on after them) and that a rerun takes exactly what failed; the
summary's bandwidth table is checked against the sweep's JSON records. None of this is GPU
verification: the GPU tests themselves run only on a GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


gpu_check = _module()


def run_check(out: Path, *args: str, timeout: float = 300) -> tuple[int, str, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    results = json.loads((out / "gpu_check.json").read_text())
    return proc.returncode, proc.stdout + proc.stderr, results


@pytest.mark.subprocess
def test_shell_entry_point_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


@pytest.mark.subprocess
@pytest.mark.slow
def test_dry_run_passes_and_reports_from_the_json(tmp_path: Path) -> None:
    rc, output, res = run_check(tmp_path, "--dry-run")
    assert rc == 0, output
    assert res["result"] == "pass" and not res["failures"]
    # the summary comes last
    tail = output.rstrip().splitlines()
    assert tail[-1].startswith("results: ")
    assert any(line.startswith("nccltree GPU check: PASS") for line in tail[-60:])
    stages = res["stages"]
    steps = ("probe", "install", "topology", "tests", "gpu_clean", "sweep", "bound",
             "issue_cost", "process_groups")  # fmt: skip
    assert {k: v["status"] for k, v in stages.items() if k != "nccl_one_gpu"} == dict.fromkeys(
        steps, "ok"
    )
    # NCCL across processes on one GPU is only attempted on a GPU: its commands are shown
    assert stages["nccl_one_gpu"]["status"].startswith("not run (dry run")
    assert all("NCCL_HOSTID" in c for c in stages["nccl_one_gpu"]["commands"])
    # each stage ran within its share, and the GPU run's plan fits
    assert set(res["timing"]) == {"core", "ipc", "rest"}
    plan = res["plan_time"]
    assert plan["ok"] and plan["total_s"] < 360
    assert all(v["planned_s"] <= 0.7 * (v["end_s"] - v["from_s"]) for v in plan["parts"].values())
    assert "planned time of a GPU run" in output
    # the GPU tests of every stage were planned: the process groups' in ipc
    assert any(k.startswith("tests") for k, _ in plan["parts"]["ipc"]["steps"])
    # the bound: a copy rate, and both ratios for every out-of-place all_reduce (one memory)
    bound = stages["bound"]
    assert bound["copy"]["rate_gbs"] > 0
    rows = []
    for run in bound["runs"]:
        rows += json.loads((tmp_path / run["json"]).read_text())["records"]
    out_of_place = [r for r in rows if r["placement"] == "out-of-place"]
    assert {r["devices"] for r in out_of_place} == {"cpu:1", "cpu:4"}
    for r in out_of_place:
        assert r["min_ratio"] > 0
        if r["algorithm"] != "nccl":
            assert r["own_ratio"] > 0 and r["bytes_moved"] >= r["min_bytes"] > 0
    assert any(line.startswith("bound     ok: copy rate") for line in tail[-60:])
    # the process groups' benchmark ran (host groups in a dry run), every case checked, and
    # the ratio of each case to the in-process World is reported at the largest size
    pgs = stages["process_groups"]
    assert pgs["wrong"] and not any(pgs["wrong"].values())
    assert set(pgs["ratios"]) == {f"{a}/{k}" for a in ("tree", "ring", "direct")
                                  for k in ("sym", "user")}  # fmt: skip
    assert all(v > 0 for v in pgs["ratios"].values())
    assert any(line.startswith("groups    ok:") for line in tail[-60:])
    counts = stages["tests"]["counts"]
    assert counts["passed"] >= 3 and counts["failed"] == 0
    # the GPU tests skip on the host backend, as expected in a dry run
    assert counts["expected_skips"] > 0 and counts["unexpected_skips"] == 0
    # every busbw the summary prints is a record of the sweep's JSON; 256 MiB is not in
    # the dry run's sweep, so it is reported as not run rather than taken from elsewhere
    records = []
    for run in stages["sweep"]["runs"]:
        records += json.loads((tmp_path / run["json"]).read_text())["records"]
    table = res["summary"]["busbw"]
    assert {(r["devices"], r["algorithm"]) for r in table} == {
        (d, a) for d in ("cpu:1", "cpu:4") for a in ("tree", "ring", "direct")
    }
    for row in table:
        cell = row["sizes"][str(1 << 20)]
        (rec,) = [
            r
            for r in records
            if (r["collective"], r["devices"], r["algorithm"], r["placement"], r["size"])
            == (row["collective"], row["devices"], row["algorithm"], "out-of-place", 1 << 20)
        ]
        assert cell["busbw"] == rec["busbw"] and cell["wrong"] == 0
        assert row["sizes"][str(256 << 20)] is None
    assert "not run" in output
    # the issue cost: every hand-built algorithm on four ranks, with its plan's step count
    issue = [r for run in stages["issue_cost"]["runs"] for r in run["records"]]
    four = [r for r in issue if r["ranks"] == 4]
    assert {r["algorithm"] for r in four} == {"tree", "ring", "direct"}
    assert all(r["ok"] and r["steps"] > 0 and r["per_step_us"] > 0 for r in four)


FAKE_TESTS = """
import os, signal, time
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.gpu
def test_gpu_skipped():
    pytest.skip("pretend there is no GPU")

@pytest.mark.multi_gpu(8)
def test_needs_eight():
    pytest.skip("needs 8 GPUs")

def test_hangs_in_python():
    time.sleep(60)

def test_crashes():
    os.abort()

def test_hangs_where_no_timer_fires():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)

def test_after_the_crashes():
    pass
"""

# the same names, all passing at once: what a rerun would meet after the fixes
FIXED_TESTS = """
import pytest

@pytest.mark.gpu
def test_gpu_skipped():
    pass

def test_fails():
    pass

def test_hangs_in_python():
    pass

def test_crashes():
    pass

def test_hangs_where_no_timer_fires():
    pass
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_gpu_mode_counts_failures_skips_crashes_and_hangs(tmp_path: Path) -> None:
    tests = tmp_path / "fake" / "test_fake.py"
    tests.parent.mkdir()
    tests.write_text(FAKE_TESTS)
    out = tmp_path / "out"
    # GPU mode (not a dry run) on a machine without one: the probe fails too, but the test
    # stage runs and is counted as it would be on a GPU machine
    args = ["--no-install", "--stages", "tests", "--test-timeout", "1", "--fallback-timeout"]
    rc, output, res = run_check(out, *args, "--tests", str(tests))
    assert rc == 1, output
    assert res["result"] == "fail"
    st = res["stages"]["tests"]
    outcomes = {tid.split("::")[-1]: r["outcome"] for tid, r in st["tests"].items()}
    assert outcomes == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_gpu_skipped": "skipped",
        "test_needs_eight": "skipped",
        "test_hangs_in_python": "failed",
        "test_crashes": "crashed",
        "test_hangs_where_no_timer_fires": "crashed",
        "test_after_the_crashes": "passed",  # the run resumed after each crash
    }
    c = st["counts"]
    assert (c["expected_skips"], c["unexpected_skips"], c["timeouts"]) == (1, 1, 1)
    assert st["timeout_via"].startswith("SIGALRM")
    assert len(st["runs"]) == 3  # started again after each crash
    failures = "\n".join(res["failures"])
    assert "gpu test(s) skipped on a GPU machine" in failures
    for name in ("test_fails", "test_hangs_in_python", "test_crashes"):
        assert name in failures
    hung = st["tests"][next(t for t in st["tests"] if t.endswith("no_timer_fires"))]
    assert "killed after" in hung["message"]

    # a rerun takes exactly what did not pass: failed, crashed, and the gpu test skipped
    tests.write_text(FIXED_TESTS)
    out2 = tmp_path / "out2"
    prev = str(out / "gpu_check.json")
    rc, output, res2 = run_check(out2, *args, "--tests", str(tests), "--rerun-failed", prev)
    planned = {t.split("::")[-1] for t in res2["plan"]["tests"]["core"]}
    assert planned == {
        "test_fails",
        "test_gpu_skipped",
        "test_hangs_in_python",
        "test_crashes",
        "test_hangs_where_no_timer_fires",
    }
    st2 = res2["stages"]["tests"]
    assert st2["status"] == "ok" and st2["counts"]["passed"] == 5, output
    assert res2["plan"]["sweep"] == [] and res2["plan"]["issue_cost"] == []
    assert res2["plan"]["process_groups"] is False


def _check_with_sweep(tmp_path: Path, records: list[dict[str, Any]]) -> Any:
    args = gpu_check.build_parser().parse_args(["--dry-run"])
    assert isinstance(args, argparse.Namespace)
    check = gpu_check.Check(args, tmp_path, 300.0)
    check.config = gpu_check.make_config(False, 1)
    (tmp_path / "s.json").write_text(json.dumps({"records": records}))
    run = {"json": "s.json", "status": "ok", "wrong": 0}
    check.results["stages"] = {"sweep": {"status": "ok", "runs": [run]}}
    return check


def _record(size: int, algorithm: str, busbw: float, placement: str = "out-of-place") -> dict:
    return {
        "collective": "all_reduce",
        "devices": "gpu:0,0,0,0",
        "algorithm": algorithm,
        "placement": placement,
        "size": size,
        "busbw": busbw,
        "algbw": busbw / 1.5,
        "time_us": 1.0,
        "ranks": 4,
        "wrong": 0,
    }


def test_summary_takes_the_sizes_it_names_from_the_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mib = 1 << 20
    check = _check_with_sweep(
        tmp_path,
        [
            _record(mib, "tree", 11.0),
            _record(mib, "tree", 99.0, placement="in-place"),  # out of place is reported
            _record(32 * mib, "tree", 55.0),  # not a summary size
            _record(mib, "ring", 12.0),
            _record(256 * mib, "ring", 300.0),
        ],
    )
    table = check.busbw_table()
    assert [r["algorithm"] for r in table] == ["tree", "ring"]  # the sweep's order
    tree, ring = table
    assert tree["sizes"][str(mib)]["busbw"] == 11.0
    assert tree["sizes"][str(256 * mib)] is None
    assert (ring["sizes"][str(mib)]["busbw"], ring["sizes"][str(256 * mib)]["busbw"]) == (
        12.0,
        300.0,
    )
    assert check.summary() == 0
    printed = capsys.readouterr().out
    tree_line = next(line for line in printed.splitlines() if " tree " in line)
    assert "11.00" in tree_line and "not run" in tree_line and "55.00" not in tree_line


@pytest.mark.subprocess
def test_a_check_stopped_by_sigterm_still_reports(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    results = tmp_path / "gpu_check.json"
    try:
        # the results file appears once the check runs (its signal handlers are set)
        for _ in range(600):
            if results.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output
    res = json.loads(results.read_text())
    assert res["result"] == "fail"
    assert any(f.startswith("interrupted (SIGTERM)") for f in res["failures"])
    assert "nccltree GPU check: FAIL" in output
    assert output.rstrip().splitlines()[-1].startswith("results: ")


@pytest.mark.subprocess
def test_modules_left_out_without_hypothesis_hold_no_gpu_tests():
    """The conftest leaves modules that need hypothesis out of collection where it is
    missing (a GPU machine); none of them may hold a gpu or multi_gpu test (the backend
    fixture's CUDA variant included), or the GPU check would not see it."""
    import conftest

    here = Path(__file__).parent
    modules = [str(here / m) for ms in conftest._NEEDS.values() for m in ms]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "-m", "gpu or multi_gpu", *modules],
        capture_output=True, text=True, timeout=300, cwd=here.parent,
    )  # fmt: skip
    assert res.returncode == 5, res.stdout + res.stderr  # 5: no tests selected
    assert "deselected" in res.stdout


# -- the plan, the limits, the process tree, the bound ----------------------------------------


def test_the_limits_and_defaults_are_the_conftests() -> None:
    """A test's own waits end before the check's limit: both sides use one rule."""
    import conftest

    for name in ("GPU_SECONDS_DEFAULT", "GPU_SECONDS_SLOW", "GPU_LIMIT_FLOOR",
                 "GPU_LIMIT_FACTOR"):  # fmt: skip
        assert getattr(gpu_check, name) == getattr(conftest, name), name
    assert gpu_check.gpu_limit(0.25) == 60.0 and gpu_check.gpu_limit(20) == 100.0


def _tests(**parts: list[float]) -> list[dict[str, Any]]:
    out = []
    for part, seconds in parts.items():
        for i, sec in enumerate(seconds):
            out.append({"id": f"{part}{i}", "gpu": 1, "multi_gpu": 0, "mpi": int(part == "ipc"),
                        "slow": int(part == "rest"), "gpu_seconds": sec})  # fmt: skip
    return out


def test_the_plan_puts_tests_in_their_stage_and_fails_a_stage_over_its_share(
    tmp_path: Path,
) -> None:
    args = gpu_check.build_parser().parse_args(["--dry-run"])
    check = gpu_check.Check(args, tmp_path, 120.0)
    ok = check.plan_time(_tests(core=[0.25] * 100, ipc=[10, 10], rest=[1.5] * 4))
    assert ok["ok"], ok
    core = dict(ok["parts"]["core"]["steps"])
    assert core["tests (100)"] == gpu_check.PLANNED["pytest_start"] + 25
    assert dict(ok["parts"]["ipc"]["steps"]) == {"tests (2)": gpu_check.PLANNED["pytest_start"]
                                                 + 20}  # fmt: skip
    # the ipc stage's share is 22% of 360 s: 70% of it is 55.4 s
    over = check.plan_time(_tests(core=[0.25], ipc=[30, 30]))
    assert not over["ok"] and not over["parts"]["ipc"]["ok"] and over["parts"]["core"]["ok"]
    # a multi_gpu(2) test skips on the one GPU of the plan: not its declared time
    multi = _tests(ipc=[40])
    multi[0]["multi_gpu"] = 2
    assert check.plan_time(multi)["parts"]["ipc"]["ok"]


@pytest.mark.subprocess
def test_processes_left_by_a_killed_test_are_found_and_killed(tmp_path: Path) -> None:
    """Whatever a test started, in a session of its own (as mpiexec's ranks), carries the
    check's run token and is killed after the test's pytest process ends."""
    args = gpu_check.build_parser().parse_args(["--dry-run"])
    check = gpu_check.Check(args, tmp_path, 120.0)
    env = {**check.env, gpu_check.RUN_ENV: check.token}
    orphan = subprocess.Popen(["sleep", "120"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)  # not the check's
    try:
        killed = check.kill_leftovers()
        assert [k.split()[0] for k in killed] == [str(orphan.pid)]
        assert orphan.wait(10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (orphan, other):
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.mpi
def test_an_mpi_job_past_its_timeout_goes_with_every_rank(tmp_path: Path) -> None:
    """``run_mpi`` at its timeout kills the job's whole session: mpiexec, the ranks and
    whatever they started. (MPICH's hydra, killed alone, takes its ranks down here too;
    the session makes it so whatever the launcher does. What outlives a killed pytest
    process is the check's to find: test_processes_left_by_a_killed_test...)"""
    from tests.mpirun import mpiexec, run_mpi

    if mpiexec() is None:
        pytest.skip("needs mpiexec")
    pids = tmp_path / "pids"
    script = tmp_path / "sleeper.py"
    # each rank starts a helper of its own (as a GPU test's rank may), then hangs
    script.write_text(
        "import os, subprocess, time\n"
        "helper = subprocess.Popen(['sleep', '120'])\n"
        f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n{{helper.pid}}\\n')\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_mpi(2, script, timeout=8, faults=True)  # MPICH cleans up nothing itself
    ranks = [int(x) for x in pids.read_text().split()] if pids.exists() else []
    assert len(ranks) == 4, ranks  # two ranks and their helpers
    deadline = time.monotonic() + 10
    alive = ranks
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()
                 and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]  # fmt: skip
        time.sleep(0.2)
    assert not alive, f"ranks still running after the job's timeout: {alive}"


def test_the_bound_on_the_fake(tmp_path: Path, fake_cupy: Any) -> None:
    """Wiring check on tests/fakecupy (not GPU verification: the fake's copies take no
    time, so its rate means nothing). The bound worker measures a copy rate on GPU 0 and
    gives every all_reduce of one GPU its ratio to its own plan's bytes and to 2 N S;
    nccl (no plan of ours) only the latter; ranks on several GPUs neither."""
    base = {"collective": "all_reduce", "dtype": "float32", "time_us": 1000.0}
    recs = [
        {**base, "devices": "gpu:0,0,0,0", "algorithm": "tree", "placement": "out-of-place",
         "size": 1 << 20, "count": 1 << 18, "ranks": 4},
        {**base, "devices": "gpu:0,0,0,0", "algorithm": "ring", "placement": "in-place",
         "size": 1 << 20, "count": 1 << 18, "ranks": 4},
        {**base, "devices": "gpu:0", "algorithm": "nccl", "placement": "out-of-place",
         "size": 1 << 20, "count": 1 << 18, "ranks": 1},
        {**base, "devices": "gpu:0,1", "algorithm": "tree", "placement": "out-of-place",
         "size": 1 << 20, "count": 1 << 18, "ranks": 2},
        {**base, "collective": "broadcast", "devices": "gpu:0", "algorithm": "tree",
         "placement": "out-of-place", "size": 1 << 20, "count": 1 << 18, "ranks": 1},
    ]  # fmt: skip
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"records": recs}))
    out = tmp_path / "bound.json"
    assert gpu_check.bound_worker("gpu:0", 1 << 20, [sweep], out) == 0
    got = json.loads(out.read_text())
    rate = got["copy"]["rate_gbs"] * 1e9
    assert rate > 0 and got["backend"] == "cuda"
    tree, ring, nccl, two_gpus = got["records"]  # all_reduce only
    assert tree["min_bytes"] == 2 * 4 * (1 << 20)
    assert tree["min_ratio"] == pytest.approx(1e-3 / (tree["min_bytes"] / rate))
    assert tree["own_ratio"] == pytest.approx(1e-3 / (tree["bytes_moved"] / rate))
    assert tree["bytes_moved"] > tree["min_bytes"]  # a tree of 4 moves more than 2 N S
    assert ring["own_ratio"] > 0 and "min_ratio" not in ring  # in place: own bound only
    assert nccl["min_ratio"] > 0 and "own_ratio" not in nccl
    assert "own_ratio" not in two_gpus and "min_ratio" not in two_gpus and two_gpus["note"]
