"""Exceptions of the data pipeline (members of the nccltree exception family)."""

from __future__ import annotations

from .._errors import NcclTreeError


class DataError(NcclTreeError, ValueError):
    """A database or one of its records cannot be used (the message names the key)."""


class EndOfData(NcclTreeError, EOFError):
    """A reader with ``epochs=k`` has served its last batch to this rank."""


class ReaderClosed(NcclTreeError, RuntimeError):
    """The reader was closed (or garbage collected) while a rank waited for a batch."""
