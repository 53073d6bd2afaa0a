"""Shared fixtures: the ``backend`` parametrisation, device factories, the fake CuPy.

``backend`` runs a test body on the host backend always and on the CUDA backend where a GPU
is usable; ``gpu`` and ``multi_gpu(n)`` tests are skipped cleanly without enough GPUs.
``fake_cupy`` runs nccltree's CUDA code on a fake of CuPy's layer (wiring only, never GPU
verification; see ``tests/fakecupy``).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccltree as nt


@functools.cache
def gpu_count() -> int:
    """GPUs usable through CuPy here (0 without CuPy, a driver or a GPU)."""
    try:
        from nccltree.backends import gpu_count as count

        return count()
    except nt.BackendUnavailable:
        return 0


# Test-only libraries a GPU machine may lack (it gets nccltree's runtime dependencies and
# pytest, nothing else). Modules that need them hold no gpu tests, so there they are left
# out of collection instead of failing it; everywhere else the test extra installs them.
_NEEDS = {"hypothesis": ("test_topology.py", "test_tree.py")}
collect_ignore: list[str] = []
for _lib, _modules in _NEEDS.items():
    try:
        __import__(_lib)
    except ImportError:
        collect_ignore.extend(_modules)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        need = 0
        if item.get_closest_marker("gpu") is not None:
            need = 1
        multi = item.get_closest_marker("multi_gpu")
        if multi is not None:
            need = max(need, int(multi.args[0]) if multi.args else 2)
        if need and gpu_count() < need:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {gpu_count()} usable")
            )


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> str:
    """The backend name a test body runs on: "host", and "cuda" where a GPU is usable."""
    return request.param


@pytest.fixture
def make_devices(backend: str):
    """``make_devices(n)`` -> n devices of ``backend``, shut down after the test. On CUDA
    the n logical devices take the visible GPUs in turn (sharing them if n is larger)."""
    runtimes = []

    def make(n: int) -> list[nt.Device]:
        if backend == "host":
            spec = f"cpu:{n}"
        else:
            spec = "gpu:" + ",".join(str(i % gpu_count()) for i in range(n))
        devs = nt.devices(spec)
        runtimes.append(devs[0].runtime)
        return devs

    yield make
    for rt in runtimes:
        rt.shutdown()


@pytest.fixture
def dev(make_devices) -> nt.Device:
    """One device of ``backend``."""
    return make_devices(1)[0]


@pytest.fixture
def devs(make_devices) -> list[nt.Device]:
    """Two devices of ``backend``."""
    return make_devices(2)


@pytest.fixture
def host_devs():
    """``host_devs(n)`` -> n host devices (host-only tests), shut down after the test."""
    runtimes = []

    def make(n: int) -> list[nt.Device]:
        devs = nt.devices(f"cpu:{n}")
        runtimes.append(devs[0].runtime)
        return devs

    yield make
    for rt in runtimes:
        rt.shutdown()


def _one_device(request):
    """None (plain numpy), a virtual host device, or a GPU; shut down afterwards."""
    if request.param == "numpy":
        yield None
        return
    devs = nt.devices("cpu:1" if request.param == "host" else "gpu:0")
    yield devs[0]
    devs[0].runtime.shutdown()


#: parameters on no device (numpy), on a host device, and on a GPU where one is usable
host_device = pytest.fixture(params=["numpy", "host"])(_one_device)
any_device = pytest.fixture(params=["numpy", "host", pytest.param("cuda", marks=pytest.mark.gpu)])(
    _one_device
)


def to_np(a):
    """A numpy view or copy of a numpy or CuPy array."""
    return a if isinstance(a, np.ndarray) else a.get()


# nccltree's per-process caches of what CuPy told it: (module, attribute, fresh value factory)
_CUDA_CACHES: tuple[tuple[str, str, Any], ...] = (
    ("nccltree.backends.cuda", "_peer_state", dict),
    ("nccltree.backends.cuda", "_peer_warned", set),
    ("nccltree._cuda_kernels", "_modules", dict),
    ("nccltree._cuda_kernels", "_origin", dict),
    ("nccltree._cuda_kernels", "_target", dict),
    ("nccltree._cuda_kernels", "_functions", dict),
    ("nccltree._cuda_kernels", "_use_fatbin", lambda: True),
    ("nccltree.memory", "_gpu_usable", lambda: None),
)


@pytest.fixture
def fake_cupy(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Any]:
    """A fake of CuPy's layer installed as ``cupy`` for one test; yields its
    ``fakecupy.FakeCuda`` (fault injection and inspection). Wiring checks only: nothing
    that passes on it is verified on a GPU.

    Configure it by indirect parametrisation with a dict of ``fakecupy.install`` arguments,
    e.g. ``@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 2, "peer": False}],
    indirect=True)``; the default is 4 GPUs with peer access between all of them. nccltree's
    caches of CuPy state are reset for the test and restored after it, compiled kernels go
    to a temporary cache directory, and the test fails if the fake recorded a misuse
    (``fake.misuse``; a test that provokes one on purpose clears the list).
    """
    import importlib

    import fakecupy

    gpu_count()  # the real answer, cached before the fake can be seen
    options: dict[str, Any] = dict(getattr(request, "param", None) or {})
    for module, attr, fresh in _CUDA_CACHES:
        mod = importlib.import_module(module)
        if hasattr(mod, attr):
            monkeypatch.setattr(mod, attr, fresh())
    monkeypatch.setenv("NCCLTREE_CACHE_DIR", str(tmp_path / "kernel-cache"))
    with fakecupy.install(**options) as fake:
        yield fake
        misuse = list(fake.misuse)
    if misuse:
        pytest.fail("the fake CuPy recorded misuse:\n" + "\n".join(misuse))


BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def bench_module(name: str) -> Any:
    """``bench/<name>.py`` imported as a module (the bench scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
