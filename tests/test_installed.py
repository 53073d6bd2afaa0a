"""Which nccltree the tests import: the checkout's, or an installed wheel's.

``.ci/wheel`` runs the quick tests against a wheel installed into a fresh virtual
environment and sets ``NCCLTREE_TEST_INSTALLED=1``; these tests then prove the tests ran
against that installed copy (the package, its kernel library and the bundled OpenMP
runtime all from the environment's site-packages), not against the checkout they sit in.
Without the variable (a developer's editable install) they skip.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

import pytest

import nccltree

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = os.environ.get("NCCLTREE_TEST_INSTALLED") == "1"
needs_installed = pytest.mark.skipif(
    not INSTALLED, reason="NCCLTREE_TEST_INSTALLED=1 is set by .ci/wheel only"
)


def _site_packages() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    paths.update(site.getsitepackages())
    return [Path(p).resolve() for p in paths]


def _inside(path: Path, folders: list[Path]) -> bool:
    return any(path.is_relative_to(f) for f in folders)


@needs_installed
def test_the_package_is_the_installed_one() -> None:
    here = Path(nccltree.__file__).resolve()
    assert not here.is_relative_to(ROOT), f"imported the checkout's nccltree: {here}"
    assert _inside(here, _site_packages()), f"nccltree is not in site-packages: {here}"
    assert sys.prefix != sys.base_prefix, "not inside a virtual environment"
    assert Path(sys.prefix).resolve() in here.parents


@needs_installed
def test_the_kernel_library_is_the_wheels() -> None:
    from nccltree import _native

    _native.library()  # loads, with its OpenMP runtime
    lib = Path(_native.library_path()).resolve()
    assert lib.parent == Path(nccltree.__file__).resolve().parent / "_lib", lib
    assert not lib.is_relative_to(ROOT), lib
    # auditwheel's copy of libgomp, next to the package, is the one the library loaded
    with open(f"/proc/{os.getpid()}/maps") as f:
        maps = f.read()
    gomp = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    assert any("nccltree.libs" in g for g in gomp), f"not the bundled libgomp: {gomp}"
    # another package's own copy (torch bundles one) may be mapped beside it, never the
    # system's, which the wheel must not need
    site = Path(nccltree.__file__).resolve().parent.parent
    assert all(Path(g).resolve().is_relative_to(site) for g in gomp), gomp


@needs_installed
def test_no_compiler_is_reachable() -> None:
    """The environment .ci/wheel gives the tests: CC, CXX and the compilers on PATH are
    one program that fails, so nothing at run time could have quietly built a library."""
    import shutil

    fakes = set()
    for exe in (os.environ.get("CC"), os.environ.get("CXX"), *map(shutil.which, ("cc", "gcc"))):
        assert exe, "CC, CXX, cc or gcc is not set or not found"
        fakes.add(Path(exe).resolve())
    assert len(fakes) == 1, fakes
    (fake,) = fakes
    assert fake.read_text().rstrip().endswith("exit 1"), fake
