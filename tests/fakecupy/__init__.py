"""A fake of CuPy's layer, for wiring tests of nccltree's CUDA paths without a GPU.

**This checks wiring only. It is not a GPU, and nothing that passes on it counts as GPU
verification.** It answers one question: does nccltree's own, unmodified CUDA code
(``backends/cuda.py``, ``_cuda_kernels.py``, ``memory.py``, ``comm/nccl.py``, ``World``)
call CuPy, the CUDA runtime, NVRTC and NCCL with the right names, argument types,
pointers, sizes, devices and streams? A fake at CuPy's layer catches bugs a fake at
nccltree's own classes cannot (reading ``streams[r].ptr`` from a nccltree stream that has
no ``ptr``, for one).

Layout: ``fakecupy.cupy`` is the fake ``cupy`` package (``cupy.cuda``, ``.runtime``,
``.nccl``, ``.nvrtc``, ``.driver``, ``.compiler``), with CuPy 14.2's names, signatures,
return values and exceptions; :func:`install` puts it in ``sys.modules`` as ``cupy``.
:class:`FakeCuda` is the simulated machine the tests inspect and inject faults into.

Rules of the fake
-----------------
- ``intptr_t`` parameters take Python ints only (TypeError otherwise); other integer
  parameters follow Cython (any integer; negatives for ``size_t`` raise OverflowError).
  Arity and keyword names are CuPy's: there are no ``**kwargs`` catch-alls.
- Memory: device allocations are numpy buffers at fake addresses (above 2**48, so a
  device pointer is never valid host memory), registered with GPU, base, size and the
  stream that was current when allocated (``Allocation.stream``: CuPy's pool keeps an arena
  per stream). ``hostAlloc``/``hostRegister`` blocks are page-locked; ``pinned_bytes()``
  says how many bytes are locked now. Every copy, memset, kernel argument and NCCL buffer
  is checked: a range outside a live allocation of the right kind and GPU raises the CUDA
  error CuPy would surface (``CUDARuntimeError(1)`` for copies, ``700`` for kernels --
  or, with ``fault_mode="async"``, a stream failed with 700 as on a GPU). Pageable host
  memory (a numpy array) is accepted by ``memcpyAsync``. Copies between GPUs work without
  peer access (CUDA stages them); kernels may only read a peer's memory with access
  enabled from the current GPU.
- Work runs at once, at enqueue (the fake is synchronous): data moves immediately. Streams
  and events still have CUDA's status model for faults: ``streamQuery``/``eventQuery``
  return 0, 600 (cudaErrorNotReady) or an error and never raise; ``Stream.done`` and
  ``Event.done`` compare with 0, as CuPy's do; synchronisation raises the error. A
  blocking call on work that never completes waits (another thread may release it) for
  ``runtime.BLOCK_LIMIT_S`` seconds, then raises :class:`FakeMisuse`.
- Streams: a kernel launch needs a stream of the current GPU (``CUDADriverError(400)``);
  an event records only on a stream of its own GPU; ``with stream:`` needs the stream's
  GPU to be current (CuPy's RuntimeError). Current streams are per thread and per GPU.
- Kernels (``RawModule(...).get_function(name)(grid, block, args)``) run the operations
  of ``csrc/nccltree_kernels.cu`` with numpy (see ``fakecupy._kernels``); every launch is
  logged in ``fake.launches``. A module from ``RawModule(code=...)`` is compiled with
  ``-ftz=true`` appended (as CuPy does) and flushes float32 subnormals; a cubin from an
  explicit NVRTC call without ``-ftz=true``, loaded with ``RawModule(path=...)``, does not.
  :func:`write_fatbin` writes a fake fatbin.
- Things real CUDA/NCCL would not report but that are bugs (wrong kernel argument types,
  mismatched collectives, deadlocks) raise :class:`FakeMisuse` and are recorded in
  ``fake.misuse``; the ``fake_cupy`` fixture fails a test that left any there.

Fault injection and inspection (``fake`` is the :class:`FakeCuda` of the fixture)
--------------------------------------------------------------------------------
- ``fake.fail_stream(stream, status=700)``: the stream (a ``cupy.cuda.Stream``, a
  nccltree stream or a handle) fails; its queries, events recorded on it afterwards and
  streams waiting on those events report ``status`` (sticky).
- ``fake.fail_device(gpu, status=700)``: a sticky context error on a GPU.
- ``token = fake.hang_stream(stream)``: events recorded on it afterwards stay pending (600),
  and so do streams that wait on them, until ``token.release(status=0)``.
- ``fake.set_peer_error(a, b, status)``: ``deviceEnablePeerAccess(b)`` on GPU a raises it.
- ``fake.peer_capable`` / ``fake.peer_enabled``: pairs that may / do have peer access.
- ``fake.ops`` (:class:`Op`: memcpy, memcpy_peer, memset, kernel, event_record,
  wait_event, nccl with stream, GPU, pointers), ``fake.launches`` (:class:`KernelLaunch`),
  ``fake.allocation_of(array)``, ``fake.device_allocations()``, ``fake.pinned_bytes()``,
  ``fake.pinned_blocks()``.

NCCL (``fake.nccl``, a ``cupy.cuda.nccl.NcclState``)
---------------------------------------------------
- ``initAll(devices)`` makes one clique: communicator r on GPU ``devices[r]``.
  ``NcclCommunicator(ndev, uid, rank)`` joins the clique of ``uid`` on the current GPU.
- Each call is validated (strict arity and types; NCCL's ``ArgsCheck``: communicator
  alive, datatype, op, root/peer, device pointers on the communicator's GPU; stricter:
  ``count`` elements must fit the buffers, the stream must be of the communicator's GPU)
  and logged in ``fake.nccl.calls`` (:class:`~fakecupy.cupy.cuda.nccl.NcclCall`: method,
  rank, device, clique, sendbuf, recvbuf, count, datatype, op, root, peer, stream,
  in_group, group, status, executed).
- A collective executes (numpy, rank order; ``NCCL_AVG`` as NCCL's pre-multiplied sum for
  floating types) when every rank of its clique has posted its k-th collective; inside a
  group only at ``groupEnd``. Until it executes, the posting streams are pending. send/recv
  pair in order per (source, destination). Mismatched collectives raise FakeMisuse.
- Groups (``src/group.cc``): a failing call inside a group raises ``NcclError`` at once and
  marks the group; ``groupEnd`` then raises that error and launches nothing of the group.
  ``groupEnd`` without ``groupStart`` raises ``NcclError(ncclInvalidUsage)``.
- ``fake.nccl.hang_next_call(rank)``: the next call of that rank never completes (its
  stream stays pending, nothing of that collective is written).
  ``fake.nccl.fail_next_call(rank, status)``: the next call of that rank raises
  ``NcclError(status)``. ``fake.nccl.fail_next_init(status)``: the next ``initAll`` or
  ``NcclCommunicator`` raises.
- ``abort()``/``destroy()`` mark the communicator gone (``fake.nccl.aborted`` /
  ``.destroyed`` list (clique, rank)); its unfinished or hung work fails its streams with
  cudaErrorLaunchFailure (719); later calls on it raise ``NcclError(ncclInvalidArgument)``
  (CuPy passes NCCL a NULL communicator).
- ``set_nccl_available(False)`` makes ``cupy.cuda.nccl.available`` False.
- Communicators of several processes (``NcclCommunicator(n, uid, rank)`` in each): their
  operations run at once when posted, carried between the processes over MPI
  (``fake.mpi_comm = MPI.COMM_WORLD``) or, without MPI, over files in /dev/shm named
  after the unique id (``fake.nccl_files = True``): see ``fakecupy/_carrier.py``. Wiring
  only: nothing of NCCL's transports or speed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from . import _core, _kernels
from ._core import (
    Allocation,
    FakeCuda,
    FakeMisuse,
    KernelLaunch,
    Op,
    StreamState,
    Token,
    active,
    set_active,
)

__all__ = [
    "Allocation",
    "FakeCuda",
    "FakeMisuse",
    "KernelLaunch",
    "Op",
    "StreamState",
    "Token",
    "active",
    "install",
    "private_kernel_cache",
    "release_dead_exports",
    "release_process",
    "set_nccl_available",
    "write_fatbin",
]

_MODULES = (
    "cupy",
    "cupy.cuda",
    "cupy.cuda.runtime",
    "cupy.cuda.nccl",
    "cupy.cuda.nvrtc",
    "cupy.cuda.driver",
    "cupy.cuda.compiler",
)


def _fake_modules() -> dict[str, ModuleType]:
    from . import cupy

    return {
        "cupy": cupy,
        "cupy.cuda": cupy.cuda,
        "cupy.cuda.runtime": cupy.cuda.runtime,
        "cupy.cuda.nccl": cupy.cuda.nccl,
        "cupy.cuda.nvrtc": cupy.cuda.nvrtc,
        "cupy.cuda.driver": cupy.cuda.driver,
        "cupy.cuda.compiler": cupy.cuda.compiler,
    }


@contextmanager
def install(
    n_gpus: int = 4,
    peer: bool | Iterable[tuple[int, int]] = True,
    *,
    compute_capability: str = "90",
    fault_mode: str = "raise",
) -> Iterator[FakeCuda]:
    """Install a fresh fake machine and the fake modules as ``cupy`` in ``sys.modules``
    (and hide ``pynvml``, so topology detection cannot mix a real NVML with fake GPUs);
    restore everything on exit. Resetting nccltree's caches is the fixture's job."""
    from .cupy import cuda
    from .cupy.cuda import nccl

    fake = FakeCuda(n_gpus, peer, compute_capability=compute_capability, fault_mode=fault_mode)
    fake.nccl = nccl.NcclState()
    saved = {name: sys.modules.get(name) for name in (*_MODULES, "pynvml")}
    set_active(fake)
    pool = cuda.PinnedMemoryPool()
    fake.default_pinned_pool = pool
    fake.pinned_pool = pool.malloc
    sys.modules.update(_fake_modules())
    sys.modules["pynvml"] = None  # type: ignore[assignment]  # makes `import pynvml` fail
    nccl.available = True
    try:
        yield fake
    finally:
        set_active(None)
        nccl.available = True
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


_kernel_caches: list[str] = []


def private_kernel_cache() -> str:
    """A kernel cache directory of this process alone, made the one nccltree uses
    (``NCCLTREE_CACHE_DIR``): for the fake GPUs of processes started by a test. In a test
    run (``NCCLTREE_TEST_TMP``, the run's own temporary folder, which the run removes at
    its end) it is ``kernel-cache-<pid>`` there, so a process that its test kills leaves
    nothing behind; elsewhere a temporary directory removed when the process exits (or by
    :func:`release_process`)."""
    run_tmp = os.environ.get("NCCLTREE_TEST_TMP")
    if run_tmp and os.path.isdir(run_tmp):
        path = os.path.join(run_tmp, f"kernel-cache-{os.getpid()}")
        os.makedirs(path, exist_ok=True)
        os.environ["NCCLTREE_CACHE_DIR"] = path
        return path
    path = tempfile.mkdtemp(prefix="nccltree-fake-cache-")
    if not _kernel_caches:
        atexit.register(_remove_kernel_caches)
    _kernel_caches.append(path)
    os.environ["NCCLTREE_CACHE_DIR"] = path
    return path


def _remove_kernel_caches() -> None:
    while _kernel_caches:
        shutil.rmtree(_kernel_caches.pop(), ignore_errors=True)


def release_process() -> None:
    """What this process made outside itself, removed: its exported IPC blocks in /dev/shm
    (which the CUDA driver frees when a process dies) and its private kernel caches. For
    a test process about to die on purpose with ``os._exit``, which runs no exit
    handlers; a normal exit does this by itself."""
    from . import _carrier
    from .cupy.cuda import runtime

    runtime._remove_ipc_files()
    _remove_kernel_caches()
    _carrier.close_all()


def release_dead_exports() -> list[str]:
    """Remove the IPC files of this test run (``_core.session_tag``) whose exporting
    process is gone, as the CUDA driver frees a dead process's exported memory: a process
    that is killed (or ended by its launcher) runs no exit handlers. Returns their paths."""
    from nccltree.comm.group.shm import alive  # a zombie is gone too, as for the driver

    prefix = f"fakecupy-ipc-{_core.session_tag()}-"
    removed: list[str] = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
        if not pid.isdigit() or alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(os.path.join("/dev/shm", name))
        except OSError:
            pass
    return removed


def set_nccl_available(flag: bool) -> None:
    """``cupy.cuda.nccl.available`` (False: CuPy built without NCCL)."""
    from .cupy.cuda import nccl

    nccl.available = flag


def write_fatbin(
    path: Path, archs: Iterable[str] = ("sm_90",), *, ftz: bool = False, source: str | None = None
) -> Path:
    """Write a fake fatbin of the kernels of ``source`` (default: the repository's
    ``csrc/nccltree_kernels.cu``) with images for ``archs``; returns ``path``."""
    if source is None:
        source = (Path(__file__).resolve().parents[2] / "csrc" / "nccltree_kernels.cu").read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_kernels.make_image("fatbin", archs, _kernels.kernel_names(source), ftz))
    return path


# the machine currently installed, for helpers that are handed no fixture
current = active
