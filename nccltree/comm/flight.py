"""The flight recorder: the last collectives of a World or of a process group's process,
printed when one fails.

A hang is read from the logs: every World and every process of a group prints what it
was doing (sequence number, collective, size, algorithm, and how far it got) when a
timeout or a peer failure is raised, so the call that stopped early stands out.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass

DEFAULT_ENTRIES = 32


@dataclass
class Entry:
    seq: int
    collective: str
    count: int
    dtype: object  # a numpy dtype (named when printed)
    algorithm: str
    state: str
    started: float
    ended: float | None = None


class FlightRecorder:
    """The last ``entries`` collectives (``NCCLTREE_FLIGHT_ENTRIES``, default 32)."""

    def __init__(self, entries: int | None = None) -> None:
        if entries is None:
            entries = int(os.environ.get("NCCLTREE_FLIGHT_ENTRIES", DEFAULT_ENTRIES) or 0)
        self.entries: collections.deque[Entry] = collections.deque(maxlen=max(1, entries))

    def start(self, seq: int, collective: str, count: int, dtype: object, algorithm: str) -> Entry:
        e = Entry(seq, collective, count, dtype, algorithm, "issued", time.monotonic())
        self.entries.append(e)
        return e

    def dump(self, who: str) -> str:
        """The recorder as text, newest last."""
        now = time.monotonic()
        lines = [f"flight recorder of {who} (last {len(self.entries)} collectives, newest last):"]
        for e in self.entries:
            took = (e.ended if e.ended is not None else now) - e.started
            lines.append(
                f"  #{e.seq:<6} {e.collective:<14} count={e.count:<10} {str(e.dtype):<8} "
                f"{e.algorithm:<7} {e.state:<24} {took * 1e3:9.3f} ms"
            )
        return "\n".join(lines)
