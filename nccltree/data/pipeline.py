"""The reader thread and the slot exchange between it and the ranks.

``Pipeline`` holds everything the thread touches and never refers to the DataReader, so
dropping the reader lets the garbage collector run its finalizer, which stops the thread.
Per rank, a ``free`` queue holds empty batch buffers and a ``full`` queue filled ones: the
thread takes free buffers for every rank, reads one round of records through its one
cursor, fills the buffers and publishes them; a rank pops full buffers and gives them back.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np

from ..queue import BlockingQueue, QueueClosed
from .batch import Slot
from .decode import BadRecord, Transform
from .errors import DataError, EndOfData, ReaderClosed
from .format import keyname
from .lmdb_io import close_env
from .order import Dealing
from .sources import SequentialSource, ShuffledSource

if TYPE_CHECKING:
    from ..backends.base import Device, Stream

JOIN_TIMEOUT = 30.0


class Pipeline:
    """The reader thread's state and the consumer side of the slot exchange."""

    def __init__(
        self,
        env: Any,
        n: int,
        deal: Dealing,
        decoder: Any,
        transform: Transform,
        shuffle: int | None,
        slots: list[list[Slot]],
        devices: list[Device] | None,
        log_msgs: list[str | None],
        epochs: int | None,
    ) -> None:
        self.env, self.n, self.deal = env, n, deal
        self.decoder, self.transform, self.shuffle = decoder, transform, shuffle
        self.devices, self.log_msgs, self.epochs = devices, log_msgs, epochs
        ranks = deal.ranks
        self.free: list[BlockingQueue[Slot]] = [BlockingQueue() for _ in range(ranks)]
        self.full: list[BlockingQueue[Slot]] = [BlockingQueue() for _ in range(ranks)]
        for r in range(ranks):
            for slot in slots[r]:
                self.free[r].push(slot)
        self.slots_per_rank = len(slots[0])
        self.lock = threading.Lock()
        self.records_read = 0
        self.rounds_built = 0
        self.phase = "starting"
        self.served = [0] * ranks
        self.held = [0] * ranks
        self.wait_s = [0.0] * ranks
        self.waiting = [False] * ranks
        self.error: BaseException | None = None
        self.ended = False
        self.closed = False
        self.env_closed = False
        self.streams: list[Stream] | None = (
            [dev.new_stream() for dev in devices] if devices else None
        )
        self.thread = threading.Thread(target=self.run, name="nccltree-DataReader", daemon=True)

    # -- reader thread --

    def run(self) -> None:
        txn = None
        try:
            txn = self.env.begin(buffers=True)
            self._loop(txn)
        except QueueClosed:
            if not self.closed:  # a queue closed by anyone but close() is a bug
                self._fail(RuntimeError("a DataReader queue was closed unexpectedly"))
        except BaseException as e:  # noqa: BLE001 -- every failure must reach the consumers
            _scrub(e)
            self._fail(e)
        finally:
            if txn is not None:
                txn.abort()
            with self.lock:
                mine = self.closed and not self.env_closed
                self.env_closed |= mine
            if mine:  # close() could not wait for this thread, so closing was left to it
                close_env(self.env)

    def _fail(self, e: BaseException) -> None:
        self.error = e
        self.phase = "failed"
        for q in self.full:
            q.close(e)

    def _free_slot(self, rank: int) -> Slot:
        slot = self.free[rank].try_pop()
        if slot is None:
            self.phase = "waiting"  # back-pressure: every buffer of this rank is in use
            slot = self.free[rank].pop()
            self.phase = "reading"
        return slot

    def _group_slots(self, i: int) -> list[list[Slot]]:
        """Buffers (one per rank) for round ``i``, waiting for them if need be, and for
        as many of the following rounds as have a free buffer for every rank right now.

        The reader reads such a group in one pass and publishes it at once. A rank that
        drains its queue faster than the reader fills it is then woken once per group
        instead of once per batch; every wake-up moves the interpreter lock between the
        two threads and back, which costs as much as reading a batch of small records
        (measured: see docs/performance.md#target-3-kb-records-at-least-40-of-the-bare-record-rate).
        A rank that consumes more slowly than the reader reads frees one buffer at a
        time and so gets groups of one: each batch is published as soon as it is read.
        """
        d, ranks = self.deal, range(self.deal.ranks)
        if d.round_length(i) == 0:
            return []
        free = self.free
        group = [[self._free_slot(r) for r in ranks]]
        # Only this thread takes free buffers, so a non-empty free queue stays non-empty
        # until it does.
        while d.round_length(i + len(group)) and all(len(free[r]) for r in ranks):
            group.append([self._free_slot(r) for r in ranks])  # never waits: none is empty
        return group

    def _loop(self, txn: Any) -> None:
        d = self.deal
        if self.shuffle is None:
            source: Any = SequentialSource(txn, self.n, d.start)
        else:
            source = ShuffledSource(txn, self.n, self.shuffle)
        self.source = source
        self.phase = "reading"
        t, ranks, size = d.total_ranks, range(d.ranks), d.round_size
        # Rounds start at multiples of the round size (a multiple of t) from start, so a
        # rank's first offset in a round is the same in every round.
        first = [d.first_offset(d.start, r) for r in ranks]
        full, sequential = self.full, self.shuffle is None
        i, s = 0, d.start
        while not self.closed:
            # Buffers first, then records: the reader never holds more than the buffers.
            group = self._group_slots(i)
            if not group:
                break
            filled = 0
            try:
                if sequential:
                    lengths = [d.round_length(i + j) for j in range(len(group))]
                    values = source.take(sum(lengths))
                    o = 0
                    for j, m in enumerate(lengths):
                        for r in ranks:
                            vals = values[o + first[r] : o + m : t]
                            self._fill(group[j][r], r, vals, s + o, first[r], i + j)
                        o += m
                        self.records_read += m
                        filled += 1
                    del values, vals
                else:
                    for j, slots in enumerate(group):
                        for r in ranks:
                            vals = source.fetch(d.positions(i + j, r))
                            self._fill(slots[r], r, vals, s + j * size, first[r], i + j)
                            self.records_read += len(vals)
                            del vals
                        filled += 1
            finally:
                # Rounds are published whole, so a bad record fails every rank at the
                # same batch; the rounds before it are served first.
                for slots in group[:filled]:
                    for r in ranks:
                        full[r].push(slots[r])
                self.rounds_built += filled
            i += filled
            s += filled * size
        if not self.closed:
            self.ended = True
            self.phase = "ended"
            for q in full:
                q.close("end of data")

    def _fill(self, slot: Slot, rank: int, vals: list, s: int, first: int, i: int) -> None:
        if slot.pushed is not None:
            slot.pushed.synchronize()  # the last copy out of this host buffer is done
        try:
            if vals:  # a rank's share of the last round may be empty: nothing to decode
                transform = self.transform
                if transform.spatial:  # random crops and flips are drawn per position
                    t = self.deal.total_ranks
                    transform = transform.at(np.arange(s + first, s + first + len(vals) * t, t))
                self.decoder.fill(vals, slot.x, slot.y, transform)
        except BadRecord as e:
            pos = s + first + e.index * self.deal.total_ranks
            key = self.source.key_of(pos)
            raise DataError(
                f"record {keyname(key)} (number {self._record_number(pos)} in key order): "
                f"{e.reason}"
            ) from None
        slot.count, slot.index, slot.position = len(vals), i, s
        if slot.x_mem is not None:
            self._push(slot, rank)

    def _record_number(self, pos: int) -> int:
        if self.shuffle is None:
            return pos % self.n
        return int(self.source.index(np.array([pos]))[0])

    def _push(self, slot: Slot, rank: int) -> None:
        """Start the copy of a filled slot to the rank's device on a side stream."""
        assert self.streams is not None and slot.x_mem is not None and slot.y_mem is not None
        stream = self.streams[rank]
        if slot.released is not None:
            stream.wait_event(slot.released)  # the consumer's kernels have read the old data
        slot.x_mem.set_host(slot.x)
        slot.y_mem.set_host(slot.y)
        slot.x_mem.async_device_push(stream)
        slot.y_mem.async_device_push(stream)
        slot.pushed = stream.record()

    # -- consumer side --

    def take(self, rank: int, timeout: float | None) -> Slot:
        if self.closed:
            raise ReaderClosed("the DataReader is closed")
        if self.held[rank] >= self.slots_per_rank:
            raise RuntimeError(
                f"rank {rank} holds all {self.slots_per_rank} of its batch buffers; release() "
                "batches (or use them as context managers) before asking for more"
            )
        q = self.full[rank]
        try:
            slot = q.try_pop()
            if slot is None:
                t0 = time.perf_counter()
                self.waiting[rank] = True
                try:
                    slot = q.pop(timeout, log_on_wait=self.log_msgs[rank])
                finally:
                    self.waiting[rank] = False
                    self.wait_s[rank] += time.perf_counter() - t0
        except QueueClosed:
            raise self._terminal(rank) from None
        except TimeoutError:
            raise TimeoutError(
                f"DataReader rank {rank}: no batch within {timeout} s (reader {self.phase})"
            ) from None
        with self.lock:
            self.served[rank] += 1
            self.held[rank] += 1
        if slot.pushed is not None:
            assert self.devices is not None, "slots are pushed to devices only"
            dev = self.devices[rank]
            if dev.backend == "host":
                slot.pushed.synchronize()  # numpy code runs now, not in stream order
            else:
                dev.current_stream().wait_event(slot.pushed)
        return slot

    def _terminal(self, rank: int) -> BaseException:
        if self.closed:
            return ReaderClosed(f"the DataReader was closed while rank {rank} waited for a batch")
        if self.error is not None:
            e = self.error
            if isinstance(e, DataError):
                err = DataError(*e.args)
            else:
                err = DataError(f"the reader thread failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            return err
        return EndOfData(
            f"rank {rank}: no more batches after {self.served[rank]} "
            f"({self.epochs} epoch(s) of {self.n} records)"
        )

    def give_back(self, rank: int, slot: Slot) -> None:
        with self.lock:
            self.held[rank] -= 1
        if slot.x_mem is not None:
            assert self.devices is not None, "slots have device memory only with devices"
            slot.released = self.devices[rank].current_stream().record()
        try:
            self.free[rank].push(slot)
        except QueueClosed:
            pass  # the reader is gone; nothing will refill this buffer

    def shutdown(self) -> None:
        """Stop the thread, wake every waiter, close the environment (idempotent)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.phase not in ("ended", "failed"):
                self.phase = "closed"
        for q in self.free + self.full:
            q.close("the DataReader was closed")
        t = self.thread
        if t.ident is not None and t is not threading.current_thread():
            t.join(JOIN_TIMEOUT)
        with self.lock:
            mine = not self.env_closed and (t.ident is None or not t.is_alive())
            self.env_closed |= mine
        if mine:
            close_env(self.env)


def _scrub(e: BaseException) -> None:
    """Clear the locals of the frames in an exception chain's tracebacks: they hold
    memoryviews into the memory map, which must not outlive the environment."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if x.__traceback__ is not None:
            traceback.clear_frames(x.__traceback__)
        todo += [x.__cause__, x.__context__]
