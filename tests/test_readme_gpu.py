"""The README's two-process CuPy all_reduce (and docs/process-groups.md's "GPUs"
example) run as written.

Each block is taken from its document as it stands (so an edit that breaks it fails here),
written to a file and run under ``mpiexec -n 2`` on the fake of CuPy's layer
(tests/fakecupy): nccltree's unmodified GPU code, IPC and NCCL wiring, and the snippet's
own check of the sum. Wiring only -- not GPU verification.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpirun import ROOT, needs_mpi, run_mpi

WORKER = Path(__file__).resolve().parent / "mpi" / "readme_gpu.py"


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"```python\n(# allreduce\.py: .*?)```", text, re.S)
    assert m, "README.md has no block starting '# allreduce.py: '"
    return m.group(1)


def guide_snippet() -> str:
    text = (ROOT / "docs" / "process-groups.md").read_text()
    gpus = text.split("\n## GPUs\n", 1)[1]
    m = re.search(r"```python\n(import cupy as cp\n.*?)```", gpus, re.S)
    assert m, "docs/process-groups.md's GPUs section has no CuPy block"
    return m.group(1)


def test_the_snippet_is_the_two_process_cupy_all_reduce() -> None:
    code = readme_snippet()
    assert "import cupy as cp" in code and "init_process_group" in code
    assert "mpiexec -n 2" in code
    compile(code, "README.md", "exec")  # valid as pasted


@needs_mpi
@pytest.mark.mpi
def test_the_readme_gpu_snippet_runs_under_mpiexec_on_the_fake(tmp_path: Path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(readme_snippet())
    proc = run_mpi(2, WORKER, str(script), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the processes share one pipe: each line is looked for, not the order
    for r in range(2):
        assert f"rank {r} of 2: 3.0" in proc.stdout, proc.stdout


@needs_mpi
@pytest.mark.mpi
def test_the_process_group_guides_gpu_example_runs_on_the_fake(tmp_path: Path) -> None:
    code = guide_snippet()
    # no elided lines (a bare ``...`` is valid Python, so running it would not say)
    assert not re.search(r"^\s*\.\.\.\s*$", code, re.M), code
    script = tmp_path / "guide.py"
    script.write_text(code)
    proc = run_mpi(2, WORKER, str(script), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
