"""Training steps of the data-parallel driver on cpu:1 and cpu:2, communication on and off.

    pytest bench/bench_train.py --benchmark-only

Each round trains 10 more iterations of the MLP of train_table.py (weak scaling, one BLAS
thread per rank, batches from memory); ``extra_info`` holds the examples per round and the
fraction of step time spent in collectives. train_table.py prints the same cases, with
efficiencies, as one Markdown table.
"""

from __future__ import annotations

import pytest
from train_table import Case, memory_data, training

BATCH, STEPS = 256, 10
CASES = [Case(1, True), Case(1, False), Case(2, True), Case(2, False)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_train_steps(benchmark, case: Case) -> None:
    results = []
    with training(case, BATCH) as t:
        dp = t.driver
        data = memory_data(case.ranks, BATCH)
        dp.fit(data, 3)  # warm-up: threads, plans and BLAS buffers exist before timing

        def steps() -> None:
            results.append(dp.fit(data, dp.iter + STEPS))

        benchmark.group = "train step, weak scaling"
        benchmark.pedantic(steps, rounds=5, warmup_rounds=1)
    last = results[-1]
    benchmark.extra_info["examples_per_round"] = BATCH * case.ranks * STEPS
    benchmark.extra_info["comm_fraction"] = last.comm_fraction
    assert last.iter - last.start_iter == STEPS
