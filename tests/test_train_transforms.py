"""``nccltree-train --mean/--crop/--mirror``: Caffe's transform_param on the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import nccltree as nt
from nccltree.cli.train import main


@pytest.fixture
def images(tmp_path):
    """Training and held-out (3, 10, 10) uint8 databases of 3 classes."""
    rng = np.random.default_rng(0)
    for name, n in (("train", 192), ("val", 48)):
        y = rng.integers(0, 3, n)
        x = rng.integers(0, 120, (n, 3, 10, 10)) + 60 * y.reshape(-1, 1, 1, 1)
        nt.data.write_lmdb(tmp_path / name, x.astype(np.uint8), y)
    return tmp_path


def argv(root, *more):
    return [
        "--devices", "cpu:2", "--data", str(root / "train"), "--val-data", str(root / "val"),
        "--model", "cnn", "--batch-size", "8", "--eval-every", "0", "--seed", "5",
        "--scale", "0.01", *more,
    ]  # fmt: skip


def run(capsys, args):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_crop_mirror_mean_end_to_end_resume_and_evaluate(capsys, images):
    flags = ["--crop", "8", "--mirror", "--mean", "100,110,120", "--snapshot-every", "10"]
    rc, out, err = run(capsys, argv(images, *flags, "--iters", "20", "--out", str(images / "a")))
    assert rc == 0, err
    assert "records of shape (3, 8, 8) (cropped from (3, 10, 10)) uint8" in out
    config = json.loads((images / "a" / "metrics.jsonl").read_text().splitlines()[0])
    assert config["mean"] == [100.0, 110.0, 120.0] and config["crop"] == 8
    assert config["mirror"] is True
    final = np.load(images / "a" / "final.npz")
    acc = float([ln for ln in out.splitlines() if ln.startswith("reached")][0].split()[1][:-1])

    # --resume takes the transforms from the snapshot: the same parameters, bitwise
    rc, _, err = run(capsys, argv(images, *flags, "--iters", "10", "--out", str(images / "b")))
    assert rc == 0, err
    rc, _, err = run(capsys, ["--resume", str(images / "b"), "--iters", "20"])
    assert rc == 0, err
    resumed = np.load(images / "b" / "final.npz")
    for name in final.files:
        assert np.array_equal(final[name], resumed[name]), name

    # --evaluate reads the held-out set as training did: the center crop, the same mean
    rc, out, err = run(
        capsys, ["--evaluate", str(images / "a" / "final.npz"), "--data", str(images / "val")]
    )
    assert rc == 0, err
    assert f"accuracy {acc:.2f}%" in out


def test_mean_file_and_mirror_change_training(capsys, images, tmp_path):
    np.save(tmp_path / "mean.npy", np.full((3, 10, 10), 90.0, np.float32))
    finals = []
    for i, more in enumerate(
        (["--mean", str(tmp_path / "mean.npy")], ["--mean", "90"], ["--mean", "90", "--mirror"])
    ):
        out_dir = tmp_path / f"r{i}"
        rc, _, err = run(capsys, argv(images, *more, "--iters", "6", "--out", str(out_dir)))
        assert rc == 0, err
        finals.append(np.load(out_dir / "final.npz"))
    names = finals[0].files
    # a full-shape mean of 90 everywhere is a scalar mean of 90; a flip changes the run
    assert all(np.array_equal(finals[0][k], finals[1][k]) for k in names)
    assert not all(np.array_equal(finals[1][k], finals[2][k]) for k in names)


@pytest.mark.parametrize(
    "more, message",
    [
        (["--crop", "11"], "--crop: crop=11 is larger than the records' height x width 10 x 10"),
        (["--crop", "0"], "--crop must be"),
        (["--mean", "1,2"], "--mean: mean must be a scalar, 3 values (one per channel)"),
        (["--mean", "nonsense"], "--mean: 'nonsense' is neither comma-separated numbers"),
    ],
)
def test_bad_transform_flags_exit_2(capsys, images, more, message):
    rc, _, err = run(capsys, argv(images, *more, "--iters", "1"))
    assert rc == 2 and message in err, err


def test_crop_on_flat_records_exits_2(capsys, tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not an array")
    rc, _, err = run(capsys, ["--devices", "cpu:1", "--crop", "4", "--iters", "1"])
    assert rc == 2 and "--crop: crop needs records of shape (C, H, W)" in err, err
    rc, _, err = run(capsys, ["--devices", "cpu:1", "--mean", str(tmp_path / "bad.npz")])
    assert rc == 2 and "--mean: cannot read a mean array" in err, err
