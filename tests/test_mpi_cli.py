"""The command lines under MPI: ``mpiexec -n P nccltree-train|nccltree-bench ...``.

A run over P processes must equal the single-process run with the same total ranks
(bitwise with the tree algorithm: the group's topology within a node is one memory, as
``cpu:N`` in one process), a signal must stop every process after the same iteration,
and the collectives benchmark prints one table, checked over every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nccltree.cli import train
from nccltree.cli._training import group_devices, job_size
from tests.mpirun import ROOT, mpiexec, needs_mpi, run_mpi

CLI = ROOT / "tests" / "mpi" / "cli_main.py"
TRAIN = ["--synthetic", "512", "--batch-size", "8", "--seed", "1", "--algorithm", "tree"]


def _single(tmp_path: Path, name: str, devices: str, iters: int) -> Path:
    out = tmp_path / name
    args = [*TRAIN, "--devices", devices, "--iters", str(iters), "--out", str(out), "--quiet"]
    assert train.main(args) == 0
    return out


def _same_run(a: Path, b: Path) -> None:
    fa, fb = np.load(a / "final.npz"), np.load(b / "final.npz")
    assert sorted(fa.files) == sorted(fb.files)
    for k in fa.files:
        assert np.array_equal(fa[k], fb[k]), k
    assert _losses(a) == _losses(b)


def _records(out: Path) -> list[dict[str, object]]:
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _losses(out: Path) -> dict[object, object]:
    return {r["iter"]: r["loss"] for r in _records(out) if r["event"] == "train"}


def test_mpi_detection_and_devices() -> None:
    assert job_size({}) == 1
    assert job_size({"PMI_SIZE": "4"}) == 4
    assert job_size({"OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert job_size({"SLURM_NTASKS": "8"}) == 1  # srun without PMIx: not MPI
    assert job_size({"SLURM_NTASKS": "8", "PMIX_RANK": "0"}) == 8
    # auto: the GPU where CuPy sees one (never here), else one host rank
    assert group_devices("auto") == "cpu" and group_devices("cpu:2") == "cpu:2"
    assert group_devices("gpu") == "gpu" and group_devices("gpu:1") == "gpu:1"
    for bad in ("gpu:0,1", "cpu:0", "cpu:x", "gpu:x", "cuda"):
        with pytest.raises(ValueError, match="in a job of several processes"):
            group_devices(bad)


def test_algorithm_mpi_needs_mpi(capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main(["--algorithm", "mpi", "--devices", "cpu:2", "--iters", "1"]) == 2
    assert "needs MPI mode" in capsys.readouterr().err


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize(
    ("procs", "per_proc", "single"), [(3, "cpu", "cpu:3"), (2, "cpu:2", "cpu:4")]
)
def test_train_over_processes_equals_one_process(
    tmp_path: Path, procs: int, per_proc: str, single: str
) -> None:
    iters = 12
    ref = _single(tmp_path, "single", single, iters)
    out = tmp_path / "mpi"
    args = [*TRAIN, "--devices", per_proc, "--iters", str(iters), "--out", str(out)]
    r = run_mpi(procs, CLI, "train", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("nccltree-train") == 1  # rank 0 alone prints
    assert f"in each of {procs} MPI processes on 1 node ({single[4:]} ranks)" in r.stdout
    _same_run(ref, out)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


@pytest.mark.mpi
@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the MPI processes in /proc")
def test_sigterm_stops_every_process_at_one_iteration_and_resumes(tmp_path: Path) -> None:
    exe = mpiexec()
    assert exe is not None
    out = tmp_path / "sig"
    args = [*TRAIN, "--devices", "cpu:2", "--iters", "100000", "--out", str(out), "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # -disable-auto-cleanup: the launcher must not end the slower process when the first
    # exits with 143 (each one exits on its own here)
    cmd = [exe, "-disable-auto-cleanup", "-n", "2", sys.executable, str(CLI), "train", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_metrics_lines(out)) < 20:
            time.sleep(0.05)
        workers = [
            p for p in _descendants(proc.pid) if str(CLI) in _cmdline(p) and _cmdline(p)[0] != exe
        ]
        assert len(workers) == 2, workers
        for p in workers:
            os.kill(p, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stdout + stderr
    assert stderr.count("interrupted (SIGTERM) at iteration") == 1, stderr
    records = _records(out)
    stop = records[-1]
    assert stop["event"] == "interrupted"
    snaps = [r for r in records if r["event"] == "snapshot"]
    assert [s["iter"] for s in snaps] == [stop["iter"]]
    assert max(_losses(out)) == stop["iter"]
    assert isinstance(stop["iter"], int)
    # every process continues from that snapshot: the same as one uninterrupted process
    iters = stop["iter"] + 5
    r = run_mpi(2, CLI, "train", "--resume", str(out), "--iters", str(iters), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    ref = _single(tmp_path, "single", "cpu:4", iters)
    _same_run(ref, out)


def _metrics_lines(out: Path) -> list[str]:
    try:
        with open(out / "metrics.jsonl", encoding="utf-8") as f:
            return [line for line in f if '"train"' in line]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return [""]


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize(
    ("g", "algorithms"), [("2", "tree,ring"), ("1", "tree,mpi")], ids=["g2", "mpi"]
)
def test_bench_collectives_one_table_checked_over_every_rank(
    tmp_path: Path, g: str, algorithms: str
) -> None:
    colls = (
        "all_reduce,broadcast,reduce,all_gather,reduce_scatter"
        if g == "2"
        else "all_reduce,reduce,all_gather"
    )
    out = tmp_path / "c.json"
    args = ["-g", g, "-b", "64", "-e", "4K", "-f", "8", "-n", "2", "-w", "1"]
    args += ["--algorithm", algorithms, "--collective", colls, "--json", str(out)]
    r = run_mpi(2, CLI, "bench", "collectives", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("# nccltree-bench collectives") == 1  # rank 0's table only
    assert f"MPI processes ({2 * int(g)} ranks" in r.stdout
    records = json.loads(out.read_text())["records"]
    assert {rec["algorithm"] for rec in records} == set(algorithms.split(","))
    assert len(records) == len(colls.split(",")) * 3 * 2 * 2  # sizes x algorithms x placements
    for rec in records:
        assert rec["ranks"] == 2 * int(g) and rec["wrong"] == 0 and rec["time_us"] > 0


@pytest.mark.mpi
@needs_mpi
def test_bench_train_under_mpi(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    args = ["--devices", "cpu", "cpu:2", "--iters", "3", "-w", "1", "--records", "256"]
    r = run_mpi(2, CLI, "bench", "train", *args, "--json", str(out), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("# nccltree-bench train") == 1
    points = json.loads(out.read_text())["points"]
    assert [(p["devices"], p["ranks"]) for p in points] == [
        ("cpu x 2 MPI processes", 2),
        ("cpu:2 x 2 MPI processes", 4),
    ]
    assert all(p["examples_per_s"] > 0 for p in points)


@pytest.mark.mpi
@needs_mpi
def test_a_setup_failure_on_rank_0_ends_every_process(tmp_path: Path) -> None:
    held = _single(tmp_path, "held", "cpu:1", 1)  # an --out holding a run: refused
    args = [*TRAIN, "--devices", "cpu", "--iters", "2", "--out", str(held)]
    r = run_mpi(2, CLI, "train", *args, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    # a usage error: once per job, by the process that found it (the first)
    assert r.stderr.count("already holds a run") == 1, r.stderr
    assert r.stderr.count("error:") == 1, r.stderr
