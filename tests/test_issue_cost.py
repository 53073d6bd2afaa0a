"""The cost of issuing a plan: the null backend, the GPU chunk policy, the resolved plans
(executor.Program) and their reused events, and bench/issue_cost.py's ``measure``.

No timing is asserted here: the times are measured by ``bench/issue_cost.py``; these tests
check the structure (step and chunk counts, which events are reused) and the results."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bench_module

import nccltree as nt
from nccltree.comm.executor import Buffers, Program
from nccltree.comm.plan import CHUNK_BYTES as HOST_CHUNK_BYTES
from nccltree.comm.plan import (
    GPU_CHUNK_MAX,
    GPU_CHUNK_MIN,
    GPU_CHUNKS,
    IN,
    OUT,
    STAGE,
    TMP,
    gpu_chunk_bytes,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def null():
    return bench_module("null_backend")


# -- the GPU chunk policy -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "chunk"),
    [
        (0, GPU_CHUNK_MIN),
        (8, GPU_CHUNK_MIN),
        (MiB, GPU_CHUNK_MIN),
        (4 * MiB, 256 << 10),
        (64 * MiB, 4 * MiB),
        (256 * MiB, 16 * MiB),
        (1 << 30, GPU_CHUNK_MAX),
        (100 * MiB + 4, 6553856),  # ceil(nbytes / 16) rounded up to 256 B
    ],
)
def test_gpu_chunk_bytes(nbytes, chunk):
    assert gpu_chunk_bytes(nbytes) == chunk


def test_gpu_chunks_are_bounded_in_count_and_size():
    for nbytes in [*range(0, 3 * MiB, 77_777), *range(3 * MiB, 600 * MiB, 7 * MiB + 13)]:
        c = gpu_chunk_bytes(nbytes)
        assert GPU_CHUNK_MIN <= c <= GPU_CHUNK_MAX and c % 256 == 0
        chunks = max(1, -(-nbytes // c))
        if nbytes <= GPU_CHUNKS * GPU_CHUNK_MAX:
            assert chunks <= GPU_CHUNKS
        else:
            assert c == GPU_CHUNK_MAX


def test_the_chunk_setting_of_each_backend(null):
    with null.null_world(2) as w:  # a GPU-like backend: the policy
        assert not w.fixed_chunk and w.chunk_bytes == GPU_CHUNK_MAX
        assert w.chunk_for(256 * MiB) == 16 * MiB and w.chunk_for(8) == GPU_CHUNK_MIN
    with null.null_world(2, chunk_bytes=MiB) as w:  # given: fixed, as before
        assert w.fixed_chunk and w.chunk_for(256 * MiB) == MiB == w.chunk_bytes
    with nt.World("cpu:2") as w:  # the host default stays one fixed size
        assert w.fixed_chunk and w.chunk_for(1 << 30) == HOST_CHUNK_BYTES == 16 * MiB
        with pytest.raises(ValueError, match="nbytes"):
            w.chunk_for(-1)


def _chunks_at_root(plan, root=0):
    """How many pieces the root's reductions write (one per chunk of the message)."""
    return len(
        {(s.dst.role, s.dst.offset) for s in plan.steps if s.kind == "reduce" and s.rank == root}
    )


