"""bench/sim_vs_gpu_check.py: the simulator against a GPU check's results. The results
here are written by the test from the H200 run on record (docs/performance.md, "GPU /
Results"), so this checks the reading and the arithmetic, not a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_module
from test_sim import H200_MEASURED

svc = bench_module("sim_vs_gpu_check")

MB = 1 << 20


def _check_dir(tmp_path: Path, per_step_us: float | None = 13.0) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    records = []
    for (n, alg), points in H200_MEASURED.items():
        for mib, us in points.items():
            records.append({"collective": "all_reduce", "placement": "out-of-place",
                            "devices": "gpu:" + ",".join(["0"] * n), "algorithm": alg,
                            "size": mib * MB, "time_us": us,
                            "machine": {"backend": "cuda", "gpus": ["NVIDIA H200"] * n}})  # fmt: skip
    records.append({"collective": "all_reduce", "placement": "out-of-place", "devices": "cpu:2",
                    "algorithm": "tree", "size": MB, "time_us": 100.0,
                    "machine": {"backend": "host"}})  # fmt: skip
    records.append({**records[0], "placement": "in-place"})  # not predicted
    (tmp_path / "sweep-1.json").write_text(json.dumps({"records": records}))
    issue = [{"records": [{"per_step_us": per_step_us}]}] if per_step_us else []
    (tmp_path / "gpu_check.json").write_text(json.dumps({"stages": {
        "sweep": {"runs": [{"json": "sweep-1.json"}, {"json": None}]},
        "issue_cost": {"runs": issue}}}))  # fmt: skip
    return tmp_path


def test_the_h200_run_predicted_from_the_checks_own_files(tmp_path: Path) -> None:
    rows, summary = svc.compare(_check_dir(tmp_path))
    assert summary["points"] == len(rows) == sum(len(p) for p in H200_MEASURED.values())
    assert all(0.45 <= r["ratio"] <= 2.0 for r in rows)
    assert summary["within_25"] >= len(rows) // 2
    assert summary["skipped"] == ["cpu:2: host backend"]
    assert "13.0 us per step (the check's median)" in summary["issue"]
    text = svc.markdown(rows, summary)
    assert "| gpu:0,0,0,0 | NVIDIA H200 | tree | 1048576 |" in text and "within 2x" in text


def test_a_slower_issue_cost_predicts_slower_and_a_missing_one_is_said(tmp_path: Path) -> None:
    fast, _ = svc.compare(_check_dir(tmp_path / "a", per_step_us=13.0))
    slow, _ = svc.compare(_check_dir(tmp_path / "b", per_step_us=26.0))
    assert all(s["predicted_us"] >= f["predicted_us"] for f, s in zip(fast, slow))
    assert sum(s["predicted_us"] > 1.5 * f["predicted_us"] for f, s in zip(fast, slow)) > 0
    _, summary = svc.compare(_check_dir(tmp_path / "c", per_step_us=None))
    assert "the check measured none" in summary["issue"]


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "t.md"
    assert svc.main([str(_check_dir(tmp_path / "d")), "--markdown", str(md)]) == 0
    assert md.read_text() == capsys.readouterr().out
    with pytest.raises(SystemExit):
        svc.main([str(tmp_path / "nowhere")])
