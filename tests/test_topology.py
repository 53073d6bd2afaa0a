"""Topology: links and their ordering, presets, the nvidia-smi parser, JSON, detection."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nccltree as nt
from nccltree.topology import Link, LinkKind, Topology

SMI = Path(__file__).parent / "data" / "smi"
K = LinkKind


def read(name: str) -> str:
    return (SMI / name).read_text()


def tokens(topo: Topology) -> list[str]:
    return [" ".join(topo.link(i, j).token for j in range(topo.n)) for i in range(topo.n)]


def p2p_rows(topo: Topology) -> list[str]:
    return [
        "".join("1" if topo.link(i, j).p2p else "." for j in range(topo.n)) for i in range(topo.n)
    ]


# -- links ---------------------------------------------------------------------------------


def test_link_kinds_are_ordered_best_first():
    assert list(K) == sorted(K)
    assert [k.name for k in K] == [
        "SELF", "SAME_DEVICE", "NVLINK", "SAME_BOARD", "PIX", "PXB", "PHB", "NODE", "SYS",
        "NET",
    ]  # fmt: skip


def test_link_cost_follows_kind_and_nvlink_count():
    best_to_worst = [
        Link(K.SELF),
        Link(K.SAME_DEVICE),
        Link(K.NVLINK, 24),
        Link(K.NVLINK, 12),
        Link(K.NVLINK, 6),
        Link(K.NVLINK, 2),
        Link(K.NVLINK, 1),
        Link(K.SAME_BOARD),
        Link(K.PIX),
        Link(K.PXB),
        Link(K.PHB),
        Link(K.NODE),
        Link(K.SYS),
        Link(K.NET, p2p=False),
    ]
    costs = [link.cost for link in best_to_worst]
    assert costs == sorted(costs) and len(set(costs)) == len(costs)
    assert [link.rank for link in best_to_worst] == sorted(link.rank for link in best_to_worst)
    assert Link(K.NVLINK, 2).cost == 24 and Link(K.NVLINK, 1).cost == 48
    assert Link(K.PIX, p2p=False).cost == 2 * Link(K.PIX).cost
    # Between nodes is worse than every link inside a node, with or without peer access.
    inside = [Link(k, 1 if k == K.NVLINK else 0, p2p) for k in K if k not in (K.SELF, K.NET)
              for p2p in ((True,) if k == K.SAME_DEVICE else (True, False))]  # fmt: skip
    assert Link(K.NET, p2p=False).cost > max(link.cost for link in inside) == 600
    # More NVLinks never rank worse, even where the integer cost saturates.
    ranks = [Link(K.NVLINK, m).rank for m in range(1, 40)]
    assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == len(ranks)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(kind=K.NVLINK, nvlinks=0), ValueError),
        (dict(kind=K.PIX, nvlinks=2), ValueError),
        (dict(kind=K.NVLINK, nvlinks=True), TypeError),
        (dict(kind=K.NVLINK, nvlinks=2.0), TypeError),
        (dict(kind=K.NVLINK, nvlinks=np.bool_(True)), TypeError),
        (dict(kind=K.PIX, nvlinks=-1), ValueError),
        (dict(kind=K.PIX, p2p=1), TypeError),
        (dict(kind=K.SAME_DEVICE, p2p=False), ValueError),
        (dict(kind=K.NET), ValueError),  # never peer access across nodes
        (dict(kind=K.NET, nvlinks=1, p2p=False), ValueError),
        (dict(kind=42), ValueError),
    ],
)
def test_link_rejects_bad_fields(kwargs, err):
    with pytest.raises(err):
        Link(**kwargs)


@pytest.mark.parametrize(
    "token, link",
    [
        ("X", Link(K.SELF)),
        ("NV1", Link(K.NVLINK, 1)),
        ("NV18", Link(K.NVLINK, 18)),
        ("PIX", Link(K.PIX)),
        ("PXB", Link(K.PXB)),
        ("PHB", Link(K.PHB)),
        ("NODE", Link(K.NODE)),
        ("SYS", Link(K.SYS, p2p=False)),
        ("SOC", Link(K.SYS, p2p=False)),
        ("BRD", Link(K.SAME_BOARD)),
        ("DEV", Link(K.SAME_DEVICE)),
        ("NET", Link(K.NET, p2p=False)),
        ("net", Link(K.NET, p2p=False)),
    ],
)
def test_link_tokens(token, link):
    assert Link.from_token(token) == link
    assert link.token == ("SYS" if token == "SOC" else token.upper())
    assert Link.from_token(link.token, link.p2p) == link


def test_net_token_never_has_peer_access():
    # as DEV always has it, whatever a p2p matrix says
    assert Link.from_token("NET", True) == Link(K.NET, p2p=False)
    assert Link.from_token("DEV", False) == Link(K.SAME_DEVICE)


@pytest.mark.parametrize("token", ["NV0", "NVX", "PCI", "", "N/A", "NETWORK"])
def test_link_unknown_token(token):
    with pytest.raises(ValueError, match="accepted: X, NV#.*NET"):
        Link.from_token(token)


# -- clusters ------------------------------------------------------------------------------


def test_cluster_links_nodes_by_net():
    topo = Topology.cluster(["a", "a", "b", "b", "b"])
    assert tokens(topo) == [
        "X DEV NET NET NET",
        "DEV X NET NET NET",
        "NET NET X DEV DEV",
        "NET NET DEV X DEV",
        "NET NET DEV DEV X",
    ]
    assert p2p_rows(topo) == ["11...", "11...", "..111", "..111", "..111"]
    assert topo.names == ("GPU0", "GPU1", "GPU2", "GPU3", "GPU4")
    # Any hashable labels, compared only; one node is a plain uniform topology.
    assert Topology.cluster([("h", 1), ("h", 1), 7, 7]) == Topology.cluster([0, 0, 1, 1])
    assert Topology.cluster(["x"] * 3) == Topology.uniform(3, Link(K.SAME_DEVICE))
    assert Topology.cluster([5]) == Topology.uniform(1, Link(K.SAME_DEVICE))
    assert Topology.cluster(np.array([0, 0, 1])) == Topology.cluster([0, 0, 1])
    named = Topology.cluster([0, 1], names=["n0.r0", "n1.r0"])
    assert named.names == ("n0.r0", "n1.r0")


def test_cluster_intra_link_and_topology():
    topo = Topology.cluster([0, 0, 1, 1], Link(K.NVLINK, 4))
    assert tokens(topo) == ["X NV4 NET NET", "NV4 X NET NET", "NET NET X NV4", "NET NET NV4 X"]
    dgx1 = Topology.preset("dgx1")
    two = Topology.cluster(["n0"] * 8 + ["n1"] * 8, dgx1)
    for i in range(16):
        for j in range(16):
            if i // 8 == j // 8:
                assert two.link(i, j) == dgx1.link(i % 8, j % 8)
            else:
                assert two.link(i, j) == Link(K.NET, p2p=False)


def test_cluster_reads_back():
    for topo in (
        Topology.cluster([0, 0, 1, 1, 1]),
        Topology.cluster([0] * 8 + [1] * 8, Topology.preset("pcie2s8")),
    ):
        text = str(topo)
        assert "NET  = Between nodes" in text
        assert Topology.from_smi(text) == topo
        assert Topology.from_json(topo.to_json()) == topo


@pytest.mark.parametrize(
    "nodes, intra, err, match",
    [
        ([0, 1, 0], None, ValueError, "node-major.*rank 2 is on node 0 again"),
        (["a", "a", "b", "a"], None, ValueError, "node-major"),
        ([], None, ValueError, "at least one rank"),
        ("aabb", None, TypeError, "not a str"),
        ([[0], [0]], None, TypeError, r"nodes\[0\] must be hashable"),
        ([0, 0, 1, 1], Link(K.NET, p2p=False), ValueError, "cannot be NET"),
        ([0, 0, 1, 1], Link(K.SELF), ValueError, "cannot be SELF"),
        ([0, 0, 1, 1], "PIX", TypeError, "intra must be"),
        ([0, 0, 1, 1, 1], Topology.preset("flat:2"), ValueError, "nodes have 3 ranks"),
        ([0, 0, 1, 1], Topology.preset("flat:4"), ValueError, "nodes have 2 ranks"),
        ([0, 0, 1, 1], Topology.cluster([0, 1]), ValueError, "cannot contain NET"),
    ],
)
def test_cluster_rejects(nodes, intra, err, match):
    with pytest.raises(err, match=match):
        Topology.cluster(nodes, intra)


def test_cluster_names_checked():
    with pytest.raises(ValueError, match="3 names for 2 devices"):
        Topology.cluster([0, 1], names=["a", "b", "c"])


# -- the Topology value --------------------------------------------------------------------


def test_constructor_validates():
    s, p = Link(K.SELF), Link(K.PIX)
    assert Topology([[s, p], [p, s]]).names == ("GPU0", "GPU1")
    with pytest.raises(ValueError, match="at least one"):
        Topology([])
    with pytest.raises(ValueError, match="square"):
        Topology([[s, p], [p]])
    with pytest.raises(ValueError, match="symmetric"):
        Topology([[s, p], [Link(K.PXB), s]])
    with pytest.raises(ValueError, match="diagonal"):
        Topology([[s, s], [s, s]])
    with pytest.raises(ValueError, match="diagonal"):
        Topology([[p, p], [p, p]])
    with pytest.raises(TypeError, match="Link"):
        Topology([[s, "PIX"], ["PIX", s]])
    with pytest.raises(ValueError, match="3 names for 2"):
        Topology([[s, p], [p, s]], names=["a", "b", "c"])


def test_link_index_checks():
    topo = Topology.preset("flat:3")
    assert topo.link(0, 2) == Link(K.PIX)
    with pytest.raises(ValueError, match=r"device index j must be in \[0, 3\), got 3"):
        topo.link(0, 3)
    with pytest.raises(ValueError, match="device index i"):
        topo.link(-1, 0)
    with pytest.raises(TypeError, match="device index j must be an integer"):
        topo.link(0, True)
    with pytest.raises(TypeError, match="device index i must be an integer"):
        topo.link(0.0, 1)


def test_numpy_integers_accepted():
    # the one argument rule: numpy integers are integers, bool is not
    topo = Topology.preset("flat:3")
    assert topo.link(np.int64(0), 1) == topo.link(0, 1) == Link(K.PIX)
    assert topo.link(np.uint8(2), np.int32(2)) == Link(K.SELF)
    link = Link(K.NVLINK, np.int64(2))
    assert link == Link(K.NVLINK, 2) and type(link.nvlinks) is int
    assert hash(link) == hash(Link(K.NVLINK, 2))
    assert Topology.uniform(np.int64(3), Link(K.PIX)) == topo
    with pytest.raises(TypeError, match="n must be an integer"):
        Topology.uniform(True, Link(K.PIX))
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        Topology.uniform(np.int64(0), Link(K.PIX))


def test_presets_listed_with_descriptions():
    listed = Topology.presets()
    assert {"dgx1", "nvswitch8", "k80x4", "pcie2s8", "flat:N"} <= set(listed)
    for name, desc in listed.items():
        assert isinstance(desc, str) and desc and "\n" not in desc, name
        if name != "flat:N":
            assert Topology.preset(name).n == 8


def test_preset_dgx1_is_the_v100_hybrid_cube_mesh():
    topo = Topology.preset("dgx1")
    assert tokens(topo) == [
        "X NV1 NV1 NV2 NV2 SYS SYS SYS",
        "NV1 X NV2 NV1 SYS NV2 SYS SYS",
        "NV1 NV2 X NV2 SYS SYS NV1 SYS",
        "NV2 NV1 NV2 X SYS SYS SYS NV1",
        "NV2 SYS SYS SYS X NV1 NV1 NV2",
        "SYS NV2 SYS SYS NV1 X NV2 NV1",
        "SYS SYS NV1 SYS NV1 NV2 X NV2",
        "SYS SYS SYS NV1 NV2 NV1 NV2 X",
    ]
    # Six NVLinks per V100; peer access exactly where there is NVLink.
    for i in range(8):
        assert sum(topo.link(i, j).nvlinks for j in range(8)) == 6
        for j in range(8):
            assert topo.link(i, j).p2p == (topo.link(i, j).kind != K.SYS)


def test_preset_k80x4_pcie2s8_nvswitch8_flat():
    k80 = Topology.preset("k80x4")
    assert [k80.link(i, i + 1).kind for i in range(0, 8, 2)] == [K.SAME_BOARD] * 4
    assert k80.link(0, 2).kind == K.PHB and k80.link(5, 7).kind == K.PHB
    assert p2p_rows(k80) == ["1111...."] * 4 + ["....1111"] * 4
    pcie = Topology.preset("pcie2s8")
    assert tokens(pcie)[0] == "X PIX PXB PXB SYS SYS SYS SYS"
    assert tokens(pcie)[6] == "SYS SYS SYS SYS PXB PXB X PIX"
    assert p2p_rows(pcie) == ["1111...."] * 4 + ["....1111"] * 4
    nvs = Topology.preset("nvswitch8")
    assert {nvs.link(i, j) for i in range(8) for j in range(8) if i != j} == {Link(K.NVLINK, 12)}
    flat = Topology.preset("flat:5")
    assert flat.n == 5 and {flat.link(i, j) for i in range(5) for j in range(5) if i != j} == {
        Link(K.PIX)
    }
    assert Topology.preset("flat:1").n == 1


@pytest.mark.parametrize("name", ["dgx2", "flat:0", "flat:", "flat:-3", "flat:x", "DGX1"])
def test_preset_unknown(name):
    with pytest.raises(ValueError, match="flat"):
        Topology.preset(name)


def test_preset_type_error():
    with pytest.raises(TypeError):
        Topology.preset(8)


# -- nvidia-smi parsing ----------------------------------------------------------------------

# What each sample file must parse to (GPU part of the matrix, row by row).
EXPECTED = {
    "dgx1_v100.txt": Topology.preset("dgx1"),
    "dgx_a100.txt": Topology.preset("nvswitch8"),
    "dgx1_p100_soc.txt": [
        "X NV1 NV1 NV1 NV1 SYS SYS SYS",
        "NV1 X NV1 NV1 SYS NV1 SYS SYS",
        "NV1 NV1 X NV1 SYS SYS NV1 SYS",
        "NV1 NV1 NV1 X SYS SYS SYS NV1",
        "NV1 SYS SYS SYS X NV1 NV1 NV1",
        "SYS NV1 SYS SYS NV1 X NV1 NV1",
        "SYS SYS NV1 SYS NV1 NV1 X NV1",
        "SYS SYS SYS NV1 NV1 NV1 NV1 X",
    ],
    "k80_8gpu_soc.txt": [
        "X PIX PHB PHB SYS SYS SYS SYS",
        "PIX X PHB PHB SYS SYS SYS SYS",
        "PHB PHB X PIX SYS SYS SYS SYS",
        "PHB PHB PIX X SYS SYS SYS SYS",
        "SYS SYS SYS SYS X PIX PHB PHB",
        "SYS SYS SYS SYS PIX X PHB PHB",
        "SYS SYS SYS SYS PHB PHB X PIX",
        "SYS SYS SYS SYS PHB PHB PIX X",
    ],
    "pcie_misaligned.txt": [
        "X PIX NODE SYS",
        "PIX X NODE SYS",
        "NODE NODE X SYS",
        "SYS SYS SYS X",
    ],
    "single_gpu.txt": ["X"],
}
P2P_FILES = {"k80_8gpu_p2p_read.txt"}  # `nvidia-smi topo -p2p r`, read with its topo file


def test_every_sample_file_has_expectations():
    assert {p.name for p in SMI.glob("*.txt")} == set(EXPECTED) | P2P_FILES


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_from_smi_sample(name):
    topo = Topology.from_smi(read(name))
    want = EXPECTED[name]
    if isinstance(want, Topology):
        assert topo == want
    else:
        assert tokens(topo) == want
    assert topo.names == tuple(f"GPU{i}" for i in range(topo.n))
    # Default peer access: everywhere but across sockets.
    for i in range(topo.n):
        for j in range(topo.n):
            assert topo.link(i, j).p2p == (topo.link(i, j).kind != K.SYS)


def test_from_smi_with_p2p_matrix():
    topo = Topology.from_smi(read("k80_8gpu_soc.txt"), p2p=read("k80_8gpu_p2p_read.txt"))
    assert p2p_rows(topo) == ["1111...."] * 4 + ["....1111"] * 4
    # The p2p matrix, not the kind, decides: a machine with peer access across sockets.
    text = "\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n"
    p2p = " \tGPU0\tGPU1\t\n GPU0\tX\tOK\t\n GPU1\tOK\tX\t\n"
    assert Topology.from_smi(text, p2p=p2p).link(0, 1) == Link(K.SYS, p2p=True)
    no = p2p.replace("OK", "CNS")
    assert Topology.from_smi(text.replace("SYS", "PIX"), p2p=no).link(0, 1) == Link(
        K.PIX, p2p=False
    )


HEADER = "\tGPU0\tGPU1\tGPU2\tmlx5_0\tCPU Affinity\n"
GOOD_ROWS = [
    "GPU0\t X \tNV2\tPIX\tPIX\t0-7\n",
    "GPU1\tNV2\t X \tPHB\tPIX\t0-7\n",
    "GPU2\tPIX\tPHB\t X \tSYS\t8-15\n",
    "mlx5_0\tPIX\tPIX\tSYS\t X \n",
]


def smi(*rows: str) -> str:
    return HEADER + "".join(rows) + "\nLegend:\n\n  X    = Self\n"


def test_malformed_fixture_is_well_formed():
    topo = Topology.from_smi(smi(*GOOD_ROWS))
    assert tokens(topo) == ["X NV2 PIX", "NV2 X PHB", "PIX PHB X"]


@pytest.mark.parametrize(
    "row_at, bad_row, message",
    [
        (1, "GPU1\tNV2\t X \tFOO\tPIX\t0-7\n", r"unknown token 'FOO' in row GPU1, column GPU2"),
        (1, "GPU1\tNV2\t X \tPHB\tQPI\t0-7\n", r"unknown token 'QPI' in row GPU1, column mlx5_0"),
        (3, "mlx5_0\tPIX\tPIX\tSYS\t Y \n", r"unknown token 'Y' in row mlx5_0, column mlx5_0"),
        (1, "GPU1\tNV2\t X \n", r"row GPU1 has 2 cells .* \(no cell for column GPU2\)"),
        (1, "GPU1\tNV0\t X \tPHB\tPIX\n", r"unknown token 'NV0' in row GPU1, column GPU0"),
        (1, "GPU1\tNV2\tPHB\tPHB\tPIX\n", r"row GPU1, column GPU1: 'X' belongs on the diagonal"),
        (1, "GPU1\t X \tX\tPHB\tPIX\n", r"row GPU1, column GPU0: 'X' belongs on the diagonal"),
        (1, "GPU1\tNV1\t X \tPHB\tPIX\n", r"not symmetric: row GPU1, column GPU0 is 'NV1' but"),
        (1, "", r"no row for GPU1"),
        (1, "GPU0\t X \tNV2\tPIX\tPIX\n", r"row GPU0 appears twice"),
    ],
)
def test_from_smi_malformed(row_at, bad_row, message):
    rows = list(GOOD_ROWS)
    if row_at == 1 and bad_row.startswith("GPU0"):
        rows.insert(1, bad_row)
    else:
        rows[row_at] = bad_row
    with pytest.raises(ValueError, match=message):
        Topology.from_smi(smi(*rows))


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no matrix header"),
        ("Legend:\n  X = Self\n", "no matrix header"),
        ("\tGPU0\tGPU0\nGPU0\t X \n", "duplicate column"),
    ],
)
def test_from_smi_no_matrix(text, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_smi(text)


def test_from_smi_bad_p2p():
    text = "\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\t X \n"
    with pytest.raises(ValueError, match=r"unknown token 'YES' in row GPU1, column GPU0"):
        Topology.from_smi(text, p2p="\tGPU0\tGPU1\nGPU0\tX\tOK\nGPU1\tYES\tX\n")
    with pytest.raises(ValueError, match="p2p matrix names GPU0 GPU1 GPU2"):
        Topology.from_smi(text, p2p=read("k80_8gpu_p2p_read.txt"))
    with pytest.raises(ValueError, match="not symmetric"):
        Topology.from_smi(text, p2p="\tGPU0\tGPU1\nGPU0\tX\tOK\nGPU1\tNS\tX\n")


def test_from_smi_type_error():
    with pytest.raises(TypeError, match="str"):
        Topology.from_smi(b"\tGPU0\nGPU0\t X \n")


# -- printing, JSON --------------------------------------------------------------------------


def test_str_prints_like_nvidia_smi():
    text = str(Topology.preset("dgx1"))
    lines = text.splitlines()
    assert lines[0].split() == [f"GPU{i}" for i in range(8)]
    assert lines[1].split() == ["GPU0", "X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]
    assert "Legend:" in lines
    assert any(line.strip().startswith("NV#") for line in lines)
    assert "Peer access (nvidia-smi topo -p2p r):" in lines
    assert "  PIX" not in text  # the legend names only kinds that occur
    assert "Peer access" not in str(Topology.preset("nvswitch8"))


@pytest.mark.parametrize("name", ["dgx1", "nvswitch8", "k80x4", "pcie2s8", "flat:3"])
def test_str_reads_back(name):
    topo = Topology.preset(name)
    assert Topology.from_smi(str(topo)) == topo


def test_str_reads_back_with_its_p2p_matrix():
    s, dev = Link(K.SELF), Link(K.SAME_DEVICE)
    odd_sys, odd_pix = Link(K.SYS, p2p=True), Link(K.PIX, p2p=False)
    topo = Topology([[s, dev, odd_sys], [dev, s, odd_pix], [odd_sys, odd_pix, s]])
    text = str(topo)
    matrix, peer = text.split("Peer access")
    assert Topology.from_smi(matrix, p2p=peer) == topo
    assert Topology.from_smi(matrix) != topo


_LINKS = st.one_of(
    st.builds(Link, st.just(K.NVLINK), st.integers(1, 24), st.booleans()),
    st.builds(
        Link,
        st.sampled_from([K.SAME_BOARD, K.PIX, K.PXB, K.PHB, K.NODE, K.SYS]),
        st.just(0),
        st.booleans(),
    ),
    st.just(Link(K.SAME_DEVICE)),
    st.just(Link(K.NET, p2p=False)),
)


@st.composite
def topologies(draw, max_n: int = 12) -> Topology:
    n = draw(st.integers(1, max_n))
    pairs = draw(st.lists(_LINKS, min_size=n * (n - 1) // 2, max_size=n * (n - 1) // 2))
    links = [[Link(K.SELF)] * n for _ in range(n)]
    it = iter(pairs)
    for i in range(n):
        for j in range(i + 1, n):
            links[i][j] = next(it)
    return Topology([[links[min(i, j)][max(i, j)] for j in range(n)] for i in range(n)])


@st.composite
def numbered(draw, link_strategy=_LINKS) -> Link:
    """A link of ``_LINKS``, with or without a rate and a latency."""
    link = draw(link_strategy)
    if link.kind == K.SELF:
        return link
    gbps = draw(st.none() | st.floats(1e-3, 1e4, allow_nan=False, allow_infinity=False))
    lat = draw(st.none() | st.floats(0, 1e-3, allow_nan=False, allow_infinity=False))
    return dataclasses.replace(link, gbps=gbps, latency_s=lat)


@settings(max_examples=40, deadline=None)
@given(st.data())
@pytest.mark.slow
def test_json_round_trip_with_numbers(data):
    n = data.draw(st.integers(1, 8))
    links = [[Link(K.SELF)] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            links[i][j] = links[j][i] = data.draw(numbered())
    topo = Topology(links)
    text = topo.to_json()
    assert Topology.from_json(text) == topo
    assert Topology.from_json(text).to_json() == text


@settings(max_examples=40, deadline=None)
@given(topologies())
def test_json_round_trip(topo):
    text = topo.to_json()
    assert Topology.from_json(text) == topo
    assert Topology.from_json(text).to_json() == text


def test_json_keeps_names():
    s, p = Link(K.SELF), Link(K.PXB, p2p=False)
    topo = Topology([[s, p], [p, s]], names=["a", "b"])
    assert Topology.from_json(topo.to_json()).names == ("a", "b")


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "not a JSON topology"),
        ("[]", "format"),
        (json.dumps({"format": "nccltree.topology", "version": 2}), "version 2"),
        (json.dumps({"format": "nccltree.topology", "version": 1, "links": [["X"]]}), "'p2p'"),
        (
            json.dumps(
                {"format": "nccltree.topology", "version": 1, "links": [["Z"]], "p2p": [[True]]}
            ),
            "unknown link token 'Z'",
        ),
        (
            json.dumps(
                {
                    "format": "nccltree.topology",
                    "version": 1,
                    "links": [["X", "PIX"]],
                    "p2p": [[True]],
                }
            ),
            r"'links' row 0 must be a list of 1 entries",
        ),
    ],
)
def test_from_json_malformed(text, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_json(text)


def _two(**fields):
    """A JSON topology of two PIX-linked devices, with ``fields`` replaced."""
    data = {
        "format": "nccltree.topology",
        "version": 1,
        "links": [["X", "PIX"], ["PIX", "X"]],
        "p2p": [[True, True], [True, True]],
    }
    data.update(fields)
    return json.dumps({k: v for k, v in data.items() if v is not None})


@pytest.mark.parametrize(
    "text, message",
    [
        (_two(links=[]), r"needs 'links': a non-empty square list"),
        (_two(links="PIX"), r"'links' must be a list of N rows, one per device, got str"),
        (
            _two(p2p=[[True, True]]),
            r"'p2p' must be a list of 2 rows, one per device, got list of 1",
        ),
        (_two(p2p=[[True, True], [True, 1]]), r"p2p\[1\]\[1\] must be true or false, got 1"),
        (_two(links=[["X", 4], ["PIX", "X"]]), r"links\[0\]\[1\] must be a link token"),
        (_two(links=[["X", "NVX"], ["NVX", "X"]]), r"links\[0\]\[1\]: unknown link token"),
        (_two(gbps=[[None, -1], [-1, None]]), r"gbps\[0\]\[1\] must be a number of GB/s > 0"),
        (_two(gbps=[[None, 0], [0, None]]), r"gbps\[0\]\[1\] must be a number of GB/s > 0"),
        (_two(gbps=[[None, "fast"], ["fast", None]]), r"gbps\[0\]\[1\] .* got 'fast'"),
        (_two(gbps=[[None, True], [True, None]]), r"gbps\[0\]\[1\] .* got True"),
        (_two(gbps=[[None, 1.0]]), r"'gbps' must be a list of 2 rows"),
        (_two(gbps=[[None, 1.0], [None]]), r"'gbps' row 1 must be a list of 2 entries"),
        (_two(gbps=[[1.0, 2.0], [2.0, None]]), r"links\[0\]\[0\]: a SELF link .* no rate"),
        (_two(gbps=[[None, 2.0], [3.0, None]]), r"symmetric"),
        (
            _two(latency_s=[[None, -2], [-2, None]]),
            r"latency_s\[0\]\[1\] must be a number of seconds",
        ),
        (_two(names=["a"]), r"'names' must be a list of 2 strings, got \['a'\]"),
        (_two(names=["a", 1]), r"'names' must be a list of 2 strings"),
    ],
)
def test_from_json_says_which_field(text, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_json(text)


def test_json_carries_link_numbers():
    s = Link(K.SELF)
    nv = Link(K.NVLINK, 4, gbps=100.0, latency_s=2e-6)
    pcie = Link(K.PIX, gbps=31.5)
    plain = Link(K.SYS, p2p=False)
    topo = Topology([[s, nv, pcie], [nv, s, plain], [pcie, plain, s]])
    data = json.loads(topo.to_json())
    assert data["gbps"] == [[None, 100.0, 31.5], [100.0, None, None], [31.5, None, None]]
    assert data["latency_s"][0][1] == 2e-6
    assert data["latency_s"][0][2] is None
    back = Topology.from_json(topo.to_json())
    assert back == topo
    assert back.link(1, 0).gbps == 100.0 and back.link(0, 1).latency_s == pytest.approx(2e-6)
    # without numbers the text is as before: no gbps or latency_us fields
    assert "gbps" not in json.loads(Topology.preset("dgx1").to_json())


def test_json_by_hand_gives_numbers_where_written():
    text = _two(gbps=[[None, 12], [12, None]])
    topo = Topology.from_json(text)
    assert topo.link(0, 1) == Link(K.PIX, gbps=12.0)
    assert topo.link(0, 1).latency_s is None


def test_link_numbers_are_checked():
    with pytest.raises(ValueError, match="gbps must be > 0"):
        Link(K.PIX, gbps=0)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        Link(K.PIX, latency_s=-1e-6)
    with pytest.raises(TypeError, match="gbps must be a real number"):
        Link(K.PIX, gbps="1")
    with pytest.raises(ValueError, match="SELF link"):
        Link(K.SELF, latency_s=1e-6)
    assert Link(K.NVLINK, 2, gbps=50) == Link(K.NVLINK, 2, gbps=50.0)
    assert Link(K.NVLINK, 2, gbps=50) != Link(K.NVLINK, 2)


def test_from_json_type_error():
    with pytest.raises(TypeError):
        Topology.from_json({"format": "nccltree.topology"})


# -- detection -------------------------------------------------------------------------------


def fake_devices(
    backend: str, physical: list[int], no_peer: frozenset = frozenset()
) -> list[SimpleNamespace]:
    """Devices as detection sees them; ``no_peer`` holds (a, b) GPU pairs whose peer
    access the backend could not enable."""
    devs = [
        SimpleNamespace(backend=backend, physical_id=p, index=i, name=f"{backend}{i}")
        for i, p in enumerate(physical)
    ]
    for d in devs:
        d.can_access_peer = lambda o, d=d: (d.physical_id, o.physical_id) not in no_peer
    return devs


def test_detect_host_is_uniform():
    topo = Topology.detect(fake_devices("host", [0, 1, 2]))
    assert topo.n == 3 and topo.names == ("host0", "host1", "host2")
    assert {topo.link(i, j) for i in range(3) for j in range(3) if i != j} == {Link(K.SAME_DEVICE)}


def test_detect_real_host_devices(host_devs):
    devs = host_devs(4)
    topo = nt.Topology.detect(devs)
    assert topo.n == 4
    assert all(topo.link(i, j).p2p for i in range(4) for j in range(4))
    assert nt.build_tree(topo).depth == 2


def test_detect_rejects():
    with pytest.raises(ValueError, match="at least one"):
        Topology.detect([])
    with pytest.raises(ValueError, match="one backend"):
        Topology.detect(fake_devices("host", [0]) + fake_devices("cuda", [0]))
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        Topology.detect(fake_devices("tpu", [0]))


class FakeNVMLError(Exception):
    pass


def fake_machine(monkeypatch, nvlink_version=None, pcie=None, curr_pcie=None):
    """Four GPUs as CUDA numbers them 0..3, listed by NVML in another (PCI) order.

    Sockets: CUDA 0, 2, 3 and CUDA 1, 4, 5. CUDA 0-1: two direct NVLinks across the
    sockets. CUDA 2-3: one K80-style board. CUDA 4-5: twelve NVLinks each into NVSwitch.
    Peer access within a socket and over NVLink.

    ``nvlink_version`` (CUDA number -> what nvmlDeviceGetNvLinkVersion returns),
    ``pcie`` and ``curr_pcie`` (CUDA number -> (generation, width), the Max and Curr
    queries) add those functions; without them the fake has none of them, as an older
    pynvml. A fake of NVML checks the wiring only, not what a real driver answers.
    """
    bus = [
        "0000:3B:00.0",
        "0000:1A:00.0",
        "0000:86:00.0",
        "0000:87:00.0",
        "0000:B1:00.0",
        "0000:B2:00.0",
    ]
    nvml_bus = {b: "0000" + b for b in bus}  # NVML writes an 8-digit domain
    links = {0: [bus[1], bus[1]], 1: [bus[0], bus[0]], 4: ["switch"] * 12, 5: ["switch"] * 12}
    board = {2: 7, 3: 7}
    socket = {0: 0, 1: 1, 2: 0, 3: 0, 4: 1, 5: 1}

    def handle_of(bus_id):
        for k, b in enumerate(bus):
            if bus_id in (b, nvml_bus[b]):
                return k
        raise FakeNVMLError("not found")

    def need_nvlink(h, link):
        if link >= len(links.get(h, [])):
            raise FakeNVMLError("not supported")
        return links[h][link]

    def p2p_status(a, b, index):
        if index == 2:  # NVLink
            return 0 if {a, b} <= {4, 5} else 3
        if index != 0:
            raise AssertionError(f"peer read status asked with index {index!r}")
        return 0 if socket[a] == socket[b] or {a, b} in ({0, 1}, {4, 5}) else 2

    def ancestor(a, b):
        if board.get(a) is not None and board.get(a) == board.get(b):
            return 0
        return 40 if socket[a] == socket[b] else 50

    calls = []
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_NVLINK_MAX_LINKS = 18
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByPciBusId = handle_of
    nvml.nvmlDeviceGetNvLinkState = lambda h, link: 1 if need_nvlink(h, link) else 0
    nvml.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: (
        2 if need_nvlink(h, link) == "switch" else 0
    )
    nvml.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: SimpleNamespace(
        busId=nvml_bus[need_nvlink(h, link)].encode()
    )
    nvml.nvmlDeviceGetMultiGpuBoard = lambda h: int(h in board)
    nvml.nvmlDeviceGetBoardId = lambda h: board[h]
    nvml.nvmlDeviceGetP2PStatus = p2p_status
    nvml.nvmlDeviceGetTopologyCommonAncestor = ancestor

    def table(values, index):
        def ask(h, *link):
            if h not in values:
                raise FakeNVMLError("not supported")
            if link:
                need_nvlink(h, link[0])  # only active links have a version
            return values[h] if index is None else values[h][index]

        return ask

    if nvlink_version is not None:
        nvml.nvmlDeviceGetNvLinkVersion = table(nvlink_version, None)
    if pcie is not None:
        nvml.nvmlDeviceGetMaxPcieLinkGeneration = table(pcie, 0)
        nvml.nvmlDeviceGetMaxPcieLinkWidth = table(pcie, 1)
    if curr_pcie is not None:
        nvml.nvmlDeviceGetCurrPcieLinkGeneration = table(curr_pcie, 0)
        nvml.nvmlDeviceGetCurrPcieLinkWidth = table(curr_pcie, 1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    runtime = SimpleNamespace(
        deviceGetPCIBusId=lambda k: bus[k],
        deviceCanAccessPeer=lambda a, b: int(socket[a] == socket[b]),
    )
    cupy = types.ModuleType("cupy")
    cupy.cuda = SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return calls


def test_detect_cuda_through_nvml(monkeypatch):
    calls = fake_machine(monkeypatch)
    topo = Topology.detect(fake_devices("cuda", [0, 1, 2, 3, 1, 4, 5]))
    assert tokens(topo) == [
        "X NV2 NODE NODE NV2 SYS SYS",
        "NV2 X SYS SYS DEV NODE NODE",
        "NODE SYS X BRD SYS SYS SYS",
        "NODE SYS BRD X SYS SYS SYS",
        "NV2 DEV SYS SYS X NODE NODE",
        "SYS NODE SYS SYS NODE X NV12",
        "SYS NODE SYS SYS NODE NV12 X",
    ]
    # Peer access as NVML reports it, not as the kind suggests (NVLink across sockets).
    assert p2p_rows(topo) == [
        "11111..",
        "11..111",
        "1.11...",
        "1.11...",
        "11..111",
        ".1..111",
        ".1..111",
    ]
    assert calls == ["init", "shutdown"]


def test_detect_cuda_through_nvml_fills_link_rates(monkeypatch):
    """NVLink version x link count and PCIe generation x width become each link's rate
    (the narrower end's over PCIe). A fake of NVML: this checks the wiring, not what a
    real driver reports."""
    fake_machine(
        monkeypatch,
        nvlink_version={0: 2, 1: 2, 4: 6, 5: 6},  # NVLink 2.0 (V100), 4.0 (H100)
        pcie={0: (3, 16), 1: (3, 16), 2: (4, 16), 3: (4, 8), 4: (5, 16), 5: (5, 16)},
    )
    topo = Topology.detect(fake_devices("cuda", [0, 1, 2, 3, 4, 5, 1]))
    rate = [[topo.link(i, j).gbps for j in range(topo.n)] for i in range(topo.n)]
    assert rate[0][1] == 2 * 25.0  # two NVLink 2.0 links
    assert rate[4][5] == 12 * 25.0  # twelve NVLink 4.0 links into the switch
    assert rate[2][3] == pytest.approx(8 * 1.969)  # the board: gen 4, the x8 end
    assert rate[0][2] == pytest.approx(16 * 0.985)  # NODE: gen 3 x16 against gen 4 x16
    assert rate[1][4] == pytest.approx(16 * 0.985)
    assert rate[1][6] is None  # one GPU twice: its memory, the device model's figure
    assert all(topo.link(i, j).latency_s is None for i in range(7) for j in range(7))
    # the kinds and peer access are those detected without the numbers
    fake_machine(monkeypatch)
    plain = Topology.detect(fake_devices("cuda", [0, 1, 2, 3, 4, 5, 1]))
    assert tokens(plain) == tokens(topo) and p2p_rows(plain) == p2p_rows(topo)
    assert all(plain.link(i, j).gbps is None for i in range(7) for j in range(7))


def test_detect_cuda_link_rates_only_where_nvml_tells(monkeypatch):
    """Unknown NVLink versions (2.2, a future one) and generations give no rate; the
    current PCIe figures stand in where the maximum ones are not answered. A fake of
    NVML: wiring only."""
    fake_machine(
        monkeypatch,
        nvlink_version={0: 3, 1: 3, 4: 4, 5: 99},
        pcie={0: (3, 16), 1: (9, 16)},
        curr_pcie={2: (4, 16), 3: (4, 16)},
    )
    topo = Topology.detect(fake_devices("cuda", [0, 1, 2, 3, 4, 5]))
    assert topo.link(0, 1).gbps is None  # NVLink 2.2: no data sheet here
    assert topo.link(4, 5).gbps is None  # one end's version unknown
    assert topo.link(2, 3).gbps == pytest.approx(16 * 1.969)  # the current figures
    assert topo.link(0, 2).gbps == pytest.approx(16 * 0.985)  # max on one end, current
    assert topo.link(0, 4).gbps is None  # GPU 4 answers no PCIe query
    assert topo.link(1, 2).gbps is None  # generation 9 is unknown


def test_link_rate_constants():
    from nccltree import sim, topology

    assert topology.nvlink_gbps(1) == 20.0  # NVLink 1.0
    assert [topology.nvlink_gbps(v) for v in (2, 4, 6)] == [25.0] * 3  # 2.0, 3.0, 4.0
    assert topology.nvlink_gbps(3) is None and topology.nvlink_gbps(0) is None
    # x16 at each generation is the simulator's data-sheet PCIe figure
    for gen, x16 in sim.PCIE_X16_GBPS.items():
        assert topology.pcie_gbps(gen, 16) == pytest.approx(x16, rel=2e-3)
    assert topology.pcie_gbps(4, 0) is None and topology.pcie_gbps(7, 16) is None


def test_detect_cuda_without_nvml_warns_and_uses_peer_access(monkeypatch):
    fake_machine(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.warns(RuntimeWarning, match="NVML is not available"):
        topo = Topology.detect(fake_devices("cuda", [0, 2, 1, 0]))
    assert tokens(topo) == [
        "X PHB SYS DEV",
        "PHB X SYS PHB",
        "SYS SYS X SYS",
        "DEV PHB SYS X",
    ]
    assert not topo.link(0, 2).p2p


def test_detect_cuda_nvml_init_failure_falls_back(monkeypatch):
    fake_machine(monkeypatch)

    def broken():
        raise FakeNVMLError("driver not loaded")

    monkeypatch.setattr(sys.modules["pynvml"], "nvmlInit", broken)
    with pytest.warns(RuntimeWarning, match="driver not loaded"):
        topo = Topology.detect(fake_devices("cuda", [0, 1]))
    assert topo.link(0, 1) == Link(K.SYS, p2p=False)


def test_detect_cuda_nvml_error_after_init_falls_back(monkeypatch):
    # NVML initialises but cannot see the GPUs CUDA sees (seen in some containers)
    calls = fake_machine(monkeypatch)

    def unknown(bus_id):
        raise FakeNVMLError("not found")

    monkeypatch.setattr(sys.modules["pynvml"], "nvmlDeviceGetHandleByPciBusId", unknown)
    with pytest.warns(RuntimeWarning, match="NVML failed after nvmlInit: not found"):
        topo = Topology.detect(fake_devices("cuda", [0, 2]))
    assert topo.link(0, 1) == Link(K.PHB)
    assert calls == ["init", "shutdown"]


def test_detect_cuda_pairs_without_enabled_peer_access_stage(monkeypatch):
    # NVML says peer access works, but enabling it failed in this process (too many peers):
    # the plans must stage through host memory on that pair
    fake_machine(monkeypatch)
    topo = Topology.detect(fake_devices("cuda", [0, 1, 2], no_peer=frozenset({(0, 2)})))
    assert not topo.link(0, 2).p2p and not topo.link(2, 0).p2p
    assert topo.link(0, 2).kind == K.NODE
    assert topo.link(0, 1).p2p


def test_detect_cuda_without_cupy(monkeypatch):
    fake_machine(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(nt.BackendUnavailable, match="CuPy"):
        Topology.detect(fake_devices("cuda", [0, 1]))


_DEFAULT_P2P_LINKS = st.one_of(
    st.builds(Link, st.just(K.NVLINK), st.integers(1, 24)),
    st.sampled_from([Link(k) for k in (K.SAME_DEVICE, K.SAME_BOARD, K.PIX, K.PXB, K.PHB, K.NODE)]),
    st.just(Link(K.SYS, p2p=False)),
)


@settings(max_examples=40, deadline=None)
@given(st.data())
@pytest.mark.slow
def test_from_smi_any_layout(data):
    """Whatever the whitespace, NIC columns and trailing columns, cells map by order."""
    n = data.draw(st.integers(1, 10))
    nics = data.draw(st.integers(0, 3))
    gap = st.sampled_from([" ", "  ", "\t", " \t", "\t\t", "    "])
    links = [[Link(K.SELF)] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            links[i][j] = links[j][i] = data.draw(_DEFAULT_P2P_LINKS)
    topo = Topology(links)
    names = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(nics)]
    trailing = data.draw(
        st.sampled_from(["", "CPU Affinity", "CPU Affinity\tNUMA Affinity\tGPU NUMA ID"])
    )

    def line(cells: list[str]) -> str:
        return data.draw(st.sampled_from(["", " ", "\t"])) + "".join(
            c + data.draw(gap) for c in cells
        )

    text = ["$ nvidia-smi topo -m", line(names) + trailing]
    for i in range(n):
        cells = [" X " if i == j else links[i][j].token for j in range(n)]
        cells += [
            data.draw(st.sampled_from(["PIX", "PXB", "NODE", "SYS", "SOC"])) for _ in range(nics)
        ]
        extra = {"": [], "CPU Affinity": ["0-7"]}.get(trailing, ["0-7,16-23", "0", "N/A"])
        text.append(line([f"GPU{i}", *cells, *extra]))
    for k in range(nics):
        text.append(
            line([f"NIC{k}"] + ["PIX"] * n + ["X" if k == m else "SYS" for m in range(nics)])
        )
    text += [
        "",
        "Legend:",
        "",
        "  X    = Self",
        "  NV#  = Connection traversing a bonded set of # NVLinks",
    ]
    assert Topology.from_smi("\n".join(text)) == topo
