"""The embedding examples of docs/examples/ run under ``mpiexec -n 2`` and every rank ends
with the same weights (a digest per rank, compared here)."""

from __future__ import annotations

import re

import pytest
from mpirun import ROOT, needs_mpi, run_mpi

EXAMPLES = ROOT / "docs" / "examples"
# not anchored to lines: the processes share one pipe, and a line's text and its newline
# are separate writes that another process's output may fall between
DIGEST = re.compile(r"rank (\d+) of (\d+): weights ([0-9a-f]{16})( max error [0-9.]+\d)?")


def _digests(script: str) -> tuple[dict[int, str], list[str], str]:
    proc = run_mpi(2, EXAMPLES / script, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = DIGEST.findall(proc.stdout)
    assert sorted(int(r) for r, *_ in found) == [0, 1], proc.stdout
    assert all(int(n) == 2 for _, n, *_ in found)
    return {int(r): d for r, _, d, _ in found}, [t for *_, t in found], proc.stdout


@needs_mpi
@pytest.mark.mpi
def test_numpy_allreduce_example() -> None:
    digests, tails, out = _digests("numpy_allreduce.py")
    assert digests[0] == digests[1], out  # every rank applied the same averaged updates
    errors = [float(x) for t in tails for x in re.findall(r"max error ([0-9.]+)", t)]
    assert len(errors) == 2, out
    assert max(errors) < 0.05, out  # and the averaged gradient solved the problem
    assert out.count("step ") == 5, out  # only rank 0 reports progress


@needs_mpi
@pytest.mark.mpi
def test_torch_dlpack_example() -> None:
    pytest.importorskip("torch")
    digests, _, out = _digests("torch_dlpack.py")
    assert digests[0] == digests[1], out
    losses = [float(x) for x in re.findall(r"loss on rank 0's shard ([0-9.]+)", out)]
    assert len(losses) == 5 and losses[-1] < losses[0], out


@pytest.mark.parametrize("spec", ["cpu:4", "cpu:3"])
@pytest.mark.subprocess
def test_the_vocabulary_example_checks_every_operation(spec: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "vocabulary.py"), spec],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every example checked" in proc.stdout
