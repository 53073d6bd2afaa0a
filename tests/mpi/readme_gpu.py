"""Worker: one process of the README's two-process CuPy all_reduce, on the fake of CuPy.

    mpiexec -n 2 python tests/mpi/readme_gpu.py SNIPPET.py

Installs tests/fakecupy as ``cupy`` (2 fake GPUs per process; IPC through /dev/shm
files, NCCL across processes carried by MPI), then runs ``SNIPPET.py`` -- the README's
code block, written out unchanged by the test -- as ``__main__``. That checks the
wiring and the snippet's own assertion, never a GPU.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import fakecupy  # noqa: E402

fakecupy.private_kernel_cache()
with fakecupy.install(n_gpus=2) as fake:
    fake.mpi_comm = MPI.COMM_WORLD
    runpy.run_path(sys.argv[1], run_name="__main__")
    if fake.misuse:
        sys.exit(f"the fake saw misuse: {fake.misuse}")
