"""A process group inside someone else's training loop (numpy arrays).

    nccltree-run --nproc-per-node 2 docs/examples/numpy_allreduce.py   # no MPI needed
    mpiexec -n 2 python docs/examples/numpy_allreduce.py               # or torchrun, srun

Every process owns one rank and a shard of the data. The loop below is the framework's:
nccltree only averages the gradient (``pg.all_reduce(grad, op="mean")``, in place), so
every rank applies the same update and ends with the same weights.
"""

import hashlib

import numpy as np

import nccltree as nt

pg = nt.init_process_group()  # every process calls it (how it was started: read)
rng = np.random.default_rng(pg.rank)  # each rank's own shard of a linear problem
true_w = np.arange(1.0, 9.0, dtype=np.float32)
x = rng.standard_normal((256, 8)).astype(np.float32)
y = x @ true_w + 0.01 * rng.standard_normal(256).astype(np.float32)

w = np.zeros(8, np.float32)  # the same start on every rank
grad = np.empty_like(w)
for step in range(50):
    err = x @ w - y
    grad[:] = 2.0 / len(y) * (x.T @ err)  # this rank's gradient
    pg.all_reduce(grad, op="mean")  # now the average over every rank
    w -= 0.1 * grad
    if pg.rank == 0 and step % 10 == 9:
        print(f"step {step + 1}: loss on rank 0's shard {float(np.mean(err**2)):.5f}")

digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
print(f"rank {pg.rank} of {pg.size}: weights {digest} max error {np.abs(w - true_w).max():.3f}")
pg.close()
