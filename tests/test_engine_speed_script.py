"""bench/engine_speed.py runs end to end on a tiny sweep (so the script cannot rot between
the runs that produce performance.md's figures); no figure is checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "engine_speed.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.subprocess
@pytest.mark.slow
def test_bounds_and_regret_on_a_tiny_sweep(tmp_path):
    out = tmp_path / "es.json"
    p = run(
        "--ranks", "2", "--max", "4K", "--skip", "latency", "issue", "--out", str(out), cwd=BENCH
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert set(d["sections"]) == {"bounds", "regret"}
    bounds = d["sections"]["bounds"]["runs"]["2"]["summary"]["bounds"]
    assert {b["algorithm"] for b in bounds} == {"tree", "ring", "direct"}
    assert all(b["ratio"] > 0 for b in bounds)
    rows = d["sections"]["regret"]["runs"][0]["rows"]
    assert [r["size"] for r in rows] == [8, 64, 512, 4096]
    assert all(r["auto_ran"] in ("tree", "ring", "direct") for r in rows)
    assert "| ranks | algorithm | placement |" in p.stdout
    assert "| ranks | size | auto ran |" in p.stdout


@pytest.mark.subprocess
def test_fewer_than_five_repetitions_are_refused(tmp_path):
    p = run("--reps", "4", "--out", str(tmp_path / "x.json"), cwd=BENCH)
    assert p.returncode == 2
    assert "--reps must be at least 5" in p.stderr
