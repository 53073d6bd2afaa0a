"""The one exception family of nccltree."""

from __future__ import annotations


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


class NativeError(NcclTreeError):
    """A native kernel returned a failure status."""
