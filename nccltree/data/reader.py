"""``DataReader``: one thread and one cursor feeding N ranks, round-robin, deterministic."""

from __future__ import annotations

import os
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..queue import BlockingQueue, QueueClosed
from .decode import BadRecord, DatumDecoder, RecordDecoder, Transform
from .errors import DataError, EndOfData, ReaderClosed
from .format import keyname, record_layout
from .lmdb_io import check_format, close_env, detect_format, open_env
from .order import Dealing
from .sources import SequentialSource, ShuffledSource

_JOIN_TIMEOUT = 30.0


class _Slot:
    """One reusable batch buffer of one rank (pinned host memory, maybe a device copy)."""

    __slots__ = ("x", "y", "count", "index", "position", "x_mem", "y_mem", "pushed", "released")

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y
        self.count = self.index = self.position = 0
        self.x_mem = self.y_mem = None  # SyncedMemory when batches go to a device
        self.pushed = None  # event: the device copy of this slot is done
        self.released = None  # event: the consumer's work on the device copy is done


class Batch:
    """A batch of one rank: ``x`` (records), ``y`` (int64 labels); unpacks as ``x, y``.

    ``index`` is the rank's batch number counted from the reader's ``start``;
    ``position`` the sequence position where its round begins (the rank's ``j``-th
    record is at sequence position ``position + first + j * T``, ``T`` the total number
    of ranks, ``first = (global_rank - position) mod T``). With a device hand-off ``x``
    and ``y`` are device arrays and ``x_host``/``y_host`` the pinned host copies.

    The arrays live in a buffer the reader reuses: hand the batch back with
    ``release()`` (or use it as a context manager) when done with them, and do not use
    the arrays afterwards.
    """

    __slots__ = ("rank", "index", "position", "_slot", "_state")

    def __init__(self, state: _State, rank: int, slot: _Slot) -> None:
        self._state, self.rank, self._slot = state, rank, slot
        self.index, self.position = slot.index, slot.position

    def _live(self) -> _Slot:
        if self._slot is None:
            raise RuntimeError("this batch was released; its buffer is being refilled")
        return self._slot

    def __len__(self) -> int:
        return self._live().count

    @property
    def x_host(self) -> np.ndarray:
        s = self._live()
        return s.x if s.count == len(s.x) else s.x[: s.count]

    @property
    def y_host(self) -> np.ndarray:
        s = self._live()
        return s.y if s.count == len(s.y) else s.y[: s.count]

    @property
    def x(self) -> Any:
        s = self._live()
        if s.x_mem is None:
            return self.x_host
        return s.x_mem.device_array()[: s.count]

    @property
    def y(self) -> Any:
        s = self._live()
        if s.y_mem is None:
            return self.y_host
        return s.y_mem.device_array()[: s.count]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.x, self.y))

    @property
    def released(self) -> bool:
        return self._slot is None

    def release(self) -> None:
        """Give the buffer back to the reader (a second call does nothing)."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self._state.give_back(self.rank, slot)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        if self._slot is None:
            return f"<Batch rank {self.rank} #{self.index} released>"
        return f"<Batch rank {self.rank} #{self.index} of {self._slot.count} at {self.position}>"


class _State:
    """Everything the reader thread uses. It never refers to the DataReader, so dropping
    the reader lets the garbage collector run its finalizer, which stops the thread."""

    def __init__(self, env: Any, n: int, deal: Dealing, decoder: Any, transform: Transform,
                 shuffle: int | None, slots: list[list[_Slot]], devices: list | None,
                 log_msgs: list[str | None], epochs: int | None) -> None:
        self.env, self.n, self.deal = env, n, deal
        self.decoder, self.transform, self.shuffle = decoder, transform, shuffle
        self.devices, self.log_msgs, self.epochs = devices, log_msgs, epochs
        ranks = deal.ranks
        self.free: list[BlockingQueue[_Slot]] = [BlockingQueue() for _ in range(ranks)]
        self.full: list[BlockingQueue[_Slot]] = [BlockingQueue() for _ in range(ranks)]
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
        self.streams = [dev.new_stream() for dev in devices] if devices else None
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
            if e.__traceback__ is not None:
                # Frames hold memoryviews into the map, which dies with the environment.
                traceback.clear_frames(e.__traceback__)
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

    def _free_slot(self, rank: int) -> _Slot:
        slot = self.free[rank].try_pop()
        if slot is None:
            self.phase = "waiting"  # back-pressure: every buffer of this rank is in use
            slot = self.free[rank].pop()
            self.phase = "reading"
        return slot

    def _loop(self, txn: Any) -> None:
        d = self.deal
        if self.shuffle is None:
            source: Any = SequentialSource(txn, self.n, d.start)
        else:
            source = ShuffledSource(txn, self.n, self.shuffle)
        self.source = source
        self.phase = "reading"
        t = d.total_ranks
        i = 0
        while not self.closed:
            m = d.round_length(i)
            if m == 0:
                break
            # Buffers first, then records: the reader never holds more than the buffers.
            slots = [self._free_slot(r) for r in range(d.ranks)]
            s = d.round_start(i)
            if self.shuffle is None:
                values = source.take(m)
                read = m
                for r, slot in enumerate(slots):
                    first = d.first_offset(s, r)
                    self._fill(slot, r, values[first:m:t], s, first, i)
                del values
            else:
                read = 0
                for r, slot in enumerate(slots):
                    vals = source.fetch(d.positions(i, r))
                    read += len(vals)
                    self._fill(slot, r, vals, s, d.first_offset(s, r), i)
                    del vals
            # A round is published whole, so a bad record fails every rank at the same batch.
            for r, slot in enumerate(slots):
                self.full[r].push(slot)
            with self.lock:
                self.records_read += read
                self.rounds_built += 1
            i += 1
        if not self.closed:
            self.ended = True
            self.phase = "ended"
            for q in self.full:
                q.close("end of data")

    def _fill(self, slot: _Slot, rank: int, vals: list, s: int, first: int, i: int) -> None:
        if slot.pushed is not None:
            slot.pushed.synchronize()  # the last copy out of this host buffer is done
        try:
            self.decoder.fill(vals, slot.x, slot.y, self.transform)
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

    def _push(self, slot: _Slot, rank: int) -> None:
        """Start the copy of a filled slot to the rank's device on a side stream."""
        stream = self.streams[rank]
        if slot.released is not None:
            stream.wait_event(slot.released)  # the consumer's kernels have read the old data
        slot.x_mem.set_host(slot.x)
        slot.y_mem.set_host(slot.y)
        slot.x_mem.async_device_push(stream)
        slot.y_mem.async_device_push(stream)
        slot.pushed = stream.record()

    # -- consumer side --

    def take(self, rank: int, timeout: float | None) -> _Slot:
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

    def give_back(self, rank: int, slot: _Slot) -> None:
        with self.lock:
            self.held[rank] -= 1
        if slot.x_mem is not None:
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
            t.join(_JOIN_TIMEOUT)
        with self.lock:
            mine = not self.env_closed and (t.ident is None or not t.is_alive())
            self.env_closed |= mine
        if mine:
            close_env(self.env)


