"""The package has no import circles, except ones closed only by type-checking imports.

The graph is read from the source (``ast``), so it holds every import a module can run:

- an import at module level, and an import inside a function (a lazy import): a lazy
  import that closes a circle is a circle all the same (the modules still cannot be
  understood, tested or moved one without the other), so both count;
- imports under ``if TYPE_CHECKING:`` do not count (they never run); their ``else:``
  branch does;
- an edge goes to the module named: ``from .plan import Plan`` to ``comm.plan``,
  ``from . import auto`` to ``comm.auto`` (a submodule), ``from ..backends import devices``
  to ``backends`` (the package's ``__init__``, where the name lives). Importing a
  submodule also runs its parent packages' ``__init__``, which is not an edge here: those
  only re-export their submodules' names;
- ``importlib.import_module`` (the lazy public names of ``nccltree/__init__.py``) is not
  seen.

A circle that is known and has an owner goes in ``KNOWN`` with the reason; none today.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: circles tolerated for now: frozenset of module names -> why (and who removes it)
KNOWN: dict[frozenset[str], str] = {}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``body`` and the blocks inside it, at any depth, except
    those under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.If) and _type_checking(node):
            yield from _imports(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _imports([child])
            elif isinstance(child, ast.excepthandler):
                yield from _imports(child.body)


def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(root: Path, package: str) -> dict[str, dict[str, list[int]]]:
    """Module -> the package's modules it imports -> the lines importing them."""
    mods = modules(root, package)
    graph: dict[str, dict[str, list[int]]] = {}
    for name, (path, is_package) in mods.items():
        here = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                if target in mods and target != name:
                    edges.setdefault(target, []).append(node.lineno)
    return graph


def circles(graph: dict[str, dict[str, list[int]]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, list[int]]], circle: frozenset[str]) -> str:
    return "; ".join(
        f"{a} -> {b} (line {', '.join(map(str, graph[a][b]))})"
        for a in sorted(circle)
        for b in sorted(graph[a])
        if b in circle
    )


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph(ROOT, "nccltree")
    assert len(graph) > 50 and graph["nccltree.comm.world"]  # the graph was read
    found = [c for c in circles(graph) if c not in KNOWN]
    assert not found, "import circles: " + " | ".join(describe(graph, c) for c in found)


def test_known_circles_still_exist() -> None:
    """An entry of KNOWN that no longer is a circle is removed from it."""
    present = set(circles(import_graph(ROOT, "nccltree")))
    assert not [sorted(c) for c in KNOWN if c not in present]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("b_text", "circle"),
    [
        ("from . import a\n", True),  # at module level
        ("def f():\n    from .a import x\n    return x\n", True),  # lazy, in a function
        ("try:\n    pass\nexcept ImportError:\n    from .sub import a\n", True),
        ("import pkg.a\n", True),  # absolute
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n", False),
        ("import typing\nif typing.TYPE_CHECKING:\n    from . import a\n", False),
        ("from .c import x\n", False),  # a module beside, no way back
    ],
)
def test_the_detector(tmp_path: Path, b_text: str, circle: bool) -> None:
    files = {
        "__init__.py": "",
        "a.py": "from .b import y\n",
        "b.py": b_text,
        "c.py": "x = 1\n",
        "sub/__init__.py": "from .. import b\n",
    }
    if "sub" in b_text:  # the way back through sub: b -> sub -> b
        files["a.py"] = ""
    root = _package(tmp_path, files)
    assert bool(circles(import_graph(root, "pkg"))) is circle
