"""Shared fixtures: the ``backend`` parametrisation and device factories.

``backend`` runs a test body on the host backend always and on the CUDA backend where a GPU
is usable; ``gpu`` and ``multi_gpu(n)`` tests are skipped cleanly without enough GPUs.
"""

from __future__ import annotations

import functools

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
any_device = pytest.fixture(
    params=["numpy", "host", pytest.param("cuda", marks=pytest.mark.gpu)]
)(_one_device)


def to_np(a):
    """A numpy view or copy of a numpy or CuPy array."""
    return a if isinstance(a, np.ndarray) else a.get()
