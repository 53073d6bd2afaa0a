"""bench/sim_published.py: every published data file loads and passes the schema, the
comparison runs on one small source, and a malformed file is refused by name."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from nccltree import sim
from nccltree.topology import LinkKind

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sim_published.py"
SMALL = "autodl-2x2080ti-pcie"  # 2 ranks, PCIe without peer access: simulates in well under 1 s


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_published", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sp = _load_script()


def test_every_data_file_loads_and_the_set_covers_the_classes() -> None:
    sources = sp.load_all()
    assert len(sources) >= 5
    classes = {s.klass for s in sources}
    assert {"PCIe", "multi-node"} <= classes and classes & {"NVLink", "NVSwitch"}
    for s in sources:
        assert s.device in sim.DEVICES and s.url.startswith("https://github.com/")
        assert all(b >= 64 << 20 and bw > 0 for b, bw in s.measured)
        assert s.topology.n * s.nodes == s.ranks
        assert (s.nodes > 1) == (s.network_gbps is not None and s.klass == "multi-node")


def test_the_comparison_on_a_small_source() -> None:
    (src,) = [s for s in sp.load_all() if s.id == SMALL]
    rows = sp.compare(src)
    assert [r.nbytes for r in rows] == [b for b, _ in src.measured]
    # two RTX 2080 Ti behind one PCIe 3.0 switch without peer access: every copy is staged
    # through the host, so no prediction can beat half the switch's x16 rate
    staged = sim.PCIE_X16_GBPS[3] * sim.PCIE_EFFICIENCY[LinkKind.PIX] / 2
    for r in rows:
        assert r.ring is not None and r.ring_procs is not None
        assert 0 < r.ring <= r.ring_procs * 1.001 and r.ring_procs <= staged * 1.001
        assert 0 < r.nccl_model <= staged * 1.001 and r.nccl_alg in ("ring", "tree")
        assert r.ring_ratio == pytest.approx(r.ring / r.measured)
    assert sp.summary(rows)[0][:3] == ("PCIe", "1", str(len(rows)))


def test_the_script_writes_its_markdown_tables(tmp_path: Path) -> None:
    out = tmp_path / "t.md"
    assert sp.main(["--only", SMALL, "--markdown", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("| source | GPU | class |") and f"| {SMALL} | rtx2080ti | PCIe |" in text
    assert "| PCIe | 1 | " in text


def _good() -> dict[str, object]:
    return dict(json.loads((sp.DATA_DIR / f"{SMALL}.json").read_text()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"device": "gtx480"}, "not in sim.DEVICES"),
        ({"measured": [{"bytes": 1 << 20, "busbw": 1.0}]}, ">= 64 MiB"),
        ({"measured": [{"bytes": 128 << 20, "busbw": 1.0}, {"bytes": 64 << 20, "busbw": 1.0}]},
         "increasing"),
        ({"ranks": 4}, "are not 4 ranks"),
        ({"nodes": 2, "ranks": 4}, "multi-node"),
        ({"class": "multi-node", "nodes": 2, "ranks": 4}, "network_gbps"),
        ({"url": "http://example.com/x"}, "github.com"),
        ({"topology": {"smi": "GPU0 GPU1\nGPU0 X QQ\nGPU1 QQ X\n", "origin": "x"}}, "QQ"),
        ({"busbw": 1.0}, "unknown fields"),
        ({"nccl_version": 2.6}, "wrong type"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_refused_by_name(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    raw = _good()
    raw.update(change)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="broken.json") as info:
        sp.load(path)
    assert message in str(info.value)
    with pytest.raises(ValueError, match="broken.json"):
        sp.load_all(tmp_path)


def test_duplicate_ids_and_bad_json_are_refused(tmp_path: Path) -> None:
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(_good()))
    with pytest.raises(ValueError, match="duplicate ids"):
        sp.load_all(tmp_path)
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ValueError, match="c.json: not JSON"):
        sp.load_all(tmp_path)
