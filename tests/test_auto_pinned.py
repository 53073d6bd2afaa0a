"""``algorithm="auto"`` chooses as recorded: the choice of every World and process-group
case below is pinned in ``tests/golden/auto_choices.json``.

Worlds: host Worlds of 2 to 8 ranks (the topology detected) and of 8 ranks on each
topology preset, and CUDA Worlds on the fake of CuPy (NCCL usable, and not: logical ranks
sharing GPUs), with ``NCCLTREE_AUTO`` unset, ``table`` and ``model``, for every
collective and message sizes from 8 B to 1 GiB per rank. Process groups: the rule over
its inputs (a GPU with or without NCCL, 1 or 2 nodes, 1 or 2 ranks per process, MPI's
rank order the group's or not, sizes around ``AUTO_MPI_BYTES``, a reducing collective on
a dtype MPI can or cannot reduce).

The expected table never changes with a restructuring; only the adapters below
(``world_choice``, ``group_choice``) follow the code. After a change meant to change
choices, regenerate with ``NCCLTREE_REGEN_GOLDEN=1`` and say why in the commit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm import auto
from nccltree.comm._args import Prepared
from nccltree.comm.collectives import COLLECTIVES

GOLDEN = Path(__file__).parent / "golden" / "auto_choices.json"
PRESETS = [p for p in nt.Topology.presets() if p != "flat:N"] + ["flat:8"]
KB = 1 << 10
MPI_BYTES = 256 * KB  # the process group's threshold for MPI, as recorded

# 8 B to 1 GiB in powers of 4, and the table's thresholds (64 KiB, 256 KiB) from both sides
POWERS = [8 << (2 * k) for k in range(14)] + [1 << 30]
SIZES = sorted({*POWERS, 64 * KB - 4, 64 * KB, 64 * KB + 4, 256 * KB - 4, 256 * KB, 256 * KB + 4})
MODES = ("unset", "table", "model")


# -- adapters: the only part that follows the code -------------------------------------------


def world_choice(world: nt.World, collective: str, nbytes: int) -> str:
    """What ``world`` runs for ``collective`` with ``nbytes`` float32 bytes per rank."""
    prep = Prepared(collective, [], [], [], np.dtype(np.float32), nbytes // 4, False, "sum", 0)
    return world._choose(prep)


def group_choice(
    gpu: str, nodes: int, per_proc: int, mpi_order: bool, nbytes: int, collective: str,
    dtype: str,
) -> str:  # fmt: skip
    """What a process group runs: ``gpu`` is none, nccl (a GPU group NCCL can serve) or
    nonccl (a GPU group it cannot)."""
    from nccltree.comm.group.mpi_collectives import mpi_reduces

    return auto.choose_group(
        gpu=gpu != "none",
        nccl_usable=gpu == "nccl",
        nodes=nodes,
        ranks_per_process=per_proc,
        mpi_order=mpi_order,
        nbytes=nbytes,
        reduces=COLLECTIVES[collective].reduces,
        mpi_reduces=mpi_reduces(np.dtype(dtype)),
    )


# -- the cases ----------------------------------------------------------------------------------


def _modes(monkeypatch: pytest.MonkeyPatch, modes: tuple[str, ...] = MODES) -> Iterator[str]:
    for mode in modes:
        if mode == "unset":
            monkeypatch.delenv("NCCLTREE_AUTO", raising=False)
        else:
            monkeypatch.setenv("NCCLTREE_AUTO", mode)
        yield mode


def _record(out: dict[str, str], name: str, world: nt.World, sizes: list[int]) -> None:
    with world:
        for coll in COLLECTIVES:
            for nbytes in sizes:
                out[f"{name} {coll} {nbytes}"] = world_choice(world, coll, nbytes)


def host_choices(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    out: dict[str, str] = {}
    for mode in _modes(monkeypatch):
        for n in range(2, 9):
            _record(out, f"world host {mode} cpu:{n}", nt.World(f"cpu:{n}", "auto"), SIZES)
        for preset in PRESETS:
            topo = nt.Topology.preset(preset)
            world = nt.World(f"cpu:{topo.n}", "auto", topology=topo)
            _record(out, f"world host {mode} {preset}", world, SIZES)
    return out


def cuda_choices(monkeypatch: pytest.MonkeyPatch, modes: tuple[str, ...]) -> dict[str, str]:
    """On the fake of CuPy (8 GPUs with peer access). Under ``model`` a choice is cached
    per size class from the class's first call, and each simulates three plans: every
    other power is asked there, each its own class."""
    out: dict[str, str] = {}
    for mode in _modes(monkeypatch, modes):
        sizes = POWERS[::2] if mode == "model" else SIZES
        for n in (2, 4, 8):
            spec = "gpu:" + ",".join(str(i) for i in range(n))
            _record(out, f"world cuda {mode} {spec}", nt.World(nt.devices(spec), "auto"), sizes)
        for preset in PRESETS:
            topo = nt.Topology.preset(preset)
            for spec in ("gpu:0,1,2,3,4,5,6,7", "gpu:0,0,1,1,2,2,3,3"):
                world = nt.World(nt.devices(spec), "auto", topology=topo)
                _record(out, f"world cuda {mode} {preset} {spec}", world, sizes)
    return out


def group_choices() -> dict[str, str]:
    out: dict[str, str] = {}
    sizes = (0, 8, 64 * KB, MPI_BYTES - 4, MPI_BYTES, MPI_BYTES + 4, 1 << 20, 1 << 30)
    for gpu in ("none", "nccl", "nonccl"):
        for nodes in (1, 2):
            for per_proc in (1, 2):
                for mpi_order in (True, False):
                    for coll in COLLECTIVES:
                        for dtype in ("float32", "float16", "bfloat16"):
                            for nbytes in sizes:
                                key = (f"group gpu={gpu} nodes={nodes} per_proc={per_proc} "
                                       f"mpi_order={mpi_order} {coll} {dtype} {nbytes}")  # fmt: skip
                                out[key] = group_choice(
                                    gpu, nodes, per_proc, mpi_order, nbytes, coll, dtype
                                )
    return out


def compact(choices: dict[str, str]) -> dict[str, str]:
    """``choices`` (keys ending in a size, in ascending order within each case) as one
    line per case: the sizes where the choice changes, each with the choice from there
    on (``"8 tree 65540 direct"``: the tree up to 64 KiB, direct above)."""
    out: dict[str, str] = {}
    last: dict[str, str] = {}
    for key, choice in choices.items():
        case, _, size = key.rpartition(" ")
        if last.get(case) != choice:
            out[case] = f"{out[case]} {size} {choice}" if case in out else f"{size} {choice}"
            last[case] = choice
    return out


def _check(part: str, got: dict[str, str]) -> None:
    table = compact(got)
    if os.environ.get("NCCLTREE_REGEN_GOLDEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[part] = table
        GOLDEN.write_text(json.dumps(golden, indent=0, sort_keys=True) + "\n")
        pytest.skip(f"regenerated {part} of {GOLDEN.name} ({len(got)} choices)")
    want = json.loads(GOLDEN.read_text())[part]
    assert sorted(table) == sorted(want), "the grid of cases changed"
    changed = [f"{k}: {want[k]!r} -> {table[k]!r}" for k in want if table[k] != want[k]]
    assert not changed, f"{len(changed)} of {len(want)} cases changed, e.g. {changed[:5]}"


def test_world_choices_on_host_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _check("world host", host_choices(monkeypatch))


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 8}], indirect=True)
def test_world_choices_on_cuda_devices(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _check("world cuda", cuda_choices(monkeypatch, ("unset", "table")))


@pytest.mark.slow
@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 8}], indirect=True)
def test_world_choices_on_cuda_devices_by_the_model(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check("world cuda model", cuda_choices(monkeypatch, ("model",)))


def test_process_group_choices() -> None:
    _check("group", group_choices())


def test_the_table_spans_every_choice() -> None:
    """The golden table is no echo of one answer: each part holds the choices it must."""
    table = json.loads(GOLDEN.read_text())

    def chosen(part: str) -> set[str]:
        return {a for line in table[part].values() for a in line.split()[1::2]}

    assert chosen("world host") == {"direct", "tree"}
    assert chosen("world cuda") == {"nccl", "tree", "direct"}
    # the model picks the ring somewhere the table never does
    assert chosen("world cuda model") == {"nccl", "tree", "ring", "direct"}
    assert chosen("group") == {"mpi", "nccl", "tree", "direct"}
    # sizes change the choice somewhere (on host devices they never do: one rule a row)
    for part in ("world cuda", "world cuda model", "group"):
        assert any(len(line.split()) > 2 for line in table[part].values()), part
