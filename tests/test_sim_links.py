"""Links that carry their own numbers (``Link.gbps``, ``Link.latency_s``) in the simulator
(nccltree.sim) and in ``nccltree-bench simulate --topo FILE``. Deterministic: no clock is
read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nccltree import sim
from nccltree.cli.bench import main as bench_main
from nccltree.comm.plan import Buf, Plan, Step
from nccltree.topology import Link, LinkKind, Topology

H100 = sim.DEVICES["h100"]
MB = 1 << 20


def _copy_time(link: Link, nbytes: int = MB, **machine: float) -> float:
    m = sim.Machine(Topology.uniform(2, link), H100, issue_s=0.0, **machine)
    count = nbytes // 4
    plan = Plan(2, [Step(0, "copy", Buf(1, "out", 0, count), (Buf(0, "in", 0, count),))], 0)
    return sim.simulate(plan, m).time_s


def test_a_link_rate_replaces_the_data_sheet_figure() -> None:
    m = sim.Machine(Topology.uniform(2, Link(LinkKind.PIX)), H100)
    # NVLink: the link's rate as it is (not links x the model's rate per link)
    assert m.link_gbps(Link(LinkKind.NVLINK, 4)) == 4 * H100.nvlink_gbps
    assert m.link_gbps(Link(LinkKind.NVLINK, 4, gbps=80.0)) == 80.0
    # PCIe: the link's nominal rate times the share of its distance, as the data sheet's
    eff = sim.PCIE_EFFICIENCY[LinkKind.PXB]
    assert m.link_gbps(Link(LinkKind.PXB)) == pytest.approx(sim.PCIE_X16_GBPS[5] * eff)
    assert m.link_gbps(Link(LinkKind.PXB, gbps=15.76)) == pytest.approx(15.76 * eff)
    # without peer access: staged through the host, half
    assert m.link_gbps(Link(LinkKind.SYS, p2p=False, gbps=10.0)) == pytest.approx(
        10.0 * sim.PCIE_EFFICIENCY[LinkKind.SYS] / 2
    )
    # the network: the link's own rate over the machine's
    assert m.link_gbps(Link(LinkKind.NET, p2p=False)) == m.net_gbps
    assert m.link_gbps(Link(LinkKind.NET, p2p=False, gbps=50.0)) == 50.0


def test_a_link_latency_replaces_the_kinds() -> None:
    m = sim.Machine(Topology.uniform(2, Link(LinkKind.PIX)), H100)
    assert m.latency_s(Link(LinkKind.PIX)) == sim.PCIE_LATENCY_S
    assert m.latency_s(Link(LinkKind.NVLINK, 2)) == sim.LATENCY_S[LinkKind.NVLINK]
    assert m.latency_s(Link(LinkKind.PIX, latency_s=7e-6)) == 7e-6
    assert m.latency_s(Link(LinkKind.NVLINK, 2, latency_s=0.0)) == 0.0


def test_one_copy_over_a_numbered_link() -> None:
    """One 1 MiB copy: the link's latency, then its bytes at the link's rate."""
    link = Link(LinkKind.NVLINK, 2, gbps=40.0, latency_s=10e-6)
    assert _copy_time(link) == pytest.approx(10e-6 + MB / 40e9, rel=1e-9)
    pcie = Link(LinkKind.PIX, gbps=15.76, latency_s=0.0)
    rate = 15.76e9 * sim.PCIE_EFFICIENCY[LinkKind.PIX]
    assert _copy_time(pcie) == pytest.approx(MB / rate, rel=1e-9)


def test_the_data_sheet_numbers_written_out_predict_the_same() -> None:
    """A topology whose links carry the device model's own figures predicts what the
    same topology without numbers does."""
    plain = Topology.preset("dgx1")
    n = plain.n
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            link = plain.link(i, j)
            if link.kind == LinkKind.NVLINK:
                link = Link(LinkKind.NVLINK, link.nvlinks, link.p2p, gbps=link.nvlinks * 25.0)
            elif link.kind != LinkKind.SELF:
                link = Link(link.kind, 0, link.p2p, gbps=sim.PCIE_X16_GBPS[3], latency_s=3e-6)
            row.append(link)
        rows.append(row)
    numbered = Topology(rows)
    v100 = sim.DEVICES["v100"]
    for alg in ("tree", "ring", "direct"):
        a = sim.simulate_collective(sim.Machine(plain, v100), alg, "all_reduce", 1 << 20)
        b = sim.simulate_collective(sim.Machine(numbered, v100), alg, "all_reduce", 1 << 20)
        assert a.time_s == pytest.approx(b.time_s, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from([LinkKind.NVLINK, LinkKind.PIX, LinkKind.SYS, LinkKind.NET]),
    gbps=st.floats(0.5, 500.0),
    factor=st.floats(1.0, 8.0),
)
@pytest.mark.slow
def test_a_faster_link_never_predicts_a_slower_plan(
    kind: LinkKind, gbps: float, factor: float
) -> None:
    nvlinks = 2 if kind == LinkKind.NVLINK else 0
    p2p = kind not in (LinkKind.NET, LinkKind.SYS)
    slow = Topology.uniform(4, Link(kind, nvlinks, p2p, gbps=gbps))
    fast = Topology.uniform(4, Link(kind, nvlinks, p2p, gbps=gbps * factor))
    for alg in ("tree", "ring"):
        ts = sim.simulate_collective(sim.Machine(slow, H100), alg, "all_reduce", 1 << 18)
        tf = sim.simulate_collective(sim.Machine(fast, H100), alg, "all_reduce", 1 << 18)
        assert tf.time_s <= ts.time_s * (1 + 1e-9)


def test_nccls_model_uses_nvlink_rates_the_links_carry() -> None:
    plain = Topology.preset("nvswitch8")
    twelve = plain.link(0, 1).nvlinks
    slow = Topology(
        [
            [
                link if link.kind == LinkKind.SELF else Link(LinkKind.NVLINK, twelve, gbps=60.0)
                for link in (plain.link(i, j) for j in range(plain.n))
            ]
            for i in range(plain.n)
        ]
    )
    a100 = sim.DEVICES["a100"]
    t_sheet, _ = sim.nccl_model_time(sim.Machine(plain, a100), "all_reduce", 256 * MB)
    t_slow, _ = sim.nccl_model_time(sim.Machine(slow, a100), "all_reduce", 256 * MB)
    assert t_slow > 4 * t_sheet  # 60 GB/s instead of 12 x 25


# -- the command -------------------------------------------------------------------------


def _simulate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = bench_main(["simulate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> dict[tuple[int, str], float]:
    """(size, algorithm) -> predicted microseconds, from the table."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        size, _, alg, us, *_ = line.split()
        rows[int(size), alg] = float(us)
    return rows


