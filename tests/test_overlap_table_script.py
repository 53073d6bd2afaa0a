"""bench/overlap_table.py runs end to end on a tiny run (so the script cannot rot between
the runs that produce performance.md's gradient-bucket figures); no figure is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "overlap_table.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.subprocess
@pytest.mark.slow
def test_speed_table_smoke(tmp_path):
    out = tmp_path / "o.json"
    p = run("--ranks", "2", "--bucket-mb", "0", "1", "--iters", "1", "--warmup", "1",
            "--repeat", "1", "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "| case | examples/s | vs 0 |" in p.stdout and "other processes kept" in p.stdout
    (table,) = json.loads(out.read_text())["speed"]
    cases = [r["case"] for r in table["rows"]]
    assert cases == [
        "cpu:2, communication off",
        "cpu:2, buckets 0 MiB",
        "cpu:2, buckets 1 MiB",
        "cpu:2, buckets 0 MiB, float16 hook",
        "cpu:2, buckets 1 MiB, float16 hook",
    ]
    assert table["rows"][1]["vs_unbucketed"] == 1.0


@pytest.mark.subprocess
@pytest.mark.slow
def test_loss_curve_smoke(tmp_path):
    out = tmp_path / "l.json"
    p = run("--loss-curve", "--iters", "20", "--hook-mb", "0.02", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["loss_curve"]["rows"]
    assert [r["run"] for r in rows][:2] == ["float32", "float16 hook"]
    assert rows[0]["rel_diff"] == 0.0 and rows[2]["rel_diff"] == 0.0  # buckets: bitwise
    assert rows[1]["rel_diff"] > 0.0  # the hook did round the gradients


@pytest.mark.subprocess
def test_sizes_must_start_with_the_unbucketed_run():
    p = run("--bucket-mb", "1", "4")
    assert p.returncode == 2 and "--bucket-mb must start with 0" in p.stderr
