"""Argument checks of a collective, for every rank at once, and the shapes they yield."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import DTypeLike

from .._validate import check_index
from ..backends.base import CARRIERS, bfloat16, carried_dtype, data_ptr
from . import _ops
from .collectives import COLLECTIVES, Collective

if TYPE_CHECKING:
    from ..backends.base import Device, Event, Stream

# A device array: numpy on the host backend, CuPy on CUDA (whose type is not importable
# without CuPy), so it stays Any.
Array = Any


@dataclass
class Prepared:
    """One collective call, checked: flat views per rank and the call's shape. ``count``
    is NCCL's count (one rank's block for all_gather and reduce_scatter).

    ``dtype`` is the dtype the call computes in; ``storage`` that of the arrays, when it
    differs (bfloat16 in ``uint16`` CuPy arrays: CuPy has no bfloat16, so the call names
    it with ``dtype="bfloat16"``). Host arrays never differ: numpy has bfloat16
    (``ml_dtypes``), so the flat views of a ``uint16`` host buffer are bfloat16 views."""

    collective: str
    ins: list[Array]  # flat views
    outs: list[Array]  # flat views (== ins where in place)
    results: list[object]  # what each rank gets back, in the caller's shapes
    dtype: np.dtype
    count: int
    in_place: bool
    op: str
    root: int
    storage: np.dtype | None = None

    @property
    def array_dtype(self) -> np.dtype:
        """The dtype of the arrays: what scratch memory beside them is allocated in."""
        return self.dtype if self.storage is None else self.storage

    @property
    def carried(self) -> np.dtype | None:
        """The dtype to name to the kernels when the arrays carry it (else None)."""
        return None if self.storage is None else self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's message per rank (nccl-tests' S for all_reduce)."""
        return self.count * self.dtype.itemsize


@dataclass
class Launched:
    """A launched collective: each rank's result, its end event (None: finished already,
    inline), the caller streams it is ordered against, and what must stay alive until the
    events fire."""

    results: list[object]
    events: list[Event] | None
    caller_streams: Sequence[Stream | None]
    keepalive: object


def prepare(
    devices: Sequence[Device],
    collective: str,
    inputs: object,
    outputs: object,
    op: str,
    root: object,
    ranks: Sequence[int] | None = None,
    size: int | None = None,
    dtype: object = None,
) -> Prepared:
    """Check every rank's arguments together (ValueError/TypeError naming the rank) and
    return flat views and the call's shape; nothing is written.

    ``dtype``: the dtype to compute in, None for the arrays' own; ``"bfloat16"`` also
    takes ``uint16`` arrays holding its bits (see :func:`check_call_dtype`).

    ``ranks``/``size``: the devices are ranks ``ranks`` of a group of ``size`` ranks (the
    local ranks of one process of a process group); by default every rank, ``0..n-1``.
    Shapes that depend on the group (blocks, in-place offsets, the root) follow ``size``
    and the global rank; errors name the global rank."""
    coll = COLLECTIVES[collective]
    local = len(devices)
    n = local if size is None else size
    ids = list(range(local)) if ranks is None else list(ranks)
    xs = _as_list(inputs, "inputs", local)
    outs = [None] * local if outputs is None else _as_list(outputs, "outputs", local)
    at = check_index(root, "root", n) if coll.rooted else 0
    ins: list[Array] = []
    outs_arr: list[Array | None] = []
    for i, r in enumerate(ids):
        dev = devices[i]
        ins.append(_device_array(dev, xs[i], f"rank {r}: input"))
        outs_arr.append(
            None if outs[i] is None else _device_array(dev, outs[i], f"rank {r}: output")
        )
    logical = check_call_dtype(dtype)
    stored = ins[0].dtype
    for i, x in enumerate(ins):
        r = ids[i]
        if x.dtype != stored:
            raise TypeError(f"dtype mismatch: rank {ids[0]} has {stored}, rank {r} has {x.dtype}")
        o = outs_arr[i]
        if o is not None and o.dtype != stored:
            raise TypeError(f"rank {r}: output dtype {o.dtype} differs from input {stored}")
    ins, outs_arr, dtype, storage = resolve_dtype(ins, outs_arr, logical, f"rank {ids[0]}: input")
    if coll.reduces:
        _ops.check_op(op, dtype)
    size = ins[0].size
    for i, x in enumerate(ins):
        if x.size != size:
            raise ValueError(
                f"size mismatch: rank {ids[0]} passes {size} elements, rank {ids[i]} passes "
                f"{x.size}"
            )
    if not coll.one_buffer and any(o is None for o in outs_arr):
        raise ValueError(f"{collective} needs an output array on every rank")
    blocks = coll.in_count(1, n)
    if size % blocks:
        raise ValueError(
            f"{collective} input of {size} elements does not split into {blocks} blocks"
        )
    count = size // blocks
    want = coll.out_count(count, n)
    flat_in: list[Array] = []
    flat_out: list[Array] = []
    results: list[object] = []
    in_place: list[bool] = []
    for i, r in enumerate(ids):
        x, o = ins[i], outs_arr[i]
        fx = x.reshape(-1)
        if o is None:
            flat_in.append(fx)
            flat_out.append(fx)
            results.append(xs[i])
            in_place.append(True)
            continue
        if o.size != want:
            raise ValueError(f"rank {r}: {collective} output needs {want} elements, got {o.size}")
        fo = o.reshape(-1)
        same = _in_place(coll, fx, fo, r, count, n)
        flat_in.append(fx)
        # one object for one memory, so the executor can tell copies onto themselves
        flat_out.append(fx if same and fo.size == fx.size else fo)
        results.append(outs[i])
        in_place.append(same)
    all_in_place = all(in_place)
    for i, r in enumerate(ids):
        # a read-only view (an immutable framework array, an unversioned DLPack import)
        # is refused where the collective writes it, before anything is written
        if (not coll.root_output or r == at) and not getattr(flat_out[i].flags, "writeable", True):
            what = "output" if outs_arr[i] is not None else "input (written in place)"
            raise ValueError(f"rank {r}: the {what} is read-only")
    if not coll.in_place_ok and any(in_place):
        raise ValueError(
            f"{collective} cannot run in place: pass an output that does not overlap the "
            f"input (in place: ranks {[ids[i] for i in range(local) if in_place[i]]})"
        )
    if not coll.one_buffer and any(in_place) != all_in_place:
        raise ValueError(
            f"{collective}: either every rank or no rank may call in place "
            f"(in place: ranks {[ids[i] for i in range(local) if in_place[i]]})"
        )
    if coll.root_output:
        # only the root's output is written, so only its placement matters (a process
        # without the root: its own ranks' placement, which every process then checks)
        all_in_place = in_place[ids.index(at)] if at in ids else all_in_place
    return Prepared(
        collective, flat_in, flat_out, results, dtype, count, all_in_place, op, at, storage
    )


