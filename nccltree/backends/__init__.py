"""Device backends: ``devices(spec)`` and the ``Device``/``Stream``/``Event`` interface."""

from __future__ import annotations

import math
import os
import re

from .base import REDUCE_OPS, Device, Event, Stream, Transfer

__all__ = [
    "REDUCE_OPS",
    "Device",
    "Event",
    "Stream",
    "Transfer",
    "available_memory",
    "check_ranks_fit",
    "devices",
    "gpu_count",
    "ranks_memory",
]

#: Host memory one rank costs, whatever the number of ranks: its virtual device (about
#: 4.5 KB of objects and its inline stream), a World's communication stream and Comm, and
#: the stack pages of the two threads that serve it (its stream's worker and its
#: ``World.run`` thread); rounded up.
RANK_BYTES = 64 << 10
#: Host memory per pair of ranks: the N x N link matrix that ``Topology.detect`` (and so
#: every World) builds, one 8-byte reference per entry, held three times over while it is
#: made (24 B), and the pairwise costs the tree builder keeps while it builds the tree
#: (about 120 B, measured); rounded up. This term is what makes a large N impossible:
#: 100,000 ranks need 10^10 pairs, 1.6 TB.
PAIR_BYTES = 160


def ranks_memory(n: int) -> int:
    """Host memory (bytes) ``n`` ranks need: their devices and a World over them, up to
    its first collective (see ``RANK_BYTES`` and ``PAIR_BYTES``). The ring algorithm's
    plans hold another O(n^2) steps each (see ``World``)."""
    return n * RANK_BYTES + n * n * PAIR_BYTES


def available_memory() -> int | None:
    """Bytes this process may still allocate: Linux's ``MemAvailable`` (memory that can
    be had without swapping), lowered to what a cgroup v2 memory limit leaves; elsewhere
    the free physical pages; None when nothing says."""
    avail: int | None = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            avail = None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        if limit != "max":
            left = max(0, int(limit) - used)
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if nbytes < 1000 or unit == "PB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def check_ranks_fit(n: int, what: str) -> None:
    """Refuse (``ValueError``) ``n`` ranks whose estimated memory (``ranks_memory``)
    exceeds ``available_memory()``, before anything is allocated; ``what`` names the
    request in the message. The bound is memory, not cores: virtual devices are cheap
    until the number of pairs of them is large."""
    need = ranks_memory(n)
    avail = available_memory()
    if avail is None or need <= avail:
        return
    # the largest m with m*RANK_BYTES + m*m*PAIR_BYTES <= avail
    b = RANK_BYTES / PAIR_BYTES
    most = max(0, int((-b + math.sqrt(b * b + 4 * avail / PAIR_BYTES)) / 2))
    raise ValueError(
        f"{what} needs about {_human(need)} of host memory ({RANK_BYTES >> 10} KiB per rank "
        f"and {PAIR_BYTES} B per pair of ranks, for the link matrix and the tree between "
        f"them), but {_human(avail)} is available: at most {most} ranks fit on this machine"
    )


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

    A malformed spec or a GPU ordinal that does not exist raises ``ValueError``; so does a
    number of virtual devices whose estimated memory, with a World over them, exceeds the
    memory available (``check_ranks_fit``); asking for GPUs without CuPy, a driver or a
    GPU raises ``BackendUnavailable``.
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
        check_ranks_fit(n, f"{spec!r}")
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
