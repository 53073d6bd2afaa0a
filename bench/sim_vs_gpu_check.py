"""The simulator against the one-call GPU check: every out-of-place all_reduce the check's
sweep measured, predicted by ``nccltree.sim`` on the machine the check ran on.

    python bench/sim_vs_gpu_check.py OUT_DIR [--markdown FILE]

OUT_DIR is the check's results folder (``gpu_check.json`` and the sweep's JSON files).
The machine: the GPU's data-sheet device model (matched by name), logical ranks of one
GPU sharing its memory (``gpu:0,0,0,0``) or, for distinct GPUs, the topology the check
detected; the host's cost per plan step is the check's own issue-cost measurement (the
median per step over its records; 13 us where it has none). tree, ring and direct are
simulated plans; nccl is NCCL's cost model (a model of NCCL, not NCCL). Nothing is
fitted. ``bench/gpu_check.py`` runs this at its end and writes ``sim_vs_measured.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# the checkout first, as for the check's other children run from it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_ISSUE_US = 13.0


def _issue_us(check: dict[str, Any]) -> tuple[float, str]:
    runs = check.get("stages", {}).get("issue_cost", {}).get("runs", [])
    per = [r["per_step_us"] for run in runs for r in run.get("records", [])
           if r.get("per_step_us") and not r.get("error")]  # fmt: skip
    if not per:
        return DEFAULT_ISSUE_US, f"{DEFAULT_ISSUE_US:g} us per step (the check measured none)"
    return statistics.median(per), f"{statistics.median(per):.1f} us per step (the check's median)"


def _machine(devices: str, gpu: str, issue_s: float, check: dict[str, Any]) -> Any:
    """The simulated machine of a device set, or None where its topology is unknown."""
    from nccltree import sim
    from nccltree.comm import auto
    from nccltree.topology import Link, LinkKind, Topology

    key, _ = auto.device_model_for(gpu)
    ids = devices.split(":", 1)[1].split(",") if ":" in devices else []
    if not ids:
        return None
    if len(set(ids)) == 1:  # logical ranks of one GPU (or one rank)
        topo = Topology.uniform(len(ids), Link(LinkKind.SAME_DEVICE))
    else:
        matrix = check.get("stages", {}).get("topology", {}).get("matrix", [])
        try:
            topo = Topology.from_smi("\n".join(matrix))
        except ValueError:
            return None
        if topo.n != len(ids):
            return None
    return sim.Machine(topo, sim.DEVICES[key], issue_s=issue_s)


def compare(out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(one row per measured point, a summary) for the check's results in ``out_dir``."""
    from nccltree import sim

    check = json.loads((out_dir / "gpu_check.json").read_text())
    issue_us, issue_note = _issue_us(check)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for run in check.get("stages", {}).get("sweep", {}).get("runs", []):
        if not run.get("json") or not (out_dir / run["json"]).exists():
            continue
        for r in json.loads((out_dir / run["json"]).read_text())["records"]:
            if r.get("collective") != "all_reduce" or r.get("placement") != "out-of-place":
                continue
            if not r.get("time_us") or r.get("error"):
                continue
            machine_desc = r.get("machine") or {}
            if machine_desc.get("backend") != "cuda":
                skipped.append(f"{r['devices']}: {machine_desc.get('backend')} backend")
                continue
            gpu = (machine_desc.get("gpus") or ["?"])[0]
            m = _machine(r["devices"], gpu, issue_us * 1e-6, check)
            if m is None:
                skipped.append(f"{r['devices']}: topology unknown")
                continue
            size = r["size"]
            alg = "nccl-model" if r["algorithm"] == "nccl" else r["algorithm"]
            if alg not in ("tree", "ring", "direct", "nccl-model"):
                continue
            pred, _, _ = sim.predict(m, alg, "all_reduce", size)
            rows.append({"devices": r["devices"], "gpu": gpu, "algorithm": r["algorithm"],
                         "size": size, "measured_us": r["time_us"],
                         "predicted_us": pred * 1e6,
                         "ratio": pred * 1e6 / r["time_us"]})  # fmt: skip
    ratios = [row["ratio"] for row in rows]
    summary: dict[str, Any] = {"points": len(rows), "issue": issue_note,
                               "skipped": sorted(set(skipped))}  # fmt: skip
    if ratios:
        summary.update(
            median_error=statistics.median(abs(x - 1) for x in ratios),
            within_25=sum(0.75 <= x <= 1.25 for x in ratios),
            within_2x=sum(0.5 <= x <= 2.0 for x in ratios),
        )
    return rows, summary


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        f"The simulator against the GPU check: {summary['points']} all_reduce points, "
        f"issue cost {summary['issue']}; nccl rows are NCCL's cost model, not NCCL.",
        "",
        "| devices | GPU | algorithm | size | measured us | predicted us | ratio |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['devices']} | {r['gpu']} | {r['algorithm']} | {r['size']} | "
                     f"{r['measured_us']:.1f} | {r['predicted_us']:.1f} | {r['ratio']:.2f} |")  # fmt: skip
    if summary["points"]:
        lines += ["", f"median |predicted / measured - 1| = {summary['median_error']:.2f}; "
                  f"{summary['within_25']} of {summary['points']} within 25%, "
                  f"{summary['within_2x']} within 2x"]  # fmt: skip
    if summary["skipped"]:
        lines += ["", "not predicted: " + "; ".join(summary["skipped"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="the GPU check's results folder")
    p.add_argument("--markdown", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    if not (args.out_dir / "gpu_check.json").is_file():
        p.error(f"{args.out_dir}: no gpu_check.json there")
    rows, summary = compare(args.out_dir)
    text = markdown(rows, summary)
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
