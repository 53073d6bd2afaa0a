"""The same with PyTorch CPU tensors, passed zero-copy.

    mpiexec -n 2 python docs/examples/torch_dlpack.py

A CPU tensor's ``.numpy()`` is a numpy view of the tensor's own memory: the all_reduce
writes the averaged gradient straight into ``param.grad``, with no copy on either side.
The check below proves the view shares the tensor's memory before the loop relies on it.
``np.from_dlpack(tensor)`` gives the same view, writable only where both sides speak the
versioned DLPack protocol (NumPy >= 2.2.5 and a PyTorch that exports it; older pairs
give a read-only view, not to be written): it is used here where it is writable.
"""

import hashlib

import numpy as np
import torch

import nccltree as nt

pg = nt.init_process_group()
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(100 + pg.rank)  # each rank's own shard
x = torch.randn(256, 8, generator=gen)
y = x @ torch.arange(1.0, 9.0) + 0.5

for step in range(50):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        g = np.from_dlpack(p.grad)  # a view, not a copy
        if not g.flags.writeable:  # an unversioned DLPack import is read-only
            g = p.grad.numpy()  # the same memory, writable
        assert g.ctypes.data == p.grad.data_ptr()  # zero-copy: the tensor's own memory
        pg.all_reduce(g, op="mean")  # in place: p.grad now holds the average
    opt.step()
    if pg.rank == 0 and step % 10 == 9:
        print(f"step {step + 1}: loss on rank 0's shard {loss.item():.5f}")

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
print(f"rank {pg.rank} of {pg.size}: weights {hashlib.sha256(flat.tobytes()).hexdigest()[:16]}")
pg.close()
