"""The groups made of a World's ranks: ``new_group``, ``split`` and the per-rank split.

``Subgroups`` checks which ranks form a group and in which order, asks the World to make
it (``make_group``: a World of those ranks), and keeps every group it made so that they
close with the World. The per-rank ``comm.split`` is a meeting of every rank, bounded by
the timeout: the last rank to arrive makes the groups, and an abort wakes every waiting
rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._errors import CommTimeout
from .._validate import check_index, check_int

if TYPE_CHECKING:
    from ..backends.base import Device
    from .comm import Comm
    from .world import World


class Subgroups:
    """The groups of a World of ``devices``. ``make_group(ranks, algorithm)`` makes a
    World of the parent's ``ranks`` (None: the parent's algorithm); ``check_usable``
    raises when the parent is closed or failed; ``fail`` fails it for good."""

    def __init__(
        self,
        devices: Sequence[Device],
        timeout: float,
        make_group: Callable[[list[int], str | None], World],
        check_usable: Callable[[], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        self.devices = list(devices)
        self.size = size = len(self.devices)
        self.timeout = timeout
        self.make_group = make_group
        self.check_usable = check_usable
        self.fail = fail
        #: every group made (closed with the parent)
        self.groups: list[World] = []
        self._barrier = threading.Barrier(size)
        self._choices: list[tuple[int | None, int]] = [(None, 0)] * size
        self._results: dict[int, dict[int, World]] = {}
        self._gen = [0] * size

    def new_group(self, ranks: Sequence[int], algorithm: str | None) -> World:
        """A group of ``ranks``, in that order (checked: distinct ranks of the parent)."""
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ranks must be a sequence of ranks, got {type(ranks).__name__}")
        picked = [check_index(r, "a rank of the group", self.size) for r in ranks]
        if not picked:
            raise ValueError("a group needs at least one rank")
        if len(set(picked)) != len(picked):
            raise ValueError(f"ranks of a group must be distinct, got {list(ranks)}")
        group = self.make_group(picked, algorithm)
        self.groups.append(group)
        return group

    def split(
        self, colors: Sequence[int | None], keys: Sequence[int] | None = None
    ) -> dict[int, World]:
        """MPI's ``Comm_split``: a group per color, ordered by ``(keys[r], r)``."""
        if len(colors) != self.size:
            raise ValueError(f"colors has {len(colors)} entries for {self.size} ranks")
        if keys is not None and len(keys) != self.size:
            raise ValueError(f"keys has {len(keys)} entries for {self.size} ranks")
        order: dict[int, list[tuple[int, int]]] = {}
        for r, c in enumerate(colors):
            if c is None:
                continue
            c = check_int(c, "a color", min=0)
            k = 0 if keys is None else check_int(keys[r], "a key")
            order.setdefault(c, []).append((k, r))
        return {c: self.new_group([r for _, r in sorted(members)], None)
                for c, members in sorted(order.items())}  # fmt: skip

    def split_by_ranks(self, rank: int, color: int | None, key: int) -> Comm | None:
        """``comm.split``: every rank calls it; the last to arrive makes the groups; each
        rank gets its face in its group (None for color None)."""
        self.check_usable()
        gen = self._gen[rank] = self._gen[rank] + 1
        self._choices[rank] = (color, key)
        try:
            if self._barrier.wait(self.timeout) == 0:
                self._results.pop(gen - 1, None)
                colors = [c for c, _ in self._choices]
                keys = [k for _, k in self._choices]
                try:
                    self.check_usable()
                    self._results[gen] = self.split(colors, keys)
                except BaseException as exc:
                    self.fail(exc)
                    raise
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            self.check_usable()  # aborted: PeerFailure, saying why
            self.fail(CommTimeout(f"rank {rank}: not every rank called split within "
                                  f"{self.timeout:g} s"))  # fmt: skip
            raise CommTimeout(
                f"rank {rank}: not every rank called split within {self.timeout:g} s"
            ) from None
        if color is None:
            return None
        group = self._results[gen][color]
        return group.comm(group.devices.index(self.devices[rank]))

    def wake(self) -> None:
        """Wake every rank waiting in ``split_by_ranks`` (they raise)."""
        self._barrier.abort()

    def close(self) -> None:
        """Wake the waiting ranks and close every group made."""
        self._barrier.abort()
        for g in self.groups:
            g.close()