def resolve_dtype(
    ins: list[Array], outs: list[Array | None], logical: np.dtype | None, what: str
) -> tuple[list[Array], list[Array | None], np.dtype, np.dtype | None]:
    """The call's dtype for arrays of one dtype (checked already) and the checked
    ``dtype=`` argument ``logical``: (inputs, outputs, dtype, storage). Numpy arrays that
    carry ``logical`` come back viewed as it; other arrays as they are, with their own
    dtype as ``storage`` (see :class:`Prepared`). TypeError for a ``dtype=`` the arrays
    do not fit and for a carrier dtype without one."""
    stored = ins[0].dtype
    storage = None
    if logical is not None:
        carried = carried_dtype(ins[0], logical, what)
        if carried is not None:
            if all(isinstance(x, np.ndarray) for x in ins):
                # numpy has the dtype: the views are of it, nothing downstream sees uint16
                ins = [x.view(carried) for x in ins]
                outs = [None if o is None else o.view(carried) for o in outs]
            else:
                storage = stored
            stored = carried
    elif stored in CARRIERS.values():
        names = " or ".join(f'dtype="{d}"' for d, c in CARRIERS.items() if c == stored)
        raise TypeError(
            f"unsupported dtype {stored}; accepted: {', '.join(str(d) for d in _ops.DTYPES)} "
            f"({stored} arrays that hold the bits of another dtype take {names})"
        )
    return ins, outs, _ops.check_dtype(stored), storage


def check_call_dtype(dtype: object) -> np.dtype | None:
    """A collective's ``dtype=`` argument: None (the arrays' own), or one of the kernels'
    dtypes, by name (``"bfloat16"``) or as a numpy dtype; ValueError for a name that is
    not a dtype, TypeError for a dtype the collectives do not take. Whether the arrays
    fit it is checked with them (:func:`~nccltree.backends.base.carried_dtype`):
    ``"bfloat16"`` takes bfloat16 arrays and ``uint16`` arrays of its bits, every other
    dtype only arrays of itself."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype == "bfloat16":
        return bfloat16()  # numpy knows the name only through ml_dtypes' type
    try:
        dt = np.dtype(cast("DTypeLike", dtype))
    except TypeError:
        raise ValueError(
            f"dtype={dtype!r} is not a dtype; accepted: None (the arrays' own), "
            f"{', '.join(str(d) for d in _ops.DTYPES)}"
        ) from None
    if dt not in _ops.DTYPES:
        raise TypeError(
            f"dtype={dt} is not one the collectives take; accepted: None (the arrays' own), "
            f"{', '.join(str(d) for d in _ops.DTYPES)}"
        )
    return dt


def _as_list(xs: object, what: str, n: int) -> list[Any]:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{what} must be a list with one array per rank, got {type(xs).__name__}")
    if len(xs) != n:
        raise ValueError(f"{what}: {len(xs)} arrays for {n} ranks")
    return list(xs)


def _device_array(dev: Device, obj: object, what: str) -> Array:
    try:
        arr = dev.asarray(obj)
        dev.check_array(arr)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: the array must be C-contiguous")
    return arr


def _in_place(coll: Collective, x: Array, out: Array, rank: int, count: int, n: int) -> bool:
    """Whether ``out`` is the in-place buffer for ``x`` (NCCL's layouts, from the table);
    ValueError when the two overlap in any other way."""
    px, po = data_ptr(x), data_ptr(out)
    item = x.dtype.itemsize
    off_in, off_out = coll.in_place(rank, count, n)
    if px - off_in * item == po - off_out * item:
        return True
    if px < po + out.nbytes and po < px + x.nbytes and x.nbytes and out.nbytes:
        raise ValueError(
            f"rank {rank}: input and output overlap but are not the in-place layout of {coll.name}"
        )
    return False
