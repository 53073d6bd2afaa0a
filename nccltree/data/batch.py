"""Batches: reused batch buffers (slots) and the handle a rank gets for one of them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..backends.base import Array, Event
    from ..memory import SyncedMemory
    from .pipeline import Pipeline


class Slot:
    """One reusable batch buffer of one rank (pinned host memory, maybe a device copy)."""

    __slots__ = ("x", "y", "count", "index", "position", "x_mem", "y_mem", "pushed", "released")

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y
        self.count = self.index = self.position = 0
        # SyncedMemory when batches go to a device
        self.x_mem: SyncedMemory | None = None
        self.y_mem: SyncedMemory | None = None
        self.pushed: Event | None = None  # the device copy of this slot is done
        self.released: Event | None = None  # the consumer's work on the device copy is done


class Batch:
    """A batch of one rank: ``x`` (records), ``y`` (int64 labels); unpacks as ``x, y``.

    ``index`` is the rank's batch number counted from the reader's ``start``;
    ``position`` the sequence position where its round begins (the rank's ``j``-th
    record is at sequence position ``position + first + j * T``, ``T`` the total number
    of ranks, ``first = (global_rank - position) mod T``). With a device hand-off ``x``
    and ``y`` are device arrays and ``x_host``/``y_host`` the pinned host copies.

    The arrays live in a buffer the reader reuses: hand the batch back with
    ``release()`` (or use it as a context manager) when done with them, and do not use
    the arrays afterwards. Made by the reader (``DataReader.next_batch``), which passes
    its pipeline ``state``, the ``rank`` and the filled ``slot``.
    """

    __slots__ = ("rank", "index", "position", "_slot", "_state")

    def __init__(self, state: Pipeline, rank: int, slot: Slot) -> None:
        self._state, self.rank = state, rank
        self._slot: Slot | None = slot
        self.index, self.position = slot.index, slot.position

    def _live(self) -> Slot:
        if self._slot is None:
            raise RuntimeError("this batch was released; its buffer is being refilled")
        return self._slot

    def __len__(self) -> int:
        return self._live().count

    @property
    def x_host(self) -> np.ndarray:
        """The records in host memory (the pinned copy under a device hand-off)."""
        s = self._live()
        return _first(s.x, s.count)

    @property
    def y_host(self) -> np.ndarray:
        """The int64 labels in host memory (the pinned copy under a device hand-off)."""
        s = self._live()
        return _first(s.y, s.count)

    @property
    def x(self) -> Any:
        """The records: a device array under a device hand-off, else the host array.
        ``RuntimeError`` once the batch is released."""
        s = self._live()
        return _first(s.x, s.count, s.x_mem)

    @property
    def y(self) -> Any:
        """The int64 labels, on the device as ``x`` is."""
        s = self._live()
        return _first(s.y, s.count, s.y_mem)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.x, self.y))

    @property
    def released(self) -> bool:
        """Whether the batch was handed back (its arrays are then not to be used)."""
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


def _first(host: np.ndarray, count: int, mem: SyncedMemory | None = None) -> Array:
    """The first ``count`` records of a slot's buffer: of its device copy ``mem`` when
    there is one, else of the pinned host array (the array itself when full)."""
    if mem is not None:
        return mem.device_array()[:count]
    return host if count == len(host) else host[:count]
