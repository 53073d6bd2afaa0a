"""The GPU defects found by reading the code (issue "The GPU check, round two"), each
reproduced on the fake of CuPy's layer (``tests/fakecupy``) and checked fixed there.

**Wiring checks only: none of this is GPU verification.** The fake runs work at enqueue
and models CUDA's stream and event status (pending work through ``hang_stream``), so it
can show which stream waits on which event, which handle is opened, which NCCL calls are
made with which datatype, and that a wait is bounded; whether the GPU then overlaps the
work, or how long it takes, only a GPU run shows (``bench/gpu_check.sh``).
"""

from __future__ import annotations

import mmap
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree._errors import CommTimeout, PeerFailure

# -- 1. gradient buckets on a GPU group: backward never waits for a bucket's collective ------


class _GroupLike:
    """A GPU process group's per-call stream contract, as ``GpuSide.begin``/``end`` keep
    it: the group's stream waits for the caller's stream at the call, and the caller's
    stream waits for the group's work at its end. The group's stream here never finishes
    (a peer that is slow to come), as the fake's ``hang_stream`` makes it."""

    rank, size = 0, 2

    def __init__(self, device: Any, fake: Any) -> None:
        self.device = device
        self.stream = device.new_stream()
        self.token = fake.hang_stream(self.stream)
        self.callers: list[Any] = []

    def all_reduce(self, x: Any, *, op: str = "sum", stream: Any = None) -> Any:
        caller = stream if stream is not None else self.device.current_stream()
        self.callers.append(caller)
        self.stream.wait_event(caller.record())  # GpuSide.begin
        caller.wait_event(self.stream.record())  # GpuSide.end
        return x

    def broadcast(self, x: Any, root: int = 0) -> Any:
        return x


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1}], indirect=True)
def test_on_the_fake_backward_kernels_do_not_wait_for_a_buckets_collective(
    fake_cupy: Any,
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification). A bucket's collective over a
    GPU group used to be called with the rank's compute stream from the helper thread:
    the group recorded that stream when the helper issued (not when the bucket was
    ready) and made it wait for the collective, so every later backward kernel waited.
    Now the rank's thread records the compute stream when the bucket is ready, the
    collective runs on a communication stream after that event, and only the consumer
    (the update, at ``on_gradients_ready``) waits for it."""
    from nccltree.parallel import BucketSync, make_buckets
    from nccltree.params import FlatParams

    dev = nt.devices("gpu:0")[0]
    try:
        params = FlatParams({"a": (256,), "b": (256,)}, device=dev)
        buckets = make_buckets(params, 1024)  # one parameter per bucket: b first
        assert len(buckets) == 2
        group = _GroupLike(dev, fake_cupy)
        sync = BucketSync(group, params, buckets, timeout=30)  # type: ignore[arg-type]
        compute = dev.current_stream()
        sync.on_gradient_ready(buckets[0].names[0])  # backward produced the first bucket
        job = sync._works[0]
        assert isinstance(job, object) and job.done.wait(30)  # type: ignore[attr-defined]
        assert job.error is None, job.error  # type: ignore[attr-defined]
        # the collective is pending; a later backward kernel on the compute stream is not
        assert group.callers and group.callers[0] is not compute
        assert compute.query(), "the compute stream waits for a bucket's collective"
        dev.scale(params.grad[:256], 2.0)  # "later backward work": not held back
        assert compute.query()
        # the consumer waits: once the collective ends, the compute stream is ordered after it
        sync.on_gradient_ready(buckets[1].names[0])
        group.token.release()
        sync.on_gradients_ready()
        waits = [op for op in fake_cupy.ops if op.kind == "wait_event"
                 and op.stream == compute.cupy_stream.ptr]  # fmt: skip
        assert len(waits) == 2, waits  # one per bucket, at on_gradients_ready
        compute.synchronize(10)
        sync.close()
    finally:
        dev.runtime.shutdown()


# -- 2. the GPU arena's IPC handle is tied to its generation ----------------------------------


class _Placement(SimpleNamespace):
    pass


class _PeerBlockSeen:
    """Stands in for ``PeerBlock`` (the fake refuses to open a handle in its own process,
    as CUDA does): records which handle and size were opened."""

    opened: list[tuple[bytes, int]] = []

    def __init__(self, device: Any, owner_id: int, handle: bytes, size: int) -> None:
        _PeerBlockSeen.opened.append((handle, size))
        self.size = size

    def close(self) -> None:
        pass


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1}], indirect=True)
def test_on_the_fake_a_slow_peer_maps_the_arena_generation_it_was_told(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification). Process 0 publishes
    generation 1 of its arena for a call, then grows it to generation 2 for its next call
    before process 1 maps it. Process 1 must open generation 1's block (its call's data is
    there), not the newest handle in the control block (the host path names its segments
    per generation; the GPU path had one handle slot)."""
    from nccltree.comm.group import node_memory as nm

    devs = nt.devices("gpu:0")
    dev = devs[0]
    size = 1 << 20
    shared = mmap.mmap(-1, nm._SLOTS + nm._SLOT * 2 + nm.mailbox_bytes(2))
    monkeypatch.setattr(nm, "mmap", SimpleNamespace(mmap=lambda *a, **k: shared))
    monkeypatch.setattr(nm, "PeerBlock", _PeerBlockSeen)
    _PeerBlockSeen.opened = []
    sides = []
    for proc in (0, 1):
        pl = _Placement(node_procs=[0, 1], proc=proc, shm=False, job="t", node_index=0)
        gpu = SimpleNamespace(device=dev, retired=[], owner_ordinal=lambda p: 0,
                              wait_stream=lambda: None)  # fmt: skip
        # the group's links (MPI's or the bootstrap's): only who leads the node is read
        links = SimpleNamespace(node_lead=proc == 0, group_wide=False)
        sides.append(nm.NodeMemory(pl, links, gpu))  # type: ignore[arg-type]
    owner, reader = sides
    try:
        assert size > 0
        owner.ensure_arena(100)  # generation 1 (64 KiB)
        first = owner.arenas[0]
        owner.publish_gen()  # the call that uses generation 1
        owner.ensure_arena(size)  # generation 2, for a later call, not yet published
        second = owner.arenas[0]
        assert first.handle != second.handle
        reader.refresh_arena(0)
        assert _PeerBlockSeen.opened == [(first.handle, first.size)], (
            "the reader opened a newer block than the generation it was told"
        )
        owner.publish_gen()
        reader.refresh_arena(0)
        assert _PeerBlockSeen.opened[-1] == (second.handle, second.size)
    finally:
        for blk in [*owner.gpu.retired, owner.arenas.get(0)]:
            if blk is not None:
                blk.close()
        dev.runtime.shutdown()