@pytest.mark.slow
def test_a_256_mib_tree_all_reduce_on_8_gpus_is_16_chunks(null):
    count = 256 * MiB // 4
    with null.null_world(8, "nvswitch8", "tree") as w:
        plan = w.plan("all_reduce", count, in_place=True)
        assert _chunks_at_root(plan) == 16
        # 1 MiB chunks made 7216 steps; 16 chunks make about 16/256 of them
        assert len(plan.steps) < 600
        small = w.plan("all_reduce", MiB // 4, in_place=True)
        assert _chunks_at_root(small) == 4  # 1 MiB still pipelines, in 256 KiB chunks
    with null.null_world(8, "nvswitch8", "tree", chunk_bytes=MiB) as w:
        assert len(w.plan("all_reduce", count, in_place=True).steps) == 7216


def test_gathered_and_scattered_buffers_set_the_chunk(null):
    # the policy sees each rank's largest buffer: the gathered output, the scattered input
    with null.null_world(8, "nvswitch8", "tree") as w:
        plan = w.plan("reduce_scatter", 32 * MiB // 4)  # a 256 MiB input per rank
        assert _chunks_at_root(plan) == 16


# -- summation order does not depend on the chunking ----------------------------------------


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.slow
def test_results_are_bitwise_the_same_for_every_chunk(alg):
    n, count = 5, 50_003
    rng = np.random.default_rng(7)
    base = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    got = []
    for chunk in (256, 4096, gpu_chunk_bytes(count * 4), 16 * MiB):
        with nt.World(f"cpu:{n}", algorithm=alg, chunk_bytes=chunk, inline_bytes=0) as w:
            xs = [x.copy() for x in base]
            w.all_reduce(xs)
            got.append(xs)
    for other in got[1:]:
        for a, b in zip(got[0], other):
            assert a.tobytes() == b.tobytes()


# -- resolved plans ------------------------------------------------------------------------


def test_the_program_checks_every_range_once():
    with nt.World("cpu:2", algorithm="ring") as w:
        plan = w.plan("all_reduce", 100)
        ok = {IN: [100, 100], OUT: [100, 100], TMP: [0, 0], STAGE: [0, 0]}
        Program(plan, w.devices, ok)
        short = dict(ok, **{OUT: [100, 99]})
        with pytest.raises(AssertionError, match="outside rank 1's out buffer of 99"):
            Program(plan, w.devices, short)


def test_a_range_used_by_many_steps_is_sliced_once():
    with nt.World("cpu:4", algorithm="tree", chunk_bytes=256) as w:
        x = [np.ones(1000, np.float32) for _ in range(4)]
        w.all_reduce(x)
        (program,) = w._programs.programs.values()
        touches = sum(len(s.touches) for s in program.plan.data_steps())
        assert len(program.ranges) < touches
        views = program.views(Buffers(x, x, [None] * 4))
        assert all(v.base is not None for v in views)  # views, never copies


def test_events_are_reused_and_async_calls_get_their_own_end_events():
    n = 3
    with nt.World(f"cpu:{n}", algorithm="tree", chunk_bytes=256, inline_bytes=0) as w:
        xs = [np.full(1000, r + 1, np.float32) for r in range(n)]
        w.all_reduce(xs)
        (program,) = w._programs.programs.values()
        events = program.events
        assert events is not None and len(events) == program.plan.n_events
        w.all_reduce(xs)
        assert program.events is events  # the same events, no new ones per call
        # an asynchronous call keeps its end events in its Work: fresh ones, and the next
        # call re-recording the plan's events leaves them alone
        work = w.all_reduce(xs, async_op=True)
        ends = set(map(id, work._events))
        assert not ends & set(map(id, events))
        w.all_reduce(xs)
        work.synchronize()
        assert xs[0][0] == 6 * n**3  # 1 + 2 + 3, then times n per call
        assert all(np.array_equal(x, xs[0]) for x in xs)


def test_scratch_follows_the_dtype_and_its_replacement():
    # float32 and int32 share a plan (same itemsize) but not their scratch; a larger call
    # replaces the scratch, and the smaller plan then uses the new buffers. The tree's
    # reduce_scatter sums into scratch memory at the root.
    n = 3
    with nt.World(f"cpu:{n}", algorithm="tree", chunk_bytes=512, inline_bytes=0) as w:
        for dtype, count in (
            ("float32", 1000),
            ("int32", 1000),
            ("float32", 5000),
            ("float32", 1000),
            ("int32", 1000),
        ):
            xs = [np.full(n * count, r + 1, dtype) for r in range(n)]
            outs = [np.zeros(count, dtype) for _ in range(n)]
            w.reduce_scatter(xs, outs)
            assert all(np.all(o == 6) for o in outs), (dtype, count)
            assert all(np.all(xs[r] == r + 1) for r in range(n))
            if count == 5000:
                # the larger call replaced the scratch: the other plan keeps no old buffer
                assert [p.plan.scratch != {} for p in w._programs.programs.values()] == [True, True]
                assert [p.memory is None for p in w._programs.programs.values()] == [True, False]


# -- the null backend ----------------------------------------------------------------------


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_the_null_backend_runs_the_real_engine(null, alg):
    with null.null_world(8, "nvswitch8", alg) as w:
        xs = [w.devices[r].empty((MiB // 4,), np.float32) for r in range(8)]
        assert w.all_reduce(xs) == xs
        work = w.all_reduce(xs, async_op=True)
        work.synchronize()
        # argument errors are the real ones
        with pytest.raises(ValueError, match="size mismatch"):
            w.all_reduce([*xs[:7], np.empty(3, np.float32)])
        with pytest.raises(TypeError, match="numpy"):
            w.all_reduce([[1.0]] * 8)


def test_the_null_backend_is_no_device_spec(null):
    with pytest.raises(ValueError):
        nt.devices("null:2")
    assert null.null_topology(8).n == 8
    assert null.null_topology(2).link(0, 1) == nt.Topology.preset("nvswitch8").link(0, 1)


def test_measure(null):
    mod = bench_module("issue_cost")
    lines: list[str] = []
    result = mod.measure((2,), (8, MiB), ("tree", "direct"), reps=1, min_time=0.0, log=lines.append)
    assert len(lines) == 4
    rows = result["rows"]
    assert [(r["algorithm"], r["bytes"]) for r in rows] == [
        ("tree", 8),
        ("tree", MiB),
        ("direct", 8),
        ("direct", MiB),
    ]
    for r in rows:
        assert r["steps"] > 0 and r["call_us"] > 0
        assert r["step_us"] == pytest.approx(r["call_us"] / r["steps"])
    assert rows[1]["steps"] > rows[0]["steps"]  # 1 MiB is cut into chunks, 8 B is not
    assert any(line.startswith("| tree | 2 | 1 MiB | 256 KiB |") for line in mod.table(result))
    with pytest.raises(ValueError, match="reps"):
        mod.measure(reps=0)
