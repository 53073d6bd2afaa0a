"""Device backends: ``devices(spec)`` and the ``Device``/``Stream``/``Event`` interface."""

from __future__ import annotations

import re

from .base import REDUCE_OPS, Device, Event, Stream, Transfer

__all__ = ["REDUCE_OPS", "Device", "Event", "Stream", "Transfer", "devices", "gpu_count"]

ACCEPTED_SPECS = (
    '"cpu:N" (N virtual host devices, N >= 1), "gpu:0,1" (these GPU ordinals), '
    '"gpu:0,0" (logical ranks sharing one GPU), "gpu:all" (every visible GPU), '
    '"auto" (every visible GPU, else cpu:2)'
)

_CPU_RE = re.compile(r"cpu:(\d+)")
_GPU_RE = re.compile(r"gpu:(all|\d+(?:,\d+)*)")


def _bad_spec(spec: object, why: str = "malformed device spec") -> ValueError:
    return ValueError(f"{why}: {spec!r}; accepted forms: {ACCEPTED_SPECS}")


def gpu_count() -> int:
    """Number of CUDA GPUs CuPy sees (raises ``BackendUnavailable`` naming what is
    missing: CuPy, the driver or a GPU)."""
    from .cuda import gpu_count as _count

    return _count()


def devices(spec: str) -> list[Device]:
    """The devices of ``spec`` (see ``ACCEPTED_SPECS``), all sharing one backend object.

    A malformed spec or a GPU ordinal that does not exist raises ``ValueError``; asking for
    GPUs without CuPy, a driver or a GPU raises ``BackendUnavailable``.
    """
    if not isinstance(spec, str):
        raise TypeError(f"devices() takes a spec string; accepted forms: {ACCEPTED_SPECS}")
    s = spec.strip().lower().replace(" ", "")
    if s == "auto":
        from .._errors import BackendUnavailable

        try:
            n = gpu_count()
        except BackendUnavailable:
            n = 0
        s = "gpu:all" if n > 0 else "cpu:2"

    m = _CPU_RE.fullmatch(s)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise _bad_spec(spec, "cpu:N needs N >= 1")
        from .host import HostRuntime

        return list(HostRuntime(n).devices)

    m = _GPU_RE.fullmatch(s)
    if not m:
        raise _bad_spec(spec)
    count = gpu_count()  # BackendUnavailable when CuPy or the driver is missing
    if count == 0:
        from .._errors import BackendUnavailable

        raise BackendUnavailable(f"{spec!r} asks for GPUs, but CuPy sees no CUDA GPU")
    if m.group(1) == "all":
        ids = list(range(count))
    else:
        ids = [int(x) for x in m.group(1).split(",")]
        missing = sorted({i for i in ids if i >= count})
        if missing:
            raise _bad_spec(
                spec, f"GPU {', '.join(map(str, missing))} does not exist ({count} visible)"
            )
    from .cuda import CudaRuntime

    return list(CudaRuntime(ids).devices)
