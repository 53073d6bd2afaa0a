"""A backend whose operations do nothing: what issuing a plan costs in Python alone.

``null_world(n, topology="nvswitch8")`` makes a ``World`` over ``n`` null devices. The
World, the argument checks, the plan cache and the executor are the real ones; only the
device layer is empty:

* arrays are numpy arrays from ``np.empty`` (the memory is reserved, never touched, so a
  256 MiB buffer per rank costs address space, not RAM); they carry the right shape,
  dtype and size, so the argument checks and the views the executor takes are the real
  ones;
* a stream's copy, reduce, scale, SGD step and ``call`` return at once without doing
  anything; waits and synchronisations return at once; every event is complete;
* the backend name is ``"null"``, which the World treats as a GPU (its chunk policy, no
  inline path, caller streams ordered by events), so the plans are the GPU ones.

It is a LOWER bound on the host time of issuing a plan on GPUs: CuPy's argument packing,
the device switches, the ``cudaMemcpyAsync``/kernel launch and event calls of the CUDA
backend all come on top. It is never a default and cannot be reached through
``nccltree.devices()``: only this file makes it, for the benchmarks and tests that
measure the executor's own cost (``bench/issue_cost.py``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from nccltree.backends.base import (
    CopyArgs,
    Device,
    Event,
    ReduceArgs,
    SgdArgs,
    ShapeLike,
    Stream,
    as_shape,
)

__all__ = ["NullDevice", "NullEvent", "NullRuntime", "NullStream", "null_topology", "null_world"]


class NullEvent(Event):
    """An event that is always complete."""

    __slots__ = ()

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, NullStream):
            raise TypeError(f"a null event records on a null stream, got {stream!r}")

    def _synchronize(self, timeout: float) -> None:
        return None

    def query(self) -> bool:
        return True


class NullStream(Stream):
    """A stream whose operations return at once and do nothing."""

    def __init__(self, device: NullDevice) -> None:
        self.device: NullDevice = device

    def _copy(self, c: CopyArgs) -> None:
        return None

    def _reduce(self, r: ReduceArgs) -> None:
        return None

    def _scale(self, x: Any, alpha: float, dtype: np.dtype | None = None) -> None:
        return None

    def _sgd_update(self, a: SgdArgs) -> None:
        return None

    def _call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        return None

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, NullEvent):
            raise TypeError(f"a null stream waits on null events, got {event!r}")

    def _synchronize(self, timeout: float) -> None:
        return None

    def query(self) -> bool:
        return True


class NullDevice(Device):
    """A device whose memory is untouched numpy memory and whose streams do nothing."""

    backend = "null"

    def __init__(self, runtime: NullRuntime, index: int) -> None:
        super().__init__()
        self.runtime = runtime
        self.index = index
        self.physical_id = index
        self.name = f"null:{index}"
        self.threads = 1

    @property
    def xp(self) -> types.ModuleType:
        return np

    def empty(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> np.ndarray:
        return np.empty(as_shape(shape), dtype)

    def zeros(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> np.ndarray:
        return np.zeros(as_shape(shape), dtype)  # calloc: pages stay untouched too

    def pinned_empty(self, shape: ShapeLike, dtype: npt.DTypeLike = "float32") -> np.ndarray:
        return np.empty(as_shape(shape), dtype)

    def asarray(self, obj: Any) -> np.ndarray:
        if not isinstance(obj, np.ndarray):
            raise TypeError(f"a null device takes numpy arrays, got {type(obj).__name__}")
        return obj

    def _check_operand(
        self, arr: object, what: str, *, writable: bool = False, host_ok: bool = False
    ) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{what} must be a numpy array, got {type(arr).__name__}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        if writable and not arr.flags.writeable:
            raise ValueError(f"{what} must be writable")

    def from_host(self, host: npt.ArrayLike, stream: Stream | None = None) -> np.ndarray:
        return np.array(host, copy=True, order="C")

    def to_host(
        self, arr: np.ndarray, out: np.ndarray | None = None, stream: Stream | None = None
    ) -> np.ndarray:
        return np.empty_like(arr) if out is None else out

    def _make_stream(self) -> NullStream:
        return NullStream(self)

    def new_event(self) -> NullEvent:
        return NullEvent()

    def _stream_waits(self) -> list[Callable[[float], None]]:
        return []

    def can_access_peer(self, other: Device) -> bool:
        return isinstance(other, NullDevice)

    def sum_into(self, dst: Any, src: Any) -> None:
        return None

    def scale(self, x: Any, alpha: float) -> None:
        return None

    def sgd_update(
        self, w: Any, g: Any, v: Any, lr: float, momentum: float, weight_decay: float
    ) -> None:
        return None


class NullRuntime:
    """The backend object shared by the null devices of one ``null_world``."""

    name = "null"

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a null runtime needs at least one device, got {n}")
        self.devices: list[NullDevice] = [NullDevice(self, i) for i in range(n)]

    def shutdown(self) -> None:
        return None


def null_topology(n: int, preset: str = "nvswitch8") -> Any:
    """The topology of ``n`` null devices: the preset itself when it has ``n`` devices,
    else ``n`` devices all linked as the preset's GPUs 0 and 1 are (one link everywhere,
    e.g. NVSwitch's NV12)."""
    from nccltree.topology import Topology

    topo = Topology.preset(preset)
    if topo.n == n:
        return topo
    if topo.n < 2:
        raise ValueError(f"preset {preset!r} has {topo.n} device(s): no link to repeat")
    return Topology.uniform(n, topo.link(0, 1))


def null_world(
    n: int,
    topology: str = "nvswitch8",
    algorithm: str = "tree",
    *,
    chunk_bytes: int | None = None,
    timeout: float = 60.0,
) -> Any:
    """A ``World`` of ``n`` null devices on the topology ``topology`` (a preset name; see
    :func:`null_topology`), with the GPU chunk policy unless ``chunk_bytes`` is given."""
    from nccltree.comm import World

    devs: Sequence[Device] = NullRuntime(n).devices
    return World(
        devs,
        algorithm=algorithm,
        topology=null_topology(n, topology),
        timeout=timeout,
        chunk_bytes=chunk_bytes,
    )
