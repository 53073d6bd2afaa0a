"""Host kernels at 64 MiB float32: copy baselines, fused 4-way sum, fused SGD vs numpy.

    pytest bench/bench_kernels.py --benchmark-only

The cases are those of kernels_table.py (which prints them as one Markdown table).
"""

from __future__ import annotations

import pytest
from kernels_table import make_cases

CASES = {c.name: c for c in make_cases(mib=64, threads=2)}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(benchmark, name: str) -> None:
    case = CASES[name]
    benchmark.group = case.group
    benchmark.extra_info["bytes"] = case.nbytes
    benchmark.pedantic(case.fn, rounds=9, warmup_rounds=2)
