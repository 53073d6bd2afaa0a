"""The small path of a process group within a node (nccltree/comm/group/small.py and the
``nccltree._small`` extension): under mpiexec, its results bitwise the general path's,
mismatches raised on every process, a killed peer named, an abort honoured, the
threshold; without mpiexec, the extension's pieces on one process's memory, two
``Path`` objects in two threads standing for two processes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nccltree import _native
from nccltree.comm.group import small
from tests.mpirun import needs_mpi, run_mpi

HERE = Path(__file__).resolve().parent / "mpi"
MISMATCH = "collective arguments differ between processes"
needs_ext = pytest.mark.skipif(not small.available(), reason="nccltree._small was not built")


def _reports(tmp: Path, n: int | list[Any], mode: str, *args: str,
             env: dict[str, str] | None = None, faults: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    proc = run_mpi(n, HERE / "pg_small.py", mode, *args, faults=faults, timeout=240,
                   env={"NCCLTREE_TEST_OUT": str(out), **(env or {})})  # fmt: skip
    got = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not faults:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert got, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


# -- under mpiexec ------------------------------------------------------------------------------
@pytest.mark.mpi
@needs_mpi
@needs_ext
@pytest.mark.parametrize("n", [2, 3])
def test_results_are_bitwise_those_of_the_general_path(n: int, tmp_path: Path) -> None:
    # at 3 processes the summation order shows (mixed signs, float16, bfloat16)
    reports = _reports(tmp_path, n, "bitwise", "30")
    assert len(reports) == n
    for r in reports:
        assert r["small"], r
        assert r["bad"] == [], r["bad"]
        assert r["paths"] == ["small"], r  # every call above took the small path
        assert r["calls"] == 2 * 4 * (4 * 5 + 4 * 4)  # in place or not, counts, dtype x op


@pytest.mark.mpi
@needs_mpi
@needs_ext
def test_mismatched_calls_raise_on_every_process_and_the_group_goes_on(tmp_path: Path) -> None:
    reports = _reports(tmp_path, 2, "mismatch", "20")
    for r in reports:
        other = 1 - r["rank"]
        for case, theirs in (("count", "count=5" if other == 1 else "count=4"),
                             ("dtype", "dtype=int32" if other == 1 else "dtype=float32"),
                             ("op", "op=max" if other == 1 else "op=sum"),
                             ("large", "count=1048576" if other == 1 else "count=4"),
                             ("mpi", "reduce_scatter" if other == 1 else "all_reduce"),
                             ("split", "split" if other == 1 else "all_reduce")):  # fmt: skip
            text = r[case]
            assert text.startswith(MISMATCH), (case, r)
            assert f"ranks [{other}] call" in text and theirs in text, (case, text)
            assert r[f"after_{case}"] == 3.0, (case, r)
        assert r["last"] == "small"
    # every process raised the same two lines, each naming its own call first
    a, b = sorted(reports, key=lambda r: r["rank"])
    for case in ("count", "dtype", "op"):
        la, lb = a[case].splitlines(), b[case].splitlines()
        assert la[1].split("call", 1)[1] == lb[0].split("call", 1)[1], (la, lb)


@pytest.mark.mpi
@needs_mpi
@needs_ext
def test_a_killed_peer_is_named_not_waited_for(tmp_path: Path) -> None:
    # MPICH's launcher ends the others soon after it sees a process die: the victim runs
    # under a shell that lingers, so the survivors must find the death themselves
    parts = [(1, {}), (1, {}, "{cmd}; sleep 5"), (1, {})]
    reports = _reports(tmp_path, parts, "kill", "30", faults=True)
    survivors = [r for r in reports if r["rank"] != 1]
    assert len(survivors) == 2, reports
    for r in survivors:
        # a death found by the liveness check (PeerFailure), not the 30 s timeout
        assert r["error"].startswith("PeerFailure: "), r
        assert "ranks [1]" in r["error"] and "died" in r["error"], r
        assert r["algorithm"] == "small", r


@pytest.mark.mpi
@needs_mpi
@needs_ext
def test_an_abort_stops_the_others_small_calls(tmp_path: Path) -> None:
    reports = _reports(tmp_path, 3, "abort", "30", faults=True)
    by_rank = {r["rank"]: r for r in reports}
    assert set(by_rank) == {0, 1, 2}, reports
    for rank in (0, 2):
        err = by_rank[rank]["error"]
        assert err.startswith("PeerFailure: "), err
        assert "stopped on purpose" in err, err


@pytest.mark.mpi
@needs_mpi
@needs_ext
def test_calls_above_the_threshold_take_the_general_path(tmp_path: Path) -> None:
    limit = 4096
    for r in _reports(tmp_path, 2, "fallback", env={"NCCLTREE_SMALL": str(limit)}):
        seen = r["seen"]
        assert r["threshold"] == limit
        assert seen["4"] == "small" and seen[str(limit)] == "small", seen
        assert seen[str(limit + 4)] != "small" and seen[str(4 * limit)] != "small", seen
        for k in ("4", str(limit), str(limit + 4), str(4 * limit)):
            assert seen[f"{k}_value"] == 2.0, seen
        # small collectives the path does not take go to MPI, as before
        assert seen["reduce_scatter"] == "mpi" and seen["reduce_scatter_value"] == 2.0, seen


@pytest.mark.mpi
@needs_mpi
def test_with_the_path_off_small_messages_go_to_mpi_as_before(tmp_path: Path) -> None:
    for r in _reports(tmp_path, 2, "fallback", env={"NCCLTREE_SMALL": "off"}):
        assert not r["small"] and r["threshold"] == 0, r
        seen = r["seen"]
        assert seen["4"] == "mpi" and seen["4_value"] == 2.0, seen


# -- the extension on one process's memory --------------------------------------------------------
class _Node:
    """The memory of a node of ``n`` processes in one buffer: arrival counters, call
    descriptors and payload slots, and a ``Path`` per process (spin and yield off: two
    threads of one process share the interpreter lock, released only in the futex wait)."""

    def __init__(self, n: int, cap: int = 4096, budget_ns: int = 50_000_000) -> None:
        self.buf = np.zeros(1 << 20, np.uint8)
        base = self.buf.ctypes.data
        self.abort = base + 64
        self.arrive = [base + 4096 + 64 * r for r in range(n)]
        self.desc = [base + 8192 + 2048 * (2 * r + p) for r in range(n) for p in (0, 1)]
        self.data = [base + 65536 + cap * (2 * r + p) for r in range(n) for p in (0, 1)]
        self.written: list[list[object]] = [[b"x", b"y"] for _ in range(n)]
        self.slow: list[tuple[int, int]] = []
        self.mismatches: list[int] = []
        kernels = small._kernel_addresses()
        self.paths = [
            small._ext.Path(
                r,
                self.arrive,
                self.desc,
                self.data,
                cap,
                self.abort,
                kernels,
                self.written[r],
                np.ndarray,
                self._slow,
                self._mismatch,
                False,
                0,
                0,
                budget_ns,
            )  # fmt: skip
            for r in range(n)
        ]

    def _slow(self, rank: int, seq: int) -> None:
        self.slow.append((rank, seq))
        counter = _native.Counter(self.buf, self.arrive[rank] - self.buf.ctypes.data, shared=True)
        if not counter.wait(seq, 10.0):
            raise TimeoutError(f"rank {rank} never arrived at {seq}")

    def _mismatch(self, parity: int) -> None:
        self.mismatches.append(parity)
        raise ValueError(f"mismatch at parity {parity}")

    def run(self, fns: list[Any]) -> list[Any]:
        got: list[Any] = [None] * len(fns)

        def one(i: int) -> None:
            try:
                got[i] = fns[i](self.paths[i])
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                got[i] = exc

        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        return got


def _learn_all_reduce(p: Any, x: np.ndarray, op: str, sig: bytes = b"sig") -> int:
    code = {"sum": 0, "prod": 1, "max": 2, "min": 3, "mean": 4}[op]
    return int(p.learn(0, _native.DTYPES[x.dtype], x.size, code, 0, x.itemsize, sig))


@needs_ext
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int8, np.uint8])
def test_the_extension_reduces_in_rank_order_with_the_library_kernel(dtype: type) -> None:
    node = _Node(3)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-50, 50, 11).astype(dtype) for _ in range(3)]
    want = np.empty_like(xs[0])
    _native.reduce_n(want, xs, op="sum")

    def call(p: Any, r: int) -> Any:
        x = xs[r].copy()
        p.run(_learn_all_reduce(p, x, "sum"), x, x)  # learnt and run: the checked path
        y = xs[r].copy()
        return x, p.all_reduce(y, None, "sum"), y  # the fast entry: in place, returns y

    got = node.run([lambda p, r=r: call(p, r) for r in range(3)])
    for x, res, y in got:
        assert x.tobytes() == want.tobytes()
        assert res is y and y.tobytes() == want.tobytes()
    assert node.mismatches == []
    # the engine's cache of its descriptors is invalidated: it rewrites them next time
    assert all(w == [None, None] for w in node.written)


@needs_ext
def test_the_fast_entry_declines_what_it_does_not_know() -> None:
    node = _Node(2)
    p = node.paths[0]
    x = np.ones(4, np.float32)
    assert p.all_reduce(x, None, "sum") is None  # no signature learnt
    _learn_all_reduce(p, x, "sum")
    assert p.all_reduce(x, None, "max") is None  # another op
    assert p.all_reduce(x, None, "bogus") is None
    assert p.all_reduce(np.ones(5, np.float32), None, "sum") is None  # another count
    assert p.all_reduce(np.ones(4, np.float64), None, "sum") is None  # another dtype
    assert p.all_reduce(np.ones(8, np.float32)[::2], None, "sum") is None  # not contiguous
    assert p.all_reduce([1.0, 1.0, 1.0, 1.0], None, "sum") is None  # not an array
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    assert p.all_reduce(ro, None, "sum") is None  # in place into a read-only array
    big = np.ones(8, np.float32)
    assert p.all_reduce(big[:4], big[2:6], "sum") is None  # overlapping output
    assert p.all_reduce(x, np.ones(4, np.float64), "sum") is None  # output of another dtype
    # nothing arrived: the counters are untouched
    assert node.buf[4096 : 4096 + 128].sum() == 0


@needs_ext
def test_the_other_fast_entries_decline_what_they_cannot_take() -> None:
    node = _Node(2)
    p = node.paths[0]
    x = np.ones(4, np.float32)
    for coll in (1, 2, 3):  # broadcast, all_gather, reduce
        p.learn(coll, _native.DTYPES[x.dtype], 4, 0, 0, 4, b"sig")
    out = np.zeros(8, np.float32)
    assert p.fast(2, x, None, "sum", 0) is None  # all_gather needs its output
    assert p.fast(2, x, np.zeros(6, np.float32), "sum", 0) is None  # of n blocks
    assert p.fast(2, out[2:6], out, "sum", 0) is None  # overlapping, not its own block
    assert p.fast(1, x, None, "sum", 1) is None  # a root never learnt
    assert p.fast(1, x, None, "sum", 2) is None  # a root out of range
    assert p.fast(1, x, None, "sum", np.int64(0)) is None  # not a plain int
    assert p.fast(3, x, np.zeros(5, np.float32), "sum", 0) is None  # an output of another size
    with pytest.raises(ValueError, match="no such collective"):
        p.fast(4, x, None, "sum", 0)
    assert node.buf[4096 : 4096 + 128].sum() == 0  # nothing arrived


@needs_ext
def test_broadcast_all_gather_and_reduce_through_the_fast_entry() -> None:
    node = _Node(3)
    xs = [np.full(5, r + 1.0, np.float32) for r in range(3)]

    def call(p: Any, r: int) -> Any:
        for coll in (1, 2, 3):
            p.learn(coll, _native.DTYPES[np.dtype(np.float32)], 5, 0, 1, 4, b"root1")
        p.learn(2, _native.DTYPES[np.dtype(np.float32)], 5, 0, 0, 4, b"gather")
        b = xs[r].copy()
        got_b = p.fast(1, b, None, "sum", 1)
        g = np.zeros(15, np.float32)
        got_g = p.fast(2, xs[r], g, "sum", 0)
        rd = xs[r].copy()
        got_r = p.fast(3, rd, None, "sum", 1)
        return got_b is b, b.tolist(), got_g is g, g.tolist(), got_r is rd, rd.tolist()

    got = node.run([lambda p, r=r: call(p, r) for r in range(3)])
    for r, (isb, b, isg, g, isr, rd) in enumerate(got):
        assert isb and isg and isr, got[r]
        assert b == [2.0] * 5  # root 1's
        assert g == [1.0] * 5 + [2.0] * 5 + [3.0] * 5
        assert rd == ([6.0] * 5 if r == 1 else [r + 1.0] * 5)  # others' inputs unchanged


@needs_ext
def test_learn_refuses_calls_beyond_its_slots() -> None:
    node = _Node(2, cap=4096)
    with pytest.raises(ValueError, match="cannot take"):
        node.paths[0].learn(0, 1, 2048, 0, 0, 4, b"too big")
    with pytest.raises(ValueError, match="cannot take"):
        node.paths[0].learn(0, 1, 4, 9, 0, 4, b"bad op")


@needs_ext
def test_a_signature_mismatch_reaches_the_callback_on_every_process() -> None:
    node = _Node(2)

    def call(p: Any, sig: bytes) -> Any:
        x = np.ones(3, np.float32)
        return p.run(_learn_all_reduce(p, x, "sum", sig), x, x)

    got = node.run([lambda p: call(p, b"all_reduce count=3"), lambda p: call(p, b"other")])
    assert all(isinstance(g, ValueError) for g in got), got
    assert node.mismatches == [1, 1]  # the first call: parity 1


@needs_ext
def test_a_slow_peer_is_left_to_the_groups_own_wait() -> None:
    # a budget of 0: the native wait hands over to the callback at once
    node = _Node(2, budget_ns=0)
    x0, x1 = np.ones(2, np.float32), np.full(2, 2.0, np.float32)
    s0 = _learn_all_reduce(node.paths[0], x0, "sum")
    s1 = _learn_all_reduce(node.paths[1], x1, "sum")
    t = threading.Thread(target=node.paths[0].run, args=(s0, x0, x0))
    t.start()
    t.join(0.3)  # process 0 waits for 1 (in the callback's wait)
    assert t.is_alive()
    node.paths[1].run(s1, x1, x1)
    t.join(10)
    assert x0.tolist() == x1.tolist() == [3.0, 3.0]
    assert (1, 1) in node.slow


@needs_ext
def test_an_abort_word_ends_the_native_wait() -> None:
    node = _Node(2, budget_ns=10_000_000_000)
    x = np.ones(2, np.float32)
    s0 = _learn_all_reduce(node.paths[0], x, "sum")
    node.buf[64:72] = np.frombuffer(np.int64(1).tobytes(), np.uint8)  # the node aborted
    calls: list[int] = []

    def slow(rank: int, seq: int) -> None:
        calls.append(rank)
        raise RuntimeError("the group's wait raises PeerFailure here")

    node.paths[0] = small._ext.Path(0, node.arrive, node.desc, node.data, 4096, node.abort,
                                    small._kernel_addresses(), node.written[0], np.ndarray,
                                    slow, node._mismatch, False, 0, 0, 10_000_000_000)  # fmt: skip
    s0 = _learn_all_reduce(node.paths[0], x, "sum")
    with pytest.raises(RuntimeError, match="PeerFailure"):
        node.paths[0].run(s0, x, x)  # within a futex slice, not the 10 s budget
    assert calls == [1]


def test_the_setting() -> None:
    assert small.setting("off") == 0
    assert small.setting("0") == 0
    if small.available():
        assert small.setting("") == small.THRESHOLD
        assert small.setting("4096") == 4096
    for bad in ("lots", "-1", str(small.MAX_THRESHOLD + 1)):
        with pytest.raises(ValueError, match="NCCLTREE_SMALL"):
            small.setting(bad)
