"""What a training driver reads: the ``BatchSource`` protocol and an in-memory source.

:class:`~nccltree.data.DataReader` implements the protocol (its batches implement
``RankBatch``); so do :class:`MemorySource` and any test double with the same members.
:meth:`nccltree.parallel.DataParallel.fit` takes a ``BatchSource``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .._validate import check_index

if TYPE_CHECKING:
    from ..backends.base import Array

__all__ = ["BatchSource", "MemorySource", "RankBatch"]


class RankBatch(Protocol):
    """One rank's batch: unpacks as ``x, y`` (records and labels, on the host or on the
    rank's device) and is handed back with ``release()`` -- a second call does nothing --
    or by leaving a ``with`` block."""

    @property
    def position(self) -> int | None:
        """The sequence position where this batch's round begins (None: not positioned)."""
        ...

    def __iter__(self) -> Iterator[Array]: ...

    def release(self) -> None:
        """Hand the batch back to its source (a second call does nothing)."""
        ...

    def __enter__(self) -> RankBatch: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class BatchSource(Protocol):
    """Batches for ``ranks`` consumers: ``next_batch(rank, timeout=)`` returns the rank's
    next :class:`RankBatch` or raises ``TimeoutError`` when ``timeout`` seconds pass first.

    ``start`` is the sequence position of the first round served (None: the source is not
    positioned, so a driver cannot say where the data continue) and ``round_size`` the
    number of examples in one round over all ranks.
    """

    @property
    def ranks(self) -> int:
        """The number of consumers (ranks) the source serves."""
        ...

    @property
    def start(self) -> int | None:
        """The sequence position of the first round served (None: not positioned)."""
        ...

    @property
    def round_size(self) -> int:
        """The number of examples in one round over all ranks."""
        ...

    def next_batch(self, rank: int = 0, timeout: float | None = None) -> RankBatch:
        """The next batch of ``rank``; ``TimeoutError`` when ``timeout`` seconds pass
        first (None: no limit)."""
        ...


class _HeldBatch:
    """A batch of :class:`MemorySource`: arrays held in memory, nothing to hand back."""

    position = None

    def __init__(self, x: Array, y: Array) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[Array]:
        return iter((self.x, self.y))

    def release(self) -> None:
        pass

    def __enter__(self) -> _HeldBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class MemorySource:
    """A :class:`BatchSource` over batches held in memory, with no I/O at all (benchmarks
    of compute and communication, tests): rank ``r``'s ``i``-th batch is
    ``batches[r][i % len(batches[r])]``, endlessly. Not positioned (``start`` is None).
    Each rank's batches are read by that rank's thread only.
    """

    start = None

    def __init__(self, batches: Sequence[Sequence[tuple[Array, Array]]]) -> None:
        if not batches or any(not per_rank for per_rank in batches):
            raise ValueError("MemorySource needs at least one batch for every rank")
        self._batches = [[_HeldBatch(x, y) for x, y in per_rank] for per_rank in batches]
        self._next = [0] * len(self._batches)

    @property
    def ranks(self) -> int:
        """The number of ranks (one list of batches each)."""
        return len(self._batches)

    @property
    def round_size(self) -> int:
        """Examples in every rank's first batch, together."""
        return sum(len(per_rank[0].y) for per_rank in self._batches)

    def next_batch(self, rank: int = 0, timeout: float | None = None) -> _HeldBatch:
        """The next batch of ``rank`` (held in memory: there is never a wait, so
        ``timeout`` is not used)."""
        rank = check_index(rank, "rank", self.ranks)
        per_rank = self._batches[rank]
        i = self._next[rank]
        self._next[rank] = i + 1
        return per_rank[i % len(per_rank)]
