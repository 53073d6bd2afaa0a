"""Collectives: plans, executors, algorithms, ``World`` / ``Comm`` / ``Work``."""

from .comm import Comm
from .plan import Buf, Plan, Step, check_races
from .work import Work
from .world import ALGORITHM_CHOICES, World

__all__ = ["ALGORITHM_CHOICES", "Buf", "Comm", "Plan", "Step", "World", "Work", "check_races"]
