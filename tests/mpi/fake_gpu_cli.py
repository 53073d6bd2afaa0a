"""Worker: a command line of nccltree (``bench`` or ``train``) in one process of an MPI job
whose GPUs are the fake of CuPy's layer (tests/fakecupy; CUDA IPC through /dev/shm files,
NCCL across processes through MPI). Wiring only, never GPU verification.

    mpiexec -n 2 python tests/mpi/fake_gpu_cli.py bench collectives --devices gpu ...
"""

from __future__ import annotations

import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fakecupy

fakecupy.private_kernel_cache()
installed = fakecupy.install(n_gpus=int(os.environ.get("FAKE_GPUS", "4")))
fake = installed.__enter__()
fake.mpi_comm = MPI.COMM_WORLD

tool, argv = sys.argv[1], sys.argv[2:]
if tool == "bench":
    from nccltree.cli.bench import main
else:
    from nccltree.cli.train import main
status = main(argv)
if fake.misuse:
    print(f"fake misuse: {fake.misuse[:3]}", file=sys.stderr, flush=True)
    status = status or 3
sys.exit(status)
