"""Gradient buckets over process groups (``mpiexec -n P nccltree-train --bucket-mb X``):
the parameters are bitwise those of the unbucketed single-process run with the tree, with
one rank per process and with several; the float16 hook runs there too; a rank failing in
the middle of its backward pass ends every process, naming the rank, without a hang."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nccltree.cli import train
from tests.mpirun import ROOT, needs_mpi, run_mpi

CLI = ROOT / "tests" / "mpi" / "cli_main.py"
FAULT = ROOT / "tests" / "mpi" / "bucket_fault.py"
TRAIN = ["--synthetic", "512", "--batch-size", "8", "--seed", "1", "--algorithm", "tree",
         "--hidden", "32,16", "--eval-every", "0"]  # fmt: skip
ITERS = 12

pytestmark = [pytest.mark.mpi, needs_mpi]


def _final(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "final.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.parametrize(
    ("procs", "per_proc", "single"), [(3, "cpu", "cpu:3"), (2, "cpu:2", "cpu:4")]
)
def test_buckets_over_processes_equal_one_unbucketed_process(
    tmp_path: Path, procs: int, per_proc: str, single: str, update_mode: str
) -> None:
    common = [*TRAIN, "--iters", str(ITERS), "--update-mode", update_mode, "--quiet"]
    ref = tmp_path / "single"
    assert train.main([*common, "--devices", single, "--out", str(ref)]) == 0
    out = tmp_path / "mpi"
    args = [*common, "--devices", per_proc, "--out", str(out), "--bucket-mb", "0.001"]
    r = run_mpi(procs, CLI, "train", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    want, got = _final(ref), _final(out)
    assert sorted(want) == sorted(got)
    for k in want:
        assert np.array_equal(want[k], got[k]), k


@pytest.mark.parametrize("algorithm", ["ring", "direct", "mpi", "auto"])
def test_every_group_algorithm_takes_buckets(tmp_path: Path, algorithm: str) -> None:
    """The other algorithms of a group: the same parameters as the single-process
    unbucketed tree run within float32 rounding (ring, MPI's and auto's choices slice
    differently), every process's replica the same (one final.npz, rank 0's)."""
    common = [*TRAIN, "--iters", str(ITERS), "--quiet"]
    ref = tmp_path / "single"
    assert train.main([*common, "--devices", "cpu:3", "--out", str(ref)]) == 0
    out = tmp_path / algorithm
    args = [*common, "--devices", "cpu", "--out", str(out), "--bucket-mb", "0.001",
            "--algorithm", algorithm]  # fmt: skip
    r = run_mpi(3, CLI, "train", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    want, got = _final(ref), _final(out)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_float16_hook_over_processes(tmp_path: Path) -> None:
    out = tmp_path / "f16"
    args = [*TRAIN, "--devices", "cpu", "--iters", str(ITERS), "--out", str(out),
            "--bucket-mb", "0.001", "--comm-hook", "float16"]  # fmt: skip
    r = run_mpi(3, CLI, "train", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gradients sent as float16" in r.stdout
    assert all(np.isfinite(v).all() for v in _final(out).values())


@pytest.mark.parametrize("mb", ["0", "0.001"])
def test_a_rank_failing_during_backward_ends_every_process(tmp_path: Path, mb: str) -> None:
    """Rank 1 raises in its backward pass (with buckets: after its first bucket started);
    the other processes learn it from the group at once (the group's timeout, 120 s, is
    longer than the test's), each naming rank 1."""
    args = [*TRAIN, "--devices", "cpu", "--iters", "50", "--timeout", "120",
            "--bucket-mb", mb]  # fmt: skip
    r = run_mpi(3, FAULT, "1", "4", *args, timeout=60, faults=True)
    assert r.returncode != 0, r.stdout + r.stderr
    err = r.stderr
    assert "rank 1 of 3 failed: RuntimeError: injected fault in backward" in err
    # every process ends with one error, and each names rank 1 (the processes' lines may
    # run together in the launcher's output, so they are found as text, not as lines)
    assert err.count("nccltree-train: error:") == 3, err
    for other in (0, 2):
        assert (
            f"nccltree-train: error: rank {other}: ranks [1] failed: CommError: rank 1 of 3 failed"
            in err
        ), err
