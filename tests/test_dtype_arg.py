"""The collectives' ``dtype=`` argument on the host backend.

CuPy has no bfloat16, so a GPU buffer of bfloat16 is a ``uint16`` array of its bits and
the call says what it holds: ``dtype="bfloat16"``. The same call on host devices must
give bitwise what the same bits in ``ml_dtypes.bfloat16`` arrays give, on every reducing
collective and algorithm, inline and on the streams, driver side and per rank; the data
movement collectives and send/recv accept and check the argument alike; everything else
is refused with the argument named. (The GPU path: tests/test_dtype_arg_gpu.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends.base import BFLOAT16
from nccltree.comm._args import check_call_dtype
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.faces import driver_method

ALGS = ("tree", "ring", "direct")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
MOVING = ("broadcast", "all_gather", "gather", "scatter", "all_to_all", "sendrecv")


def bf16_inputs(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    """bfloat16 values whose sum depends on the order and on float32 accumulation."""
    rng = np.random.default_rng(seed)
    mag = 2.0 ** rng.integers(-20, 21, (n, size))
    vals = rng.uniform(-1, 1, (n, size)) * mag
    return [vals[r].astype(BFLOAT16) for r in range(n)]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def call(world: nt.World, coll: str, xs, outs, op: str, **kw):
    c = COLLECTIVES[coll]
    args: dict[str, object] = dict(kw)
    if c.reduces:
        args["op"] = op
    if c.rooted:
        args["root"] = world.size - 1
    if outs is not None:
        args["outs"] = outs
    return getattr(world, driver_method(coll))(xs, **args)


def out_arrays(coll: str, n: int, count: int, dtype) -> list[np.ndarray] | None:
    c = COLLECTIVES[coll]
    if c.one_buffer:
        return None
    return [np.full(c.out_count(count, n), 7, dtype) for _ in range(n)]


@pytest.fixture(scope="module")
def worlds():
    made: dict[tuple[int, str, bool], nt.World] = {}

    def get(n: int, alg: str, inline: bool) -> nt.World:
        key = (n, alg, inline)
        if key not in made:
            # 64-byte chunks: several chunks even for these small messages
            made[key] = nt.World(f"cpu:{n}", algorithm=alg, timeout=30, chunk_bytes=64,
                                 inline_bytes=None if inline else 0)  # fmt: skip
        return made[key]

    yield get
    for w in made.values():
        w.close()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "streams"])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("coll", REDUCING)
@pytest.mark.slow
def test_uint16_named_bfloat16_reduces_bitwise_as_bfloat16(worlds, coll, n, alg, inline):
    world = worlds(n, alg, inline)
    c = COLLECTIVES[coll]
    count = 37
    size = c.in_count(count, n)
    for op in ("sum", "mean", "max"):
        full = bf16_inputs(n, size, seed=n * 7 + len(op))
        # reference: the bfloat16 arrays themselves
        xs = [f.copy() for f in full]
        outs = out_arrays(coll, n, count, BFLOAT16)
        got = call(world, coll, xs, outs, op)
        # the same bits in uint16 arrays, named bfloat16
        us = [bits(f).copy() for f in full]
        uouts = None if outs is None else [bits(o).copy() for o in outs]
        res = call(world, coll, us, uouts, op, dtype="bfloat16")
        for r in range(n):
            assert res[r].dtype == np.uint16  # the caller's own arrays come back
            np.testing.assert_array_equal(res[r], bits(got[r]), err_msg=f"{op} rank {r}")
            np.testing.assert_array_equal(us[r], bits(xs[r]), err_msg=f"{op} input {r}")


@pytest.mark.parametrize("alg", ALGS)
def test_in_place_uint16_all_reduce_and_reduce_scatter(worlds, alg):
    n, count = 4, 64
    world = worlds(n, alg, False)
    full = bf16_inputs(n, n * count, seed=3)
    want = [f.copy() for f in full]
    world.all_reduce(want)
    us = [bits(f).copy() for f in full]
    world.all_reduce(us, dtype="bfloat16")
    for r in range(n):
        np.testing.assert_array_equal(us[r], bits(want[r]))
    # reduce_scatter in place: each output is the rank's block inside its input
    ref = [f.copy() for f in full]
    world.reduce_scatter(ref, [ref[r][r * count : (r + 1) * count] for r in range(n)])
    us = [bits(f).copy() for f in full]
    world.reduce_scatter(
        us, [us[r][r * count : (r + 1) * count] for r in range(n)], dtype="bfloat16"
    )
    for r in range(n):
        np.testing.assert_array_equal(
            us[r][r * count : (r + 1) * count], bits(ref[r][r * count : (r + 1) * count])
        )


def test_async_and_explicit_streams(worlds):
    world = worlds(3, "ring", False)
    full = bf16_inputs(3, 100, seed=5)
    want = [f.copy() for f in full]
    world.all_reduce(want, op="mean")
    us = [bits(f).copy() for f in full]
    world.all_reduce(us, op="mean", dtype="bfloat16", async_op=True).synchronize()
    for r in range(3):
        np.testing.assert_array_equal(us[r], bits(want[r]))
    us = [bits(f).copy() for f in full]
    streams = [d.new_stream() for d in world.devices]
    world.all_reduce(us, op="mean", dtype="bfloat16", streams=streams)
    for s in streams:
        s.synchronize()
    for r in range(3):
        np.testing.assert_array_equal(us[r], bits(want[r]))


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("coll", MOVING)
def test_data_movement_takes_the_argument(worlds, coll, alg):
    n, count = 3, 40
    world = worlds(n, alg, False)
    c = COLLECTIVES[coll]
    full = bf16_inputs(n, c.in_count(count, n), seed=11)
    xs = [f.copy() for f in full]
    outs = out_arrays(coll, n, count, BFLOAT16)
    got = call(world, coll, xs, outs, "sum")
    us = [bits(f).copy() for f in full]
    uouts = None if outs is None else [bits(o).copy() for o in outs]
    res = call(world, coll, us, uouts, "sum", dtype="bfloat16")
    for r in range(n):
        np.testing.assert_array_equal(res[r], bits(got[r]))
    # the bfloat16 arrays may name their own dtype too
    xs = [f.copy() for f in full]
    outs = out_arrays(coll, n, count, BFLOAT16)
    again = call(world, coll, xs, outs, "sum", dtype=BFLOAT16)
    for r in range(n):
        np.testing.assert_array_equal(bits(again[r]), bits(got[r]))


def test_all_to_all_v_takes_the_argument(worlds):
    world = worlds(2, "direct", False)
    counts = [[1, 2], [3, 4]]
    full = bf16_inputs(2, 7, seed=1)
    xs = [full[0][:3].copy(), full[1][:7].copy()]
    outs = [np.zeros(4, BFLOAT16), np.zeros(6, BFLOAT16)]
    world.all_to_all_v(xs, outs, counts)
    uouts = [np.zeros(4, np.uint16), np.zeros(6, np.uint16)]
    world.all_to_all_v([bits(x).copy() for x in xs], uouts, counts, dtype="bfloat16")
    for r in range(2):
        np.testing.assert_array_equal(uouts[r], bits(outs[r]))
    with pytest.raises(TypeError, match="dtype="):
        world.all_to_all_v([bits(x).copy() for x in xs], uouts, counts)


@pytest.mark.parametrize("alg", ALGS)
def test_per_rank_calls(worlds, alg):
    n = 4
    world = worlds(n, alg, False)
    full = bf16_inputs(n, 50, seed=9)
    want = [f.copy() for f in full]
    world.all_reduce(want)
    at_root = np.zeros(50, BFLOAT16)
    world.reduce([f.copy() for f in full], root=1,
                 outs=[at_root if r == 1 else np.zeros(50, BFLOAT16) for r in range(n)])  # fmt: skip

    def body(comm):
        x = bits(full[comm.rank]).copy()
        comm.all_reduce(x, dtype="bfloat16")
        out = np.zeros(50, np.uint16)
        comm.reduce(bits(full[comm.rank]).copy(), root=1, out=out, dtype="bfloat16")
        return x, out

    got = world.run(body)
    for r in range(n):
        np.testing.assert_array_equal(got[r][0], bits(want[r]))
    np.testing.assert_array_equal(got[1][1], bits(at_root))


def test_per_rank_disagreement_is_an_argument_error(worlds):
    world = worlds(2, "tree", False)

    def body(comm):
        x = np.zeros(8, np.uint16)
        comm.all_reduce(x, dtype="bfloat16" if comm.rank == 0 else None)

    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        world.run(body)
    # an argument error: the World is still usable
    x = [np.ones(4, np.float32), np.ones(4, np.float32)]
    world.all_reduce(x)
    assert x[0][0] == 2


def test_send_recv(worlds):
    world = worlds(2, "tree", False)
    src = bf16_inputs(1, 16, seed=2)[0]

    def body(comm):
        if comm.rank == 0:
            comm.send(bits(src).copy(), 1, dtype="bfloat16")
            return None
        out = np.zeros(16, np.uint16)
        comm.recv(out, 0, dtype="bfloat16")
        return out

    got = world.run(body)
    np.testing.assert_array_equal(got[1], bits(src))

    def mismatch(comm):
        if comm.rank == 0:
            comm.send(bits(src).copy(), 1, dtype="bfloat16")
        else:
            comm.recv(np.zeros(16, np.uint16), 0)

    with pytest.raises(ValueError, match="bfloat16"):
        world.run(mismatch)


@pytest.mark.parametrize(
    "arrays, dtype, exc, match",
    [
        (np.uint16, None, TypeError, 'dtype="bfloat16"'),  # a carrier needs its name
        (np.float16, "bfloat16", TypeError, "dtype=bfloat16 takes"),  # not 2-byte bits
        (np.int8, "bfloat16", TypeError, "dtype=bfloat16 takes"),
        (np.float32, "bfloat16", TypeError, "dtype=bfloat16 takes"),
        (np.float32, "float16", TypeError, "dtype=float16 differs"),
        (np.float32, "uint16", TypeError, "dtype=uint16 is not one"),
        (np.float32, "bfloat17", ValueError, "dtype='bfloat17' is not a dtype"),
        (np.float32, 3.5, ValueError, "is not a dtype"),
    ],
)
def test_bad_combinations(worlds, arrays, dtype, exc, match):
    world = worlds(2, "tree", False)
    xs = [np.ones(8, arrays), np.ones(8, arrays)]
    before = [x.copy() for x in xs]
    with pytest.raises(exc, match=match):
        world.all_reduce(xs, dtype=dtype)
    with pytest.raises(exc, match=match):
        world.broadcast(xs, dtype=dtype)
    for x, b in zip(xs, before, strict=True):
        np.testing.assert_array_equal(x, b)  # nothing written


def test_output_must_match_the_input(worlds):
    world = worlds(2, "tree", False)
    xs = [np.zeros(8, np.uint16) for _ in range(2)]
    outs = [np.zeros(8, BFLOAT16) for _ in range(2)]
    with pytest.raises(TypeError, match="output dtype"):
        world.all_reduce(xs, outs=outs, dtype="bfloat16")


def test_matching_dtype_is_accepted(worlds):
    world = worlds(2, "tree", False)
    xs = [np.ones(8, np.float32) for _ in range(2)]
    world.all_reduce(xs, dtype="float32")
    world.all_reduce(xs, dtype=np.float32)
    np.testing.assert_array_equal(xs[0], 4.0)


def test_check_call_dtype():
    assert check_call_dtype(None) is None
    assert check_call_dtype("bfloat16") == BFLOAT16
    assert check_call_dtype("int8") == np.dtype(np.int8)
    with pytest.raises(TypeError, match="dtype=uint16"):
        check_call_dtype(np.uint16)


def test_plan_cache_shares_a_program_across_dtypes_of_one_size():
    """Host arrays never carry a dtype (uint16 buffers named bfloat16 are viewed as it),
    so float16, bfloat16 and uint16-as-bfloat16 calls of one count share one program,
    as float32 and int32 do (the plan depends on the itemsize only)."""
    with nt.World("cpu:2", algorithm="tree") as w:
        w.all_reduce([np.ones(8, np.float16) for _ in range(2)])
        w.all_reduce([np.ones(8, BFLOAT16) for _ in range(2)])
        w.all_reduce([np.ones(8, np.uint16) for _ in range(2)], dtype="bfloat16")
        assert len(w._programs.programs) == 1
        ((key, program),) = w._programs.programs.items()
        assert key[-2:] == (2, None) and program.dtype is None


def test_stream_reduce_and_scale_take_the_dtype():
    devs = nt.devices("cpu:1")
    d = devs[0]
    a, b = bf16_inputs(2, 1000, seed=4)
    want = np.empty_like(a)
    st = d.new_stream()
    st.reduce(want, [a, b])
    st.scale(want, 0.5)
    got = np.empty(1000, np.uint16)
    st.reduce(got, [bits(a), bits(b)], dtype="bfloat16")
    st.scale(got, 0.5, dtype="bfloat16")
    st.synchronize()
    np.testing.assert_array_equal(got, bits(want))
    with pytest.raises(TypeError, match="dtype=bfloat16 takes"):
        st.reduce(np.zeros(4, np.float16), [np.zeros(4, np.float16)], dtype="bfloat16")
    with pytest.raises(ValueError, match="srcs\\[0\\]"):
        st.reduce(np.zeros(4, np.uint16), [np.zeros(4, np.float16)], dtype="bfloat16")
