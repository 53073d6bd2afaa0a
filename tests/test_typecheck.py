"""The type checker over the files listed in ``[tool.mypy]`` of pyproject.toml.

It runs in the test suite (and so in CI) so that a wrong attribute on a typed object, such
as reading ``.ptr`` from a nccltree ``Stream`` (which only the CUDA stream's CuPy stream
has), fails before a GPU ever runs the line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def mypy_available() -> None:
    # mypy is pinned in the test extra; a missing one is an installation error, not a skip
    import mypy  # noqa: F401


def test_configured_files_type_check(mypy_available):
    res = _mypy()
    assert res.returncode == 0, res.stdout + res.stderr


def test_stream_attributes_are_checked(mypy_available):
    # negative control: the annotations must be strong enough to reject the NCCL engine's
    # old `streams[r].ptr`
    snippet = (
        "from collections.abc import Sequence\n"
        "from nccltree.backends.base import Stream\n"
        "def handles(streams: Sequence[Stream]) -> list[int]:\n"
        "    return [streams[r].ptr for r in range(len(streams))]\n"
    )
    res = _mypy(
        "--config-file=", "--follow-imports=silent", "--ignore-missing-imports", "-c", snippet
    )
    assert res.returncode != 0
    assert '"Stream" has no attribute "ptr"' in res.stdout


def test_nccl_engine_takes_typed_streams():
    import typing

    from nccltree.comm import nccl

    hints = typing.get_type_hints(nccl.NcclEngine.launch)
    assert "Stream" in str(hints["streams"])
    assert typing.get_type_hints(nccl.stream_handle)["stream"].__name__ == "Stream"
