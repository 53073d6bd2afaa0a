"""Processes that disagree (tests/mpi/pg_agree.py): every process-group call, whatever
the algorithm, agrees on collective, count, dtype, op and root before any buffer is
written, or raises ``ValueError`` on every process and the group goes on; so do
point-to-point pairs (dtype as well as size) and ``new_group``; a process that calls
``split`` while the others call a collective is named within the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nccltree.comm.group.agreement import check_enabled, digest
from tests.mpirun import needs_mpi, run_mpi

HERE = Path(__file__).resolve().parent / "mpi"
MISMATCH = "collective arguments differ between processes"


def _reports(tmp: Path, n: int, mode: str, env: dict[str, str], **kw: Any) -> list[dict[str, Any]]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    proc = run_mpi([(n, env)], HERE / "pg_agree.py", mode, "10",
                   env={"NCCLTREE_TEST_OUT": str(out)}, timeout=150, **kw)  # fmt: skip
    got = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not kw.get("faults"):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(got) == n, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


CALLS = {
    "auto": {"ALG": "auto"},
    "mpi": {"ALG": "mpi"},
    "tree": {"ALG": "tree"},
    "auto, shared memory off": {"ALG": "auto", "NCCLTREE_SHM": "0"},
    "direct, shared memory off": {"ALG": "direct", "NCCLTREE_SHM": "0"},
}


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("name", list(CALLS))
def test_disagreeing_calls_raise_on_every_process_and_the_group_goes_on(
    name: str, tmp_path: Path
) -> None:
    for r in _reports(tmp_path, 2, "calls", CALLS[name]):
        other = 1 - r["rank"]
        for case, theirs in (("dtype", "dtype=float64"), ("op", "op=max"), ("count", "count=32"),
                             ("collective", "broadcast(root=0) count=4")):  # fmt: skip
            text = r[case]
            assert text.startswith(MISMATCH), (case, r)
            assert theirs in text, (case, r)
            assert f"ranks [{other}] call" in text, (case, r)
            assert r[f"after_{case}"] == 3.0, (case, r)
        # the refused call: its own error on process 1, the others name it
        if r["rank"] == 1:
            assert r["local"].startswith("unknown reduction op 'bogus'"), r
        else:
            assert r["local"].startswith(MISMATCH), r
            assert "ranks [1] call all_reduce refused by its own checks" in r["local"], r
        assert r["after_local"] == 3.0, r
        if r["rank"] == 1:
            assert r["local_async"].startswith("unknown reduction op 'bogus'"), r
        else:
            assert "ranks [1] call all_reduce refused by its own checks" in r["local_async"], r
        assert r["async_before"] == [2.0, 2.0, 2.0], r
        assert r["after_local_async"] == 3.0, r
        # float32 sent, int32 received: refused, not the bits reinterpreted
        if r["rank"] == 1:
            assert "received float32 from rank 0 into its int32 buffer" in r["p2p"], r
        elif name.endswith("shared memory off"):
            assert r["p2p"] == "not raised", r  # (MPI tells only the receiver)
        else:
            assert "whose receive takes int32" in r["p2p"], r
        assert r["after_p2p"] == 3.0, r


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("alg", ["auto", "tree"])
def test_new_group_with_different_rank_lists_raises_everywhere(alg: str, tmp_path: Path) -> None:
    reports = _reports(tmp_path, 3, "groups", {"ALG": alg})
    for r in reports:
        assert r["new_group"].startswith(MISMATCH), r
        assert "new_group [0, 1]" in r["new_group"] and "new_group [0, 2]" in r["new_group"], r
        assert r["after_new_group"] == 6.0, r
        if r["rank"] in (0, 2):
            assert r["sub"] == 2.0, r


@pytest.mark.mpi
@needs_mpi
def test_split_against_a_collective_raises_on_every_process_with_auto(tmp_path: Path) -> None:
    for r in _reports(tmp_path, 2, "split", {"ALG": "auto"}):
        assert r["split"].startswith(f"ValueError: {MISMATCH}"), r
        assert "split" in r["split"] and "all_reduce" in r["split"], r
        assert r["after_split"] == 3.0, r


@pytest.mark.mpi
@needs_mpi
def test_split_against_an_engine_collective_is_named_within_the_timeout(tmp_path: Path) -> None:
    reports = _reports(tmp_path, 2, "split", {"ALG": "tree"}, faults=True)
    by_rank = {r["rank"]: r["split"] for r in reports}
    # the process in the collective names the one that never arrived; the one in split
    # says the others did not come to it, or (both time out at about the same moment)
    # hears of the other's failure first, which names it the same way
    assert "ranks [1]" in by_rank[0] and "never came" in by_rank[0], by_rank
    if by_rank[1].startswith("PeerFailure"):
        assert "ranks [0] failed" in by_rank[1] and "never came" in by_rank[1], by_rank
    else:
        assert by_rank[1].startswith("CommTimeout"), by_rank
        assert "split" in by_rank[1], by_rank


def test_the_check_setting() -> None:
    assert check_enabled("") and check_enabled("on") and check_enabled("1")
    assert not check_enabled("off") and not check_enabled("0")
    with pytest.raises(ValueError, match="NCCLTREE_CHECK must be"):
        check_enabled("yes")


def test_the_digest_is_the_same_in_every_process_and_tells_calls_apart() -> None:
    a, b = digest("all_reduce count=4 dtype=float32"), digest("all_reduce count=4 dtype=int32")
    assert a != b and 0 <= a < 1 << 62 and 0 <= b < 1 << 62
    assert a == digest("all_reduce count=4 dtype=float32")
    # another interpreter, with another hash seed, makes the same digest
    code = "from nccltree.comm.group.agreement import digest; print(digest('all_reduce count=4 dtype=float32'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)  # fmt: skip
    assert int(other.stdout) == a


def _boot(tmp: Path, mode: str) -> dict[int, dict[str, Any]]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    run_mpi(3, HERE / "pg_boot.py", mode, "3", env={"NCCLTREE_TEST_OUT": str(out)},
            timeout=120, faults=True)  # fmt: skip
    got = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    return {r["rank"]: r for r in got}


@pytest.mark.mpi
@needs_mpi
def test_a_process_that_never_starts_the_group_is_named_within_the_timeout(tmp_path: Path) -> None:
    got = _boot(tmp_path, "absent")
    assert set(got) == {0, 1, 2}, got
    for r in (0, 1):
        seen = got[r]["seen"]
        assert seen.startswith("CommTimeout: "), seen
        assert "MPI ranks [2] of 3 did not call init_process_group within 3 s" in seen, seen
        assert got[r]["took"] < 30, got[r]


@pytest.mark.mpi
@needs_mpi
def test_processes_that_start_with_different_settings_all_refuse(tmp_path: Path) -> None:
    got = _boot(tmp_path, "settings")
    assert set(got) == {0, 1, 2}, got
    for r in got.values():
        assert r["seen"].startswith("ValueError: the processes start the process group"), r
        assert "'tree' on MPI ranks [1]" in r["seen"], r
