"""``DataReader``: one thread and one cursor feeding N ranks, round-robin, deterministic."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

from .._validate import check_index, check_int, check_timeout
from .batch import Batch, Slot
from .datum import image_mode
from .decode import DatumDecoder, RecordDecoder, Transform
from .errors import DataError, EndOfData
from .format import keyname, record_layout
from .lmdb_io import HoldsEnv, check_format, close_env, detect_format, open_env
from .order import Dealing
from .pipeline import Pipeline

if TYPE_CHECKING:
    from ..backends.base import Device

__all__ = ["Batch", "DataReader"]

log = logging.getLogger("nccltree.data")


class DataReader(HoldsEnv):
    """Feed ``ranks`` consumers from one LMDB database through one cursor (a
    :class:`~nccltree.data.BatchSource`, whose batches are :class:`Batch` objects).

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
        process_rank, process_count: run as process ``p`` of ``P`` with ``ranks=R`` each:
            local rank ``r`` is global rank ``p * R + r`` of ``R * P`` (the process
            group's numbering), so this reader keeps the positions ``g`` with
            ``g mod (R * P)`` in ``p * R .. p * R + R - 1`` and the data order over all
            processes is the single-process order with ``R * P`` ranks.
        dtype, scale, mean: Caffe's transforms, applied while the batch is assembled:
            ``(x - mean) * scale`` in ``dtype`` (float32 by default when a mean or scale
            is given). ``mean``: scalar, one value per channel (axis 0), or full shape.
        crop, mirror, train, seed: Caffe's ``crop_size`` and ``mirror``, on records
            ``(C, H, W)``: batches hold ``(C, crop, crop)`` windows, flipped horizontally
            at random with ``mirror``. With ``train=True`` (training) the window offsets
            and flips are drawn at random, a pure function of ``(seed, g)`` for record
            ``g`` of the endless sequence, so they do not depend on the rank count or on
            prefetch; with ``train=False`` (evaluation) the window is the center one and
            nothing is flipped. A full-shape mean is subtracted before the crop, as Caffe
            does. ``shape`` is then the cropped shape (``record_shape`` the stored one).
        format: ``"auto"`` (detected from the first record), ``"nccltree"`` or ``"datum"``.
        force_color, force_gray: decode encoded Datum images as 3 BGR channels or as 1
            gray channel, as Caffe's data-layer options of these names do; by default each
            image keeps its own channels (Caffe's default: an RGBA PNG gives 4). They
            apply to encoded Datums only; both at once is a ValueError.
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
        dtype: DTypeLike | None = None,
        scale: float | None = None,
        mean: Any = None,
        crop: int | None = None,
        mirror: bool = False,
        train: bool = True,
        seed: int = 0,
        format: str = "auto",
        force_color: bool = False,
        force_gray: bool = False,
        log_on_wait: bool | str | None = True,
        device: Device | Sequence[Device] | None = None,
    ) -> None:
        batch_size = check_int(batch_size, "batch_size", min=1)
        ranks = check_int(ranks, "ranks", min=1)
        prefetch = check_int(prefetch, "prefetch", min=0)
        if epochs is not None:
            epochs = check_int(epochs, "epochs", min=1)
        start = check_int(start, "start", min=0)
        if shuffle is not None:
            shuffle = check_int(shuffle, "shuffle (a seed, or None)", min=0)
        process_count = check_int(process_count, "process_count", min=1)
        process_rank = check_index(process_rank, "process_rank", process_count)
        check_format(format)
        mode = image_mode(force_color, force_gray)
        devices = _check_devices(device, ranks)

        self.path = str(path)
        env = open_env(path)
        try:
            n, fmt, decoder = _inspect(env, self.path, format, mode)
            end = None if epochs is None else epochs * n
            deal = Dealing(n, batch_size, ranks, process_rank, process_count, start, end, drop_last)
            if end is not None and start > end:
                raise ValueError(
                    f"start={start} is past the end of the data ({epochs} x {n} records)"
                )
            if end is not None and drop_last and deal.rounds() == 0:
                raise ValueError(
                    f"no batch at all: a round of batch_size={batch_size} x {deal.total_ranks} "
                    f"rank(s) needs {deal.round_size} records, but the data has "
                    f"{end - start} ({epochs} epoch(s) of {n}) and drop_last=True"
                )
            transform = Transform(
                decoder.shape,
                decoder.dtype,
                dtype,
                scale,
                mean,
                crop=crop,
                mirror=mirror,
                train=train,
                seed=seed,
            )
            shape = transform.out_shape
            slots = _make_slots(
                ranks, max(1, prefetch), batch_size, shape, transform.out_dtype, devices
            )
            msgs = [_wait_message(log_on_wait, self.path, r) for r in range(ranks)]
            state = Pipeline(
                env, n, deal, decoder, transform, shuffle, slots, devices, msgs, epochs
            )
        except BaseException:
            close_env(env)
            raise
        self._state = state
        self.format, self.records = fmt, n
        self.batch_size, self.ranks, self.prefetch = batch_size, ranks, prefetch
        self.epochs, self.drop_last, self.start, self.shuffle = epochs, drop_last, start, shuffle
        self.process_rank, self.process_count = process_rank, process_count
        self.shape, self.dtype = transform.out_shape, transform.out_dtype
        self.record_shape = decoder.shape
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
        rank = check_index(rank, "rank", self.ranks)
        timeout = check_timeout(timeout)
        return Batch(self._state, rank, self._state.take(rank, timeout))

    def batches(self, rank: int = 0, timeout: float | None = None) -> Iterator[Batch]:
        """Iterate over ``rank``'s batches until the end of the data, each waited for up
        to ``timeout`` s as in :meth:`next_batch`.

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
        """Whether the reader was closed (:meth:`close`, or its finalizer)."""
        return self._state.closed

    def close(self) -> None:
        """Stop the reader thread and wake waiting ranks with ``ReaderClosed`` (idempotent)."""
        self._finalizer()

    def __repr__(self) -> str:
        return (
            f"<DataReader {self.path!r}: {self.records} {self.format} records, "
            f"batch_size={self.batch_size}, ranks={self.ranks}, phase={self._state.phase}>"
        )


def _inspect(env: Any, path: str, format: str, mode: str) -> tuple[int, str, Any]:
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
            decoder = (
                RecordDecoder(record_layout(value))
                if fmt == "nccltree"
                else DatumDecoder(value, mode)
            )
        except ValueError as e:
            raise DataError(f"record {keyname(key)} (number 0 in key order): {e}") from None
    if mode != "native" and not getattr(decoder, "encoded", False):
        # Caffe logs the same and goes on: the options concern encoded images only.
        log.warning("DataReader %r: force_%s applies to encoded Datums only", path, mode)
    return n, fmt, decoder


def _check_devices(device: Device | Sequence[Device] | None, ranks: int) -> list[Device] | None:
    if device is None:
        return None
    from ..backends.base import Device

    devs = [device] if isinstance(device, Device) else list(device)
    if len(devs) != ranks or not all(isinstance(d, Device) for d in devs):
        raise ValueError(
            f"device must be None or {ranks} nccltree Device(s), one per rank; got {device!r}"
        )
    return devs


def _make_slots(
    ranks: int,
    count: int,
    batch_size: int,
    shape: tuple[int, ...],
    dtype: np.dtype,
    devices: Sequence[Device] | None,
) -> list[list[Slot]]:
    from ..memory import SyncedMemory, pinned_empty

    slots = []
    for r in range(ranks):
        row = []
        for _ in range(count):
            slot = Slot(
                pinned_empty((batch_size, *shape), dtype), pinned_empty((batch_size,), np.int64)
            )
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
    raise TypeError(
        f"log_on_wait must be True, False, None or a message string; got {log_on_wait!r}"
    )
