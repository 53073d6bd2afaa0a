"""Seeing what happens: the World's flight recorder (printed when a rank hangs on purpose),
and ``NCCLTREE_DEBUG`` (what auto chose and why, the plans, every call)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm import debug


def test_a_rank_that_hangs_on_purpose_prints_the_flight_recorder(
    capfd: pytest.CaptureFixture[str],
) -> None:
    w = nt.World(nt.devices("cpu:3"), algorithm="ring", timeout=0.5)
    xs = [np.ones(100, np.float32) for _ in range(3)]
    w.all_reduce(xs)  # #1
    w.broadcast(xs, root=2)  # #2

    def body(comm: nt.Comm) -> None:
        comm.all_gather(np.ones(5, np.float32), np.zeros(15, np.float32))  # #3, every rank
        if comm.rank == 1:
            time.sleep(3)  # rank 1 hangs in its own code: never calls #4
            return
        comm.all_reduce(np.ones(7, np.float32))

    with pytest.raises(nt.NcclTreeError):
        w.run(body)
    err = capfd.readouterr().err
    lines = err.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("nccltree: "))
    assert "rank" in lines[head] and "1" in lines[head], err
    assert lines[head + 1].startswith("flight recorder of the World of 3 ranks (cpu:0,cpu:1,")
    recorded = lines[head + 2 : head + 5]
    assert [r.split()[:2] for r in recorded] == [
        ["#1", "all_reduce"], ["#2", "broadcast"], ["#3", "all_gather"]
    ], err  # fmt: skip
    assert all("done" in r for r in recorded), err
    assert "count=100" in recorded[0] and "ring" in recorded[0]
    # an abort the caller asks for prints nothing
    w2 = nt.World(nt.devices("cpu:2"))
    w2.abort("on purpose")
    assert "flight recorder" not in capfd.readouterr().err
    w.close()
    w2.close()


def _run(code: str, value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NCCLTREE_DEBUG": value}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


CODE = """
import numpy as np, nccltree as nt
w = nt.World(nt.devices("cpu:3"), algorithm="auto")
xs = [np.ones(1000, np.float32) for _ in range(3)]
w.all_reduce(xs); w.all_reduce(xs)
w.all_gather([np.ones(10, np.float32)] * 3, [np.zeros(30, np.float32) for _ in range(3)])
w.close()
"""


@pytest.mark.subprocess
def test_debug_info_says_what_auto_chose_and_why_and_each_plan_once() -> None:
    r = _run(CODE, "INFO")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    auto = [line for line in lines if "auto chose" in line]
    # once per size: the two all_reduce share one choice, the all_gather has its own
    assert len(auto) == 2, r.stderr
    assert auto[0].startswith("nccltree INFO World of 3 ranks: auto chose direct for 4000 B")
    assert "measured" in auto[0]  # the rule's reason
    plans = [line for line in lines if ": plan '" in line]
    assert len(plans) == 2, r.stderr
    assert "direct all_reduce sum count=1000" in plans[0] and "data steps" in plans[0]
    assert not any("TRACE" in line for line in lines)


@pytest.mark.subprocess
@pytest.mark.slow
def test_debug_trace_adds_every_call_and_unset_says_nothing() -> None:
    r = _run(CODE, "trace")
    calls = [line for line in r.stderr.splitlines() if line.startswith("nccltree TRACE")]
    assert [c.split()[3:5] for c in calls] == [
        ["#1:", "all_reduce"], ["#2:", "all_reduce"], ["#3:", "all_gather"]
    ], r.stderr  # fmt: skip
    assert _run(CODE, "").stderr == ""
    bad = _run(CODE, "LOUD")
    assert bad.returncode == 0
    assert "NCCLTREE_DEBUG='LOUD': accepted values are WARN, INFO, TRACE" in bad.stderr


def test_configure_refuses_an_unknown_level() -> None:
    with pytest.raises(ValueError, match="accepted values"):
        debug.configure("VERBOSE")


@pytest.mark.mpi
def test_process_groups_log_their_plans_and_calls() -> None:
    from tests.mpirun import ROOT, mpiexec, run_mpi

    if mpiexec() is None:
        pytest.skip("needs mpiexec (the mpi extra)")
    r = run_mpi(2, ROOT / "tests" / "mpi" / "debug_lines.py", env={"NCCLTREE_DEBUG": "TRACE"},
                timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        plans = [ln for ln in r.stderr.splitlines()
                 if ln.startswith(f"nccltree INFO process group rank {rank}: plan ")]  # fmt: skip
        assert len(plans) == 1 and "items" in plans[0], r.stderr
        calls = [ln for ln in r.stderr.splitlines()
                 if ln.startswith(f"nccltree TRACE process group rank {rank} #")]  # fmt: skip
        assert len(calls) == 2 and "algorithm=direct" in calls[0], r.stderr


# -- memory: the scratch cache's cap and release ----------------------------------------------


@pytest.mark.parametrize("cap", [None, 0, 10_000])
def test_scratch_memory_is_capped_and_released(cap: int | None) -> None:
    """The tree's reduce keeps inner partial sums in scratch: without a cap the cache
    grows to the largest message; with one it never holds more (a larger call gets buffers
    of its own); ``trim`` releases it; results are right throughout."""
    w = nt.World(nt.devices("cpu:4"), algorithm="tree", max_scratch_bytes=cap)
    held = []
    for count in (1000, 100_000, 10, 100_000):
        xs = [np.full(count, r + 1, np.float32) for r in range(4)]
        outs = [np.zeros(count, np.float32) for _ in range(4)]
        w.reduce(xs, root=0, outs=outs)
        np.testing.assert_array_equal(outs[0], np.full(count, 10, np.float32))
        held.append(w.scratch_bytes)
        if cap is not None:
            assert w.scratch_bytes <= cap
    if cap is None:
        assert held == [4000, 400_000, 400_000, 400_000]  # grows, never shrinks
    elif cap == 10_000:
        assert held == [4000, 4000, 4000, 4000]  # the larger calls kept nothing
    assert w.trim() == held[-1] and w.scratch_bytes == 0
    xs = [np.full(1000, 1, np.float32) for _ in range(4)]
    w.all_reduce(xs)
    np.testing.assert_array_equal(xs[3], np.full(1000, 4, np.float32))
    w.close()


def test_max_scratch_bytes_is_checked() -> None:
    with pytest.raises(ValueError, match="max_scratch_bytes"):
        nt.World(nt.devices("cpu:2"), max_scratch_bytes=-1)


# -- traces ---------------------------------------------------------------------------------


def test_world_trace_times_every_step_of_the_plan_and_performs_the_call() -> None:
    w = nt.World(nt.devices("cpu:3"), algorithm="tree")
    xs = [np.full(300_000, r + 1, np.float32) for r in range(3)]
    spans = w.trace("all_reduce", xs, algorithm="ring")
    for x in xs:
        np.testing.assert_array_equal(x, np.full(300_000, 6, np.float32))
    plan = w.plan("all_reduce", 300_000, algorithm="ring", in_place=True)
    steps = [s for s in spans if s.kind in ("copy", "reduce", "scale")]
    # every data step, in plan order (the executor skips copies onto themselves)
    assert len(steps) == len(
        [s for s in plan.data_steps() if not (s.kind == "copy" and s.dst == s.srcs[0])]
    )
    assert {s.rank for s in steps} == {0, 1, 2}
    # on the host the steps run one after another: in order, never overlapping
    for a, b in zip(steps, steps[1:]):
        assert b.start >= a.start + a.duration
    assert all(s.elements > 0 and ("<-" in s.detail or "=" in s.detail) for s in steps)
    with pytest.raises(ValueError, match="tree, ring or direct"):
        w.trace("all_reduce", xs, algorithm="nccl")
    w.close()


def test_the_benchmark_writes_a_chrome_trace(tmp_path: pytest.TempPathFactory) -> None:
    import json
    from pathlib import Path

    from nccltree.cli import bench

    path = Path(str(tmp_path)) / "trace.json"
    argv = ["collectives", "--devices", "cpu:3", "--algorithm", "tree,direct", "-b", "1K",
            "-e", "64K", "-f", "64", "-n", "1", "-w", "0", "--trace", str(path), "--quiet",
            "--json", str(Path(str(tmp_path)) / "r.json")]  # fmt: skip
    assert bench.main(argv) == 0
    events = json.loads(path.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "tree: all_reduce 65536 B", 1: "direct: all_reduce 65536 B"}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(p, r) for p in (0, 1) for r in range(3)}
    w = nt.World(nt.devices("cpu:3"))
    for pid, alg in ((0, "tree"), (1, "direct")):
        xs = [e for e in events if e.get("ph") == "X" and e["pid"] == pid]
        plan = w.plan("all_reduce", 16384, algorithm=alg)
        assert len(xs) == len(plan.data_steps()), alg
        assert all(e["dur"] > 0 and e["ts"] >= 0 and "step" in e["args"] for e in xs)
        instants = [e for e in events if e.get("ph") == "i" and e["pid"] == pid]
        assert {e["name"] for e in instants} <= {"record", "wait"}
    w.close()


def test_a_trace_on_gpus_uses_timing_events_on_each_stream(fake_cupy: object) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): each step between two
    events on its rank's stream; the call's results are right."""
    w = nt.World(nt.devices("gpu:0,1,2"), algorithm="direct")
    xs = [d.from_host(np.full(1000, r + 1, np.float32)) for r, d in enumerate(w.devices)]
    spans = w.trace("all_reduce", xs)
    for x in xs:
        np.testing.assert_array_equal(x.get(), np.full(1000, 6, np.float32))
    steps = [s for s in spans if s.kind in ("copy", "reduce")]
    assert steps and all(s.duration >= 0 for s in steps)
    w.close()
