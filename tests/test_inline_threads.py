"""Inline calls: one caller performs every rank's steps in turn, each kernel on
``World(inline_threads=)`` threads (default: the devices' threads together, at most the
CPU count)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import nccltree as nt
from nccltree import _native
from nccltree.comm.executor import Program


@pytest.fixture(params=["native program", "step by step"])
def kernel_threads(request, monkeypatch):
    """The nthreads of every native copy and reduce: of the steps the whole inline program
    hands the library in one call (the thread count of each step's rank), or, with that
    path off, of each step issued on the inline streams."""
    seen: list[int] = []
    if request.param == "native program":
        run = _native.run_steps

        def spy(code, steps, bases, threads, failed):
            seen.extend(threads[st.rank] for st in steps)
            run(code, steps, bases, threads, failed)

        monkeypatch.setattr(_native, "run_steps", spy)
        return seen
    monkeypatch.setattr(Program, "_lower", lambda self: False)
    return _spy_step_kernels(monkeypatch, seen)


@pytest.fixture
def stream_kernel_threads(monkeypatch):
    """The nthreads of every native copy and reduce the streams' operations run."""
    return _spy_step_kernels(monkeypatch, [])


def _spy_step_kernels(monkeypatch, seen: list[int]) -> list[int]:
    copy, reduce_n = _native.copy_checked, _native.reduce_n_checked

    def spy_copy(dst, src, nthreads):
        seen.append(nthreads)
        copy(dst, src, nthreads)

    def spy_reduce(dst, srcs, op, nthreads, alpha=1.0):
        seen.append(nthreads)
        reduce_n(dst, srcs, op, nthreads, alpha)

    monkeypatch.setattr(_native, "copy_checked", spy_copy)
    monkeypatch.setattr(_native, "reduce_n_checked", spy_reduce)
    return seen


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("inline_threads", [None, 1, 3])
@pytest.mark.slow
def test_inline_kernels_use_the_inline_threads(kernel_threads, alg, inline_threads):
    n, count = 3, 160 << 10  # 640 KiB per rank: every core from 512 KiB (driver side)
    with nt.World(
        nt.devices(f"cpu:{n}"), algorithm=alg, inline_bytes=1 << 20, inline_threads=inline_threads
    ) as w:
        want = inline_threads or min(sum(d.threads for d in w.devices), os.cpu_count() or 1)
        assert w.inline_threads == want
        xs = [np.full(count, float(r + 1), np.float32) for r in range(n)]
        w.all_reduce(xs)
    assert kernel_threads and set(kernel_threads) == {want}
    assert all(np.all(x == 6.0) for x in xs)


def test_calls_on_streams_keep_the_device_threads(stream_kernel_threads):
    kernel_threads = stream_kernel_threads
    with nt.World(nt.devices("cpu:2"), inline_bytes=0, inline_threads=2) as w:
        for d in w.devices:
            d.threads = 1
        xs = [np.ones(64 << 10, np.float32) for _ in range(2)]
        w.all_reduce(xs)
    assert kernel_threads and set(kernel_threads) == {1}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_inline_threads_is_checked(bad):
    with pytest.raises((TypeError, ValueError), match="inline_threads"):
        nt.World(nt.devices("cpu:2"), inline_threads=bad)


def test_smaller_calls_and_calls_by_the_ranks_keep_the_device_threads(kernel_threads):
    # below 512 KiB per rank a driver-side call, and below 8 MiB a call made by the ranks'
    # threads, run each kernel on its device's threads (measured: performance.md)
    n = 2
    with nt.World(nt.devices(f"cpu:{n}"), inline_threads=2) as w:
        for d in w.devices:
            d.threads = 1
        xs = [np.ones(64 << 10, np.float32) for _ in range(n)]  # 256 KiB
        w.all_reduce(xs)
        assert kernel_threads and set(kernel_threads) == {1}
        kernel_threads.clear()
        big = [np.ones(256 << 10, np.float32) for _ in range(n)]  # 1 MiB
        w.all_reduce(big)
        assert set(kernel_threads) == {2}
        kernel_threads.clear()
        w.run(lambda comm: comm.all_reduce(big[comm.rank]))
        assert kernel_threads and set(kernel_threads) == {1}
        kernel_threads.clear()
        huge = [np.ones(2 << 20, np.float32) for _ in range(n)]  # 8 MiB
        w.run(lambda comm: comm.all_reduce(huge[comm.rank]))
        assert set(kernel_threads) == {2}
