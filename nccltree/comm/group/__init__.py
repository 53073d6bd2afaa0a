"""Process groups: collectives across processes and nodes (MPI and shared memory)."""

from .group import GROUP_ALGORITHMS, ProcessGroup, init_process_group

__all__ = ["GROUP_ALGORITHMS", "ProcessGroup", "init_process_group"]
