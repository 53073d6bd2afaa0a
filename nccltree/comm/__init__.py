"""Collectives: plans, executors, algorithms, ``World`` / ``Comm`` / ``Work``.

The public names are loaded on first use, so that importing a light submodule (the
start-up store that ``nccltree-run`` uses, say) does not load the whole engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .comm import Comm
    from .plan import Buf, Plan, Step, check_races
    from .work import Work
    from .world import ALGORITHM_CHOICES, World

_LAZY = {
    "Comm": ".comm",
    "Buf": ".plan",
    "Plan": ".plan",
    "Step": ".plan",
    "check_races": ".plan",
    "Work": ".work",
    "ALGORITHM_CHOICES": ".world",
    "World": ".world",
}

__all__ = ["ALGORITHM_CHOICES", "Buf", "Comm", "Plan", "Step", "World", "Work", "check_races"]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        return _submodule(name)
    value = getattr(importlib.import_module(module, __name__), name)
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