# -- 3. a peer that dies with GPU work pending cannot leave our stream waiting forever --------


def _gpu_side(dev: Any, check_peers: Any, timeout: float) -> Any:
    """A ``GpuSide`` of events mode with one peer (process 1), without MPI."""
    from nccltree.comm.group.gpu import GpuContext, GpuSide

    side = GpuSide.__new__(GpuSide)
    life = SimpleNamespace(seq=7, failure=None)
    placement = SimpleNamespace(rank=0, proc=0)
    side.ctx = GpuContext(placement, None, "tree", timeout, life, check_peers,  # type: ignore[arg-type]
                          lambda exc: None)  # fmt: skip
    side.device = dev
    side.sync_mode = False
    side.stream = dev.new_stream()
    return side


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1}], indirect=True)
def test_on_the_fake_a_peer_dead_with_gpu_work_pending_is_named_not_waited_on(
    fake_cupy: Any,
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification). The peer published work
    whose inter-process event never completes (it died with it pending). The survivor
    used to make its stream wait on that event: its stream, and the caller's after it,
    would wait forever. Now the wait goes through a bounded host-side wait that watches
    the node's processes: the dead peer is named, and nothing waits on its event."""
    from nccltree.comm.group.gpu import IpcEvent

    dev = nt.devices("gpu:0")[0]
    try:
        peer_stream = dev.new_stream()
        token = fake_cupy.hang_stream(peer_stream)
        peer_event = IpcEvent(dev)  # the peer's event (opened from its handle on a GPU)
        peer_event.record(int(peer_stream.cupy_stream.ptr))
        dead = threading.Event()

        def check_peers() -> None:
            if dead.is_set():
                raise PeerFailure("rank 0: process of ranks [1] died")

        side = _gpu_side(dev, check_peers, timeout=30)
        side.peer_events = {1: peer_event}
        threading.Timer(0.3, dead.set).start()
        t0 = time.monotonic()
        with pytest.raises(PeerFailure, match=r"ranks \[1\] died"):
            side.after([1])
        assert time.monotonic() - t0 < 20
        assert side.stream.query(), "the group's stream waits on a dead peer's event"
        # a slow peer that is alive: the wait is bounded by the group's timeout
        dead.clear()
        side.ctx.timeout = 0.5
        with pytest.raises(CommTimeout, match="did not finish within 0.5 s"):
            side.after([1])
        # a peer whose work completes: the stream is ordered after it
        token.release()
        side.after([1])
        assert side.stream.query()
        peer_event.close()
    finally:
        dev.runtime.shutdown()


