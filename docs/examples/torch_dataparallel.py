"""Data-parallel training of a small torch CPU model through nccltree, two ways.

    python docs/examples/torch_dataparallel.py [--devices cpu:2] [--steps 40]

1. **As a framework author embeds nccltree** (``train_with_all_reduce``): a World of
   ranks in this process, a thread per rank (``world.run``), each with its own copy of
   the model. Every parameter's ``.grad`` is a view of one flat gradient tensor per
   rank (torch accumulates into an existing ``.grad`` in place), so after ``backward()``
   one ``comm.all_reduce(flat, op="mean")`` on the torch tensor itself (no copy: nccltree
   views it through DLPack and writes the average into it) averages every gradient, and
   each rank's optimizer steps alike. The initial weights come from rank 0 by a
   ``comm.broadcast`` of the flat parameters.
2. **Through DataParallel** (``train_with_data_parallel``): ``TorchModel`` below adapts
   a torch module to nccltree's model protocol (``nccltree.models.TrainableModel``): the
   parameters live in nccltree's flat buffer (the module's parameters are views of it)
   and a post-accumulate-grad hook copies each gradient into the flat gradient buffer
   and announces it (the gradient callback), so buckets go out during backward.

Both are checked against the same model trained in one process on the full batch
(``train_single``): rank r takes examples r, r+N, r+2N, ... of each global batch, so the
mean of the ranks' mean losses is the full batch's mean loss and the averaged gradient is
the full batch's gradient, equal up to float32 summation order. The script prints the
three loss curves and the largest relative difference (tests/test_interop_torch.py
asserts it stays below 1e-4).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import nccltree as nt
from nccltree.params import FlatParams

FEATURES, CLASSES, HIDDEN = 8, 3, 16


_RNG = threading.Lock()  # torch's default generator is one for the whole process


def make_module(seed: int = 0) -> torch.nn.Module:
    """The model: the same initial weights for every ``seed``, from any thread (seeded and
    built under one lock: another thread seeding in between would change them)."""
    with _RNG:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
        )


def make_data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A separable synthetic task: ``n`` float32 examples, int64 labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    w = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    return x, (x @ w).argmax(axis=1).astype(np.int64)


def global_batch(x: np.ndarray, y: np.ndarray, step: int, size: int) -> slice:
    start = (step * size) % len(y)
    return slice(start, start + size)


# -- 1. a framework author's loop over comm.all_reduce -------------------------------------


def train_with_all_reduce(
    devices: str, steps: int, batch: int, lr: float, x: np.ndarray, y: np.ndarray
) -> list[float]:
    """Per-rank batch ``batch``; returns the mean loss of every step."""
    with nt.World(devices) as world:
        n = world.size

        def rank_fn(comm: Any) -> list[float]:
            # different weights on purpose: the broadcast makes rank 0's everyone's
            model = make_module(seed=0 if comm.rank == 0 else 100 + comm.rank)
            params = list(model.parameters())
            flat_w = torch.cat([p.detach().reshape(-1) for p in params])
            comm.broadcast(flat_w, 0)  # a torch tensor, in place: rank 0's weights
            grads = torch.zeros_like(flat_w)  # the flat gradient buffer
            at = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat_w[at : at + p.numel()].view_as(p))
                    p.grad = grads[at : at + p.numel()].view_as(p)  # .grad is a view
                    at += p.numel()
            opt = torch.optim.SGD(params, lr=lr)
            losses = []
            loss_t = torch.zeros(1)
            for step in range(steps):
                g = global_batch(x, y, step, batch * n)
                xb = torch.from_numpy(x[g][comm.rank :: n])
                yb = torch.from_numpy(y[g][comm.rank :: n])
                grads.zero_()  # not opt.zero_grad(): that would drop the views
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                loss.backward()  # accumulates into the views of `grads`
                comm.all_reduce(grads, op="mean")  # every rank: the full batch's gradient
                opt.step()
                loss_t[0] = loss.item()
                comm.all_reduce(loss_t, op="mean")
                losses.append(float(loss_t[0]))
            return losses

        per_rank = world.run(rank_fn)
    assert all(r == per_rank[0] for r in per_rank)  # every rank saw the same mean losses
    return per_rank[0]


# -- 2. a torch module as DataParallel's model ---------------------------------------------


class TorchModel:
    """A torch module behind nccltree's model protocol (``TrainableModel``): ``factory()``
    builds the module (the same architecture every call). One module per rank, whose
    parameters are views of that rank's ``FlatParams.data``; gradients are copied into
    ``FlatParams.grad`` by a post-accumulate-grad hook, which also announces them."""

    def __init__(self, factory: Callable[[], torch.nn.Module]) -> None:
        self.factory = factory
        template = factory()
        self._shapes = {n: tuple(p.shape) for n, p in template.named_parameters()}
        self._modules: dict[int, tuple[FlatParams, torch.nn.Module]] = {}
        self._ready: dict[int, Callable[[str], None] | None] = {}

    def make_params(self, dtype: Any = np.float32, device: Any = None) -> FlatParams:
        return FlatParams(self._shapes, dtype=dtype, device=device)

    def init(self, params: FlatParams, seed: int = 0) -> None:
        module = self.factory()
        params.load({n: p.detach().numpy() for n, p in module.named_parameters()})

    def _module(self, params: FlatParams) -> torch.nn.Module:
        key = id(params)
        if key not in self._modules:
            module = self.factory()
            for name, p in module.named_parameters():
                p.data = torch.from_numpy(params.views[name])  # a view of the flat buffer

                def hook(p: torch.Tensor, name: str = name) -> None:
                    assert p.grad is not None
                    np.copyto(params.grad_views[name], p.grad.numpy())
                    p.grad = None
                    ready = self._ready.get(key)
                    if ready is not None:
                        ready(name)

                p.register_post_accumulate_grad_hook(hook)
            self._modules[key] = (params, module)  # keeps params alive: id stays unique
        return self._modules[key][1]

    def loss_and_grad(
        self, params: FlatParams, x: Any, y: Any, ready: Callable[[str], None] | None = None
    ) -> float:
        module = self._module(params)
        self._ready[id(params)] = ready
        loss = torch.nn.functional.cross_entropy(
            module(torch.from_numpy(np.asarray(x))), torch.from_numpy(np.asarray(y))
        )
        loss.backward()
        return float(loss.item())


def train_with_data_parallel(
    devices: str, steps: int, batch: int, lr: float, x: np.ndarray, y: np.ndarray,
    bucket_bytes: int = 0,
) -> list[float]:  # fmt: skip
    """The same training through ``DataParallel`` and ``TorchModel``."""
    ndev = len(nt.devices(devices))
    batches = [[] for _ in range(ndev)]  # type: list[list[tuple[np.ndarray, np.ndarray]]]
    for step in range(steps):
        g = global_batch(x, y, step, batch * ndev)
        for r in range(ndev):
            batches[r].append((x[g][r::ndev].copy(), y[g][r::ndev].copy()))
    model = TorchModel(make_module)
    with nt.DataParallel(model, devices, lr=lr, bucket_bytes=bucket_bytes) as dp:
        result = dp.fit(nt.data.MemorySource(batches), steps)
    return list(result.losses)


# -- the reference: one process, the full batch --------------------------------------------


def train_single(steps: int, batch: int, lr: float, x: np.ndarray, y: np.ndarray) -> list[float]:
    model = make_module(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        g = global_batch(x, y, step, batch)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x[g])), torch.from_numpy(y[g])
        )
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def max_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(p - q) / max(abs(q), 1e-12) for p, q in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu:2", help="the ranks (default cpu:2)")
    ap.add_argument("--steps", type=int, default=40, help="SGD steps (default 40)")
    ap.add_argument("--batch", type=int, default=16, help="examples per rank and step")
    ap.add_argument("--lr", type=float, default=0.2, help="learning rate (default 0.2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a thread per rank already
    n = len(nt.devices(args.devices))
    x, y = make_data(args.batch * n * 8)
    single = train_single(args.steps, args.batch * n, args.lr, x, y)
    looped = train_with_all_reduce(args.devices, args.steps, args.batch, args.lr, x, y)
    dp = train_with_data_parallel(args.devices, args.steps, args.batch, args.lr, x, y)
    for i in range(0, args.steps, max(1, args.steps // 8)):
        print(f"step {i:3d}: one process {single[i]:.6f}  all_reduce loop {looped[i]:.6f}  "
              f"DataParallel {dp[i]:.6f}")  # fmt: skip
    print(f"max relative loss difference: all_reduce loop "
          f"{max_relative_difference(looped, single):.2e}, DataParallel "
          f"{max_relative_difference(dp, single):.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
