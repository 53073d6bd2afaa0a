"""``nccltree-train``: --weights (fine-tuning), --evaluate (Caffe's ``caffe test``), the
snapshot history (--snapshot-keep), and all of them end to end."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import nccltree as nt
from nccltree.cli.train import main
from nccltree.snapshot import load_snapshot

SMALL = ["--devices", "cpu:2", "--synthetic", "1024", "--eval-every", "0"]


def run_main(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def same_params(a, b):
    a = dict(np.load(a)) if not isinstance(a, dict) else a
    b = dict(np.load(b)) if not isinstance(b, dict) else b
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with a snapshot history of 2: iterations 30 and 40 kept."""
    root = tmp_path_factory.mktemp("trained")
    argv = [*SMALL, "--iters", "40", "--snapshot-every", "10", "--snapshot-keep", "2"]
    assert main([*argv, "--out", str(root / "run"), "--quiet"]) == 0
    return root / "run"


@pytest.mark.slow
def test_weights_start_a_new_run_from_saved_parameters(capsys, tmp_path, trained):
    # no iteration: the final parameters are the weights, bitwise
    for source in ("final.npz", "snapshot_iter_30.npz"):
        out_dir = tmp_path / source
        argv = [*SMALL, "--iters", "0", "--weights", str(trained / source), "--out", str(out_dir)]
        rc, out, err = run_main(capsys, argv)
        assert rc == 0, err
        assert f"weights    {trained / source}" in out
        want = load_snapshot(trained / source).params if "iter" in source else trained / source
        assert same_params(out_dir / "final.npz", want)
    # a fine-tuning starts at iteration 0 with fresh solver state and data
    rc, _, err = run_main(
        capsys,
        [*SMALL, "--iters", "5", "--snapshot-every", "5", "--weights", str(trained / "final.npz"),
         "--out", str(tmp_path / "ft")],
    )  # fmt: skip
    assert rc == 0, err
    snap = load_snapshot(tmp_path / "ft" / "snapshot.npz")
    assert snap.iter == 5 and snap.position == 5 * 64


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hidden", "32"], "--weights: parameter 'fc0.weight' has shape (256, 64) in "),
        (["--model", "cnn"], "has no parameter 'conv0.weight', which the model needs"),
        (["--hidden", "256,16"], "parameter 'fc1.weight' has shape (10, 256) in "),
        (["--model", "softmax"], "but (10, 64) in the model"),
    ],
)
def test_weights_that_do_not_fit_the_model_exit_2_naming_the_parameter(
    capsys, trained, extra, message
):
    rc, _, err = run_main(capsys, [*SMALL, "--weights", str(trained / "final.npz"), *extra])
    assert rc == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content, message",
    [(b"", "is not an .npz"), (b"hello", "is not an .npz"), (None, "no weights file at")],
)
def test_a_weights_file_that_holds_no_weights_exits_2(capsys, tmp_path, content, message):
    path = tmp_path / "w.npz"
    if content is not None:
        path.write_bytes(content)
    rc, _, err = run_main(capsys, [*SMALL, "--weights", str(path)])
    assert rc == 2 and "--weights: " in err and message in err


def test_weights_and_resume_are_exclusive(capsys, trained):
    rc, _, err = run_main(
        capsys, ["--resume", str(trained), "--weights", str(trained / "final.npz")]
    )
    assert rc == 2 and "give one" in err


def test_evaluate_loads_onto_one_device_and_reports(capsys, trained):
    final = [
        json.loads(ln)
        for ln in (trained / "metrics.jsonl").read_text().splitlines()
        if '"final"' in ln
    ][-1]
    # a final.npz: the model from metrics.jsonl beside it; one device by default
    rc, out, err = run_main(capsys, ["--evaluate", str(trained / "final.npz")])
    assert rc == 0, err
    assert f"accuracy {100 * final['accuracy']:.2f}%" in out
    assert "on cpu:0" in out and "over 256 records" in out
    # a snapshot carries its configuration; --target-accuracy missed: a wrong result
    rc, out, err = run_main(
        capsys,
        ["--evaluate", str(trained / "snapshot_iter_30.npz"), "--devices", "cpu:1",
         "--target-accuracy", "99.9"],
    )  # fmt: skip
    assert rc == 3, err
    assert "below the target 99.9%" in out


def test_evaluate_over_a_database(capsys, tmp_path):
    x, y = nt.data.synthetic(256, shape=(1, 8, 8), classes=3, seed=4)
    xv, yv = nt.data.synthetic(64, shape=(1, 8, 8), classes=3, seed=4, split="test")
    nt.data.write_lmdb(tmp_path / "train", x, y)
    nt.data.write_lmdb(tmp_path / "val", xv, yv)
    common = ["--devices", "cpu:2", "--model", "cnn", "--iters", "10", "--batch-size", "16"]
    train = [*common, "--data", str(tmp_path / "train"), "--out", str(tmp_path / "run")]
    rc, _, err = run_main(capsys, [*train, "--val-data", str(tmp_path / "val")])
    assert rc == 0, err
    final = tmp_path / "run" / "final.npz"
    rc, out, err = run_main(capsys, ["--evaluate", str(final), "--data", str(tmp_path / "val")])
    assert rc == 0, err
    assert f"over 64 records of {tmp_path / 'val'}" in out
    # the held-out set recorded by the run is the default
    rc, out2, err = run_main(capsys, ["--evaluate", str(final)])
    assert rc == 0, err
    assert out2 == out
    # a final.npz alone: the model flags must be given
    os.unlink(tmp_path / "run" / "metrics.jsonl")
    rc, _, err = run_main(capsys, ["--evaluate", str(final), "--data", str(tmp_path / "val")])
    assert rc == 2 and "has no parameter 'fc0.weight'" in err
    rc, out3, err = run_main(
        capsys, ["--evaluate", str(final), "--data", str(tmp_path / "val"), "--model", "cnn"]
    )
    assert rc == 0, err
    assert out3 == out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--devices", "cpu:2"], "onto one device, but --devices cpu:2 names 2"),
        (["--resume", "x"], "--evaluate trains nothing: --resume does not apply"),
        (["--val-data", "x"], "name the database with --data"),
        (["--data", "/nonexistent"], "--data: no database at /nonexistent"),
    ],
)
def test_evaluate_usage_errors_exit_2(capsys, trained, extra, message):
    rc, _, err = run_main(capsys, ["--evaluate", str(trained / "final.npz"), *extra])
    assert rc == 2 and message in err


