"""Plans are unchanged by refactoring: every plan the World builds for a grid of
algorithms, collectives, rank counts, sizes, placements, roots, dtypes and topologies has
the same steps, events and memory needs as recorded in ``tests/golden/plans.json``.

The golden file holds a digest of each plan's canonical text. After a change that is
meant to change plans, regenerate it with ``NCCLTREE_REGEN_GOLDEN=1 ./dev test
tests/test_plans_golden.py`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm.plan import Plan

GOLDEN = Path(__file__).parent / "golden" / "plans.json"
ALGORITHMS = ("tree", "ring", "direct")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
CHUNK_BYTES = 1024  # small, so that the sizes below span several pipelined chunks


def canonical(plan: Plan) -> str:
    """A plan as text: every step and the plan's memory and event bookkeeping."""
    lines = [
        f"size={plan.size} events={plan.n_events} same_buffer={plan.same_buffer}",
        f"scratch={sorted(plan.scratch.items())} stage={sorted(plan.stage.items())}",
        f"start={sorted(plan.start_events.items())} end={sorted(plan.end_events.items())}",
    ]
    for s in plan.steps:
        bufs = [b if b is None else (b.rank, b.role, b.offset, b.count) for b in s.touches]
        lines.append(f"{s.rank} {s.kind} {bufs} {s.op} {s.alpha!r} {s.event}")
    return "\n".join(lines)


def _worlds() -> Iterator[tuple[str, nt.World]]:
    for n in range(2, 9):
        yield f"cpu:{n}", nt.World(f"cpu:{n}", chunk_bytes=CHUNK_BYTES)
    for preset in ("dgx1", "k80x4", "pcie2s8"):
        topo = nt.Topology.preset(preset)
        world = nt.World(f"cpu:{topo.n}", topology=topo, chunk_bytes=CHUNK_BYTES)
        yield preset, world


def _cases(n: int) -> Iterator[tuple[str, str, int, int, bool, str]]:
    for alg in ALGORITHMS:
        for coll in COLLECTIVES:
            roots = (0, n - 1) if coll in ("reduce", "broadcast") else (0,)
            for count in (1, 7 * n, 1001 * n, 4099):
                if coll == "reduce_scatter" and count % n:
                    count -= count % n
                for root in roots:
                    for in_place in (False, True):
                        dtypes = ("float32", "float16") if n in (3, 8) else ("float32",)
                        for dt in dtypes:
                            yield alg, coll, count, root, in_place, dt


def compute() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, world in _worlds():
        with world:
            for alg, coll, count, root, in_place, dt in _cases(world.size):
                op = "mean" if coll in ("all_reduce", "reduce_scatter") and count % 2 else "sum"
                plan = world.plan(coll, count, op=op, root=root, in_place=in_place,
                                  dtype=np.dtype(dt), algorithm=alg)  # fmt: skip
                key = f"{name} {alg} {coll} count={count} root={root} in_place={in_place} {dt} {op}"
                out[key] = hashlib.sha256(canonical(plan).encode()).hexdigest()[:20]
    return out


@pytest.mark.slow
def test_plans_match_the_golden_file() -> None:
    got = compute()
    if os.environ.get("NCCLTREE_REGEN_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
        pytest.skip(f"regenerated {GOLDEN.name} ({len(got)} plans)")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want), "the grid of plans changed"
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"{len(changed)} of {len(want)} plans changed, e.g. {changed[:5]}"
