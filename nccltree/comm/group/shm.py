"""Shared-memory segments for the processes of one node (Linux ``/dev/shm``).

A segment is created by one process with mode 0600 under a name that carries the user,
the job and the creator's process id, attached by the node's other processes, and
unlinked as soon as they all have it mapped: the kernel then frees it when the last
mapping goes, even if every process is killed. Segments of this naming whose creator is
gone (a crash between creation and unlink) are removed by :func:`remove_stale`.

The pages are reserved when the segment is created (``posix_fallocate``), so a segment
that does not fit in ``/dev/shm`` fails there with one line saying how to make room,
instead of a ``SIGBUS`` on first touch.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import sys

import numpy as np

from ..._errors import CommError

SHM_DIR = "/dev/shm"
PREFIX = "nccltree"


def user_tag() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else "u"


def segment_name(job: str, what: str) -> str:
    """``nccltree-<uid>-<job>-p<pid>-<what>``: the user, the job, the creator."""
    return f"{PREFIX}-{user_tag()}-{job}-p{os.getpid()}-{what}"


class ShmTooSmall(CommError):
    """``/dev/shm`` cannot hold a segment."""


def _too_small(nbytes: int, detail: str) -> ShmTooSmall:
    return ShmTooSmall(
        f"shared memory: a segment of {nbytes} bytes does not fit in {SHM_DIR} ({detail}); "
        f"give the container more (docker run --shm-size=2g; Kubernetes: an emptyDir with "
        f"medium Memory mounted at {SHM_DIR}) or remount it larger "
        f"(mount -o remount,size=4G {SHM_DIR}), or set NCCLTREE_SHM=0 to exchange the data "
        f"over MPI instead"
    )


class Segment:
    """A mapped segment: ``buf`` (a writable ``mmap``) of ``size`` bytes."""

    def __init__(self, name: str, size: int, buf: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.buf = buf
        self.linked = True

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        size = max(int(size), mmap.PAGESIZE)
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.statvfs(SHM_DIR)
        except OSError as exc:
            raise CommError(f"shared memory: {SHM_DIR} is not usable ({exc})") from exc
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise _too_small(size, f"{free} bytes free of {st.f_blocks * st.f_frsize}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise _too_small(size, os.strerror(exc.errno)) from None
                raise CommError(f"shared memory: cannot size {path}: {exc}") from exc
            buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, buf)

    @classmethod
    def attach(cls, name: str) -> Segment:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise CommError(f"shared memory: cannot attach {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = cls(name, size, buf)
        seg.linked = False  # the creator unlinks
        return seg

    def view(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        """``count`` elements of ``dtype`` from byte ``offset``."""
        return np.frombuffer(self.buf, dtype, count, offset)

    def unlink(self) -> None:
        """Remove the name (the memory stays while mapped). Idempotent."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        try:
            self.buf.close()
        except BufferError:
            pass  # views still exported: the mapping goes with them


_NAME = re.compile(rf"^{PREFIX}-(\d+|u)-[0-9a-zA-Z]+-p(\d+)-")


def remove_stale() -> list[str]:
    """Unlink this user's segments whose creating process no longer exists; returns their
    names. (Process ids are per machine: only this node's segments are looked at.)"""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    me = user_tag()
    for name in names:
        m = _NAME.match(name)
        if not m or m.group(1) != me:
            continue
        pid = int(m.group(2))
        if alive(pid):
            continue  # (or another user's process with that id: leave it)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed


#: ``/dev/shm`` needs this much free space for a node's processes to share memory; with
#: less (Docker's default is 64 MiB in all) they exchange data over MPI
SHM_MIN_FREE = 64 << 20


def shm_usable(shm: bool | None) -> bool:
    """Whether this process may use shared memory: ``shm`` when given, else
    ``NCCLTREE_SHM`` (0 or 1) when set, else whether ``/dev/shm`` has
    :data:`SHM_MIN_FREE` bytes free. Another value of ``NCCLTREE_SHM`` is a
    ``ValueError`` naming the accepted ones (not ignored: ``yes`` would read as unset)."""
    if shm is not None:
        return bool(shm)
    env = os.environ.get("NCCLTREE_SHM", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(
            f"NCCLTREE_SHM={env!r}: accepted values are 0 (no shared memory) and 1 (use "
            "it whatever /dev/shm has free); unset, the free space of /dev/shm decides"
        )
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= SHM_MIN_FREE


def shm_usable_reason(shm: bool | None) -> str:
    if shm is False or os.environ.get("NCCLTREE_SHM", "").strip() == "0":
        return "shared memory is switched off (shm=False or NCCLTREE_SHM=0)"
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError as exc:
        return f"{SHM_DIR} is not usable ({exc})"
    return (
        f"{SHM_DIR} has {free >> 20} MiB free, under {SHM_MIN_FREE >> 20} MiB (docker run "
        f"--shm-size=2g, or mount -o remount,size=4G {SHM_DIR}, gives it more; "
        "NCCLTREE_SHM=1 uses it anyway)"
    )


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, killed but not yet reaped
    by its launcher, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill()
    return state not in (b"Z", b"X")


def exit_without_finalize() -> None:
    """At exit after a failed group: MPI_Finalize would wait for the failed process for
    ever (it synchronises every process), so leave without it, with status 1."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def address(seg: Segment) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(seg.buf))


def name_for(job: str, pid: int, what: str) -> str:
    return f"{PREFIX}-{user_tag()}-{job}-p{pid}-{what}"