def test_evaluate_a_missing_file_exits_2(capsys, tmp_path):
    rc, _, err = run_main(capsys, ["--evaluate", str(tmp_path / "none.npz")])
    assert rc == 2 and "--evaluate: no file at" in err


def test_snapshot_history_keeps_the_last_k_and_points_at_the_latest(capsys, tmp_path, trained):
    names = sorted(os.listdir(trained))
    assert [n for n in names if n.startswith("snapshot")] == [
        "snapshot.npz",
        "snapshot_iter_30.npz",
        "snapshot_iter_40.npz",
    ]
    latest = load_snapshot(trained / "snapshot.npz")
    assert latest.iter == 40
    assert same_params(latest.params, load_snapshot(trained / "snapshot_iter_40.npz").params)
    snaps = [
        json.loads(ln)
        for ln in (trained / "metrics.jsonl").read_text().splitlines()
        if '"snapshot"' in ln
    ]
    assert [os.path.basename(r["path"]) for r in snaps] == [
        f"snapshot_iter_{i}.npz" for i in (10, 20, 30, 40)
    ]
    # a directory holding a history is a run: refused unless overwritten
    (tmp_path / "h").mkdir()
    os.link(trained / "snapshot_iter_30.npz", tmp_path / "h" / "snapshot_iter_30.npz")
    rc, _, err = run_main(capsys, [*SMALL, "--iters", "1", "--out", str(tmp_path / "h")])
    assert rc == 2 and "snapshot_iter_30.npz" in err
    rc, _, err = run_main(
        capsys, [*SMALL, "--iters", "1", "--out", str(tmp_path / "h"), "--overwrite"]
    )
    assert rc == 0, err
    assert not (tmp_path / "h" / "snapshot_iter_30.npz").exists()


def test_resume_from_a_history_file_continues_bitwise(capsys, tmp_path, trained):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    rc, out, err = run_main(capsys, ["--resume", str(run / "snapshot_iter_30.npz")])
    assert rc == 0, err
    assert "resumed    at iteration 30" in out
    assert same_params(run / "final.npz", trained / "final.npz")


@pytest.mark.slow
def test_train_snapshot_resume_fine_tune_evaluate(capsys, tmp_path):
    """Train with a snapshot history, stop, resume from the latest, fine-tune the result
    with --weights into a new directory, and evaluate that on one device."""
    common = [*SMALL, "--snapshot-every", "10", "--snapshot-keep", "2", "--update-mode", "root"]
    rc, _, err = run_main(capsys, [*common, "--iters", "40", "--out", str(tmp_path / "whole")])
    assert rc == 0, err
    rc, _, err = run_main(capsys, [*common, "--iters", "20", "--out", str(tmp_path / "a")])
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "a").glob("snapshot_iter_*")) == [
        "snapshot_iter_10.npz",
        "snapshot_iter_20.npz",
    ]
    rc, out, err = run_main(capsys, ["--resume", str(tmp_path / "a"), "--iters", "40"])
    assert rc == 0, err
    assert "resumed    at iteration 20" in out
    assert same_params(tmp_path / "a" / "final.npz", tmp_path / "whole" / "final.npz")
    assert sorted(p.name for p in (tmp_path / "a").glob("snapshot_iter_*")) == [
        "snapshot_iter_30.npz",
        "snapshot_iter_40.npz",
    ]
    tuned = tmp_path / "tuned"
    rc, out, err = run_main(
        capsys,
        ["--devices", "cpu:3", "--synthetic", "1024", "--iters", "10", "--lr", "0.01",
         "--weights", str(tmp_path / "a" / "final.npz"), "--out", str(tuned)],
    )  # fmt: skip
    assert rc == 0, err
    reached = float(out.split("reached ")[1].split("%")[0])
    rc, out, err = run_main(capsys, ["--evaluate", str(tuned / "final.npz")])
    assert rc == 0, err
    assert "on cpu:0:" in out and f"accuracy {reached:.2f}%" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-gpu", "0,1"], "Caffe's -gpu 0,1 is --devices gpu:0,1 here"),
        (["-gpu", "all", "--iters", "5"], "Caffe's -gpu all is --devices gpu:all here"),
        (["-gpu=2"], "Caffe's -gpu 2 is --devices gpu:2 here"),
        (["-weights", "x.caffemodel"], "Caffe's -weights is --weights here"),
        (["-snapshot", "x.solverstate"], "Caffe's -snapshot is --resume here"),
    ],
)
def test_caffe_spellings_are_answered_with_ours(capsys, argv, message):
    rc, out, err = run_main(capsys, argv)
    assert rc == 2 and out == ""
    assert err.startswith("nccltree-train: error: ") and message in err
    assert len(err.splitlines()) == 1


def test_negative_values_are_no_caffe_flags(capsys):
    rc, _, err = run_main(capsys, ["--lr", "-0.5"])
    assert rc == 2 and "lr must be >= 0" in err
