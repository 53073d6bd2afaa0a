"""nccltree: topology-aware tree collectives and data-parallel training over CuPy and NCCL.

Public names are loaded on first use, so ``import nccltree`` is cheap and never needs a
GPU, CuPy, NVML or LMDB.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._errors import (
    BackendUnavailable,
    CommError,
    CommTimeout,
    MissingRanks,
    NativeError,
    NcclTreeError,
    PeerFailure,
)

__version__ = "0.1.0"

_LAZY = {
    "devices": "nccltree.backends",
    "Device": "nccltree.backends",
    "Stream": "nccltree.backends",
    "Event": "nccltree.backends",
    "pinned_empty": "nccltree.memory",
    "PinnedPool": "nccltree.memory",
    "SyncedMemory": "nccltree.memory",
    "BlockingQueue": "nccltree.queue",
    "QueueClosed": "nccltree.queue",
    "Topology": "nccltree.topology",
    "Link": "nccltree.topology",
    "LinkKind": "nccltree.topology",
    "build_tree": "nccltree.tree",
    "Tree": "nccltree.tree",
    "World": "nccltree.comm",
    "init_process_group": "nccltree.comm.group",
    "ProcessGroup": "nccltree.comm.group",
    "Comm": "nccltree.comm",
    "Work": "nccltree.comm",
    "FlatParams": "nccltree.params",
    "SGD": "nccltree.solver",
    "DataReader": "nccltree.data",
    "Batch": "nccltree.data",
    "DataParallel": "nccltree.parallel",
    "RankFailure": "nccltree.parallel",
    "build_model": "nccltree.models",
}

__all__ = [
    "BackendUnavailable",
    "CommError",
    "CommTimeout",
    "MissingRanks",
    "NativeError",
    "NcclTreeError",
    "PeerFailure",
    "__version__",
    "data",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name == "data":
        return importlib.import_module("nccltree.data")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nccltree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