def _check_int(name: str, value: object, lo: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}; got {value!r}")
    return int(value)


class DataReader:
    """Feed ``ranks`` consumers from one LMDB database through one cursor.

    **The round-robin rule.** Record ``g`` of the endless sequence (the database in key
    order, wrapping at its end; with ``shuffle=seed`` each epoch's records in a seeded
    permutation) goes to rank ``g mod ranks``, and each rank's batch ``i`` is its next
    ``batch_size`` records. So the union of all ranks' batch ``i`` is exactly the
    single-rank batch ``i`` of size ``ranks * batch_size``: ``N``-rank weak-scaling
    training sees the same data as 1-rank training with the ``N``-times larger batch.

    Parameters:
        path: the LMDB environment (directory with ``data.mdb``, or the file).
        batch_size: records per batch and rank (>= 1).
        ranks: consumers served by this reader (>= 1).
        prefetch: batch buffers per rank, i.e. how far the reader may run ahead of a
            rank (>= 0; 0 means one buffer: the next batch is read after the last is
            released). Steady state allocates nothing: buffers are reused.
        epochs: None for the endless sequence; ``k`` ends after ``k * len(db)`` records:
            the last round is short (some ranks' last batch may be short or even empty,
            so every rank sees the same number of batches) or, with ``drop_last``,
            dropped. Then ``next_batch`` raises ``EndOfData`` and ``batches`` stops.
        drop_last: drop a final incomplete round (only with ``epochs``).
        start: begin at sequence position ``start``; see ``position`` for resuming.
        shuffle: None (key order) or an int seed: a permutation per epoch, the same on
            every run; the round-robin rule applies to the permuted sequence.
        process_rank, process_count: run as process ``p`` of ``P``: this reader keeps the
            positions ``g`` with ``g mod P == p``, so the data order over all processes
            is the single-process order (local rank ``r`` is global rank ``r * P + p``).
        dtype, scale, mean: Caffe's transforms, applied while the batch is assembled:
            ``(x - mean) * scale`` in ``dtype`` (float32 by default when a mean or scale
            is given). ``mean``: scalar, one value per channel (axis 0), or full shape.
        format: ``"auto"`` (detected from the first record), ``"nccltree"`` or ``"datum"``.
        log_on_wait: a rank that has to wait for data logs (logger ``nccltree.queue``)
            a message (True: a default one; a string: that one, ``{rank}`` filled in;
            None/False: nothing).
        device: None, or one nccltree Device per rank: each batch is copied to its
            rank's device on a side stream while the rank still works on the previous one.

    Errors in the reader thread (a record that does not decode, records of mixed shapes)
    are raised by ``next_batch`` as ``DataError`` naming the key. ``close()``,
    context-manager exit and garbage collection stop the thread and wake waiting ranks
    with ``ReaderClosed``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        batch_size: int,
        ranks: int = 1,
        prefetch: int = 4,
        epochs: int | None = None,
        drop_last: bool = False,
        start: int = 0,
        shuffle: int | None = None,
        *,
        process_rank: int = 0,
        process_count: int = 1,
        dtype: Any = None,
        scale: float | None = None,
        mean: Any = None,
        format: str = "auto",
        log_on_wait: bool | str | None = True,
        device: Any = None,
    ) -> None:
        batch_size = _check_int("batch_size", batch_size, 1)
        ranks = _check_int("ranks", ranks, 1)
        prefetch = _check_int("prefetch", prefetch, 0)
        if epochs is not None:
            epochs = _check_int("epochs", epochs, 1)
        start = _check_int("start", start, 0)
        if shuffle is not None:
            shuffle = _check_int("shuffle (a seed, or None)", shuffle, 0)
        process_count = _check_int("process_count", process_count, 1)
        process_rank = _check_int("process_rank", process_rank, 0)
        if process_rank >= process_count:
            raise ValueError(f"process_rank must be < process_count={process_count}; got {process_rank}")
        check_format(format)
        devices = _check_devices(device, ranks)

        self.path = str(path)
        env = open_env(path)
        try:
            n, fmt, decoder = _inspect(env, self.path, format)
            end = None if epochs is None else epochs * n
            deal = Dealing(n, batch_size, ranks, process_rank, process_count, start, end, drop_last)
            if end is not None and start > end:
                raise ValueError(f"start={start} is past the end of the data ({epochs} x {n} records)")
            if end is not None and drop_last and deal.rounds() == 0:
                raise ValueError(
                    f"no batch at all: a round of batch_size={batch_size} x {deal.total_ranks} "
                    f"rank(s) needs {deal.round_size} records, but the data has "
                    f"{end - start} ({epochs} epoch(s) of {n}) and drop_last=True"
                )
            transform = Transform(decoder.shape, decoder.dtype, dtype, scale, mean)
            slots = _make_slots(ranks, max(1, prefetch), batch_size, decoder.shape,
                                transform.out_dtype, devices)
            msgs = [_wait_message(log_on_wait, self.path, r) for r in range(ranks)]
            state = _State(env, n, deal, decoder, transform, shuffle, slots, devices, msgs, epochs)
        except BaseException:
            close_env(env)
            raise
        self._state = state
        self.format, self.records = fmt, n
        self.batch_size, self.ranks, self.prefetch = batch_size, ranks, prefetch
        self.epochs, self.drop_last, self.start, self.shuffle = epochs, drop_last, start, shuffle
        self.process_rank, self.process_count = process_rank, process_count
        self.shape, self.dtype = decoder.shape, transform.out_dtype
        self._finalizer = weakref.finalize(self, state.shutdown)
        state.thread.start()

    def __len__(self) -> int:
        """Records in the database."""
        return self.records

    @property
    def round_size(self) -> int:
        """Sequence positions per batch round: batch_size x ranks x process_count."""
        return self._state.deal.round_size

    @property
    def batches_per_rank(self) -> int | None:
        """Batches each rank gets (None when endless)."""
        return self._state.deal.rounds()

    @property
    def position(self) -> int:
        """Where the next batch round not yet served to every rank begins.

        A rank's batch ``i`` counts as served when ``next_batch`` returns it. Snapshot
        ``position`` once every rank has consumed batch ``i`` (and none has asked for
        batch ``i + 1``), and a reader created with ``start=position`` serves exactly the
        batches ``i + 1, i + 2, ...`` this one would have.
        """
        st = self._state
        pos = st.deal.round_start(min(st.served))
        return pos if st.deal.end is None else min(pos, st.deal.end)

    def next_batch(self, rank: int = 0, timeout: float | None = None) -> Batch:
        """The next batch of ``rank`` (waiting up to ``timeout`` s; None: no limit).

        Raises ``EndOfData`` after the last batch (``epochs=k``), ``DataError`` if the
        reader hit a bad record, ``ReaderClosed`` once the reader is closed, and
        ``TimeoutError`` when ``timeout`` runs out.
        """
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < self.ranks:
            raise ValueError(f"rank must be an int in [0, {self.ranks}); got {rank!r}")
        return Batch(self._state, int(rank), self._state.take(int(rank), timeout))

    def batches(self, rank: int = 0, timeout: float | None = None) -> Iterator[Batch]:
        """Iterate over ``rank``'s batches until the end of the data.

        Each batch is released when the next one is requested (or the loop ends), so a
        batch's arrays are valid until the next iteration.
        """
        batch = None
        try:
            while True:
                try:
                    batch = self.next_batch(rank, timeout)
                except EndOfData:
                    return
                yield batch
                batch.release()
        finally:
            if batch is not None:
                batch.release()

    def stats(self) -> dict[str, Any]:
        """Counters and state: ``records_read`` (from the database), ``rounds_built``;
        per rank ``batches_served``, ``wait_s`` (seconds spent waiting for data),
        ``waiting`` (waiting now) and ``queued`` (batches ready); ``position``; and
        ``phase``, the reader thread's state: starting, reading, waiting (for a free
        buffer: the consumers are the bottleneck), ended, failed or closed."""
        st = self._state
        with st.lock:
            return {
                "records_read": st.records_read,
                "rounds_built": st.rounds_built,
                "batches_served": list(st.served),
                "wait_s": list(st.wait_s),
                "waiting": list(st.waiting),
                "position": self.position,
                "phase": st.phase,
                "queued": [len(q) for q in st.full],
            }

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Stop the reader thread and wake waiting ranks with ``ReaderClosed`` (idempotent)."""
        self._finalizer()

    def __enter__(self) -> DataReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<DataReader {self.path!r}: {self.records} {self.format} records, "
            f"batch_size={self.batch_size}, ranks={self.ranks}, phase={self._state.phase}>"
        )


