"""Every public name is documented, with its arguments.

The public modules are the ones the API reference (docs/api/) renders: ``nccltree`` and
the modules in :data:`PUBLIC_MODULES`; their ``__all__`` is the public surface. Each name
there that is a function or a class has a docstring; so has every public method and
property of those classes (inherited ones included, as long as nccltree defines them),
and every argument of a function, method or constructor is named in its docstring --
or, for a method, in its class's docstring (where arguments shared by a family of
methods, the collectives' ``out``, ``op``, ``stream``, ``async_op``, ``dtype``, are
described once). ``*args`` and ``**kwargs`` are exempt: their docstring says what they
carry in words.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from collections.abc import Iterator

import pytest

#: the modules whose ``__all__`` the API reference documents (nccltree.data is also
#: reached through ``nccltree.__all__``)
PUBLIC_MODULES = (
    "nccltree",
    "nccltree.backends",
    "nccltree.comm",
    "nccltree.comm.group",
    "nccltree.data",
    "nccltree.memory",
    "nccltree.parallel",
    "nccltree.queue",
)
#: names in ``__all__`` that are data, not code (constants, tables)
_DATA = (str, bytes, int, float, tuple, list, dict, frozenset, set, types.MappingProxyType)


def _named(name: str, doc: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", doc) is not None


def _arguments(fn: object) -> list[str]:
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.kind not in skip
    ]


def _ours(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("nccltree")


def _gaps_of_callable(qual: str, fn: object, context: str = "") -> Iterator[str]:
    doc = inspect.getdoc(fn) or ""
    if not doc.strip():
        yield f"{qual}: no docstring"
        return
    for arg in _arguments(fn):
        if not _named(arg, doc + "\n" + context):
            yield f"{qual}: argument {arg!r} not named in the docstring"


def _gaps_of_class(qual: str, cls: type) -> Iterator[str]:
    doc = inspect.getdoc(cls) or ""
    if not doc.strip():
        yield f"{qual}: no docstring"
    init = cls.__dict__.get("__init__")
    if init is not None and _ours(init) and not issubclass(cls, BaseException):
        init_doc = inspect.getdoc(init) or ""
        for arg in _arguments(init):
            if not _named(arg, doc + "\n" + init_doc):
                yield f"{qual}(): argument {arg!r} not named in the class docstring"
    for attr in sorted(dir(cls)):
        if attr.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if attr in k.__dict__), None)
        if owner is None or not _ours(owner):
            continue  # inherited from object, Exception, Protocol, ...
        raw = owner.__dict__[attr]
        if isinstance(raw, property):
            if not (raw.__doc__ or "").strip():
                yield f"{qual}.{attr}: property without a docstring"
        elif isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            context = (inspect.getdoc(owner) or "") + "\n" + doc
            yield from _gaps_of_callable(f"{qual}.{attr}", getattr(cls, attr), context)


def gaps(module: types.ModuleType) -> list[str]:
    """What is undocumented among ``module.__all__``, one line each."""
    out: list[str] = []
    for name in module.__all__:
        obj = getattr(module, name)
        qual = f"{module.__name__}.{name}"
        if inspect.isclass(obj):
            out.extend(_gaps_of_class(qual, obj))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            out.extend(_gaps_of_callable(qual, obj))
        elif inspect.ismodule(obj) or isinstance(obj, _DATA) or obj is None:
            continue  # a public module is listed in PUBLIC_MODULES itself
        elif callable(obj):
            out.extend(_gaps_of_callable(qual, obj))
    return out


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_is_documented_with_its_arguments(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__ and module.__doc__.strip(), f"{name} has no module docstring"
    missing = gaps(module)
    assert not missing, f"{len(missing)} undocumented in {name}:\n" + "\n".join(missing)


def test_the_public_modules_cover_the_packages_public_modules() -> None:
    """A module ``nccltree.__all__`` exports is in the list, so the reference shows it."""
    import nccltree

    exported = {f"nccltree.{n}" for n in nccltree.__all__ if inspect.ismodule(getattr(nccltree, n))}
    assert exported <= set(PUBLIC_MODULES), exported - set(PUBLIC_MODULES)


def test_the_check_finds_what_is_undocumented() -> None:
    """The checker itself: a module with an undocumented function, a class without a
    docstring, a method whose argument goes unnamed and a bare property is caught on
    each count, and a documented one passes."""
    mod = types.ModuleType("nccltree._api_docs_probe", "A probe.")

    def bare(x: int) -> int:
        return x

    def named(count: int, *rest: int, **extra: int) -> int:
        """Return ``count`` (the rest is ignored)."""
        return count

    class NoDoc:
        pass

    class Half:
        """A probe class of ``size``."""

        def __init__(self, size: int, depth: int) -> None:
            self.size, self.depth = size, depth

        def grow(self, by: int, limit: int) -> None:
            """Grow ``by`` elements."""

        @property
        def area(self) -> int:
            return self.size

    for obj in (bare, named, NoDoc, Half, Half.__init__):
        obj.__module__ = mod.__name__
    for obj in (bare, named, NoDoc, Half):
        setattr(mod, obj.__name__, obj)
    mod.__all__ = ["bare", "named", "NoDoc", "Half"]
    found = gaps(mod)
    assert found == [
        "nccltree._api_docs_probe.bare: no docstring",
        "nccltree._api_docs_probe.NoDoc: no docstring",
        "nccltree._api_docs_probe.Half(): argument 'depth' not named in the class docstring",
        "nccltree._api_docs_probe.Half.area: property without a docstring",
        "nccltree._api_docs_probe.Half.grow: argument 'limit' not named in the docstring",
    ], found
