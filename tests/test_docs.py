"""The documents point at things that exist.

Every repository path a document names (``nccltree/comm/world.py``, ``bench/gpu_check.sh``),
every ``nccltree.x.y`` name it gives, every relative link and every ``#anchor`` (in the
documents and in the code's ``docs/NAME.md#anchor`` references) resolves, and the layout
of docs/architecture.md lists exactly the package's modules.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# what the build puts into the package: named by the documents, absent from a fresh checkout
BUILT = {
    "nccltree/_lib",
    "nccltree/_lib/libnccltree_host.so",
    "nccltree/_lib/nccltree_kernels.fatbin",
}
# names of modules that need an optional package or a build step, looked up only if present
OPTIONAL = ("nccltree._records", "nccltree._small", "nccltree.backends.cuda", "nccltree.comm.nccl")

PATH_RE = re.compile(r"(?<![\w./-])((?:\.ci|bench|csrc|docs|nccltree|tests)/[\w./-]*[\w/])")
DOTTED_RE = re.compile(r"(?<![\w./])(nccltree(?:\.\w+)+)(?![\w/])")
FILE_SUFFIXES = {"c", "cu", "h", "md", "py", "so"}  # nccltree.h is a file, not a module
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOC_ANCHOR_RE = re.compile(r"\b(docs/\w+\.md|README\.md)#([\w-]+)")
CODE_SPAN_RE = re.compile(r"`[^`\n]*`")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _split(text: str) -> tuple[str, str]:
    """(prose without code, code): fenced blocks and inline spans go to the code part."""
    prose: list[str] = []
    code: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            code.append(line)
        else:
            code.extend(CODE_SPAN_RE.findall(line))
            prose.append(CODE_SPAN_RE.sub("", line))
    return "\n".join(prose), "\n".join(code)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _doc_ids(docs: list[Path]) -> list[str]:
    return [_rel(d) for d in docs]


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids(DOCS))
def test_named_paths_exist(doc: Path) -> None:
    missing = sorted(
        p
        for p in set(PATH_RE.findall(doc.read_text()))
        if p.rstrip("/") not in BUILT and not (ROOT / p).exists()
    )
    assert not missing, f"{_rel(doc)} names paths that do not exist: {missing}"


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj: object = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue  # not a module: one level up, then attributes
            if module.startswith(OPTIONAL):
                return True  # an optional dependency is missing here
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids(DOCS))
def test_named_modules_and_attributes_exist(doc: Path) -> None:
    _, code = _split(doc.read_text())
    names = {
        n
        for n in DOTTED_RE.findall(code)
        if not n.startswith(OPTIONAL) and n.rsplit(".", 1)[1] not in FILE_SUFFIXES
    }
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{_rel(doc)} names what nccltree does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids(DOCS))
def test_links_and_anchors_resolve(doc: Path) -> None:
    prose, _ = _split(doc.read_text())
    bad = []
    for target in LINK_RE.findall(prose):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{_rel(doc)}: broken links {bad}"


def _anchor_references() -> Iterator[tuple[str, str, str]]:
    sources = [*DOCS, *sorted((ROOT / "nccltree").rglob("*.py")), *sorted(ROOT.glob("bench/*"))]
    sources += sorted((ROOT / "csrc").iterdir())
    for src in sources:
        if src.is_file():
            for doc, anchor in DOC_ANCHOR_RE.findall(src.read_text(errors="replace")):
                yield _rel(src), doc, anchor


def test_anchor_references_in_code_and_docs_resolve() -> None:
    bad = [
        f"{src}: {doc}#{anchor}"
        for src, doc, anchor in _anchor_references()
        if not (ROOT / doc).exists() or anchor not in anchors(ROOT / doc)
    ]
    assert not bad, f"references to headings that do not exist: {bad}"


def _layout() -> list[str]:
    """The paths the code block under "## Layout" of docs/architecture.md lists: a name
    ending in "/" opens a folder for the lines indented below it; later names on a line
    (after the first column) are files of the folder the line's first name belongs to."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    paths = []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if indent > 10:  # a description continued from the line above
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        folder = "".join(name for _, name in stack)
        paths.append(folder + first)
        if first.endswith("/"):
            stack.append((indent, first))
    return paths


def test_architecture_layout_lists_existing_files() -> None:
    missing = [p for p in _layout() if p.rstrip("/") not in BUILT and not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md's layout lists what does not exist: {missing}"


def test_architecture_layout_lists_every_module() -> None:
    """Every module of the package is on the map (a package's ``__init__.py`` may go
    unnamed when it only re-exports)."""
    listed = set(_layout())
    unlisted = []
    for py in sorted((ROOT / "nccltree").rglob("*.py")):
        rel = _rel(py)
        if rel not in listed and (py.name != "__init__.py" or rel == "nccltree/__init__.py"):
            unlisted.append(rel)
    assert not unlisted, f"modules missing from docs/architecture.md's layout: {unlisted}"
