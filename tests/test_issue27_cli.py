"""The command lines' usage errors and small silences: every one a usage error (exit 2,
one line, no traceback) found before the work, or a clear failure instead of a quiet
success."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nccltree.cli import bench, data, train
from tests.mpirun import ROOT

CLI = ROOT / "tests" / "mpi" / "cli_main.py"


def _run(main, argv, capsys):  # type: ignore[no-untyped-def]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_usage_line(err: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "AssertionError" not in err


# -- simulate: floats that are not numbers, sizes beyond reason ------------------------------


@pytest.mark.parametrize("flag", ["--issue-us", "--net-gbps", "--stepfactor"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_simulate_refuses_nan_and_inf(flag: str, value: str, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["simulate", "--topo", "dgx1", "-b", "1M", "-e", "1M", f"{flag}={value}"]
    code, out, err = _run(bench.main, argv, capsys)
    assert code == 2, out + err
    _one_usage_line(err)
    assert flag in err and "# all_reduce" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--topo", "flat:100000"],
        ["simulate", "--topo", "flat:8", "--nodes", "100000"],
        ["topo", "--preset", "flat:100000"],
    ],
)
def test_topology_size_is_bounded(argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    code, out, err = _run(bench.main, argv, capsys)
    assert code == 2, out + err
    _one_usage_line(err)
    assert "at most" in err
    assert time.monotonic() - start < 10  # refused before anything is built


def test_simulate_and_topo_accept_the_largest_allowed(capsys) -> None:  # type: ignore[no-untyped-def]
    from nccltree.cli._simulate import MAX_DEVICES

    code, out, err = _run(bench.main, ["topo", "--preset", "flat:16"], capsys)
    assert code == 0, err
    assert MAX_DEVICES >= 64


# -- collectives: --trace checked up front, mpi cannot reduce float16 ------------------------


def test_trace_to_an_unwritable_path_is_refused_before_the_sweep(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "missing" / "t.json"
    argv = ["collectives", "--devices", "cpu:2", "-b", "8", "-e", "8", "-n", "1", "-w", "0"]
    code, out, err = _run(bench.main, [*argv, "--trace", str(trace)], capsys)
    assert code == 2, out + err
    assert "--trace" in err and "does not exist" in err
    assert "all_reduce" not in out  # nothing ran


# -- small silences (item 19) ------------------------------------------------------------------


def test_bench_usage_line_lists_calibrate(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert "calibrate" in usage, usage


@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_nccltree_shm_takes_only_0_or_1(value: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from nccltree.comm.group.shm import shm_usable

    monkeypatch.setenv("NCCLTREE_SHM", value)
    with pytest.raises(ValueError, match=r"NCCLTREE_SHM.*0.*1"):
        shm_usable(None)
    assert shm_usable(False) is False  # an explicit argument wins
    monkeypatch.setenv("NCCLTREE_SHM", "0")
    assert shm_usable(None) is False
    monkeypatch.setenv("NCCLTREE_SHM", " 1 ")
    assert shm_usable(None) is True


def test_verify_of_an_empty_database_is_no_success(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import lmdb

    lmdb.open(str(tmp_path / "empty"), subdir=True).close()
    code, out, err = _run(data.main, ["info", "--verify", str(tmp_path / "empty")], capsys)
    assert code == 1, out + err
    assert "all good" not in out and "empty" in err
    code, out, err = _run(
        data.main, ["info", "--verify", "--json", str(tmp_path / "empty")], capsys
    )
    assert code == 1 and '"records": 0' in out and "empty" in err


def test_verify_refuses_negative_labels(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from nccltree.data import write_lmdb

    write_lmdb(tmp_path / "db", np.zeros((4, 3), np.float32), np.array([0, 1, -1, 2]))
    code, out, err = _run(data.main, ["info", "--verify", str(tmp_path / "db")], capsys)
    assert code == 3, out + err
    assert "bad record '00000002'" in out and "negative" in out
    assert "1 bad" in out


def test_an_rgb_image_in_a_gray_database_suggests_force_gray(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("PIL")
    pytest.importorskip("google.protobuf")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_data_robust import _encode, _encoded_db

    rng = np.random.default_rng(0)
    files = [_encode(rng.integers(0, 256, (5, 7), dtype=np.uint8), "PNG") for _ in range(4)]
    files[2] = _encode(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8), "PNG")
    _encoded_db(tmp_path / "db", files)
    code, out, err = _run(data.main, ["info", "--verify", str(tmp_path / "db")], capsys)
    assert code == 3 and "--force-gray" in out, out
    argv = ["--devices", "cpu:1", "--data", str(tmp_path / "db"), "--iters", "2"]
    code, out, err = _run(train.main, [*argv, "--batch-size", "2", "--quiet"], capsys)
    assert code == 1 and "--force-gray" in err, err
    # forced, every image reads as 1 channel: it trains
    code, out, err = _run(
        train.main, [*argv, "--batch-size", "2", "--quiet", "--force-gray"], capsys
    )
    assert code == 0, err


def test_out_empty_is_a_usage_error(tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    argv = ["--devices", "cpu:1", "--synthetic", "64", "--iters", "1", "--quiet", "--out", ""]
    code, out, err = _run(train.main, argv, capsys)
    assert code == 2, out + err
    assert "--out" in err
    assert os.listdir(tmp_path) == []  # nothing written into the current directory


def test_resume_with_iters_below_the_snapshot_is_an_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    argv = ["--devices", "cpu:1", "--synthetic", "64", "--batch-size", "4", "--quiet"]
    code, _, err = _run(
        train.main, [*argv, "--iters", "6", "--snapshot-every", "3", "--out", str(out)], capsys
    )
    assert code == 0, err
    code, stdout, err = _run(train.main, ["--resume", str(out), "--iters", "4", "--quiet"], capsys)
    assert code == 2, stdout + err
    assert "--iters 4" in err and "6" in err


@pytest.mark.subprocess
def test_import_nccltree_without_ml_dtypes() -> None:
    code = (
        "import sys; sys.modules['ml_dtypes'] = None\n"
        "import numpy as np, nccltree as nt\n"
        "with nt.World(nt.devices('cpu:2')) as w:\n"
        "    xs = [np.ones(4, np.float32), np.ones(4, np.float32)]\n"
        "    w.all_reduce(xs)\n"
        "    assert xs[0].tolist() == [2.0] * 4\n"
        "    try:\n"
        "        w.all_reduce([np.zeros(4, np.uint16)] * 2, dtype='bfloat16')\n"
        "    except ImportError as exc:\n"
        "        assert 'ml_dtypes' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('bfloat16 ran without ml_dtypes')\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT)
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# -- ./dev run: the README's mpiexec lines after ./dev train -----------------------------------


def _stand_in_venv(tmp_path: Path) -> Path:
    """A virtual environment ./dev takes as installed (its stamp matches the checkout's
    build inputs), whose bin holds a python and a stand-in nccltree-train."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    tool = venv / "bin" / "nccltree-train"
    tool.write_text('#!/bin/sh\necho "stand-in nccltree-train $*"\n')
    tool.chmod(0o755)
    stamp = subprocess.run(
        ["bash", "-c", "cat pyproject.toml CMakeLists.txt csrc/* 2>/dev/null | cksum"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        check=True,
    ).stdout.split()[0]
    (venv / ".nccltree-stamp").write_text(stamp + "\n")
    return venv


@pytest.mark.subprocess
def test_dev_run_puts_the_venv_first_on_path_in_the_callers_directory(tmp_path: Path) -> None:
    venv = _stand_in_venv(tmp_path)
    env = dict(os.environ, NCCLTREE_VENV=str(venv))
    here = tmp_path / "work"
    here.mkdir()
    r = subprocess.run(
        [
            str(ROOT / "dev"),
            "run",
            "sh",
            "-c",
            'nccltree-train --iters 3; pwd; echo "$VIRTUAL_ENV"',
        ],
        capture_output=True,
        text=True,
        cwd=str(here),
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["stand-in nccltree-train --iters 3", str(here), str(venv)]
    r = subprocess.run(
        [str(ROOT / "dev"), "run"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 2 and "usage: ./dev run" in r.stderr
