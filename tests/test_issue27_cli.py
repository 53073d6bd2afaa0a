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
from tests.mpirun import ROOT, needs_mpi, run_mpi

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
