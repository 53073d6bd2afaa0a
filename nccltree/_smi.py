"""Reading the matrices that ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p r`` print.

Real output varies between driver versions and machines: tabs or spaces, cells that do
not sit under their headers, extra NIC rows and columns (``mlx5_0``, ``NIC0``), trailing
``CPU Affinity`` / ``NUMA Affinity`` / ``GPU NUMA ID`` columns, a prompt line before and a
legend block after. So cells are mapped by their *order* in a row, never by their
column position, and only the part of the text between the header and the legend is
read. This module only splits text into names and cell tokens; what the tokens mean is
decided by the caller (``nccltree.topology``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_GPU_NAME = re.compile(r"^GPU\d+$")

# Header words of the trailing per-row columns. They end the list of device columns;
# the cells under them (CPU lists, NUMA ids, "N/A") are not part of the matrix.
_TRAILING_HEADER_WORDS = frozenset({"CPU", "NUMA", "GPU"})


def _header_columns(tokens: list[str]) -> list[str]:
    columns: list[str] = []
    for tok in tokens:
        if tok in _TRAILING_HEADER_WORDS:
            break
        columns.append(tok)
    return columns


def parse_matrix(
    text: str, accept: Callable[[str], bool], accepted: str
) -> tuple[list[str], list[list[str]]]:
    """Split an ``nvidia-smi topo`` matrix into GPU names and the GPU-by-GPU cell tokens.

    ``accept(token)`` says whether a cell token is valid; every cell of every row is
    checked (NIC cells too, they use the same vocabulary), and the first invalid one is
    a ``ValueError`` naming its row and column and listing ``accepted``. Returns the GPU
    names in header order and, for each of them, its row restricted to the GPU columns.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected the text nvidia-smi printed (str), got {type(text).__name__}")
    lines = text.splitlines()
    header_at = None
    for at, line in enumerate(lines):
        tokens = line.split()
        # The header starts with GPU0 like the first row does, but only rows hold the
        # "X" of the diagonal.
        if tokens and _GPU_NAME.match(tokens[0]) and "X" not in tokens:
            header_at = at
            break
    if header_at is None:
        raise ValueError(
            "no matrix header found: expected a line of column names starting with GPU0"
        )
    columns = _header_columns(lines[header_at].split())
    if len(set(columns)) != len(columns):
        raise ValueError(f"duplicate column names in the header: {' '.join(columns)}")
    gpu_columns = [c for c in columns if _GPU_NAME.match(c)]
    gpu_index = {name: k for k, name in enumerate(columns) if _GPU_NAME.match(name)}

    rows: dict[str, list[str]] = {}
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].rstrip(":") == "Legend":
            break
        label = tokens[0]
        if label not in columns:
            # Text that is not a row of this matrix (a stray line between blocks).
            continue
        if label in rows:
            raise ValueError(f"row {label} appears twice")
        cells = tokens[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            missing = columns[len(cells)]
            raise ValueError(
                f"row {label} has {len(cells)} cells but the header names {len(columns)} "
                f"columns (no cell for column {missing})"
            )
        for column, cell in zip(columns, cells, strict=True):
            if not accept(cell):
                raise ValueError(
                    f"unknown token {cell!r} in row {label}, column {column} (accepted: {accepted})"
                )
        rows[label] = cells

    missing_rows = [g for g in gpu_columns if g not in rows]
    if missing_rows:
        raise ValueError(f"no row for {', '.join(missing_rows)} in the matrix")
    grid = [[rows[g][gpu_index[c]] for c in gpu_columns] for g in gpu_columns]
    return gpu_columns, grid
