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

import errno
import mmap
import os
import re

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
        try:
            os.kill(pid, 0)
            continue  # alive (or another user's process with that id: leave it)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed
