"""bench/small_pg.py runs end to end: one job of 2 processes, tiny counts, every figure
present and every result correct."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, needs_mpi

from nccltree.comm.group import small


@needs_mpi
@pytest.mark.mpi
@pytest.mark.skipif(not small.available(), reason="nccltree._small was not built")
def test_small_pg_smoke(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "small_pg.py"), "--procs", "2", "--sizes", "8,4K",
        "--iters", "30", "--sweep", "8,8K", "--sweep-iters", "20", "--big", "64K",
        "--big-reps", "1", "--json", str(out), "--timeout", "100",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| size | small p50 |" in proc.stdout and "AMD" in proc.stdout or "CPU:" in proc.stdout
    got = json.loads(out.read_text())
    (run,) = got["results"]
    assert run["procs"] == 2 and len(run["load"]) == 2
    assert set(run["per_call_us"]) == {"8", "4096"}
    for row in run["per_call_us"].values():
        assert row["small_p50"] > 0 and row["mpich_p50"] > 0
        assert row["small_p99"] >= row["small_p50"]
        assert set(row["breakdown_us"]) == {"python", "entry", "exchange", "wait", "reduce"}
    assert run["wrong"] == {"8": 0, "4096": 0, "sweep": 0}
    assert set(run["sweep_p50_us"]["8192"]) == {"small", "auto before", "direct", "mpich"}
    assert set(run["big_ms"]) == {"small", "auto before"}