def test_simulate_reads_a_topology_json_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dgx1.json"
    path.write_text(Topology.preset("dgx1").to_json())
    flags = ["--gpu", "v100", "-b", "1M", "-e", "16M", "--algorithm", "tree,ring"]
    code, from_file, _ = _simulate(capsys, "--topo", str(path), *flags)
    assert code == 0
    assert f"({path}" in from_file
    code, from_preset, _ = _simulate(capsys, "--topo", "dgx1", *flags)
    assert code == 0
    assert _rows(from_file) == _rows(from_preset)  # the same topology, the same table
    # links that carry a slower rate predict slower transfers
    data = json.loads(path.read_text())
    data["gbps"] = [[None if t == "X" else 5.0 for t in row] for row in data["links"]]
    path.write_text(json.dumps(data))
    code, slower, _ = _simulate(capsys, "--topo", str(path), *flags, "--json", str(tmp_path / "p"))
    assert code == 0
    assert "56 of 56 links carry their own rates" in slower
    big = max(s for s, _ in _rows(slower))
    assert _rows(slower)[big, "ring"] > 2 * _rows(from_preset)[big, "ring"]
    record = json.loads((tmp_path / "p").read_text())
    assert record["machine"]["topology"] == str(path)
    assert record["machine"]["links_with_rates"] == 56


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "not a JSON topology"),
        (json.dumps({"format": "nccltree.topology", "version": 1, "links": [["X"]]}), "'p2p'"),
        (
            json.dumps(
                {
                    "format": "nccltree.topology",
                    "version": 1,
                    "links": [["X", "PIX"], ["PIX", "X"]],
                    "p2p": [[True, True], [True, True]],
                    "gbps": [[None, "fast"], ["fast", None]],
                }
            ),
            r"gbps\[0\]\[1\] must be a number of GB/s > 0",
        ),
        ("        GPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV2\t X\n", "--smi"),
    ],
)
def test_simulate_says_what_is_wrong_with_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "topo.json"
    path.write_text(content)
    code, out, err = _simulate(capsys, "--topo", str(path))
    assert code == 2, out + err
    assert str(path) in err
    assert re.search(message, err), err


def test_simulate_names_what_topo_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _simulate(capsys, "--topo", "dgx7")
    assert code == 2
    assert "neither a preset" in err and "dgx1" in err and "no such file" in err


def test_simulate_still_reads_nvidia_smi_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "smi.txt"
    path.write_text(str(Topology.preset("dgx1")))
    code, out, _ = _simulate(capsys, "--smi", str(path), "-b", "1M", "-e", "1M")
    assert code == 0 and "ring" in out


def test_simulate_help_explains_the_file_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("PRESET|FILE", "topology JSON", "gbps", "latency_s", "nvidia-smi topo -m"):
        assert words in text, words


def test_topo_writes_the_json_simulate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.json"
    assert bench_main(["topo", "--preset", "pcie2s8", "--json", str(path)]) == 0
    assert "Link rates" not in capsys.readouterr().out  # a preset carries none
    assert Topology.from_json(path.read_text()) == Topology.preset("pcie2s8")
    code, out, _ = _simulate(capsys, "--topo", str(path), "-b", "1M", "-e", "1M")
    assert code == 0 and "direct" in out


def test_topo_prints_the_rates_links_carry(tmp_path: Path) -> None:
    import argparse
    import io

    from nccltree.cli.bench import run_topo
    from nccltree.tree import build_tree

    s, nv, pix = Link(LinkKind.SELF), Link(LinkKind.NVLINK, 2, gbps=50.0), Link(LinkKind.PIX)
    topo = Topology([[s, nv, pix], [nv, s, pix], [pix, pix, s]])
    out = io.StringIO()
    path = tmp_path / "t.json"
    args = argparse.Namespace(dot=None, json=str(path))
    assert run_topo(topo, "detected", build_tree(topo), args, out) == 0
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Link rates"))
    assert lines[at + 2].split() == ["GPU0", "X", "50", "-"]
    assert lines[at + 4].split() == ["GPU2", "-", "-", "X"]
    assert Topology.from_json(path.read_text()) == topo


def test_simulate_counts_the_links_with_rates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, nv, pix = Link(LinkKind.SELF), Link(LinkKind.NVLINK, 2, gbps=50.0), Link(LinkKind.PIX)
    path = tmp_path / "t.json"
    path.write_text(Topology([[s, nv, pix], [nv, s, pix], [pix, pix, s]]).to_json())
    code, out, _ = _simulate(capsys, "--topo", str(path), "-b", "1K", "-e", "1K")
    assert code == 0 and "2 of 6 links carry their own rates" in out