# -- 4. NCCL communicators lazily, and ncclCommInitRank bounded --------------------------------


class _Comm:
    """The MPI communicator's part that ``nccl_comm`` uses (one process)."""

    def Get_rank(self) -> int:
        return 0

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 2}], indirect=True)
def test_on_the_fake_a_communicator_init_that_never_completes_is_bounded(
    fake_cupy: Any,
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): a process whose peers never
    join NCCL's bootstrap (``ncclCommInitRank`` blocks) gives up at the group's timeout
    with ``CommTimeout``, and a peer found dead meanwhile is named at once."""
    from nccltree.comm.group.gpu import nccl_comm

    dev = nt.devices("gpu:0")[0]
    try:
        release = fake_cupy.nccl.hang_next_init()
        t0 = time.monotonic()
        with pytest.raises(CommTimeout, match="within 0.5 s"):
            nccl_comm(_Comm().bcast, True, 0, 2, dev, timeout=0.5, check_peers=lambda: None)
        assert time.monotonic() - t0 < 10
        release()

        def dead() -> None:
            raise PeerFailure("rank 0: process of ranks [1] died")

        fake_cupy.nccl.hang_next_init()
        with pytest.raises(PeerFailure, match="died"):
            nccl_comm(_Comm().bcast, True, 0, 2, dev, timeout=30, check_peers=dead)
        fake_cupy.nccl.release_inits()
    finally:
        dev.runtime.shutdown()


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 2}], indirect=True)
def test_on_the_fake_a_one_node_group_makes_no_communicator_until_one_is_needed(
    fake_cupy: Any,
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): a group of one node whose
    processes have distinct GPUs used to create its NCCL communicator at bootstrap, in
    every such group, whether or not a call ever used NCCL. It now creates none there
    (NCCL's presence is still checked, so ``auto`` knows whether it may choose it); the
    first call that needs one creates it (every process makes that call)."""
    from nccltree.comm.group.gpu import GpuSide

    dev = nt.devices("gpu:0")[0]
    try:
        side = _gpu_side(dev, lambda: None, timeout=30)
        side.ctx.placement = SimpleNamespace(node_procs=[0], proc=0, nprocs=1)
        side.nccl_ok, side.nccl_missing, side.engine, side.comm = True, "", None, None
        side.event, side.peer_events = None, {}
        side.buses = ["0000:01:00.0"]
        side.ipc_problem = None  # IPC reaches every GPU of the node
        made: list[int] = []
        real = GpuSide.ensure_nccl

        def counting(self: Any) -> Any:
            made.append(1)
            return real(self)

        GpuSide.ensure_nccl = counting  # type: ignore[method-assign]
        try:
            side.connect()
        finally:
            GpuSide.ensure_nccl = real  # type: ignore[method-assign]
        assert made == [] and side.engine is None
        assert side.nccl_ok  # NCCL is there: auto may choose it
        calls = [c for c in fake_cupy.nccl.calls]
        assert calls == []
    finally:
        dev.runtime.shutdown()


