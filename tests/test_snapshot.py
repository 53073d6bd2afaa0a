"""Snapshots (nccltree.snapshot): the file format, the atomic write that survives kill -9,
and the checks made when one is read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from nccltree import parallel
from nccltree.snapshot import (
    SNAPSHOT_FORMAT,
    Snapshot,
    history,
    history_name,
    load_snapshot,
    load_weights,
    point_latest,
    prune_history,
    save_arrays,
    save_snapshot,
)

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, **override: object) -> None:
    """A valid snapshot file with entries replaced (None: left out)."""
    arrays: dict[str, object] = {
        "param/w": np.arange(4, dtype=np.float32),
        "solver/iter": np.int64(3),
        "solver/history": np.zeros(4, np.float32),
        "data/position": np.int64(48),
        "meta/format": np.str_(SNAPSHOT_FORMAT),
        "meta/config": np.str_("{}"),
    }
    arrays.update(override)
    with open(path, "wb") as f:
        np.savez(f, **{k: v for k, v in arrays.items() if v is not None})


def test_round_trip_and_the_file_format(tmp_path):
    path = tmp_path / "s.npz"
    params = {"fc0.weight": np.ones((2, 3), np.float32), "fc0.bias": np.zeros(2, np.float32)}
    history = np.linspace(0, 1, 8, dtype=np.float32)
    save_snapshot(path, params, {"iter": 7, "history": history}, 112, {"lr": 0.1, "b": [1]})
    with np.load(path) as z:  # the format, entry by entry
        assert sorted(z.files) == [
            "data/position",
            "meta/config",
            "meta/format",
            "param/fc0.bias",
            "param/fc0.weight",
            "solver/history",
            "solver/iter",
        ]
        assert str(z["meta/format"]) == "nccltree-snapshot-1"
        assert json.loads(str(z["meta/config"])) == {"b": [1], "lr": 0.1}
        assert z["solver/iter"].dtype == np.int64 and int(z["data/position"]) == 112
    snap = load_snapshot(str(path))
    assert snap.iter == 7 and snap.position == 112 and snap.config == {"lr": 0.1, "b": [1]}
    assert snap.params.keys() == params.keys()
    for name, value in params.items():
        assert np.array_equal(snap.params[name], value)
    assert np.array_equal(snap.history, history)
    assert snap.solver_state()["iter"] == 7
    assert snap.solver_state()["history"] is snap.history
    save_snapshot(path, params, {"iter": 0, "history": history}, None)
    assert load_snapshot(path).position is None and load_snapshot(path).config == {}


def test_the_driver_module_keeps_the_old_names():
    assert parallel.save_snapshot is save_snapshot
    assert parallel.load_snapshot is load_snapshot
    assert parallel.Snapshot is Snapshot and parallel.SNAPSHOT_FORMAT == SNAPSHOT_FORMAT


def test_an_interrupted_write_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    path = str(tmp_path / "s.npz")
    params = {"w": np.arange(4, dtype=np.float32)}
    save_snapshot(path, params, {"iter": 3, "history": np.zeros(4, np.float32)}, 48)

    def broken_savez(f, **arrays):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        save_snapshot(path, params, {"iter": 9, "history": np.ones(4, np.float32)}, 99)
    monkeypatch.undo()
    snap = load_snapshot(path)  # the previous snapshot is intact
    assert snap.iter == 3 and snap.position == 48
    assert os.listdir(tmp_path) == ["s.npz"]  # no temporary left behind


_WRITER = """
import sys
import numpy as np
from nccltree.snapshot import save_snapshot
path = sys.argv[1]
w = np.zeros(1 << 20, np.float32)
i = 0
while True:
    w[:] = i  # every parameter equals the iteration: a torn file would show it
    save_snapshot(path, {"w": w}, {"iter": i, "history": w}, 16 * i)
    print(i, flush=True)
    i += 1
