"""The simulator (nccltree.sim): hand-computed cases, sharing, ordering, and the model
against the one GPU run on record (docs/performance.md, GPU results). Deterministic: no
clock is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nccltree import sim
from nccltree.comm.plan import Buf, Plan, Step
from nccltree.comm.world import gpu_chunk_bytes
from nccltree.topology import Link, LinkKind, Topology

H100 = sim.DEVICES["h100"]
MB = 1 << 20


def _machine(link: Link, n: int = 2, issue_s: float = 0.0) -> sim.Machine:
    return sim.Machine(Topology.uniform(n, link), H100, issue_s=issue_s)


def _copy(rank: int, dst: int, src: int, count: int) -> Step:
    return Step(rank, "copy", Buf(dst, "out", 0, count), (Buf(src, "in", 0, count),))


def test_one_copy_takes_its_latency_and_its_bytes_over_the_link() -> None:
    m = _machine(Link(LinkKind.PIX), issue_s=1e-6)
    plan = Plan(2, [_copy(0, 1, 0, MB // 4)], 0)
    rate = sim.PCIE_X16_GBPS[5] * sim.PCIE_EFFICIENCY[LinkKind.PIX] * 1e9
    got = sim.simulate(plan, m).time_s
    assert got == pytest.approx(1e-6 + sim.PCIE_LATENCY_S + MB / rate, rel=1e-9)
    # without peer access the copy is staged through the host: half the rate
    slow = sim.simulate(plan, _machine(Link(LinkKind.PIX, p2p=False), issue_s=1e-6)).time_s
    assert slow == pytest.approx(1e-6 + sim.PCIE_LATENCY_S + 2 * MB / rate, rel=1e-9)


def test_flows_share_a_link_fairly_and_separate_links_do_not_slow_each_other() -> None:
    m = _machine(Link(LinkKind.NVLINK, 2), n=3)
    one = sim.simulate(Plan(3, [_copy(0, 1, 0, MB)], 0), m).time_s
    # two streams pushing over the same directed link 0->1 at once
    same = Plan(3, [_copy(0, 1, 0, MB), Step(2, "copy", Buf(1, "tmp", 0, MB),
                                               (Buf(0, "in", 0, MB),))], 0)  # fmt: skip
    # rank 2's stream copies 0->1 too (the link is the source's and destination's)
    shared = sim.simulate(same, m).time_s
    lat = sim.LATENCY_S[LinkKind.NVLINK]
    assert shared - lat == pytest.approx(2 * (one - lat), rel=1e-6)
    # 0->1 and 2->1 use different links
    apart = Plan(3, [_copy(0, 1, 0, MB), _copy(2, 1, 2, MB)], 0)
    assert sim.simulate(apart, m).time_s == pytest.approx(one, rel=1e-6)


def test_waits_order_the_streams() -> None:
    m = _machine(Link(LinkKind.NVLINK, 4), n=3)
    one = sim.simulate(Plan(3, [_copy(0, 1, 0, MB)], 0), m).time_s
    chained = Plan(3, [
        _copy(0, 1, 0, MB), Step(0, "record", event=0), Step(2, "wait", event=0),
        _copy(2, 1, 2, MB),
    ], 1)  # fmt: skip
    assert sim.simulate(chained, m).time_s == pytest.approx(2 * one, rel=1e-6)
    with pytest.raises(AssertionError, match="cannot progress"):
        sim.simulate(Plan(2, [Step(0, "wait", event=0), _copy(0, 1, 0, 4)], 1), _machine(
            Link(LinkKind.PIX)))  # fmt: skip


def test_a_large_ring_all_reduce_approaches_the_link_rate() -> None:
    """On 8 ranks with uniform 2-link NVLink and no issue cost, the ring's busbw is close
    to one direction of a link (the ring's bound)."""
    m = _machine(Link(LinkKind.NVLINK, 2), n=8)
    size = 256 * MB
    r = sim.simulate_collective(m, "ring", "all_reduce", size // 4, chunk_bytes=4 * MB)
    busbw = size / r.time_s * 2 * 7 / 8 / 1e9
    assert 0.8 * 50 <= busbw <= 50 * 1.001
    assert r.bytes["link 0->1"] == pytest.approx(2 * 7 / 8 * size, rel=1e-6)


# what the one-call GPU check measured on an H200 (docs/performance.md, "GPU / Results"):
# all_reduce on logical ranks of GPU 0, microseconds, with 13 us per issued plan step
H200_MEASURED = {
    (4, "tree"): {1: 797, 16: 4306, 256: 4125},
    (4, "ring"): {1: 1124, 16: 3002, 256: 3070},
    (4, "direct"): {1: 772, 16: 1725, 256: 1627},
    (2, "tree"): {1: 365, 16: 1996, 256: 1873},
    (2, "ring"): {1: 519, 16: 1032, 256: 1034},
    (2, "direct"): {1: 464, 16: 1051, 256: 1031},
}


def test_the_model_against_the_h200_run_on_record() -> None:
    """Data-sheet memory bandwidth and the measured issue cost, nothing fitted: every
    point within 2x of the measurement, most within 25% (the table is in
    docs/benchmarks.md)."""
    ratios = []
    for (n, alg), points in H200_MEASURED.items():
        m = sim.Machine(Topology.uniform(n, Link(LinkKind.SAME_DEVICE)), sim.DEVICES["h200"],
                        issue_s=13e-6)  # fmt: skip
        for mib, measured_us in points.items():
            size = mib * MB
            r = sim.simulate_collective(m, alg, "all_reduce", size // 4,
                                        chunk_bytes=gpu_chunk_bytes(size))  # fmt: skip
            ratios.append(r.time_s * 1e6 / measured_us)
    assert all(0.45 <= x <= 2.0 for x in ratios), ratios
    assert sum(0.75 <= x <= 1.25 for x in ratios) >= len(ratios) // 2, ratios


def test_the_simulate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nccltree.cli import bench

    out = tmp_path / "s.json"
    argv = ["simulate", "--topo", "dgx1", "--gpu", "v100", "-b", "1M", "-e", "16M", "-f", "16",
            "--collective", "all_reduce,broadcast", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "predicted, not measured" in text and "# broadcast" in text
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 2 * 2 * 3 and all(r["predicted"] and r["time_us"] > 0 for r in recs)
    assert bench.main(["simulate", "--topo", "dgx1", "--gpu", "tpu"]) == 2
    assert bench.main(["simulate", "--topo", "dgx1", "--algorithm", "mesh"]) == 2
    assert bench.main(["simulate", "--topo", "nvswitch8", "--nodes", "2", "-b", "1M",
                       "-e", "1M"]) == 0  # fmt: skip
    assert "16 ranks (nvswitch8 x 2 nodes)" in capsys.readouterr().out


def test_nccls_model_finds_the_nvlink_ring_and_its_latency() -> None:
    """The model of NCCL (not NCCL): on a DGX-1 it rides NVLink alone (the hybrid cube
    mesh has NVLink rings), its busbw at large sizes is a GPU's NVLink bandwidth, and a
    small message costs its latency, base + 2(n-1) steps."""
    m = sim.Machine(Topology.preset("dgx1"), sim.DEVICES["v100"])
    busbw, hw = sim._node_busbw(m, list(range(8)))
    assert hw == "nvlink" and busbw == 6 * 25.0  # every DGX-1 V100 has 6 NVLinks
    t_small, alg = sim.nccl_model_time(m, "all_reduce", 8)
    lat = sim.NCCL_BASE_US["ring"] + 2 * 7 * sim.NCCL_HW_US[("nvlink", "ring")]
    assert alg == "ring" and t_small == pytest.approx(lat * 1e-6, rel=1e-3)
    size = 1 << 30
    t_big, _ = sim.nccl_model_time(m, "all_reduce", size)
    assert size / t_big * 2 * 7 / 8 / 1e9 == pytest.approx(150.0, rel=0.01)
    # PCIe only: the best ring's slowest hop
    p = sim.Machine(Topology.preset("pcie2s8"), sim.DEVICES["a100"])
    assert sim._node_busbw(p, list(range(8)))[1] == "pci"


def test_calibrate_host_measures_positive_costs_and_the_host_machine_uses_them() -> None:
    cal = sim.calibrate_host((3,), repeats=1, cores=2)
    assert set(cal.copy_gbps) == {1, 2} and len(cal.copy_gbps[2]) == 6
    assert all(g > 0 for c in cal.copy_gbps.values() for _, g in c)
    assert cal.step_s > 0 and cal.call_s[3] > 0
    # the rate for a working set: the measurements at the sizes measured, interpolated
    # between them (log2 of the size), the end ones beyond
    curve = cal.copy_gbps[2]
    assert cal.rate(2, curve[2][0]) == pytest.approx(curve[2][1])
    mid = cal.rate(2, int((curve[2][0] * curve[3][0]) ** 0.5))
    assert mid == pytest.approx((curve[2][1] + curve[3][1]) / 2, rel=1e-6)
    assert cal.rate(2, 1) == curve[0][1] and cal.rate(2, 1 << 40) == curve[-1][1]
    m = sim.host_machine(3, cal, 1 << 20, 6 << 20)
    assert m.memory(0) == m.memory(1) == m.memory(2)  # one memory for every host rank
    assert m.device.memory_gbps == cal.rate(2, 6 << 20)  # 1 MiB per rank: every core
    assert sim.host_machine(3, cal, 1 << 10, 6 << 10).device.memory_gbps == cal.rate(1, 6 << 10)
    # inline calls skip records and waits: a plan's time counts its data steps only
    assert sim.simulate_collective(m, "direct", "all_reduce", 3).time_s > 0
