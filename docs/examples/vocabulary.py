"""One short example per operation of an in-process World, each checked as it runs.

    python docs/examples/vocabulary.py        # 4 virtual CPU ranks; "gpu:0,1" works too

Collectives driver side (one array per rank), the per-rank API (a thread per rank:
point-to-point, batches, sub-groups), uneven all_to_all, and what to look at when
something is slow or stuck (a trace of one call's steps, the flight recorder).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

import nccltree as nt

spec = sys.argv[1] if len(sys.argv) > 1 else "cpu:4"
world = nt.World(nt.devices(spec), algorithm="auto")
n = world.size
dev = world.devices


def host(a: object) -> np.ndarray:
    return np.asarray(a) if isinstance(a, np.ndarray) else dev[0].to_host(a)


def arrays(make: Callable[[int], np.ndarray]) -> list[object]:
    """One array per rank, made by ``make(rank)`` on the host and put on its device."""
    return [d.from_host(make(r)) for r, d in enumerate(dev)]


# all_reduce: every rank gets the sum (in place without outputs)
xs = arrays(lambda r: np.full(4, r + 1, np.float32))
world.all_reduce(xs)
assert host(xs[0])[0] == n * (n + 1) / 2

# bfloat16: CuPy has no such dtype, so its bits travel in uint16 arrays and the call
# names the dtype (the same call on host devices: bitwise the ml_dtypes.bfloat16 result)
bf16 = np.dtype("bfloat16")  # numpy knows the name through ml_dtypes (nccltree imports it)
xs = arrays(lambda r: np.full(4, r + 0.5, bf16).view(np.uint16))
world.all_reduce(xs, dtype="bfloat16")
assert float(host(xs[0]).view(bf16)[0]) == n * n / 2

# reduce and broadcast: to and from a root
xs = arrays(lambda r: np.full(4, r, np.float32))
world.reduce(xs, root=n - 1, op="max")
world.broadcast(xs, root=n - 1)
assert all(host(x)[0] == n - 1 for x in xs)

# all_gather and reduce_scatter: blocks of the output / of the input, one per rank
outs = arrays(lambda r: np.zeros(2 * n, np.float32))
world.all_gather(arrays(lambda r: np.full(2, r, np.float32)), outs)
assert list(host(outs[0])[::2]) == list(range(n))
mine = arrays(lambda r: np.zeros(2, np.float32))
world.reduce_scatter(arrays(lambda r: np.arange(2 * n, dtype=np.float32)), mine)
assert list(host(mine[1])) == [2 * n, 3 * n]  # block 1 of every rank's 0..2n-1, summed

# gather and scatter: to the root's output, from the root's input
blocks = arrays(lambda r: np.zeros(3 * n, np.float32))
world.gather(arrays(lambda r: np.full(3, r, np.float32)), blocks, root=0)
assert list(host(blocks[0])[::3]) == list(range(n))
parts = arrays(lambda r: np.zeros(3, np.float32))
world.scatter(blocks, parts, root=0)  # rank r gets block r of the root's array
assert all(host(p)[0] == r for r, p in enumerate(parts))

# all_to_all: block q of rank r goes to block r of rank q; all_to_all_v: uneven blocks
outs = arrays(lambda r: np.zeros(n, np.float32))
world.all_to_all(arrays(lambda r: np.arange(n, dtype=np.float32) + 10 * r), outs)
assert list(host(outs[1])) == [10 * r + 1 for r in range(n)]
counts = [[(r + q) % 3 for q in range(n)] for r in range(n)]  # counts[r][q]: r sends q
send = arrays(lambda r: np.full(sum(counts[r]), r, np.float32))
recv = arrays(lambda q: np.zeros(sum(row[q] for row in counts), np.float32))
world.all_to_all_v(send, recv, counts)
assert list(host(recv[0])) == [float(r) for r in range(n) for _ in range(counts[r][0])]

# shift, driver side: the ring shift, nccl-tests' sendrecv (rank r's array to rank r+1)
outs = arrays(lambda r: np.zeros(2, np.float32))
world.shift(arrays(lambda r: np.full(2, r, np.float32)), outs)
assert host(outs[0])[0] == n - 1


def per_rank(comm: nt.Comm) -> float:
    r = comm.rank
    d = comm.device
    # point-to-point: a lone send waits for its receive; a batch posts both halves
    got = d.from_host(np.zeros(2, np.float32))
    with comm.batch():
        comm.send(d.from_host(np.full(2, r, np.float32)), (r + 1) % n)
        comm.recv(got, (r - 1) % n)
    # sub-groups: even and odd ranks, each a World of its own
    half = comm.split(color=r % 2)
    assert half is not None
    half.all_reduce(got)
    return float(host(got)[0])


sums = world.run(per_rank)
# rank r holds its group's sum of predecessors: (r-1) % n over the group's ranks
assert sums == [float(sum((q - 1) % n for q in range(r % 2, n, 2))) for r in range(n)]

# seeing what happens: every step of one call, timed (a Chrome trace: nccltree-bench
# collectives --trace FILE), and the flight recorder of the last calls
spans = world.trace("all_reduce", arrays(lambda r: np.ones(1 << 16, np.float32)))
steps = [s for s in spans if s.kind in ("copy", "reduce", "scale")]
print(f"{n} ranks on {spec}: every example checked; the last all_reduce took "
      f"{len(steps)} steps, {sum(s.duration for s in steps) * 1e6:.0f} us of work")  # fmt: skip
print(world.flight.dump("this World").splitlines()[-1])
world.close()