def _inspect(env: Any, path: str, format: str) -> tuple[int, str, Any]:
    """Records, format and a batch decoder, from the database's first record."""
    with env.begin(buffers=True) as txn:
        n = txn.stat()["entries"]
        if n == 0:
            raise DataError(f"the database at {path!r} is empty")
        cur = txn.cursor()
        cur.first()
        key, value = cur.key(), cur.value()
        fmt = detect_format(value, key) if format == "auto" else format
        try:
            decoder = RecordDecoder(record_layout(value)) if fmt == "nccltree" else DatumDecoder(value)
        except ValueError as e:
            raise DataError(f"record {keyname(key)}: {e}") from None
    return n, fmt, decoder


def _check_devices(device: Any, ranks: int) -> list | None:
    if device is None:
        return None
    from ..backends.base import Device

    devs = [device] if isinstance(device, Device) else list(device)
    if len(devs) != ranks or not all(isinstance(d, Device) for d in devs):
        raise ValueError(f"device must be None or {ranks} nccltree Device(s), one per rank; got {device!r}")
    return devs


def _make_slots(ranks: int, count: int, batch_size: int, shape: tuple[int, ...],
                dtype: np.dtype, devices: Sequence | None) -> list[list[_Slot]]:
    from ..memory import SyncedMemory, pinned_empty

    slots = []
    for r in range(ranks):
        row = []
        for _ in range(count):
            slot = _Slot(pinned_empty((batch_size, *shape), dtype), pinned_empty((batch_size,), np.int64))
            if devices is not None:
                slot.x_mem = SyncedMemory(slot.x.shape, dtype, devices[r])
                slot.y_mem = SyncedMemory(slot.y.shape, np.int64, devices[r])
            row.append(slot)
        slots.append(row)
    return slots


def _wait_message(log_on_wait: bool | str | None, path: str, rank: int) -> str | None:
    if log_on_wait is None or log_on_wait is False:
        return None
    if log_on_wait is True:
        return f"DataReader {path!r}: rank {rank} is waiting for data (the reader is behind)"
    if isinstance(log_on_wait, str):
        return log_on_wait.replace("{rank}", str(rank))
    raise TypeError(f"log_on_wait must be True, False, None or a message string; got {log_on_wait!r}")
