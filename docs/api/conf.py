"""Sphinx configuration of nccltree's API reference, generated from the docstrings.

Build it (CI does, with warnings as errors) from the checkout with the dev extra
installed (``./dev setup`` installs it)::

    .venv/bin/python -m sphinx -W --keep-going -b html docs/api build/api

The pages are written at build time from the ``__all__`` of the public modules (the same
list ``tests/test_api_docs.py`` checks), each object documented once, under the first
module that exports it: ``nccltree`` first, then the modules below it. The generated
``.rst`` files and the HTML are build output, not committed.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the public-module list lives there
from test_api_docs import PUBLIC_MODULES  # noqa: E402

import nccltree  # noqa: E402

project = "nccltree"
author = "the nccltree authors"
copyright = "the nccltree authors"
release = version = nccltree.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# prose docstrings in reStructuredText; napoleon also reads a Google or NumPy section
napoleon_google_docstring = True
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = True
html_theme = "alabaster"
exclude_patterns = ["_build"]
master_doc = "index"

GENERATED = HERE / "_generated"

_TITLES = {
    "nccltree": "nccltree: devices, World, Comm, process groups, training, errors",
    "nccltree.backends": "nccltree.backends: devices, streams, events",
    "nccltree.comm": "nccltree.comm: the World, its per-rank Comm, Work and plans",
    "nccltree.comm.group": "nccltree.comm.group: process groups across processes and nodes",
    "nccltree.data": "nccltree.data: record databases and the reader",
    "nccltree.memory": "nccltree.memory: pinned host memory and synced memory",
    "nccltree.parallel": "nccltree.parallel: the data-parallel driver",
    "nccltree.queue": "nccltree.queue: the blocking queue",
}


def _ours(cls: type) -> bool:
    return cls.__module__.startswith("nccltree")


def _foreign_bases(cls: type) -> list[str]:
    """The bases whose members the reference leaves out: every non-nccltree class."""
    return [base.__name__ for base in cls.__mro__[1:] if not _ours(base)]


def _directive(module: str, name: str, obj: object) -> str:
    target = f"{module}.{name}"
    if inspect.isclass(obj):
        lines = [f".. autoclass:: {target}", "   :members:", "   :show-inheritance:"]
        if any(_ours(base) for base in obj.__mro__[1:]):
            # the collectives a face inherits from the one declaration (comm/faces.py);
            # not what a class inherits from Python's own types (int, Exception, ...)
            lines.append("   :inherited-members: " + ", ".join(_foreign_bases(obj)))
        return "\n".join(lines)
    if callable(obj):
        return f".. autofunction:: {target}"
    return f".. autodata:: {target}\n   :annotation:"


def write_pages() -> None:
    """One page per public module: the objects its ``__all__`` names that no earlier
    module documented (a name re-exported by ``nccltree`` is documented there)."""
    GENERATED.mkdir(exist_ok=True)
    seen: set[int] = set()
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        title = _TITLES.get(module, module)
        body = [title, "=" * len(title), "", f".. automodule:: {module}", ""]
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or name.startswith("__"):
                continue
            if not (inspect.isclass(obj) or callable(obj)):
                continue  # constants are described in the module docstring
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            body += [_directive(module, name, obj), ""]
        (GENERATED / f"{module}.rst").write_text("\n".join(body))


write_pages()
