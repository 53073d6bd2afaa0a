"""Other frameworks' streams as nccltree's: what every ``stream=`` argument goes through.

A call's ``stream=`` takes nccltree's own :class:`~nccltree.backends.base.Stream`, and
on a GPU also what a framework embedding nccltree holds: a CuPy stream
(``cupy.cuda.Stream`` or ``cupy.cuda.ExternalStream``), a torch stream
(``torch.cuda.Stream``: anything with a ``cuda_stream`` handle) or a raw ``cudaStream_t``
(an int). The last two are wrapped in CuPy's ``ExternalStream``: nccltree orders its
work against that stream with events and never owns or destroys it. ``None`` stays None:
the call then orders against the caller's default (CuPy's current stream on a GPU; the
calling thread on the host backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias

from ..backends.base import Stream

if TYPE_CHECKING:
    from ..backends.base import Device


class HasCudaStream(Protocol):
    """A torch stream (``torch.cuda.Stream``, ``torch.cuda.ExternalStream``)."""

    @property
    def cuda_stream(self) -> int: ...


class HasPtr(Protocol):
    """A CuPy stream (``cupy.cuda.Stream``, ``cupy.cuda.ExternalStream``)."""

    @property
    def ptr(self) -> int: ...


#: the type of every ``stream=`` argument: nccltree's Stream, a torch or CuPy stream, a
#: raw ``cudaStream_t`` (an int), or None
StreamArg: TypeAlias = Stream | HasCudaStream | HasPtr | int | None

#: what ``stream=`` accepts, for messages
STREAM_KINDS = (
    "an nccltree Stream, a CuPy stream, a torch.cuda.Stream (or anything with a "
    "cuda_stream handle) or a raw cudaStream_t int"
)


def as_stream(device: Device, stream: object) -> Stream | None:
    """``stream`` (any kind above, or None) as a stream of ``device``'s backend; None
    stays None. TypeError for anything else, or for a foreign stream on the host backend
    (whose streams are worker threads: only its own exist); ValueError for a stream of
    another GPU."""
    if stream is None or isinstance(stream, Stream):
        return stream
    if device.backend != "cuda":
        raise TypeError(
            f"stream= on a {device.backend} device takes an nccltree Stream "
            f"(device.new_stream()) or None, got {type(stream).__name__}"
        )
    from ..backends.cuda import CudaDevice, CudaStream, _cupy

    cp = _cupy()
    assert isinstance(device, CudaDevice)
    raw: object
    if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
        raw = stream
    else:
        handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream's cudaStream_t
        if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
            raise TypeError(f"stream= takes {STREAM_KINDS}; got {type(stream).__name__}")
        raw = cp.cuda.ExternalStream(handle, device.physical_id)
    dev_id = getattr(raw, "device_id", -1)
    if dev_id not in (-1, device.physical_id):
        raise ValueError(f"the stream belongs to GPU {dev_id}, the call's device is {device.name}")
    return CudaStream(device, raw)
