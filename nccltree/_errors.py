"""The one exception family of nccltree."""

from __future__ import annotations

from collections.abc import Sequence


class NcclTreeError(Exception):
    """Base class of every error nccltree raises on its own account."""


class BackendUnavailable(NcclTreeError):
    """A backend (CuPy, a GPU driver, NVML, NCCL, the native library) is missing."""


class CommError(NcclTreeError):
    """A collective failed."""


class CommTimeout(CommError, TimeoutError):
    """A collective (or a wait inside one) did not finish within the World's timeout."""


class PeerFailure(CommError):
    """Another rank failed, so this rank's collective cannot complete."""


class MissingRanks(CommTimeout, PeerFailure):
    """Ranks that did not arrive at a collective, or did not return from ``World.run``,
    within the World's timeout. ``ranks`` names them: they are the ones at fault, not the
    rank that raised this (a rank that waited for them).

    Both a ``CommTimeout`` (the wait ran out) and a ``PeerFailure`` (the raising rank did
    nothing wrong: another rank kept it from completing).
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(ranks)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.ranks))


class NativeError(NcclTreeError):
    """A native kernel returned a failure status."""
