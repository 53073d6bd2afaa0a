"""The command lines in a job started without MPI: ``nccltree-train`` and ``nccltree-bench``
under ``nccltree-run``, under torchrun's variables set by hand and under an srun step's
(mpi4py unimportable in every process), as under ``mpiexec``.

A training over P processes must be bitwise the single-process run with the same total
ranks (``--algorithm tree``: within a node the group's plans are those of ``cpu:N``), and
so bitwise the same run under ``mpiexec -n P`` (the ``mpi`` test checks that directly).
The benchmarks must run their sweep over every process, with ``#wrong`` 0; the MPI peer
line (``--algorithm mpi``) is left out with a note."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nccltree.cli import bench, train
from nccltree.cli._common import job_rank, job_size, over_mpi, reports_usage
from tests.envrun import run_env, run_nccltree_run
from tests.mpirun import ROOT, needs_mpi, run_mpi

CLI = ROOT / "tests" / "mpi" / "cli_main.py"
TRAIN = ["--synthetic", "256", "--batch-size", "8", "--seed", "1", "--algorithm", "tree"]
TRAIN += ["--eval-every", "0", "--quiet"]
ITERS = 6


def _single(tmp_path: Path, devices: str) -> Path:
    out = tmp_path / "single"
    args = [*TRAIN, "--devices", devices, "--iters", str(ITERS), "--out", str(out)]
    assert train.main(args) == 0
    return out


def _losses(out: Path) -> dict[object, object]:
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {r["iter"]: r["loss"] for r in records if r["event"] == "train"}


def _same_run(a: Path, b: Path) -> None:
    fa, fb = np.load(a / "final.npz"), np.load(b / "final.npz")
    assert sorted(fa.files) == sorted(fb.files)
    for k in fa.files:
        assert np.array_equal(fa[k], fb[k]), k
    assert _losses(a) == _losses(b) and len(_losses(a)) == ITERS


def _launch(how: str, procs: int, *args: str) -> list[tuple[int, str, str]]:
    """``tests/mpi/cli_main.py ARGS`` in ``procs`` processes started ``how``: by
    ``nccltree-run`` (one status, the launcher's), or one process per rank with
    torchrun's or Slurm's variables set by hand; (status, stdout, stderr) of each."""
    if how == "nccltree-run":
        done = run_nccltree_run([{}], procs, CLI, *args, timeout=120)
    else:
        done = run_env(procs, CLI, *args, style=how, timeout=120)
    return [(p.returncode, p.stdout, p.stderr) for p in done]


# -- which job this process is in, from the environment ------------------------------------


def test_job_size_and_rank_follow_the_launchers_precedence() -> None:
    assert (job_size({}), job_rank({})) == (1, 0)
    assert (job_size({"PMI_SIZE": "4", "PMI_RANK": "3"}), job_rank({"PMI_RANK": "3"})) == (4, 0)
    assert job_rank({"PMI_SIZE": "4", "PMI_RANK": "3"}) == 3 and job_rank({"PMIX_RANK": "1"}) == 1
    assert job_size({"SLURM_NTASKS": "8", "PMIX_RANK": "0"}) == 8  # srun --mpi=pmix
    torchrun = {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert (job_size(torchrun), job_rank(torchrun)) == (3, 2)
    step = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert (job_size(step), job_rank(step)) == (2, 1)
    # SLURM_NTASKS alone: a one-process script under sbatch sees it too
    assert job_size({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) == 1
    # an MPI launcher's first, then torchrun's, then Slurm's
    assert job_rank({**torchrun, **step}) == 2
    assert job_rank({**torchrun, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}) == 1
    assert not reports_usage(torchrun) and reports_usage({**torchrun, "RANK": "0"})
    assert not over_mpi(torchrun) and not over_mpi(step)
    assert over_mpi({"PMI_SIZE": "2", "PMI_RANK": "0"})


@pytest.mark.parametrize("command", ["nccltree-train", "nccltree-bench"])
def test_a_launcher_variable_that_is_no_number_is_one_line(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "two")
    if command == "nccltree-train":
        rc = train.main(["--devices", "cpu:1", "--iters", "1"])
    else:
        rc = bench.main(["collectives", "--devices", "cpu:2", "-b", "8", "-e", "8"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(command), err
    assert "error: the launcher's environment: WORLD_SIZE='two' is not a whole number" in err
    assert err.count("\n") == 1, err


def test_bench_algorithm_mpi_alone_without_mpi_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found before any process group starts: nothing waits for the other process."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", "1")
    rc = bench.main(["collectives", "-g", "1", "-b", "8", "-e", "8", "--algorithm", "mpi"])
    assert rc == 2
    assert "--algorithm mpi runs MPI's own collectives, and this job was not started by" in (
        capsys.readouterr().err
    )


# -- nccltree-train ------------------------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("how", "per_proc", "single"),
    [
        ("nccltree-run", "cpu", "cpu:2"),
        ("torchrun", "cpu", "cpu:2"),
        ("slurm", "cpu", "cpu:2"),
        ("nccltree-run", "cpu:2", "cpu:4"),
    ],
    ids=["nccltree-run", "torchrun-variables", "slurm-variables", "nccltree-run-cpu:2"],
)
def test_train_without_mpi_equals_one_process(
    tmp_path: Path, how: str, per_proc: str, single: str
) -> None:
    ref = _single(tmp_path, single)
    out = tmp_path / how
    args = [*TRAIN, "--devices", per_proc, "--iters", str(ITERS), "--out", str(out)]
    args.remove("--quiet")
    done = _launch(how, 2, "train", *args)
    for rc, stdout, stderr in done:
        assert rc == 0, stdout[-2000:] + stderr[-3000:]
    stdout = "".join(o for _, o, _ in done)
    assert stdout.count("nccltree-train\n") == 1  # global rank 0 alone prints
    assert f"in each of 2 processes on 1 node ({single[4:]} ranks)" in stdout
    assert "MPI" not in stdout
    _same_run(ref, out)


@pytest.mark.subprocess
def test_train_setup_failure_under_nccltree_run_ends_every_process(tmp_path: Path) -> None:
    """An ``--out`` holding a run, found by global rank 0 alone: every process learns of
    it through the group (no MPI) and exits 2; the error is printed once."""
    held = _single(tmp_path, "cpu:1")
    args = [*TRAIN, "--devices", "cpu", "--iters", "2", "--out", str(held)]
    [(rc, stdout, stderr)] = _launch("nccltree-run", 2, "train", *args)
    assert rc == 2, stdout + stderr
    assert stderr.count("already holds a run") == 1, stderr
    assert stderr.count("nccltree-train: error:") == 1, stderr


@pytest.mark.subprocess
def test_train_flags_that_differ_between_processes_are_named(tmp_path: Path) -> None:
    """The start agreement without MPI: processes given different flags (each adds its
    own --lr, by its RANK) all exit 2, the job's first process naming the flag and the
    processes by RANK."""
    script = tmp_path / "two_flags.py"
    script.write_text(
        "import os, sys\n"
        "from nccltree.cli import train\n"
        "lr = ['--lr', '0.05'] if os.environ['RANK'] == '0' else ['--lr', '0.5']\n"
        "sys.exit(train.main(sys.argv[1:] + lr))\n"
    )
    args = [*TRAIN, "--devices", "cpu", "--iters", "2", "--out", str(tmp_path / "o")]
    done = run_env(2, script, *args, style="torchrun", timeout=120)
    assert [p.returncode for p in done] == [2, 2], [p.stderr for p in done]
    said = done[0].stderr
    assert "the processes of this job were given different flags" in said, said
    assert "--lr: 0.05 on process [0], 0.5 on process [1]" in said, said
    assert "error" not in done[1].stderr, done[1].stderr  # printed once, by rank 0


@pytest.mark.mpi
@needs_mpi
def test_train_under_nccltree_run_equals_mpiexec(tmp_path: Path) -> None:
    runs = {}
    for how in ("mpiexec", "nccltree-run"):
        out = runs[how] = tmp_path / how
        args = [*TRAIN, "--devices", "cpu", "--iters", str(ITERS), "--out", str(out)]
        if how == "mpiexec":
            r = run_mpi(2, CLI, "train", *args, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
        else:
            [(rc, stdout, stderr)] = _launch(how, 2, "train", *args)
            assert rc == 0, stdout + stderr
    _same_run(runs["mpiexec"], runs["nccltree-run"])


# -- nccltree-bench ------------------------------------------------------------------------


@pytest.mark.subprocess
def test_bench_collectives_under_nccltree_run(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    args = ["-g", "1", "-b", "64", "-e", "4K", "-f", "8", "-n", "2", "-w", "1"]
    args += ["--algorithm", "tree,ring,mpi", "--collective", "all_reduce,all_gather"]
    [(rc, stdout, stderr)] = _launch("nccltree-run", 2, "bench", "collectives", *args,
                                     "--json", str(out))  # fmt: skip
    assert rc == 0, stdout + stderr
    assert stdout.count("# nccltree-bench collectives") == 1  # rank 0's table only
    assert "x 2 processes (2 ranks" in stdout
    # the MPI peer line needs MPI: left out, said once, not an error
    assert stderr.count("note: --algorithm mpi left out") == 1, stderr
    assert "error" not in stderr, stderr
    records = json.loads(out.read_text())["records"]
    assert {rec["algorithm"] for rec in records} == {"tree", "ring"}
    assert len(records) == 2 * 3 * 2 * 2  # collectives x sizes x algorithms x placements
    for rec in records:
        assert rec["ranks"] == 2 and rec["wrong"] == 0 and rec["time_us"] > 0


@pytest.mark.subprocess
def test_bench_train_under_nccltree_run(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    args = ["--devices", "cpu", "cpu:2", "--iters", "2", "-w", "1", "--records", "128"]
    args += ["--hidden", "32", "--batch-size", "16"]
    [(rc, stdout, stderr)] = _launch("nccltree-run", 2, "bench", "train", *args,
                                     "--json", str(out))  # fmt: skip
    assert rc == 0, stdout + stderr
    assert stdout.count("# nccltree-bench train") == 1
    points = json.loads(out.read_text())["points"]
    assert [(p["devices"], p["ranks"]) for p in points] == [
        ("cpu x 2 processes", 2),
        ("cpu:2 x 2 processes", 4),
    ]
    assert all(p["examples_per_s"] > 0 for p in points)


@pytest.mark.subprocess
def test_sigterm_to_nccltree_run_stops_every_process_at_one_iteration(tmp_path: Path) -> None:
    """SIGTERM to the launcher (passed on to every child) stops every rank after the
    same iteration, which rank 0 snapshots (status 143); resumed under nccltree-run,
    the run is bitwise the uninterrupted single-process one."""
    import signal
    import subprocess
    import sys
    import time

    from tests.envrun import child_env, kill_all, tests_path

    out = tmp_path / "sig"
    args = [*TRAIN, "--devices", "cpu", "--iters", "100000", "--out", str(out)]
    cmd = [sys.executable, "-m", "nccltree.run", "--nproc-per-node", "2", str(CLI), "train"]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(), cwd=str(tests_path()))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_losses_so_far(out)) < 20:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        kill_all([proc])
    assert proc.returncode == 143, stderr
    assert stderr.count("interrupted (SIGTERM) at iteration") == 1, stderr
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    stop = records[-1]
    assert stop["event"] == "interrupted" and isinstance(stop["iter"], int)
    assert [r["iter"] for r in records if r["event"] == "snapshot"] == [stop["iter"]]
    assert max(_losses(out)) == stop["iter"]
    iters = stop["iter"] + 3
    [(rc, stdout, err)] = _launch("nccltree-run", 2, "train", "--resume", str(out),
                                  "--iters", str(iters), "--quiet")  # fmt: skip
    assert rc == 0, stdout + err
    ref = tmp_path / "single"
    args = [*TRAIN, "--devices", "cpu:2", "--iters", str(iters), "--out", str(ref)]
    assert train.main(args) == 0
    fa, fb = np.load(ref / "final.npz"), np.load(out / "final.npz")
    assert all(np.array_equal(fa[k], fb[k]) for k in fa.files)
    assert _losses(ref) == _losses(out)


def _losses_so_far(out: Path) -> list[str]:
    try:
        with open(out / "metrics.jsonl", encoding="utf-8") as f:
            return [line for line in f if '"train"' in line]
    except FileNotFoundError:
        return []
