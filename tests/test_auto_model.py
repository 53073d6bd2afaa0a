"""``NCCLTREE_AUTO=model``: ``auto`` on GPUs consulting the simulator (nccltree.comm.auto,
ModelChooser). On the fake of CuPy, whose GPUs are no model the simulator knows: these
tests check the wiring (which plans are simulated on which machine, what is cached, what
NCCL keeps, what is logged), not that the model's choices are right on a GPU."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree import sim, sim_model
from nccltree.comm import auto, debug
from nccltree.comm._args import Prepared

KB, MB = 1 << 10, 1 << 20


def prep(nbytes: int, collective: str = "all_reduce") -> Prepared:
    return Prepared(collective, [], [], [], np.dtype(np.float32), nbytes // 4, False, "sum", 0)


def predicted(world: nt.World, nbytes: int, collective: str = "all_reduce") -> dict[str, float]:
    """Each hand-built plan of the call, as the World builds it, simulated on the World's
    topology with the h100 model (the fake GPUs' names match none)."""
    machine = sim.Machine(world.topology, sim.DEVICES["h100"])
    return {
        alg: sim.simulate(world.plan(collective, nbytes // 4, algorithm=alg), machine).time_s
        for alg in ("tree", "ring", "direct")
    }


@pytest.fixture
def info_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ``nccltree`` logger at INFO, its lines collected."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect()
    monkeypatch.setattr(debug, "_configured", True)
    level = debug.log.level
    debug.log.setLevel(logging.INFO)
    debug.log.addHandler(handler)
    try:
        yield lines
    finally:
        debug.log.removeHandler(handler)
        debug.log.setLevel(level)


SHARED8 = "gpu:0,0,1,1,2,2,3,3"  # logical ranks sharing GPUs: NCCL is not usable


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 4}], indirect=True)
def test_auto_takes_what_the_model_predicts_fastest(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch, info_lines: list[str]
) -> None:
    monkeypatch.setenv("NCCLTREE_AUTO", "model")
    topo = nt.Topology.preset("pcie2s8")
    with nt.World(nt.devices(SHARED8), algorithm="auto", topology=topo) as w:
        assert auto.topology_class(topo) == auto.OTHER  # the table takes the tree
        seen = set()
        for nbytes in (1 * KB, 64 * KB, 1 * MB, 16 * MB):
            times = predicted(w, nbytes)
            best = min(times, key=times.__getitem__)
            assert w._choose(prep(nbytes)) == best, (nbytes, times)
            seen.add(best)
        # on this machine's model the direct plan wins at 16 MiB, where the table's tree
        # would run
        assert w._choose(prep(16 * MB)) == "direct"
        assert auto.choose("cuda", auto.OTHER, 16 * MB, lambda a: a != "nccl") == "tree"
    chose = [line for line in info_lines if "auto chose" in line]
    assert any("auto chose direct for 16777216 B per rank (all_reduce" in c for c in chose)
    assert all("NCCLTREE_AUTO=model" in c and "h100 device model" in c for c in chose)
    assert any("direct " in c and " us" in c and "tree " in c for c in chose)  # the times
    notes = [line for line in info_lines if "consults the simulator" in line]
    assert len(notes) == 1  # one chooser per World
    assert "'Fake GPU 0'" in notes[0] and "no device model matches" in notes[0]


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 4}], indirect=True)
def test_the_switch_is_off_by_default(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCLTREE_AUTO", raising=False)
    topo = nt.Topology.preset("pcie2s8")
    with nt.World(nt.devices(SHARED8), algorithm="auto", topology=topo) as w:
        assert w._choose(prep(16 * MB)) == "tree"  # the table's
        assert w._chooser.model is None


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 4}], indirect=True)
def test_choices_are_cached_per_collective_and_size_class(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCLTREE_AUTO", "model")
    topo = nt.Topology.preset("pcie2s8")
    with nt.World(nt.devices(SHARED8), algorithm="auto", topology=topo) as w:
        simulated: list[int] = []
        real = sim.simulate

        def counting(plan: Any, machine: Any, itemsize: int = 4) -> sim.SimResult:
            simulated.append(plan.size)
            return real(plan, machine, itemsize)

        monkeypatch.setattr(sim_model, "simulate", counting)
        w._choose(prep(12 * MB))
        assert len(simulated) == 3  # tree, ring and direct, once
        w._choose(prep(16 * MB))  # the same class (up to 16 MiB): no new simulation
        w._choose(prep(9 * MB))
        assert len(simulated) == 3
        w._choose(prep(12 * MB, "all_gather"))  # another collective: its own choice
        assert len(simulated) == 6
        w._choose(prep(17 * MB))  # the next class
        assert len(simulated) == 9


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 8}], indirect=True)
def test_nccl_stays_where_the_table_takes_it(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCLTREE_AUTO", "model")
    topo = nt.Topology.preset("pcie2s8")
    with nt.World(nt.devices("gpu:0,1,2,3,4,5,6,7"), algorithm="auto", topology=topo) as w:
        assert w._choose(prep(16 * MB)) == "nccl"
        # below NCCL's range the model picks among the hand-built plans
        times = predicted(w, 4 * KB)
        assert w._choose(prep(4 * KB)) == min(times, key=times.__getitem__)


def test_host_worlds_keep_their_measured_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCLTREE_AUTO", "model")
    with nt.World(nt.devices("cpu:4"), algorithm="auto") as w:
        assert {w._choose(prep(n)) for n in (4, 1 * MB, 16 * MB)} == {"direct"}
        assert not w._chooser.model_on


def test_the_chooser_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelChooser without a World: the fastest candidate that has a plan."""
    chooser = auto.ModelChooser(nt.Topology.preset("dgx1"), "Tesla V100-SXM2-32GB")
    assert chooser.device == "v100" and chooser.note == ""
    assert chooser.machine.device is sim.DEVICES["v100"]
    times = {"tree": 3.0, "ring": 1.0, "direct": 2.0}

    def plan_for(alg: str) -> Any:
        if alg == "ring":
            raise ValueError("no plan for 'ring' 'gather'")
        return alg  # stands for the plan: the fake simulator below reads it

    monkeypatch.setattr(
        sim_model, "simulate", lambda plan, machine, itemsize=4: sim.SimResult(times[plan])
    )
    choice = chooser.choose("gather", 1000, 4, plan_for)
    assert choice is not None
    assert choice.algorithm == "direct"  # ring had no plan; direct beats the tree
    assert choice.predicted_s == {"tree": 3.0, "direct": 2.0}
    assert "tree 3000000.0 us, direct 2000000.0 us" in choice.why
    assert chooser.cached("gather", 1000) and not chooser.cached("gather", 1025)

    def no_plan(alg: str) -> Any:
        raise ValueError(alg)

    assert chooser.choose("scatter", 8, 4, no_plan) is None  # the table decides then


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100pcie"),
        ("NVIDIA H800", "h800"),
        ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ],
)
def test_gpu_names_find_their_device_model(name: str, key: str) -> None:
    assert auto.device_model_for(name) == (key, "")


@pytest.mark.parametrize(
    "name", ["NVIDIA RTX A1000", "NVIDIA L4", "NVIDIA GeForce RTX 2080", "Fake GPU 0", ""]
)
def test_other_gpus_get_the_default_model_and_a_note(name: str) -> None:
    key, note = auto.device_model_for(name)
    assert key == auto.DEFAULT_DEVICE_MODEL == "h100"
    assert "no device model matches" in note and repr(name) in note


def test_size_classes_and_the_switch_values() -> None:
    assert [auto.size_class(n) for n in (0, 1, 2, 3, 4, 1000, 1024, 1025)] == [
        0, 1, 2, 4, 4, 1024, 1024, 2048
    ]  # fmt: skip
    assert auto.auto_mode("model") == "model" and auto.auto_mode(" MODEL ") == "model"
    assert auto.auto_mode("") == "table" and auto.auto_mode("table") == "table"
    with pytest.warns(RuntimeWarning, match="NCCLTREE_AUTO='sim'"):
        assert auto.auto_mode("sim") == "table"
