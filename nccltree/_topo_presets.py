"""Link matrices of well-known machines, written the way ``nvidia-smi topo -m`` prints them.

Each preset is a description and a matrix of link tokens (``BRD`` marks GPUs on one
multi-GPU board, which nvidia-smi itself prints as ``PIX``). Peer access follows the
default of ``Topology.from_smi``: everywhere except across sockets (``SYS``), which is
what these machines report.
"""

from __future__ import annotations

# DGX-1 with V100: the hybrid cube mesh. Every GPU has six NVLinks; GPUs 0-3 and 4-7 are
# the two quads on the two CPU sockets, and the pairs without NVLink are exactly those
# across sockets, where PCIe peer access is not available.
_DGX1 = """
        GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7
GPU0     X    NV1   NV1   NV2   NV2   SYS   SYS   SYS
GPU1    NV1    X    NV2   NV1   SYS   NV2   SYS   SYS
GPU2    NV1   NV2    X    NV2   SYS   SYS   NV1   SYS
GPU3    NV2   NV1   NV2    X    SYS   SYS   SYS   NV1
GPU4    NV2   SYS   SYS   SYS    X    NV1   NV1   NV2
GPU5    SYS   NV2   SYS   SYS   NV1    X    NV2   NV1
GPU6    SYS   SYS   NV1   SYS   NV1   NV2    X    NV2
GPU7    SYS   SYS   SYS   NV1   NV2   NV1   NV2    X
"""

# An 8-GPU NVSwitch node (DGX A100): every GPU has 12 NVLinks into the switches, so
# every pair is the same, NV12.
_NVSWITCH8 = "\n".join(
    ["      " + "  ".join(f"GPU{j}" for j in range(8))]
    + [f"GPU{i}  " + "  ".join(" X  " if i == j else "NV12" for j in range(8)) for i in range(8)]
)

# Four Tesla K80 boards (8 GPUs): the two GPUs of a board sit behind the board's own
# PCIe switch; two boards share a host bridge on each socket; nothing crosses the
# sockets by peer access.
_K80X4 = """
        GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7
GPU0     X    BRD   PHB   PHB   SYS   SYS   SYS   SYS
GPU1    BRD    X    PHB   PHB   SYS   SYS   SYS   SYS
GPU2    PHB   PHB    X    BRD   SYS   SYS   SYS   SYS
GPU3    PHB   PHB   BRD    X    SYS   SYS   SYS   SYS
GPU4    SYS   SYS   SYS   SYS    X    BRD   PHB   PHB
GPU5    SYS   SYS   SYS   SYS   BRD    X    PHB   PHB
GPU6    SYS   SYS   SYS   SYS   PHB   PHB    X    BRD
GPU7    SYS   SYS   SYS   SYS   PHB   PHB   BRD    X
"""

# Two sockets with four PCIe GPUs each: pairs behind one switch (PIX), the two switches
# of a socket under a common upstream switch (PXB), the sockets joined by QPI/UPI (SYS)
# without peer access.
_PCIE2S8 = """
        GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7
GPU0     X    PIX   PXB   PXB   SYS   SYS   SYS   SYS
GPU1    PIX    X    PXB   PXB   SYS   SYS   SYS   SYS
GPU2    PXB   PXB    X    PIX   SYS   SYS   SYS   SYS
GPU3    PXB   PXB   PIX    X    SYS   SYS   SYS   SYS
GPU4    SYS   SYS   SYS   SYS    X    PIX   PXB   PXB
GPU5    SYS   SYS   SYS   SYS   PIX    X    PXB   PXB
GPU6    SYS   SYS   SYS   SYS   PXB   PXB    X    PIX
GPU7    SYS   SYS   SYS   SYS   PXB   PXB   PIX    X
"""

PRESETS: dict[str, tuple[str, str]] = {
    "dgx1": (
        "DGX-1 (8x V100, hybrid cube mesh of NV1/NV2 links, no peer access across sockets)",
        _DGX1,
    ),
    "nvswitch8": ("8 GPUs on NVSwitch (DGX A100 style), every pair NV12", _NVSWITCH8),
    "k80x4": (
        "4 Tesla K80 twin-GPU boards (8 GPUs), 2 boards per socket, no peer access across sockets",
        _K80X4,
    ),
    "pcie2s8": (
        "2 sockets x 4 PCIe GPUs (PIX pairs, PXB within a socket), no peer access across sockets",
        _PCIE2S8,
    ),
}

FLAT_DESCRIPTION = (
    "N GPUs behind one PCIe switch (PIX), every pair the same, peer access everywhere"
)
