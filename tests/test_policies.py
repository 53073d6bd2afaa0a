"""Policies are written once: the chunk (``comm.plan.CHUNK_BYTES`` and the GPU policy
beside it) and the alignment (``comm.plan.ALIGN_BYTES``, ``align_bytes``) are spelled as
literals nowhere else in the package's code.

``ELSEWHERE`` lists the literals still written in code whose owners are changing it; each
entry goes when its line does (the test only refuses new ones)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from nccltree.comm import plan

ROOT = Path(__file__).resolve().parent.parent

#: what spells the chunk: 16 MiB written out
CHUNK = re.compile(r"\b16\s*<<\s*20\b|\b16\s*\*\s*1024\s*\*\s*1024\b|\b1\s*<<\s*24\b|\b16777216\b")
#: what spells the alignment: a round-up to 256 bytes, or a constant of its own
ALIGN = re.compile(r"//\s*256\s*\)\s*\*\s*256\b|\b_?ALIGN\w*\s*=\s*256\b")

#: (path, the line stripped) -> why it stays for now
ELSEWHERE: dict[tuple[str, str], str] = {
    ("nccltree/comm/plan.py", "CHUNK_BYTES = 16 << 20"): "the policy itself",
    ("nccltree/comm/plan.py", "ALIGN_BYTES = 256"): "the policy itself",
    (
        "nccltree/sim_calibration.py",
        "for size in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):",
    ): "the sizes the copy rate is measured at, no chunk",
}


def _code_lines(path: Path) -> list[str]:
    """The file's lines with comments and strings blanked (docstrings may say 16 MiB)."""
    text = path.read_text()
    lines = text.splitlines()
    blank = [list(line) for line in lines]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = blank[r - 1]
                lo = c0 if r == r0 else 0
                hi = c1 if r == r1 else len(row)
                row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in blank]


def literals(pattern: re.Pattern[str]) -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((ROOT / "nccltree").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text().splitlines()
        for i, line in enumerate(_code_lines(path)):
            if pattern.search(line):
                found.append((rel, i + 1, source[i].strip()))
    return found


@pytest.mark.parametrize("what", ["chunk", "alignment"])
def test_policy_literals_are_written_once(what: str) -> None:
    found = literals(CHUNK if what == "chunk" else ALIGN)
    assert found  # the policy's own line at least: the scan works
    new = [f"{p}:{n}: {line}" for p, n, line in found if (p, line) not in ELSEWHERE]
    assert not new, f"the {what} written out again (use comm.plan): {new}"


def test_the_policy() -> None:
    assert plan.CHUNK_BYTES == plan.GPU_CHUNK_MAX == 16 << 20 and plan.ALIGN_BYTES == 256
    assert plan.align_bytes(0) == 0 and plan.align_bytes(1) == plan.align_bytes(256) == 256
    assert plan.align_bytes(257) == 512
    assert plan.chunk_elements(plan.CHUNK_BYTES, 4) == 4 << 20
    assert plan.chunk_elements(2, 8) == 1  # at least one element


def test_the_scan_sees_code_not_comments(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""16 << 20 in a docstring"""\nx = 1  # 16 << 20\ny = (16 << 20)\n')
    lines = _code_lines(f)
    assert [bool(CHUNK.search(line)) for line in lines] == [False, False, True]
    assert ALIGN.search("off += -(-n // 256) * 256") and ALIGN.search("_ALIGN = 256")
