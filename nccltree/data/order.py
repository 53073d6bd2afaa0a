"""The record sequence and how it is dealt to ranks (pure functions, no I/O).

The endless sequence: position ``g`` is database record ``g mod n`` in key order (with
``shuffle=seed``: record ``perm_e[g mod n]`` where ``e = g // n`` is the epoch and
``perm_e`` a seeded permutation). Position ``g`` goes to global rank ``g mod T`` where
``T = ranks * process_count``; local rank ``r`` of process ``p`` is global rank
``p * ranks + r`` (the process group's node-major numbering: process ``p`` holds the
consecutive ranks ``p * ranks .. p * ranks + ranks - 1``), so a process keeps exactly the
positions ``g`` with ``g mod T`` in that range. Batch ``i`` of every rank comes from round ``i``: the
``T * batch_size`` positions starting at ``start + i * T * batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The record order of ``epoch`` under ``shuffle=seed``: the same on every run."""
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass(frozen=True)
class Dealing:
    """Round geometry for one process of a reader."""

    n: int  # records in the database
    batch_size: int
    ranks: int  # ranks served by this process
    process_rank: int = 0
    process_count: int = 1
    start: int = 0
    end: int | None = None  # one past the last position (epochs * n), None = endless
    drop_last: bool = False

    @property
    def total_ranks(self) -> int:
        return self.ranks * self.process_count

    @property
    def round_size(self) -> int:
        """Positions per round, over all ranks of all processes."""
        return self.total_ranks * self.batch_size

    def global_rank(self, rank: int) -> int:
        return self.process_rank * self.ranks + rank

    def round_start(self, i: int) -> int:
        return self.start + i * self.round_size

    def round_length(self, i: int) -> int:
        """Positions in round ``i`` (short at the end), 0 when there is no round ``i``."""
        s = self.round_start(i)
        if self.end is None:
            return self.round_size
        m = max(0, min(self.round_size, self.end - s))
        if self.drop_last and m < self.round_size:
            return 0
        return m

    def rounds(self) -> int | None:
        """Number of rounds (None when endless)."""
        if self.end is None:
            return None
        total = max(0, self.end - self.start)
        full, rest = divmod(total, self.round_size)
        return full + (1 if rest and not self.drop_last else 0)

    def first_offset(self, round_start: int, rank: int) -> int:
        """Offset in a round of the first position that goes to local ``rank``."""
        return (self.global_rank(rank) - round_start) % self.total_ranks

    def positions(self, i: int, rank: int) -> np.ndarray:
        """Sequence positions of local ``rank``'s batch ``i`` (the round-robin rule)."""
        s, m = self.round_start(i), self.round_length(i)
        return np.arange(s + self.first_offset(s, rank), s + m, self.total_ranks, dtype=np.int64)


class ShuffledIndex:
    """Maps sequence positions to record indices under ``shuffle=seed``."""

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n = seed, n
        self._perms: dict[int, np.ndarray] = {}

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.n)
        out = np.empty_like(positions)
        for e in np.unique(epochs).tolist():
            perm = self._perms.get(e)
            if perm is None:
                # Keep only the permutations still in use (a round spans few epochs).
                self._perms = {k: v for k, v in self._perms.items() if k >= e - 1}
                perm = self._perms[e] = epoch_permutation(self.seed, e, self.n)
            sel = epochs == e
            out[sel] = perm[offsets[sel]]
        return out
