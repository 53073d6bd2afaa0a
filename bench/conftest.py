"""Shared set-up for the pytest-benchmark files in bench/.

Run them explicitly, e.g. ``pytest bench/bench_kernels.py --benchmark-only``.  A benchmark
that sets ``benchmark.extra_info["bytes"]`` (bytes read + written per call) gets a GB/s
line in the terminal summary, computed from its median.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the bench scripts share case definitions (kernels_table.py); make them importable
# whatever the import mode
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    session = getattr(terminalreporter.config, "_benchmarksession", None)
    benchmarks = getattr(session, "benchmarks", None) or []
    rows = []
    for bench in benchmarks:
        nbytes = bench.extra_info.get("bytes") if bench.extra_info else None
        if nbytes and bench.stats and bench.stats.median:
            rows.append((bench.fullname.split("::")[-1], nbytes / bench.stats.median / 1e9))
    if rows:
        terminalreporter.section("throughput (bytes read + written / median, GB = 1e9 B)")
        width = max(len(name) for name, _ in rows)
        for name, gbs in rows:
            terminalreporter.write_line(f"{name:<{width}}  {gbs:8.2f} GB/s")
