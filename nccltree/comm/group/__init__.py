"""Process groups: collectives across processes and nodes (MPI and shared memory).

The public names are loaded on first use (the start-up store and the launcher's
modules here are light; the group is not)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .group import GROUP_ALGORITHMS, ProcessGroup, init_process_group

__all__ = ["GROUP_ALGORITHMS", "ProcessGroup", "init_process_group"]


def __getattr__(name: str) -> object:
    if name not in __all__:
        return _submodule(name)
    value = getattr(importlib.import_module(".group", __name__), name)
    globals()[name] = value
    return value


def _submodule(name: str) -> object:
    """A submodule not imported yet (as the eager imports of this package made them all
    attributes before), else AttributeError."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
