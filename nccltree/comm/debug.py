"""``NCCLTREE_DEBUG``: what the engine decided and did, on standard error.

As ``NCCL_DEBUG``, a variable read once, when the package is first used:

- ``INFO``: what ``auto`` chose and why (once per size class: the choice is cached), and
  every plan when it is built (algorithm, collective, ranks, steps, chunks, bytes moved,
  scratch and staging per rank);
- ``TRACE``: also every call (sequence number, collective, count, dtype, algorithm,
  placement), from Worlds and process groups;
- ``WARN`` or unset: nothing.

Lines go through the ``logging`` logger ``nccltree`` (``nccltree INFO ...``), so an
application may route them elsewhere; the handler this module adds writes to stderr only
where the variable asks for it and nobody configured that logger.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._args import Prepared
    from .plan import Plan

TRACE = 5  # below logging.DEBUG: one line per call
logging.addLevelName(TRACE, "TRACE")
LEVELS = {"WARN": logging.WARNING, "INFO": logging.INFO, "TRACE": TRACE}

log = logging.getLogger("nccltree")
_configured = False


def configure(value: str | None = None) -> int:
    """Set the ``nccltree`` logger from ``value`` (default: ``NCCLTREE_DEBUG``); returns
    the level. An unknown value is a ValueError naming the accepted ones."""
    global _configured
    raw = os.environ.get("NCCLTREE_DEBUG", "") if value is None else value
    name = raw.strip().upper() or "WARN"
    if name not in LEVELS:
        raise ValueError(
            f"NCCLTREE_DEBUG={raw!r}: accepted values are {', '.join(LEVELS)} (or unset)"
        )
    level = LEVELS[name]
    log.setLevel(level)
    if level < logging.WARNING and not log.handlers and not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("nccltree %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    _configured = True
    return level


def _from_environment() -> None:
    """The first use: the variable, where a bad value warns once (it is not worth failing
    a training run for) and counts as unset."""
    try:
        configure()
    except ValueError as exc:
        import warnings

        warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
        configure("WARN")


def info_enabled() -> bool:
    if not _configured:
        _from_environment()
    return log.isEnabledFor(logging.INFO)


def trace_enabled() -> bool:
    if not _configured:
        _from_environment()
    return log.isEnabledFor(TRACE)


def plan_line(plan: Plan, itemsize: int, where: str, chunk: int | None = None) -> str:
    """One line describing a plan as built for ``where`` (a World or a process group);
    ``chunk``: the chunk it was cut into, in elements."""
    steps = plan.data_steps()
    kinds: dict[str, int] = {}
    for s in steps:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    counts = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    scratch = {r: c for r, c in plan.scratch.items() if c}
    stage = {r: c for r, c in plan.stage.items() if c}
    return (
        f"{where}: plan '{plan.description}' over {plan.size} ranks"
        f"{'' if chunk is None else f', chunks of {chunk * itemsize} B'}: {len(steps)} data "
        f"steps ({counts or 'none'}), {plan.n_events} events, "
        f"{plan.bytes_moved(itemsize)} B read and written, scratch {scratch or 'none'}, "
        f"staging {stage or 'none'} (elements per rank)"
    )


def trace_call(who: str, prep: Prepared, algorithm: str, extra: str = "") -> None:
    """One ``TRACE`` line for a call (where that level is on)."""
    if trace_enabled():
        log.log(
            TRACE,
            f"{who}: {prep.collective} count={prep.count} {prep.dtype.name} op={prep.op} "
            f"root={prep.root} algorithm={algorithm}{' in place' if prep.in_place else ''}"
            f"{extra}",
        )
