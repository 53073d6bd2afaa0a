"""Which algorithm a World's call runs: its own, or ``auto``'s choice.

``Chooser`` answers for a prepared call. A World of one algorithm runs it for every call;
``auto`` reads the one rule table (:func:`nccltree.comm.auto.choose_rule`) for the
backend, the topology's class and the size per rank, and on GPUs with
``NCCLTREE_AUTO=model`` lets the simulator pick among the hand-built plans. Each choice is
remembered per collective and size, so a repeated call walks nothing again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import auto, debug
from ._args import Prepared
from .plan import Plan

if TYPE_CHECKING:
    from ..backends.base import Device
    from ..topology import Topology


class Chooser:
    """The choice for a World of ``algorithm`` over ``devices`` and ``topology``.
    ``usable(algorithm)`` says whether an algorithm can run (NCCL may not);
    ``build_plan(algorithm, prep)`` builds the plan the model times."""

    def __init__(
        self,
        algorithm: str,
        devices: Sequence[Device],
        topology: Topology,
        usable: Callable[[str], bool],
        build_plan: Callable[[str, Prepared], Plan],
    ) -> None:
        self.algorithm = algorithm
        self.devices = list(devices)
        self.backend = self.devices[0].backend
        self.topology = topology
        self.usable = usable
        self.build_plan = build_plan
        self.topology_class = auto.topology_class(topology)
        # (collective, bytes per rank) -> what "auto" ran
        self._choices: dict[tuple[str, int], str] = {}
        #: NCCLTREE_AUTO=model: on GPUs the simulator picks among the hand-built plans
        #: (``model``, made at the first choice: it asks CuPy for the GPU's name)
        self.model_on = (
            algorithm == "auto" and self.backend == "cuda" and auto.auto_mode() == "model"
        )
        self.model: auto.ModelChooser | None = None

    def choose(self, prep: Prepared) -> str:
        """The algorithm ``prep`` runs."""
        if self.algorithm != "auto":
            return self.algorithm
        # the choice depends only on the collective and the size once NCCL's usability is
        # known (asked once, then kept): remember it, so a repeated call does not walk the
        # table (or ask the model) again
        key = (prep.collective, prep.nbytes)
        alg = self._choices.get(key)
        if alg is None:
            rule = auto.choose_rule(self.backend, self.topology_class, prep.nbytes, self.usable)
            alg, why = rule.algorithm, rule.why
            if self.model_on and alg != "nccl":  # NCCL stays where the table takes it
                choice = self._model_choice(prep)
                if choice is not None:
                    alg, why = choice.algorithm, choice.why
            if debug.info_enabled():
                debug.log.info(
                    f"World of {len(self.devices)} ranks: auto chose {alg} for {prep.nbytes} "
                    f"B per rank ({prep.collective}, {self.backend} backend, "
                    f"{self.topology_class} topology): {why}"
                )
            if len(self._choices) >= 1024:
                self._choices.clear()
            self._choices[key] = alg
        return alg

    def _model_choice(self, prep: Prepared) -> auto.ModelChoice | None:
        """What the simulator predicts fastest for this call (NCCLTREE_AUTO=model)."""
        if self.model is None:
            name = auto.gpu_name(self.devices)
            self.model = auto.ModelChooser(self.topology, name)
            if debug.info_enabled():
                debug.log.info(
                    f"World of {len(self.devices)} ranks: auto consults the simulator "
                    f"(NCCLTREE_AUTO=model) with the {self.model.device} device model "
                    f"for GPU {name!r}" + (f": {self.model.note}" if self.model.note else "")
                )
        return self.model.choose(
            prep.collective, prep.nbytes, prep.dtype.itemsize, lambda a: self.build_plan(a, prep)
        )
