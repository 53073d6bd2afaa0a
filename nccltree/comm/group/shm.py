"""Shared-memory segments for the processes of one node (Linux ``/dev/shm``).

A segment is created by one process with mode 0600 and ``O_EXCL`` under a name that
carries the user, the job, the creator's process id (for people reading a listing; see
:func:`remove_stale`) and a part nobody can guess (:func:`name_part`: drawn at random, or
derived from a secret the node's processes share in their control block), attached by
the node's other processes, and unlinked as soon as they all have it mapped: the kernel
then frees it when the last mapping goes, even if every process is killed.

While its name exists, the creator holds an exclusive ``flock`` on the segment's file
(on a descriptor it keeps open until it unlinks the name): the kernel drops the lock
when the creator dies, however it dies, and a lock on a ``/dev/shm`` file is seen by
every process that opens the file, whatever its pid namespace. A segment whose lock
nobody holds is stale (its creator died between creating and unlinking it) and
:func:`remove_stale` removes it; a held lock means a live job, whose segment is never
touched (a process id means nothing across pid namespaces: one alive here only ever
keeps a segment, never removes one).

A process also unlinks at exit the names it still holds (:func:`unlink_own`, from an
``atexit`` hook), and a process that leaves without ``MPI_Finalize`` after a failed
group (:func:`exit_without_finalize`) first unlinks the MPICH segments it has mapped
itself, found in its own ``/proc/self/maps`` (:func:`unlink_mapped_mpich`): MPICH
unlinks them only in ``MPI_Finalize``.

The pages are reserved when the segment is created (``posix_fallocate``), so a segment
that does not fit in ``/dev/shm`` fails there with one line saying how to make room,
instead of a ``SIGBUS`` on first touch.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import hashlib
import hmac
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ..._errors import CommError

SHM_DIR = "/dev/shm"
PREFIX = "nccltree"
MPICH_PREFIX = "mpich_shm_"
#: names tried when a segment's name is taken (each with a fresh unguessable part)
CREATE_TRIES = 8


def user_tag() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else "u"


def name_part(secret: bytes | None = None, what: str = "") -> str:
    """The unguessable part of a segment's name: 16 hex digits, at random, or (with
    ``secret``) derived from ``secret`` and ``what`` (the node's processes, which read
    each other's secrets in the control block, name each other's segments; nobody who
    sees only names can)."""
    if secret is None:
        return secrets.token_hex(8)
    return hmac.new(secret, what.encode(), hashlib.sha256).hexdigest()[:16]


def name_for(job: str, pid: int, part: str, what: str) -> str:
    """``nccltree-<uid>-<job>-p<pid>-<part>-<what>``: the user, the job, the creator,
    the unguessable part, what it holds."""
    return f"{PREFIX}-{user_tag()}-{job}-p{pid}-{part}-{what}"


def segment_name(job: str, what: str, secret: bytes | None = None) -> str:
    """The name of a segment this process creates (see :func:`name_for`)."""
    return name_for(job, os.getpid(), name_part(secret, what), what)


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


# the names this process created and still holds (unlinked at exit: see unlink_own)
_own: dict[str, Segment] = {}
_own_lock = threading.Lock()
_own_pid = 0  # the process that registered the exit hook (a forked child is another)


def _hold(seg: Segment) -> None:
    global _own_pid
    with _own_lock:
        if _own_pid != os.getpid():
            _own.clear()  # a forked child: its parent's names are the parent's
            _own_pid = os.getpid()
            atexit.register(unlink_own)
        _own[seg.name] = seg


def unlink_own() -> list[str]:
    """Unlink every name this process created and still holds (at exit, and before a
    process leaves without finalizing); the names."""
    if _own_pid != os.getpid():
        return []
    with _own_lock:
        held = list(_own.values())
    for seg in held:
        seg.unlink()
    return [seg.name for seg in held]


class Segment:
    """A mapped segment: ``buf`` (a writable ``mmap``) of ``size`` bytes. ``lock_fd``:
    the creator's descriptor holding the segment's lock while its name exists."""

    def __init__(self, name: str, size: int, buf: mmap.mmap, lock_fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.buf = buf
        self.linked = True
        self.lock_fd = lock_fd

    @classmethod
    def create(cls, name: str | Callable[[], str], size: int) -> Segment:
        """A new segment of ``size`` bytes (at least a page), locked and registered for
        unlinking at exit. ``name``: the name, or a function that draws one (a name that
        exists then makes it draw another; :data:`CREATE_TRIES` in all). A name that
        exists raises ``CommError`` (O_EXCL: nobody else's file is ever used)."""
        size = max(int(size), mmap.PAGESIZE)
        try:
            st = os.statvfs(SHM_DIR)
        except OSError as exc:
            raise CommError(f"shared memory: {SHM_DIR} is not usable ({exc})") from exc
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise _too_small(size, f"{free} bytes free of {st.f_blocks * st.f_frsize}")
        taken: list[str] = []
        fd = _TAKEN
        for _ in range(CREATE_TRIES):
            seg_name = name() if callable(name) else name
            fd = _create_locked(os.path.join(SHM_DIR, seg_name))
            if fd >= 0:
                break
            if fd == _TAKEN:
                taken.append(seg_name)
                if not callable(name):
                    break  # a name that cannot change
        if fd < 0:
            raise CommError(
                f"shared memory: cannot create a segment in {SHM_DIR}: "
                + (f"{', '.join(taken)} exist(s) already, made by another process or user"
                   if taken else f"{seg_name} was taken by a stale-segment cleanup")
            )  # fmt: skip
        path = os.path.join(SHM_DIR, seg_name)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise _too_small(size, os.strerror(exc.errno)) from None
                raise CommError(f"shared memory: cannot size {path}: {exc}") from exc
            buf = mmap.mmap(fd, size)
        except BaseException:
            _unlink_path(path)
            os.close(fd)
            raise
        seg = cls(seg_name, size, buf, fd)
        _hold(seg)
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
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
        """Remove the name (the memory stays while mapped), then drop the lock.
        Idempotent."""
        if self.linked:
            self.linked = False
            _unlink_path(os.path.join(SHM_DIR, self.name))
            with _own_lock:
                _own.pop(self.name, None)
        if self.lock_fd >= 0:
            fd, self.lock_fd = self.lock_fd, -1
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        self.unlink()
        try:
            self.buf.close()
        except BufferError:
            pass  # views still exported: the mapping goes with them


def _unlink_path(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_TAKEN, _RACED = -1, -2


def _create_locked(path: str) -> int:
    """A new file at ``path`` (0600, exclusive), locked: its descriptor; ``_TAKEN`` when
    the name exists, ``_RACED`` when a stale-segment cleanup locked the new file before
    this process did (it removes it: this waits, up to a second, until it has)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _TAKEN
    except OSError as exc:
        raise CommError(f"shared memory: cannot create {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        deadline = time.monotonic() + 1.0
        while os.path.lexists(path) and time.monotonic() < deadline:
            time.sleep(0.001)
        return _RACED
    except OSError as exc:
        _unlink_path(path)
        os.close(fd)
        raise CommError(f"shared memory: cannot lock {path}: {exc}") from exc
    return fd


_NAME = re.compile(rf"^{PREFIX}-(\d+|u)-[0-9a-zA-Z]+-p(\d+)-")


def remove_stale() -> list[str]:
    """Unlink this user's segments whose lock nobody holds (their creator died before
    unlinking them); returns their names. A segment whose lock is held belongs to a
    live process, of this pid namespace or another, and stays. The creator's pid in the
    name never removes one; a live process of that pid here keeps it (a segment made by
    a version that took no lock is safe too; one whose pid was reused waits for it)."""
    # (a pid alive here only ever keeps one: see the docstring)
    return _remove_unlocked(lambda pid: not alive(pid))


def remove_of_pids(pids: set[int]) -> list[str]:
    """Unlink this user's segments created by the processes ``pids`` (ended: a launcher
    sweeping its job's segments after its children) whose lock nobody holds; their
    names. A held lock (a live creator, whatever its pid says) keeps a segment."""
    return _remove_unlocked(lambda pid: pid in pids)


def _remove_unlocked(of_pid: Callable[[int], bool]) -> list[str]:
    """Unlink this user's segments whose creator's pid ``of_pid`` picks and whose lock
    nobody holds; their names."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    me = user_tag()
    for name in names:
        m = _NAME.match(name)
        if not m or m.group(1) != me or not of_pid(int(m.group(2))):
            continue
        if _remove_if_unlocked(os.path.join(SHM_DIR, name)):
            removed.append(name)
    return removed


def _remove_if_unlocked(path: str) -> bool:
    """Unlink ``path`` if it is this user's regular file and nobody holds its lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone, or not ours to open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its creator lives
        try:
            now = os.lstat(path)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # the name is another file's now
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def unlink_mapped_mpich(maps: str = "/proc/self/maps") -> list[str]:
    """Unlink the MPICH segments (``/dev/shm/mpich_shm_*``) that this process has mapped
    (``maps``: its memory map), each only while its name still names the very file
    mapped (device and inode) and belongs to this user; the paths unlinked. MPICH
    unlinks them in ``MPI_Finalize``; a process that leaves without it calls this
    first. Unlinking a name does not touch the mappings: the node's other processes of
    the job keep their memory, and ``MPI_Finalize`` copes with the name gone."""
    done: list[str] = []
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return done
    seen: set[str] = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5]
        if not path.startswith(f"{SHM_DIR}/{MPICH_PREFIX}") or path.endswith(" (deleted)"):
            continue
        if path in seen:
            continue
        seen.add(path)
        try:
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            inode = int(fields[4])
            st = os.lstat(path)
        except (OSError, ValueError):
            continue
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_ino != inode
            or (os.major(st.st_dev), os.minor(st.st_dev)) != (major, minor)
            or (hasattr(os, "getuid") and st.st_uid != os.getuid())
        ):
            continue
        try:
            os.unlink(path)
            done.append(path)
        except OSError:
            pass
    return done


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
    ever (it synchronises every process), so leave without it, with status 1; first
    unlink the names of this process's segments and of the MPICH segments it maps
    (``MPI_Finalize`` would have unlinked those)."""
    try:
        unlink_own()
        unlink_mapped_mpich()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def address(seg: Segment) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(seg.buf))
