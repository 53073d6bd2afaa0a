"""The processes of an MPI job agree on their configuration before training, and a usage
error under mpiexec is printed once per job (by the process of launcher rank 0), every
process exiting with 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from nccltree.cli import train
from nccltree.cli._agreement import _disagreement
from nccltree.cli._common import UsageError, job_rank, job_size, reports_usage
from tests.mpirun import ROOT, needs_mpi, run_mpi

CLI = ROOT / "tests" / "mpi" / "cli_main.py"
TRAIN = ["--synthetic", "256", "--batch-size", "8", "--iters", "4", "--devices", "cpu"]
TRAIN += ["--eval-every", "0"]


def test_job_rank_and_who_reports() -> None:
    assert job_rank({}) == 0 and reports_usage({})
    assert job_rank({"PMI_RANK": "3", "PMI_SIZE": "4"}) == 3
    assert not reports_usage({"PMI_RANK": "3", "PMI_SIZE": "4"})
    assert reports_usage({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert job_rank({"PMIX_RANK": "1"}) == 1
    # a rank without a job of several processes: it speaks for itself
    assert reports_usage({"PMI_RANK": "1"}) and job_size({"PMI_RANK": "1"}) == 1


def test_the_message_names_each_differing_flag_and_its_processes() -> None:
    def start(proc: int, **cfg: object) -> dict[str, object]:
        base: dict[str, object] = {"lr": 0.05, "batch_size": 32, "iters": 500, "hidden": [256]}
        base.update(cfg)
        return {"proc": proc, "body": {"config": base, "error": None, "usage": True}}

    err = _disagreement(
        [start(0), start(1, lr=0.5), start(2, lr=0.5, hidden=[64, 32])], {"lr": "--lr"}
    )
    assert isinstance(err, UsageError)
    text = str(err)
    assert "--lr: 0.05 on process [0], 0.5 on processes [1, 2]" in text
    assert "--hidden: 256 on processes [0, 1], 64,32 on process [2]" in text
    assert "batch" not in text and "iters" not in text
    failed = {"proc": 1, "body": {"config": None, "error": "argument --lr: bad", "usage": True}}
    err = _disagreement([start(0), failed], {})
    assert isinstance(err, UsageError) and str(err) == "process [1]: argument --lr: bad"


def test_comm_hook_float16_with_algorithm_mpi_is_a_usage_error(capsys) -> None:  # type: ignore[no-untyped-def]
    code = train.main(["--algorithm", "mpi", "--comm-hook", "float16", "--devices", "cpu:2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--comm-hook float16" in err and "--algorithm mpi" in err


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


@pytest.mark.mpi
@needs_mpi
def test_processes_with_different_flags_refuse_to_train(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*TRAIN, "--out", str(out)]
    r = run_mpi(
        [(1, {}), (1, {}, "exec {cmd} --lr 0.5 --batch-size 4 --iters 6")],
        CLI,
        "train",
        *args,
        "--lr",
        "0.05",
        timeout=120,
        faults=True,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    errors = _errors(r.stderr)
    assert len(errors) == 1, r.stderr  # once per job, not once per process
    assert "--lr: 0.05 on process [0], 0.5 on process [1]" in errors[0]
    assert "--batch-size: 8 on process [0], 4 on process [1]" in errors[0]
    assert "--iters: 4 on process [0], 6 on process [1]" in errors[0]
    assert "nccltree-train\n" not in r.stdout  # nothing started
    assert not (out / "final.npz").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.mpi
@needs_mpi
def test_per_process_flags_may_differ(tmp_path: Path) -> None:
    # --out (rank 0 writes it; the others cache the built-in data there), --timeout and
    # --blas-threads are each process's own
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_mpi(
        [(1, {}), (1, {}, f"exec {{cmd}} --out {b} --timeout 90 --blas-threads 1")],
        CLI,
        "train",
        *TRAIN,
        "--out",
        str(a),
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (a / "final.npz").exists() and not (b / "final.npz").exists()


@pytest.mark.mpi
@needs_mpi
def test_a_usage_error_prints_once_per_job() -> None:
    r = run_mpi(3, CLI, "train", "--no-such-flag", timeout=120, faults=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("usage: nccltree-train") == 1, r.stderr
    assert len(_errors(r.stderr)) == 1, r.stderr


@pytest.mark.mpi
@needs_mpi
def test_a_bad_flag_on_another_process_is_named_by_the_first() -> None:
    r = run_mpi(
        [(1, {}), (1, {}, "exec {cmd} --lr fast")], CLI, "train", *TRAIN, timeout=120, faults=True
    )
    assert r.returncode == 2, r.stdout + r.stderr
    errors = _errors(r.stderr)
    assert len(errors) == 1, r.stderr
    assert "process [1]: argument --lr: invalid float value: 'fast'" in errors[0]


@pytest.mark.mpi
@needs_mpi
def test_algorithm_mpi_with_float16_under_mpi_is_one_usage_error() -> None:
    r = run_mpi(
        2, CLI, "train", *TRAIN, "--algorithm", "mpi", "--comm-hook", "float16", timeout=120
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(_errors(r.stderr)) == 1 and "--comm-hook float16" in r.stderr, r.stderr
    args = ["-g", "1", "-b", "64", "-e", "64", "-n", "1", "-w", "0", "--algorithm", "mpi"]
    r = run_mpi(2, CLI, "bench", "collectives", *args, "-d", "float16", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = _errors(r.stderr)
    assert len(errors) == 1 and "float16" in errors[0], r.stderr
    assert "# nccltree-bench collectives" not in r.stdout  # refused before the sweep
