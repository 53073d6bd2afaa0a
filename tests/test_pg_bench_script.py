"""bench/pg_table.py runs end to end: tiny sizes, one repetition, both the one-node jobs
and the 2 simulated nodes x 2 processes placement, every case correct."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, needs_mpi


@needs_mpi
@pytest.mark.mpi
def test_pg_table_smoke(tmp_path: Path) -> None:
    out = tmp_path / "pg.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "pg_table.py"), "--procs", "2", "--sizes", "8,4K",
        "--reps", "1", "--budget", "0.001", "--pingpong-rounds", "50",
        "--placement-size", "4K", "--json", str(out), "--job-timeout", "60",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| procs | size | case |" in proc.stdout and "mpich" in proc.stdout
    got = json.loads(out.read_text())
    (run,) = got["runs"]
    cases = {r["case"] for r in run["rows"]}
    assert cases == {f"{a}/{b}" for a in ("tree", "ring", "direct") for b in ("user", "sym")} | {
        "mpich"
    }
    assert all(r["wrong"] == 0 for r in run["rows"]), run["rows"]
    assert all(r["bound_us"] > 0 for r in run["rows"] if r["case"] != "mpich")
    assert run["nt_copy"]["gbps"] > 0
    assert run["pingpong"][0]["shm_us"] > 0 and run["pingpong"][0]["mpi_us"] > 0
    place = got["placement"]
    assert place["nodes"] == 2 and place["node_of_rank"] == ["a", "a", "b", "b"]
    for r in place["rows"]:
        assert r["wrong"] == 0
        if r["case"] != "mpich":  # every byte the plan sends between nodes, and no more
            assert r["cross_node_bytes"] == r["plan_cross_node_bytes"] > 0
    tree = next(r for r in place["rows"] if r["case"] == "tree/sym")
    assert tree["cross_node_bytes"] == 2 * tree["size"]  # the tree's top level: up, down


@needs_mpi
@pytest.mark.mpi
def test_pg_train_smoke(tmp_path: Path) -> None:
    """bench/pg_train.py: one repetition of two iterations of each configuration."""
    out = tmp_path / "train.json"
    cmd = [sys.executable, str(ROOT / "bench" / "pg_train.py"), "--reps", "1", "--iters", "2",
           "--warmup", "1", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [1, 2, 2]
    assert rows[0]["efficiency"] == 1.0
    assert all(r["examples_per_s"][0] > 0 for r in rows)
    assert "mpiexec -n 2" in proc.stdout


@needs_mpi
@pytest.mark.mpi
def test_pg_p2p_bench_smoke(tmp_path: Path) -> None:
    """bench/pg_p2p_bench.py: every case at a small size and at a chunked one, checked."""
    from mpirun import run_mpi

    out = tmp_path / "p2p.json"
    proc = run_mpi(2, ROOT / "bench" / "pg_p2p_bench.py", "--sizes", "8,5M", "--reps", "1",
                   "--iters", "1", "--json", str(out), timeout=90)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["wrong"] == [] and got["processes"] == 2
    assert set(got["us_per_call"]) == {"8", str(5 << 20)}
    assert all(v > 0 for row in got["us_per_call"].values() for v in row.values())
