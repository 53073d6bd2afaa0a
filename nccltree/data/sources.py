"""Where the reader thread's records come from: one cursor of one read transaction.

``SequentialSource`` walks the database in key order with a value-only iterator (wrapping
at the end), so a round costs one C-level ``islice`` over the cursor. ``ShuffledSource``
fetches the records of a seeded permutation by key through the same kind of cursor
(``getmulti``), which is random access and only as fast as the storage allows.

Values are zero-copy memoryviews into the memory map, valid only while the transaction
is open; decoders copy them into batch buffers and nothing else keeps them.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any

import numpy as np

from .errors import DataError
from .order import ShuffledIndex


def _changed() -> DataError:
    return DataError("the database has fewer records than it reported; was it modified while open?")


class SequentialSource:
    def __init__(self, txn: Any, n: int, start: int) -> None:
        self.txn, self.n = txn, n
        self.cur = txn.cursor()
        self._restart()
        skip = start % n
        if skip:
            deque(islice(self.it, skip), maxlen=0)
            self.idx = skip

    def _restart(self) -> None:
        if not self.cur.first():
            raise _changed()
        self.it = self.cur.iternext(keys=False)
        self.idx = 0

    def take(self, m: int) -> list:
        """The next ``m`` values of the endless key-order sequence."""
        out: list = []
        while len(out) < m:
            if self.idx == self.n:
                self._restart()
            k = min(m - len(out), self.n - self.idx)
            got = list(islice(self.it, k))
            if len(got) != k:
                raise _changed()
            if out:
                out.extend(got)
            else:
                out = got
            self.idx += k
        return out

    def key_of(self, position: int) -> bytes:
        """Key of the record at a sequence position (error path only: walks a cursor)."""
        cur = self.txn.cursor()
        cur.first()
        for key in islice(cur.iternext(keys=True, values=False), position % self.n, None):
            return bytes(key)
        raise _changed()


class ShuffledSource:
    def __init__(self, txn: Any, n: int, seed: int) -> None:
        self.cur = txn.cursor()
        self.cur.first()
        self.keys = [bytes(k) for k in self.cur.iternext(keys=True, values=False)]
        if len(self.keys) != n:
            raise _changed()
        self.index = ShuffledIndex(seed, n)

    def fetch(self, positions: np.ndarray) -> list:
        """The values at the given sequence positions, in that order."""
        keys = self.keys
        wanted = [keys[i] for i in self.index(positions).tolist()]
        pairs = self.cur.getmulti(wanted)
        if len(pairs) != len(wanted):
            raise _changed()
        return [v for _, v in pairs]

    def key_of(self, position: int) -> bytes:
        return self.keys[int(self.index(np.array([position]))[0])]
