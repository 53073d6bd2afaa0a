"""The bfloat16 measurement script of docs/performance.md runs and prints every case."""

from __future__ import annotations

from conftest import BENCH_DIR, bench_module


def test_bf16_table_script_prints_every_case(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    lines = bench_module("bf16_table").table(1, 1)
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "---" not in line]
    cases = [r[0].strip() for r in rows[1:]]
    assert cases == [c for c in ("sum2", "sum4", "scale", "sgd") for _ in (2, 1)]
    assert all(len(r) == 10 and r[-1].strip().endswith("x") for r in rows[1:])
