"""Process groups: collectives across processes and nodes (MPI and shared memory).

The public names are loaded on first use (the start-up store and the launcher's
modules here are light; the group is not)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import load

if TYPE_CHECKING:
    from .group import GROUP_ALGORITHMS, ProcessGroup, init_process_group

__all__ = ["GROUP_ALGORITHMS", "ProcessGroup", "init_process_group"]


def __getattr__(name: str) -> object:
    return load(__name__, dict.fromkeys(__all__, ".group"), globals(), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
