"""``nccltree-train`` under bad input, kills and signals: nothing lost, nothing silent.

A previous run in ``--out`` is kept unless replaced on purpose, final.npz and snapshots
survive ``kill -9`` at any moment, leftovers of killed runs are removed, labels and the
held-out set are checked before training, divergence stops the run, SIGTERM snapshots.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nccltree as nt
from nccltree.cli.train import TERMINATED, main
from nccltree.snapshot import load_snapshot

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--devices", "cpu:2", "--synthetic", "1024", "--eval-every", "0", "--quiet"]
DEAD_PID = 2**22 + 12345  # above Linux's pid_max default: never a running process


def train(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def strict_json(line: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def records(out_dir: Path) -> list[dict]:
    return [strict_json(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines()]


def train_iters(out_dir: Path) -> list[int]:
    return [r["iter"] for r in records(out_dir) if r["event"] == "train"]


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "nccltree.cli.train", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- an existing --out ---------------------------------------------------------------------


def test_a_previous_run_in_out_is_refused_unless_resumed_or_overwritten(capsys, tmp_path):
    run = tmp_path / "run"
    argv = [*SMALL, "--iters", "10", "--out", str(run), "--snapshot-every", "5"]
    assert train(capsys, argv)[0] == 0
    before = (run / "final.npz").read_bytes(), (run / "metrics.jsonl").read_text()
    rc, _, err = train(capsys, [*argv, "--seed", "1"])
    assert rc == 2, err  # nothing ran: the command is wrong
    assert "already holds a run (metrics.jsonl, final.npz, snapshot.npz)" in err
    assert f"--resume {run}" in err and "--overwrite" in err
    assert (run / "final.npz").read_bytes(), (run / "metrics.jsonl").read_text() == before
    rc, _, err = train(capsys, [*argv, "--overwrite", "--resume", str(run)])
    assert rc == 2 and "give one" in err
    # --overwrite starts afresh: one run's records, not two
    assert train(capsys, [*argv, "--seed", "1", "--overwrite"])[0] == 0
    assert [r["event"] for r in records(run)].count("config") == 1
    assert train_iters(run) == list(range(1, 11))
    # the cached built-in data alone is no run
    (run / "metrics.jsonl").unlink(), (run / "final.npz").unlink(), (run / "snapshot.npz").unlink()
    assert train(capsys, argv)[0] == 0


def test_out_that_cannot_be_a_directory_is_a_usage_error(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    rc, _, err = train(capsys, [*SMALL, "--out", str(tmp_path / "file")])
    assert rc == 2 and "exists and is not a directory" in err and "Errno" not in err
    rc, _, err = train(capsys, [*SMALL, "--out", str(tmp_path / "file" / "run")])
    assert rc == 2 and "is not a directory" in err and "Errno" not in err


# -- atomic outputs and leftovers -----------------------------------------------------------


def test_an_interrupted_final_write_keeps_the_previous_file(capsys, tmp_path, monkeypatch):
    run = tmp_path / "run"
    argv = [*SMALL, "--out", str(run), "--snapshot-every", "5"]
    assert train(capsys, [*argv, "--iters", "5"])[0] == 0
    good = (run / "final.npz").read_bytes()
    real_savez = np.savez

    def dies_half_way(file, *args, **kwargs):
        real_savez(file, *args, **kwargs)
        if "final.npz" in str(getattr(file, "name", file)):
            with open(file, "r+b") if isinstance(file, (str, os.PathLike)) else file as f:
                f.truncate(100)  # a write cut short, as kill -9 leaves it
            raise OSError("injected: killed while writing")

    monkeypatch.setattr(np, "savez", dies_half_way)
    assert train(capsys, [*argv, "--resume", str(run), "--iters", "6"])[0] == 1
    assert (run / "final.npz").read_bytes() == good
    assert not [p for p in os.listdir(run) if ".tmp" in p]


def test_leftovers_of_killed_runs_are_removed_at_the_next_start(capsys, tmp_path):
    run, data = tmp_path / "run", tmp_path / "run" / "data"
    data.mkdir(parents=True)
    stale = [
        run / f"snapshot.npz.tmp{DEAD_PID}.139872",
        run / f"final.npz.tmp{DEAD_PID}.1",
        data / f".tmp-{DEAD_PID}-k2j4",
        data / ".tmp-olds1x",  # written before temporaries carried their writer's pid
    ]
    for p in stale:
        if p.name.startswith(".tmp-"):
            p.mkdir()
            (p / "data.mdb").write_bytes(b"\0" * 4096)
        else:
            p.write_bytes(b"PK partial")
    alive = [run / f"snapshot.npz.tmp{os.getpid()}.7", data / f".tmp-{os.getpid()}-live"]
    alive[0].write_bytes(b"in progress")
    alive[1].mkdir()
    assert train(capsys, [*SMALL, "--iters", "3", "--out", str(run)])[0] == 0
    assert [p for p in stale if p.exists()] == []
    assert all(p.exists() for p in alive)  # a writer still running keeps its temporary


@pytest.mark.subprocess
@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing(tmp_path):
    # Many kills at random moments of runs into one directory: whatever is there afterwards
    # is whole (snapshot, final.npz, every metrics line), the next run cleans up after the
    # killed one, and resuming always works.
    rng = random.Random(13)
    run = tmp_path / "run"
    base = [*SMALL, "--out", str(run), "--snapshot-every", "7", "--hidden", "512"]
    deadline = time.monotonic() + 12
    kills = 0
    # at least 5 kills even on a loaded machine, where a run takes longer to start
    while (
        kills < 14
        and (time.monotonic() < deadline or kills < 5)
        and time.monotonic() < deadline + 30
    ):
        resume = (run / "snapshot.npz").exists()
        argv = [*base, "--resume", str(run)] if resume else [*base, "--overwrite"]
        # more iterations than a run can finish before its kill, whatever the machine
        iters = (load_snapshot(run / "snapshot.npz").iter if resume else 0) + 100_000
        proc = spawn([*argv, "--iters", str(iters)])
        time.sleep(rng.uniform(0.3, 1.2))
        proc.kill()
        _, err = proc.communicate(timeout=30)
        kills += proc.returncode == -signal.SIGKILL
        assert proc.returncode in (0, -signal.SIGKILL), err
        if (run / "snapshot.npz").exists():
            load_snapshot(run / "snapshot.npz")  # whole
        if (run / "final.npz").exists():
            with np.load(run / "final.npz") as z:
                assert all(np.isfinite(z[k]).all() for k in z.files)
        if (run / "metrics.jsonl").exists():
            lines = (run / "metrics.jsonl").read_text().split("\n")
            for ln in lines[:-1]:
                strict_json(ln)  # a line cut by the kill may only be the last
    assert kills >= 5
    # resumed up to where the snapshot is (an --iters below it is a usage error)
    done = load_snapshot(run / "snapshot.npz").iter if (run / "snapshot.npz").exists() else 1
    proc = spawn([*base, "--resume", str(run), "--iters", str(done)])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not [p for p in os.listdir(run) if ".tmp" in p]
    assert not [p for p in os.listdir(run / "data") if p.startswith(".tmp")]
    iters = train_iters(run)
    assert iters == list(range(1, len(iters) + 1))  # resumed runs repeat no iteration


# -- checks before training -----------------------------------------------------------------


@pytest.fixture
def dbs(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((200, 8), dtype=np.float32)
    y = rng.integers(0, 3, 200)
    paths = {}
    for name, patch in (("good", {}), ("negative", {57: -1}), ("large", {57: 1, 120: 5})):
        labels = y.copy()
        for i, v in patch.items():
            labels[i] = v
        paths[name] = str(tmp_path / name)
        nt.data.write_lmdb(paths[name], x, labels)
    paths["narrow"] = str(tmp_path / "narrow")
    nt.data.write_lmdb(paths["narrow"], x[:50, :6].copy(), y[:50])
    paths["val-large"] = str(tmp_path / "val-large")
    nt.data.write_lmdb(paths["val-large"], x[:50], np.full(50, 3))
    return paths


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "negative"], "--data: record 57 (key '00000057') has label -1, outside"),
        (
            ["--data", "large", "--classes", "3"],
            "--data: record 120 (key '00000120') has label 5, outside the 3 classes 0..2",
        ),
        (
            ["--data", "good", "--val-data", "narrow"],
            "holds records of shape (6,), but the training records have shape (8,)",
        ),
        (
            ["--data", "good", "--val-data", "val-large"],
            "--val-data: record 0 (key '00000000') and 49 more has label 3, outside",
        ),
    ],
)
def test_labels_and_the_held_out_set_are_checked_before_training(capsys, dbs, flags, message):
    flags = [dbs.get(f, f) for f in flags]
    rc, _, err = train(capsys, ["--devices", "cpu:2", "--batch-size", "8", "--iters", "5", *flags])
    assert rc == 2, err
    assert message in err
    assert "loss" not in err and "rank" not in err  # found before any training


@pytest.mark.parametrize("flag", ["--timeout", "--scale", "--target-accuracy", "--lr"])
def test_nan_is_refused_where_a_number_is_meant(capsys, flag):
    rc, _, err = train(capsys, [*SMALL, "--iters", "3", flag, "nan"])
    assert rc == 2
    assert f"{flag} must be a number, got NaN" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "a single .npy array"),
        (b"", "the file is empty"),
        (b"\x80\x04K\x01.", "not an .npz archive"),  # a pickle
    ],
)
def test_a_resume_file_that_is_no_snapshot_says_so(capsys, tmp_path, content, message):
    path = tmp_path / "thing.npz"
    if content is None:
        path = tmp_path / "thing.npy"
        np.save(path, np.arange(3))
    else:
        path.write_bytes(content)
    rc, _, err = train(capsys, [*SMALL, "--resume", str(path)])
    assert rc == 2
    assert f"{path} is not an nccltree snapshot (nccltree-snapshot-1): {message}" in err
    assert "pickle" not in err and "context manager" not in err


# -- divergence -----------------------------------------------------------------------------


def test_divergence_stops_the_run_and_keeps_the_last_good_snapshot(capsys, tmp_path):
    run = tmp_path / "run"
    argv = [*SMALL, "--iters", "100", "--out", str(run), "--snapshot-every", "2", "--lr", "20"]
    with np.errstate(all="ignore"):
        rc, out, err = train(capsys, argv)
    assert rc == 1, err  # the run failed; it wrote no wrong result
    assert "training diverged at iteration" in err and "a lower --lr may help" in err
    recs = records(run)  # strict JSON throughout, though the loss went to infinity
    diverged = [r for r in recs if r["event"] == "diverged"]
    assert len(diverged) == 1
    it = diverged[0]["iter"]
    assert f"training diverged at iteration {it}:" in err
    snap = load_snapshot(run / "snapshot.npz")
    assert snap.iter < it and f"the snapshot {run / 'snapshot.npz'} holds iteration" in err
    assert all(np.isfinite(v).all() for v in snap.params.values())
    assert np.isfinite(snap.history).all()
    assert not (run / "final.npz").exists() and "reached" not in out


# -- signals --------------------------------------------------------------------------------


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, TERMINATED), (signal.SIGINT, 130)])
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_signal_snapshots_the_iteration_reached(tmp_path, sig, status):
    run = tmp_path / "run"
    proc = spawn([*SMALL, "--iters", "100000000", "--out", str(run), "--snapshot-every", "1000"])
    try:
        deadline = time.monotonic() + 30
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(random.uniform(0.2, 0.6))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, err
    snap = load_snapshot(run / "snapshot.npz")
    assert snap.iter > 0  # the iteration reached, not the last periodic snapshot
    name = "SIGTERM" if sig == signal.SIGTERM else "SIGINT"
    assert (
        f"interrupted ({name}) at iteration {snap.iter}; the snapshot {run / 'snapshot.npz'} "
        f"holds iteration {snap.iter}"
    ) in err
    assert train_iters(run) == list(range(1, snap.iter + 1))
    if sig != signal.SIGTERM:
        return
    # resumed, it ends bitwise where an uninterrupted run ends, and repeats no iteration
    end = snap.iter + 3
    for argv in (["--resume", str(run)], [*SMALL, "--out", str(tmp_path / "ref")]):
        proc = spawn([*argv, "--iters", str(end)])
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    assert train_iters(run) == list(range(1, end + 1))
    with np.load(run / "final.npz") as a, np.load(tmp_path / "ref" / "final.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in a.files)


def test_a_corrupt_held_out_record_is_a_runtime_error_naming_it(capsys, dbs, tmp_path):
    # the data cannot be read: status 1 with the record named, not a usage error (2)
    import lmdb

    bad = str(tmp_path / "bad-val")
    nt.data.write_lmdb(bad, np.zeros((20, 8), np.float32), np.zeros(20, np.int64))
    with lmdb.open(bad, subdir=True) as env, env.begin(write=True) as txn:
        txn.put(b"00000013", b"not a record")
    argv = ["--devices", "cpu:2", "--batch-size", "8", "--iters", "5"]
    rc, _, err = train(capsys, [*argv, "--data", dbs["good"], "--val-data", bad])
    assert rc == 1, err
    assert "--val-data: record" in err and "00000013" in err
    assert "usage:" not in err and "Traceback" not in err


def test_force_color_and_force_gray(capsys, dbs):
    # one or the other: both at once is a usage error; either is kept in the run's config
    argv = ["--devices", "cpu:2", "--batch-size", "8", "--iters", "2", "--data", dbs["good"]]
    rc, _, err = train(capsys, [*argv, "--force-color", "--force-gray"])
    assert rc == 2 and "not allowed with argument" in err
    from nccltree.cli.train import TrainConfig, build_parser, resolve_config

    cfg, _ = resolve_config(build_parser().parse_args([*argv, "--force-gray"]))
    assert cfg.decode == "gray"
    assert TrainConfig.checked(cfg.as_dict()).decode == "gray"  # survives a snapshot's config
    assert train(capsys, [*argv, "--force-color"])[0] == 0  # no encoded images: no effect
