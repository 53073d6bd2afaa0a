"""``bucket_fault.py RANK CALL TRAIN-ARGS...``: nccltree-train under MPI, where global rank
RANK raises in the middle of its backward pass, after its first gradient bucket started,
at its CALL-th batch."""

import os
import sys

from mpi4py import MPI

from nccltree.cli import train
from nccltree.models import Model

if __name__ == "__main__":
    rank, call = int(sys.argv[1]), int(sys.argv[2])
    calls = [0]
    original = Model.loss_and_grad

    def faulty(self, params, x, y, ready=None):  # type: ignore[no-untyped-def]
        if MPI.COMM_WORLD.Get_rank() != rank:
            return original(self, params, x, y, ready)
        calls[0] += 1
        if ready is None:  # without buckets: after the backward pass
            loss = original(self, params, x, y)
            if calls[0] == call:
                raise RuntimeError("injected fault in backward")
            return loss
        announced = [0]

        def failing(name: str) -> None:
            ready(name)
            announced[0] += 1
            if calls[0] == call and announced[0] == 2:
                raise RuntimeError("injected fault in backward")

        return original(self, params, x, y, failing)

    Model.loss_and_grad = faulty  # type: ignore[method-assign]
    rc = train.main(sys.argv[3:])
    # out at once, without MPI's finalize: after a failure it would wait for processes that
    # left without it (the failing process is the one under test, not its teardown)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
