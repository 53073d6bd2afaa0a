"""A Caffe user's own files end to end: a folder of images and a list file made into a
database (``convert-imageset``), its mean (``mean``, a mean.binaryproto) and a Caffe solver
file, trained with ``nccltree-train --solver solver.prototxt --data DB --mean
mean.binaryproto`` on cpu:2 and under ``mpiexec -n 2``: the two runs bitwise alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("google.protobuf")

from PIL import Image

from nccltree.cli import data as data_cli
from nccltree.cli import train
from tests.mpirun import ROOT, needs_mpi, run_mpi

CLI = ROOT / "tests" / "mpi" / "cli_main.py"

# A solver file as Caffe's examples write them (net, solver_mode: GPU), with
# gradient accumulation and a step policy
SOLVER = """\
net: "examples/mine/train_val.prototxt"
test_iter: 10
test_interval: 3
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "step"
gamma: 0.5
stepsize: 3
display: 2
max_iter: 6
iter_size: 2
random_seed: 5
solver_mode: GPU
"""


@pytest.fixture(scope="module")
def caffe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Images in class folders, a list file, the converted database, its mean file and
    a solver file."""
    base = tmp_path_factory.mktemp("caffe_user")
    root = base / "images"
    rng = np.random.default_rng(7)
    lines = []
    for label in range(3):
        (root / f"class{label}").mkdir(parents=True)
        for i in range(6):
            h, w = (int(v) for v in rng.integers(6, 12, 2))
            img = rng.integers(0, 90, (h, w, 3), dtype=np.uint8)
            img[:, :, label] += 120  # a class is the colour that dominates
            name = f"class{label}/img{i}.png"
            Image.fromarray(img).save(root / name)
            lines.append(f"{name} {label}")
    listfile = base / "train.txt"
    listfile.write_text("\n".join(lines) + "\n")
    db, mean = base / "train_lmdb", base / "mean.binaryproto"
    argv = ["convert-imageset", f"{root}/", str(listfile), str(db), "--resize-height", "8",
            "--resize-width", "8", "--shuffle", "--quiet"]  # fmt: skip
    assert data_cli.main(argv) == 0
    assert data_cli.main(["mean", str(db), str(mean), "--quiet"]) == 0
    solver = base / "solver.prototxt"
    solver.write_text(SOLVER)
    return {"db": db, "mean": mean, "solver": solver}


def _argv(files: dict[str, Path], devices: str, out: Path) -> list[str]:
    return ["-solver", str(files["solver"]), "--data", str(files["db"]), "--mean",
            str(files["mean"]), "--scale", "0.00390625", "--model", "cnn", "--batch-size", "2",
            "--devices", devices, "--out", str(out), "--quiet"]  # fmt: skip


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_caffe_users_files_train_on_cpu2(caffe_files, tmp_path):
    out = tmp_path / "run"
    assert train.main(_argv(caffe_files, "cpu:2", out)) == 0
    records = _records(out)
    config = next(r for r in records if r["event"] == "config")
    assert config["iters"] == 6 and config["iter_size"] == 2 and config["seed"] == 5
    assert config["sources"]["lr"] == "solver file (base_lr)"
    assert config["sources"]["mean"] == "flag" and config["solver_file"] == str(
        caffe_files["solver"]
    )
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert len(losses) == 6 and all(np.isfinite(losses))
    lrs = [r["lr"] for r in records if r["event"] == "train"]
    assert lrs == [0.01] * 3 + [0.005] * 3
    assert (out / "final.npz").exists()


@pytest.mark.mpi
@needs_mpi
def test_the_same_files_under_mpiexec_train_bitwise_alike(caffe_files, tmp_path):
    single = tmp_path / "single"
    assert train.main(_argv(caffe_files, "cpu:2", single)) == 0
    out = tmp_path / "mpi"
    r = run_mpi(2, CLI, "train", *_argv(caffe_files, "cpu", out), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = np.load(single / "final.npz"), np.load(out / "final.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert np.array_equal(a[k], b[k]), k
    losses = [[r["loss"] for r in _records(o) if r["event"] == "train"] for o in (single, out)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