# -- 6. plain moves through NCCL as bytes; fewer device switches per step ------------------------


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 3}], indirect=True)
@pytest.mark.parametrize("coll", ["broadcast", "all_gather", "gather", "scatter", "all_to_all",
                                  "sendrecv"])  # fmt: skip
def test_on_the_fake_nccl_moves_data_that_it_does_not_combine_as_bytes(
    fake_cupy: Any, coll: str
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): a collective that only moves
    data (broadcast, all_gather, and the sends and receives of gather, scatter,
    all_to_all and sendrecv) names ``ncclUint8`` and the byte count, whatever the dtype
    (bfloat16 here, a uint16 carrier); the results are numpy's."""
    from nccltree.comm.collectives import COLLECTIVES
    from nccltree.comm.faces import driver_method

    c = COLLECTIVES[coll]
    w = nt.World(nt.devices("gpu:0,1,2"), algorithm="nccl")
    try:
        n, count, root = 3, 6, 1
        rng = np.random.default_rng(5)
        full = [rng.integers(0, 60000, c.in_count(count, n)).astype(np.uint16) for _ in range(n)]
        xs = [d.from_host(f) for d, f in zip(w.devices, full, strict=True)]
        outs = [d.zeros(c.out_count(count, n), np.uint16) for d in w.devices]
        fake_cupy.nccl.calls.clear()
        kw: dict[str, Any] = {"root": root} if c.rooted else {}
        if coll == "broadcast":
            getattr(w, driver_method(coll))(xs, dtype="bfloat16", **kw)
        else:
            getattr(w, driver_method(coll))(xs, outs, dtype="bfloat16", **kw)
        calls = fake_cupy.nccl.calls
        assert calls
        import cupy

        assert {k.datatype for k in calls} == {cupy.cuda.nccl.NCCL_UINT8}, calls
        for r, (which, want) in enumerate(c.expected(full, "sum", root)):
            in_place = which == "in" or coll == "broadcast"  # broadcast was called in place
            got = (xs[r] if in_place else outs[r]).get().reshape(-1)
            np.testing.assert_array_equal(got, want.astype(np.uint16), err_msg=f"rank {r}")
    finally:
        w.close()


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 2}], indirect=True)
def test_on_the_fake_a_plan_step_switches_the_device_at_most_once(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wiring check on tests/fakecupy (not GPU verification): a stream's copy, reduction,
    scaling and SGD step enter their GPU once (they used to enter it twice: the stream's
    own context, then the kernel wrapper's), and an event record or a stream wait on a
    GPU's own stream enters none (CUDA needs no current device for them)."""
    import cupy

    entered: list[int] = []
    real_enter = cupy.cuda.Device.__enter__

    def counting(self: Any) -> Any:
        entered.append(self.id)
        return real_enter(self)

    devs = nt.devices("gpu:0,1")
    try:
        d0, d1 = devs
        s = d0.new_stream()
        a, b = d0.from_host(np.ones(1000, np.float32)), d0.zeros(1000, np.float32)
        c = d1.from_host(np.ones(1000, np.float32))
        ev = s.record()
        s.synchronize(10)
        monkeypatch.setattr(cupy.cuda.Device, "__enter__", counting)
        per_op: dict[str, int] = {}
        for name, op in (
            ("copy", lambda: s.copy(b, a)),
            ("peer copy", lambda: s.copy(b, c, src_device=d1)),
            ("reduce", lambda: s.reduce(b, [a, c], src_devices=[d0, d1])),
            ("scale", lambda: s.scale(b, 0.5)),
            ("record", lambda: s.record(ev)),
            ("wait", lambda: s.wait_event(ev)),
        ):
            op()  # the first time may enable peer access or load a kernel
            entered.clear()
            op()
            per_op[name] = len(entered)
        assert per_op == {"copy": 1, "peer copy": 1, "reduce": 1, "scale": 1, "record": 0,
                          "wait": 0}, per_op  # fmt: skip
        s.synchronize(10)
        np.testing.assert_array_equal(b.get(), np.full(1000, 0.5, np.float32))
    finally:
        devs[0].runtime.shutdown()
