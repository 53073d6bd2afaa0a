"""Collectives: plans, executors, algorithms, ``World`` / ``Comm`` / ``Work``.

The public names are loaded on first use, so that importing a light submodule (the
start-up store that ``nccltree-run`` uses, say) does not load the whole engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import load

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
    return load(__name__, _LAZY, globals(), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
