"""Public names of a package loaded on first use (the module ``__getattr__`` of PEP 562).

``nccltree.comm`` and ``nccltree.comm.group`` keep their heavy modules out of an import
of a light submodule; both resolve a name the same way, here."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping


def load(
    package: str, lazy: Mapping[str, str], namespace: MutableMapping[str, object], name: str
) -> object:
    """``name`` of ``package``: a public name from the module ``lazy`` maps it to (kept
    in ``namespace``, the package's globals, so the next lookup is direct), else a
    submodule not imported yet (as the eager imports of the package made them all
    attributes before), else AttributeError."""
    module = lazy.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value
    if name.startswith("__"):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
