"""The plan builders, one module per algorithm (:mod:`.tree`, :mod:`.ring`,
:mod:`.direct`), and what they share (:mod:`._base`): the one signature every builder
has, ``builder(PlanRequest) -> Plan``, and the registry :data:`BUILDERS` that
:func:`~nccltree.comm.algorithms.build_plan` looks them up in. An algorithm module
writes the steps of a collective, ``steps(PlanRequest, PlanBuilder)``; :func:`builds`
registers them as a builder that makes the ``PlanBuilder`` and builds the plan."""

from __future__ import annotations

# importing the algorithm modules registers their builders
from . import direct, ring, tree
from ._base import (
    BUILDERS,
    MAX_FAN_IN,
    Builder,
    PlanRequest,
    builds,
    finish_mean,
    reduce_final,
    reduce_many,
)

__all__ = [
    "BUILDERS",
    "MAX_FAN_IN",
    "Builder",
    "PlanRequest",
    "builds",
    "direct",
    "finish_mean",
    "reduce_final",
    "reduce_many",
    "ring",
    "tree",
]
