"""The simulator: a pure model that predicts a plan's time on a machine
(:mod:`nccltree.sim_model`: the link model and the event-driven simulation of the exact
plan nccltree would execute, NCCL's own cost model for comparison), and its calibration
on the host backend (:mod:`nccltree.sim_calibration`: figures measured on this machine).
This module names both; ``comm.auto`` imports the model alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sim_calibration import HostCalibration, calibrate_host, host_machine, predict_host
from .sim_model import (
    DEVICES,
    GB,
    LATENCY_S,
    NCCL_BASE_US,
    NCCL_HW_US,
    NCCL_TREE_CORRECTION,
    PCIE_EFFICIENCY,
    PCIE_LATENCY_S,
    PCIE_X16_GBPS,
    DeviceModel,
    Machine,
    SimResult,
    cluster_topology,
    nccl_model_time,
    predict,
    simulate,
    simulate_collective,
)

__all__: Sequence[str] = [
    "DEVICES",
    "GB",
    "LATENCY_S",
    "NCCL_BASE_US",
    "NCCL_HW_US",
    "NCCL_TREE_CORRECTION",
    "PCIE_EFFICIENCY",
    "PCIE_LATENCY_S",
    "PCIE_X16_GBPS",
    "DeviceModel",
    "HostCalibration",
    "Machine",
    "SimResult",
    "calibrate_host",
    "cluster_topology",
    "host_machine",
    "nccl_model_time",
    "predict",
    "predict_host",
    "simulate",
    "simulate_collective",
]