"""


@pytest.mark.subprocess
def test_a_snapshot_survives_kill_9_of_its_writer(tmp_path):
    path = tmp_path / "s.npz"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for _ in range(3):  # a few complete snapshots, then kill it in the middle of one
            assert proc.stdout.readline(), "the writer died"
        time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    snap = load_snapshot(path)
    assert snap.iter >= 2 and snap.position == 16 * snap.iter
    assert np.all(snap.params["w"] == snap.iter) and np.all(snap.history == snap.iter)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"meta/format": np.str_("something-else")}, "is not an nccltree snapshot"),
        ({"meta/format": None}, "is not an nccltree snapshot"),
        ({"solver/iter": None}, "has no solver/iter"),
        ({"solver/history": None}, "has no solver/history"),
        ({"data/position": None}, "has no data/position"),
        ({"meta/config": None}, "has no meta/config"),
        ({"solver/iter": np.int64(-1)}, r"solver/iter must be an integer >= 0"),
        ({"solver/iter": np.float64(3)}, r"solver/iter must be an integer >= 0"),
        ({"solver/iter": np.arange(2)}, r"solver/iter must be an integer >= 0"),
        ({"data/position": np.int64(-2)}, r"data/position must be an integer >= -1"),
        ({"meta/config": np.str_("[1, 2]")}, "meta/config must be a JSON object"),
        ({"meta/config": np.str_("{not json")}, "meta/config must be a JSON object"),
    ],
)
def test_a_damaged_snapshot_is_refused_by_name(tmp_path, override, match):
    path = tmp_path / "s.npz"
    write(path, **override)
    with pytest.raises(ValueError, match=match) as ei:
        load_snapshot(path)
    assert str(path) in str(ei.value)


def test_a_file_that_is_no_snapshot_is_refused(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a snapshot")
    with pytest.raises(ValueError, match="is not an nccltree snapshot"):
        load_snapshot(str(tmp_path / "bad.npz"))
    with pytest.raises(ValueError, match="cannot read snapshot"):
        load_snapshot(tmp_path / "missing.npz")
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    with pytest.raises(ValueError, match="is not an nccltree snapshot"):
        load_snapshot(tmp_path / "empty.npz")
    write(tmp_path / "ok.npz")
    assert load_snapshot(tmp_path / "ok.npz").iter == 3


def test_load_weights_reads_a_final_npz_or_a_snapshot(tmp_path):
    w = {"fc0.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "fc0.bias": np.ones(2)}
    save_arrays(tmp_path / "final.npz", w)
    got = load_weights(tmp_path / "final.npz")
    assert list(got) == list(w) and all(np.array_equal(got[k], w[k]) for k in w)
    save_snapshot(tmp_path / "s.npz", w, {"iter": 3, "history": np.zeros(8)}, 5)
    got = load_weights(tmp_path / "s.npz")
    assert list(got) == list(w)  # the parameters only, by their names
    np.save(tmp_path / "one.npy", np.zeros(3))
    save_arrays(tmp_path / "empty.npz", {})
    for name, message in [
        ("one.npy", "is not an .npz of named arrays"),
        ("empty.npz", "holds no named arrays"),
        ("none.npz", "no weights file at"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_weights(tmp_path / name)


@pytest.mark.parametrize("links", [True, False])
def test_the_latest_pointer_and_the_history(tmp_path, monkeypatch, links):
    if not links:  # a file system without hard links: a copy, still atomic

        def no_link(*args: object) -> None:
            raise OSError("no hard links here")

        monkeypatch.setattr(os, "link", no_link)
    latest = tmp_path / "snapshot.npz"
    for it in (10, 20, 30):
        path = tmp_path / history_name(it)
        save_snapshot(path, {"w": np.full(2, it)}, {"iter": it, "history": np.zeros(2)}, it)
        point_latest(path, latest)
        assert load_snapshot(latest).iter == it
    assert [it for it, _ in history(tmp_path)] == [10, 20, 30]
    assert prune_history(tmp_path, 2) == [str(tmp_path / "snapshot_iter_10.npz")]
    assert [os.path.basename(p) for _, p in history(tmp_path)] == [
        "snapshot_iter_20.npz",
        "snapshot_iter_30.npz",
    ]
    assert prune_history(tmp_path, 0) and history(tmp_path) == []
    assert load_snapshot(latest).iter == 30  # the pointer outlives the history's files
    assert sorted(os.listdir(tmp_path)) == ["snapshot.npz"]  # no temporary left
