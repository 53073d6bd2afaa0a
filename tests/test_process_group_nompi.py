"""Process groups started without MPI (mpi4py unimportable in every process): the host
grid (every collective x tree/ring/direct/auto, tests/mpi/grid_cases.py) started by
torchrun's variables set by hand and by Slurm's, bitwise the in-process World's, as the
MPI grid is; a split through the bootstrap; host groups across (simulated) nodes and
``algorithm="mpi"`` refused at start with one line on every process.

Each test is one launch of a few processes running a whole grid (tests/pg_nompi/*.py),
sized to run in seconds on a shared machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.envrun import run_env

pytestmark = pytest.mark.subprocess
HERE = Path(__file__).resolve().parent / "pg_nompi"


def _reports(tmp: Path, parts: Any, script: str, *args: str, style: str = "torchrun",
             timeout: float = 180) -> tuple[list[dict[str, Any]], list[Any]]:  # fmt: skip
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    procs = run_env(parts, HERE / script, *args, style=style, timeout=timeout,
                    env={"NCCLTREE_TEST_OUT": str(out)})  # fmt: skip
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))], procs


GRIDS = {
    # (processes, launcher style, grid arguments)
    "2 processes, torchrun's variables": (2, "torchrun", []),
    "3 processes, Slurm's variables": (3, "slurm", ["--dtypes", "float64", "--ops", "sum,mean",
                                                   "--counts", "5,70001"]),
    "4 processes, torchrun's variables": (4, "torchrun", ["--algorithms", "tree,ring,direct",
                                                         "--dtypes", "float32", "--ops", "sum",
                                                         "--counts", "1,70001"]),
    "2 processes of 2 ranks, Slurm's variables": (2, "slurm", ["--devices", "cpu:2",
                                                              "--dtypes", "float32",
                                                              "--ops", "max", "--counts", "1000"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GRIDS))
def test_host_grid_without_mpi_is_the_worlds(name: str, tmp_path: Path) -> None:
    n, style, args = GRIDS[name]
    reports, procs = _reports(tmp_path, n, "grid.py", *args, style=style)
    for p in procs:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(reports) == n
    for rep in reports:
        assert rep["failures"] == [], rep["failures"]
        assert rep["checked"] > 20
        assert rep["nodes"] == 1 and rep["size"] == n * len(rep["ranks"])
        assert rep["mpi4py_loaded"] is False  # never imported (it cannot be)
