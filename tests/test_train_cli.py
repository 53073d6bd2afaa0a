"""``nccltree-train``: the default run, flags, outputs, resume, failures and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nccltree as nt
from nccltree.cli.train import build_parser, main
from nccltree.models import Model
from nccltree.parallel import load_snapshot

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--devices", "cpu:2", "--synthetic", "1024", "--eval-every", "0"]


def run_main(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_no_arguments_trains_to_the_stated_accuracy(capsys):
    rc, out, err = run_main(capsys, [])
    assert rc == 0, err
    assert "scaling    weak: batch 32 per rank, effective batch" in out
    assert "learning rate 0.05 (policy fixed)" in out
    assert "algorithm  tree, update mode allreduce" in out
    line = [ln for ln in out.splitlines() if ln.startswith("reached")][0]
    assert line.endswith("accuracy on the held-out set (target 90%)"), line
    assert float(line.split()[1].rstrip("%")) >= 90.0
    assert "iter 500/500" in err  # the progress line


def test_outputs_metrics_and_final_parameters(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, out, err = run_main(
        capsys,
        [*SMALL, "--iters", "60", "--eval-every", "20", "--out", str(out_dir), "--hidden", "32,16"],
    )
    assert rc == 0, err
    records = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[0] == "config" and events[-1] == "final"
    train = [r for r in records if r["event"] == "train"]
    assert [r["iter"] for r in train] == list(range(1, 61))
    assert all(r["examples"] == 64 and r["loss"] > 0 for r in train)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["iter"] for r in evals] == [20, 40, 60]
    final = np.load(out_dir / "final.npz")
    assert sorted(final.files) == sorted(
        ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    )
    assert final["fc0.weight"].shape == (32, 64)
    assert "iter 40: held-out accuracy" in err
    assert (out_dir / "data").is_dir()  # the built-in data are cached with the run


def test_strong_scaling_header_and_quiet(capsys):
    rc, out, err = run_main(
        capsys,
        [
            "--devices",
            "cpu:4",
            "--batch-size",
            "32",
            "--scaling",
            "strong",
            "--iters",
            "5",
            "--synthetic",
            "512",
        ],
    )
    assert rc == 0, err
    assert "strong: batch 8 per rank, effective batch 32 (global batch 32 split across 4" in out
    rc, out, err = run_main(capsys, [*SMALL, "--iters", "5", "--quiet"])
    assert rc == 0
    assert err == ""
    assert out.splitlines() == [out.strip()] and out.startswith("reached")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "cpu:4", "--batch-size", "30", "--scaling", "strong"], "split evenly"),
        (["--snapshot-every", "5"], "--snapshot-every needs --out"),
        (["--devices", "tpu:1"], "accepted forms"),
        (["--model", "rnn"], "invalid choice"),
        (["--data", "/nonexistent/db"], "no database at"),
        (["--resume", "/nonexistent/snap.npz"], "no snapshot at"),
        (["--hidden", "a,b"], "comma-separated integers"),
        (["--lr-policy", "step"], "needs gamma and stepsize"),
        # the one argument rule: argparse's float takes "nan" and "inf"
        (["--timeout", "nan"], "--timeout must be a number, got NaN"),
        (["--timeout", "inf"], "--timeout must be finite"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--lr", "nan"], "--lr must be a number, got NaN"),
        (["--momentum", "inf"], "--momentum must be finite"),
        (["--scale", "nan"], "--scale must be a number"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--blas-threads", "0"], "--blas-threads must be >= 1"),
        (["--bucket-mb", "-1"], "--bucket-mb must be >= 0"),
        (["--bucket-mb", "nan"], "--bucket-mb must be a number, got NaN"),
        (["--comm-hook", "int8"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, message):
    assert main([*argv, "--iters", "1", "--synthetic", "256"]) == 2
    out, err = capsys.readouterr()
    assert message in err
    assert err.startswith("usage: nccltree-train") and "nccltree-train: error:" in err
    assert out == ""  # nothing ran


def test_help_explains_every_flag(capsys):
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "Exit status: 0 success; 1 the run failed; 2 bad usage" in " ".join(text.split())
    for action in parser._actions:
        for opt in action.option_strings:
            assert opt in text


@pytest.mark.parametrize("update_mode", ["allreduce", "root"])
@pytest.mark.slow
def test_gradient_buckets_train_bitwise_as_one_collective(capsys, tmp_path, update_mode):
    """--bucket-mb: the same parameters as without buckets (the tree, 3 ranks), the flag
    in the header and the exposed communication in the metrics."""
    runs = {}
    for mb in ("0", "0.002"):
        out_dir = tmp_path / f"run{mb}"
        rc, out, err = run_main(
            capsys,
            [*SMALL, "--devices", "cpu:3", "--iters", "20", "--out", str(out_dir),
             "--update-mode", update_mode, "--bucket-mb", mb],
        )  # fmt: skip
        assert rc == 0, err
        assert ("gradient buckets of 0.002 MiB" in out) == (mb != "0")
        records = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["event"] == "train"]
        assert all(0.0 <= r["exposed_s"] <= r["comm_s"] for r in train)
        runs[mb] = np.load(out_dir / "final.npz")
    for k in runs["0"].files:
        assert np.array_equal(runs["0"][k], runs["0.002"][k]), k


@pytest.mark.slow
def test_float16_comm_hook(capsys, tmp_path):
    finals = []
    for hook in ([], ["--comm-hook", "float16"]):
        out_dir = tmp_path / ("f16" if hook else "f32")
        rc, out, err = run_main(
            capsys, [*SMALL, "--iters", "30", "--out", str(out_dir), "--bucket-mb", "0.01", *hook]
        )
        assert rc == 0, err
        assert ("gradients sent as float16" in out) == bool(hook)
        finals.append(np.load(out_dir / "final.npz"))
    assert finals[0]["fc0.weight"].dtype == finals[1]["fc0.weight"].dtype == np.float32
    a, b = (np.concatenate([f[k].ravel() for k in sorted(f.files)]) for f in finals)
    assert not np.array_equal(a, b)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-2


@pytest.mark.slow
def test_train_from_lmdb_with_cnn_and_target(capsys, tmp_path):
    x, y = nt.data.synthetic(512, shape=(1, 8, 8), classes=3, seed=4)
    xv, yv = nt.data.synthetic(128, shape=(1, 8, 8), classes=3, seed=4, split="test")
    nt.data.write_lmdb(tmp_path / "train", x, y)
    nt.data.write_lmdb(tmp_path / "val", xv, yv)
    argv = [
        "--devices",
        "cpu:2",
        "--data",
        str(tmp_path / "train"),
        "--val-data",
        str(tmp_path / "val"),
        "--model",
        "cnn",
        "--iters",
        "30",
        "--batch-size",
        "16",
    ]
    rc, out, err = run_main(capsys, argv)
    assert rc == 0, err
    assert "3 classes" in out and "ConvNet" in out
    assert "reached" in out and "target" not in out
    rc, out, err = run_main(capsys, [*argv, "--target-accuracy", "101"])
    assert rc == 3  # a wrong result, not a crash
    assert "below the target 101%" in out


@pytest.mark.slow
def test_resume_continues_bitwise(capsys, tmp_path):
    common = [*SMALL, "--lr", "0.1", "--snapshot-every", "20", "--update-mode", "root"]
    rc, _, err = run_main(capsys, [*common, "--iters", "40", "--out", str(tmp_path / "a")])
    assert rc == 0, err
    rc, _, err = run_main(capsys, [*common, "--iters", "20", "--out", str(tmp_path / "b")])
    assert rc == 0, err
    snap = load_snapshot(tmp_path / "b" / "snapshot.npz")
    assert snap.iter == 20 and snap.position == 20 * 64
    # every other flag comes from the snapshot
    rc, out, err = run_main(capsys, ["--resume", str(tmp_path / "b"), "--iters", "40"])
    assert rc == 0, err
    assert "resumed    at iteration 20, data position 1280" in out
    assert "update mode root" in out
    a, b = np.load(tmp_path / "a" / "final.npz"), np.load(tmp_path / "b" / "final.npz")
    for name in a.files:
        assert np.array_equal(a[name], b[name]), name
    train = [json.loads(ln) for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in train if r["event"] == "train"] == list(range(1, 41))


def test_a_failing_rank_exits_1_naming_it(capsys, monkeypatch):
    calls = {"n": 0}
    original = Model.loss_and_grad

    def flaky(self, params, x, y):
        if params.device.index == 1:
            calls["n"] += 1
            if calls["n"] == 4:
                raise FloatingPointError("injected: the loss is not finite")
        return original(self, params, x, y)

    monkeypatch.setattr(Model, "loss_and_grad", flaky)
    rc, out, err = run_main(capsys, [*SMALL, "--iters", "50", "--timeout", "20"])
    assert rc == 1
    assert "rank 1 of 2 failed: FloatingPointError: injected: the loss is not finite" in err
    assert "reached" not in out


@pytest.mark.subprocess
def test_ctrl_c_stops_promptly_and_keeps_the_snapshot(tmp_path):
    out_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "nccltree.cli.train",
        *SMALL,
        "--iters",
        "10000000",
        "--out",
        str(out_dir),
        "--snapshot-every",
        "20",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snap_path = out_dir / "snapshot.npz"
    try:
        deadline = time.monotonic() + 60
        while not snap_path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert snap_path.exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    # the iteration reached is snapshotted, and the message names what the snapshot holds
    snap = load_snapshot(snap_path)
    assert snap.iter > 0
    assert f"interrupted (SIGINT) at iteration {snap.iter}; the snapshot {snap_path} " in err
    assert not [p for p in os.listdir(out_dir) if ".tmp" in p]


class _Terminal:
    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_progress_refreshes_in_place_on_a_terminal():
    from nccltree.cli.train import TrainProgress
    from nccltree.parallel import StepInfo

    term = _Terminal()
    progress = TrainProgress(total=3, every=1, quiet=False, stream=term)
    for it in (1, 2, 3):
        progress.update(StepInfo(it, 1.0 / it, 0.1, 64, 0.01, 0.002, 0.01 * it, None, None))
        if it == 1:
            progress.message("iter 1: held-out accuracy 50.00%")
    assert term.text.startswith(
        "\r\x1b[2Kiter 1/3  loss 1.0000  lr 0.1  6,400 examples/s  comm  20%"
    )
    assert "\r\x1b[2Kiter 1: held-out accuracy 50.00%\n" in term.text
    assert term.text.endswith("iter 3/3  loss 0.6111  lr 0.1  6,400 examples/s  comm  20%\n")
    assert term.text.count("\n") == 2  # the message and the finished line; no line per step
