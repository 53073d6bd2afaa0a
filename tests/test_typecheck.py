"""The type checker over the files listed in ``[tool.mypy]`` of pyproject.toml.

It runs in the test suite (and so in CI) so that a wrong attribute on a typed object, such
as reading ``.ptr`` from a nccltree ``Stream`` (which only the CUDA stream's CuPy stream
has), fails before a GPU ever runs the line. The counts of ``Any`` and ``type: ignore`` in
``nccltree/`` are a ratchet: they may only fall (tests/golden/typing_counts.json).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TYPING_COUNTS = ROOT / "tests" / "golden" / "typing_counts.json"
# what is counted, over every .py file under nccltree/ (comments and docstrings included:
# the count is a ratchet, not a measure)
TYPING_PATTERNS = {
    "Any": re.compile(r"\bAny\b"),
    "type: ignore": re.compile(r"#\s*type:\s*ignore"),
}


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


@pytest.mark.subprocess
@pytest.mark.slow
def test_configured_files_type_check(mypy_available):
    res = _mypy()
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.subprocess
@pytest.mark.slow
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


def typing_counts(package: Path = ROOT / "nccltree") -> dict[str, int]:
    """How often each of TYPING_PATTERNS occurs in the package's sources."""
    counts = dict.fromkeys(TYPING_PATTERNS, 0)
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for name, pattern in TYPING_PATTERNS.items():
            counts[name] += len(pattern.findall(text))
    return counts


def test_typing_counts_only_fall():
    # `Any` where a real type exists (Device, Stream, World, Tree, numpy arrays...) and
    # `type: ignore` hide exactly the errors the type checker is there to find
    ceiling = json.loads(TYPING_COUNTS.read_text())
    now = typing_counts()
    assert set(ceiling) == set(now), f"{TYPING_COUNTS} must hold exactly {sorted(now)}"
    over = [f"{k}: {now[k]} > {ceiling[k]}" for k in now if now[k] > ceiling[k]]
    assert not over, (
        f"more {' and '.join(over)} in nccltree/ than the ceiling in {TYPING_COUNTS.name}: "
        "use the real type (TYPE_CHECKING imports avoid import cycles) or fix the error "
        "instead of raising the ceiling"
    )
    assert now == ceiling, (
        f"the counts fell ({ceiling} -> {now}): well done; lower the ceiling to match, "
        f"write {json.dumps(now)} into tests/golden/{TYPING_COUNTS.name}"
    )


def test_typing_counts_see_what_they_count(tmp_path):
    # negative control: the patterns find the spellings in use and ignore look-alikes
    (tmp_path / "a.py").write_text(
        "from typing import Any\n"
        "x: Any = 1  # type: ignore[assignment]\n"
        "y = 2  #type:ignore\n"
        "AnyStr = Company = 3\n"
    )
    assert typing_counts(tmp_path) == {"Any": 2, "type: ignore": 2}
