"""The one argument-checking rule (``nccltree._validate``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nccltree._validate import (
    check_call_timeout,
    check_choice,
    check_index,
    check_int,
    check_real,
    check_timeout,
    is_int,
)


@pytest.mark.parametrize("v", [0, 3, np.int64(3), np.uint8(3), np.int32(-1)])
def test_integers_python_and_numpy(v):
    assert is_int(v)
    assert check_int(v, "n") == int(v) and type(check_int(v, "n")) is int


@pytest.mark.parametrize("v", [True, np.bool_(True), 1.0, np.float32(1), "1", None])
def test_not_integers(v):
    assert not is_int(v)
    with pytest.raises(TypeError, match=r"n must be an integer, got"):
        check_int(v, "n")


def test_int_ranges():
    assert check_int(5, "n", min=1, max=5) == 5
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        check_int(0, "n", min=1)
    with pytest.raises(ValueError, match=r"n must be in \[1, 4\], got 5"):
        check_int(np.int64(5), "n", min=1, max=4)
    with pytest.raises(ValueError, match=r"n must be <= 4"):
        check_int(5, "n", max=4)


def test_index():
    assert check_index(np.int64(1), "rank", 2) == 1
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        check_index(2, "rank", 2)
    with pytest.raises(TypeError, match="rank must be an integer"):
        check_index(True, "rank", 2)


@pytest.mark.parametrize("v", [0, 1.5, np.float32(2.5), np.int64(3)])
def test_reals(v):
    assert check_real(v, "x") == float(v)


@pytest.mark.parametrize("v", [True, "1.0", None, 1j])
def test_not_reals(v):
    with pytest.raises(TypeError, match="x must be a real number"):
        check_real(v, "x")


def test_nan_and_infinities():
    with pytest.raises(ValueError, match="x must be a number, got NaN"):
        check_real(math.nan, "x")
    with pytest.raises(ValueError, match="x must be a number, got NaN"):
        check_real(np.float64("nan"), "x", finite=False)
    with pytest.raises(ValueError, match="x must be finite, got inf"):
        check_real(math.inf, "x")
    assert check_real(math.inf, "x", finite=False) == math.inf


def test_real_ranges():
    with pytest.raises(ValueError, match=r"lr must be > 0, got 0"):
        check_real(0.0, "lr", min=0.0, min_open=True)
    with pytest.raises(ValueError, match=r"m must be in \[0, 1\], got 1.5"):
        check_real(1.5, "m", min=0.0, max=1.0)
    assert check_real(0.0, "m", min=0.0, max=1.0) == 0.0


def test_timeouts():
    assert check_timeout(None) is None
    assert check_timeout(np.float32(0.5)) == 0.5
    for bad, err in ((math.nan, ValueError), (-1, ValueError), (math.inf, ValueError),
                     (True, TypeError)):  # fmt: skip
        with pytest.raises(err, match="timeout"):
            check_timeout(bad)


def test_call_timeouts():
    """A communicator's timeout: every call gets a finite, positive one (None refused)."""
    assert check_call_timeout(60) == 60.0 and check_call_timeout(np.float64(0.25)) == 0.25
    for bad, err, what in (
        (0, ValueError, "timeout must be > 0, got 0"),
        (-1.0, ValueError, "must be > 0"),
        (math.nan, ValueError, "must be a number, got NaN"),
        (math.inf, ValueError, "must be finite"),
        (None, TypeError, "must be a real number"),
        (True, TypeError, "must be a real number"),
    ):
        with pytest.raises(err, match=what):
            check_call_timeout(bad)
    with pytest.raises(ValueError, match="^--timeout must be > 0"):
        check_call_timeout(0, "--timeout")


def test_choices():
    assert check_choice("sum", "reduction op", ("sum", "max")) == "sum"
    for bad in ("avg", None, 3, ["sum"]):
        with pytest.raises(ValueError, match=r"^unknown reduction op .*; accepted: sum, max$"):
            check_choice(bad, "reduction op", ("sum", "max"))
    # any iterable of names, a dict's keys included
    assert check_choice("b", "name", {"a": 1, "b": 2}) == "b"


def test_op_and_timeout_checks_go_through_the_validator():
    """The collective ops, the World's algorithm and timeout, and the command lines'
    timeouts are checked by the one rule (same messages everywhere)."""
    import nccltree as nt
    from nccltree.comm import _ops
    from nccltree.comm.algorithms import build_plan

    msg = "unknown reduction op 'avg'; accepted: sum, mean, max, min, prod"
    with pytest.raises(ValueError, match=msg):
        _ops.check_op("avg", np.dtype(np.float32))
    with pytest.raises(ValueError, match=msg):
        _ops.reference("avg", [np.zeros(1)])
    with pytest.raises(ValueError, match=msg):
        build_plan("tree", "all_reduce", size=2, count=1, op="avg")
    with pytest.raises(ValueError, match="^unknown algorithm 'fast'; accepted: tree, "):
        nt.World("cpu:2", algorithm="fast")
    with pytest.raises(ValueError, match="^timeout must be > 0, got 0"):
        nt.World("cpu:2", timeout=0)
    from nccltree.comm.watchdog import Watchdog

    wd = Watchdog(lambda exc: None, poll_interval=0.001)
    try:
        for bad in (-1, math.nan):
            with pytest.raises(ValueError, match="^timeout must be"):
                wd.watch("work", [], timeout=bad)
    finally:
        wd.close()


def test_a_process_groups_algorithm_and_timeout_go_through_the_validator():
    """Checked before MPI is touched: the same messages as a World's."""
    from nccltree.comm.group.group import GROUP_ALGORITHMS, ProcessGroup

    accepted = ", ".join(GROUP_ALGORITHMS)
    with pytest.raises(ValueError, match=f"^unknown algorithm 'fast'; accepted: {accepted}$"):
        ProcessGroup(algorithm="fast")
    with pytest.raises(ValueError, match="^timeout must be > 0, got 0"):
        ProcessGroup(timeout=0)
    with pytest.raises(TypeError, match="^timeout must be a real number"):
        ProcessGroup(timeout="1")  # type: ignore[arg-type]
