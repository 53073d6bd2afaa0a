"""What the CLI writes besides its progress: the collectives table (nccl-tests' columns),
the training and bucket tables, JSON and CSV files, and the plots (matplotlib,
optional). Shared by
``nccltree-bench``'s commands (cli/bench.py) and ``simulate``/``calibrate``
(cli/_simulate.py)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..comm.collectives import COLLECTIVES
from ._common import UsageError, human_bytes, output_path, write_output

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ..comm.bench import BenchRecord

PLOT_MISSING = (
    "--plot needs matplotlib, which is not installed; install it with "
    "`pip install matplotlib` (or the `plot` extra: `pip install nccltree[plot]`)"
)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(PLOT_MISSING) from None


def _fmt_time(us: float) -> str:
    return f"{us:.2f}" if us < 100 else f"{us:.1f}" if us < 10000 else f"{us:.0f}"


_COLS = ("{:>12} {:>12} {:>8} {:>6} {:>5} {:>10}", " {:>10} {:>7} {:>7} {:>7}")


def table_header(collective: str) -> list[str]:
    left = _COLS[0].format("size", "count", "type", "redop", "root", "algorithm")
    units = _COLS[0].format("(B)", "(elements)", "", "", "", "")
    half = len(_COLS[1].format("", "", "", ""))
    groups = " " * len(left) + "out-of-place".center(half) + "in-place".center(half)
    cols = left + 2 * _COLS[1].format("time", "algbw", "busbw", "#wrong")
    units += 2 * _COLS[1].format("(us)", "(GB/s)", "(GB/s)", "")
    return [f"# {collective}", *("#" + s[1:].rstrip() for s in (groups, cols, units))]


def table_row(recs: Sequence[BenchRecord]) -> str:
    """One line: the columns of a size x algorithm, then each placement's figures."""
    r0 = recs[0]
    line = _COLS[0].format(r0.size, r0.count, r0.dtype, r0.op, r0.root, r0.algorithm)
    for r in recs:
        wrong = "N/A" if r.wrong is None else str(r.wrong)
        line += _COLS[1].format(_fmt_time(r.time_us), f"{r.algbw:.2f}", f"{r.busbw:.2f}", wrong)
    if (
        len(recs) == 1
        and r0.placement == "out-of-place"
        and not COLLECTIVES[r0.collective].in_place_ok
    ):
        line += _COLS[1].format("n/a", "", "", "")  # no in-place form (all_to_all)
    return line


def table_footer(records: Sequence[BenchRecord]) -> list[str]:
    wrong = sum(r.wrong or 0 for r in records)
    algs = list(dict.fromkeys(r.algorithm for r in records))
    avg = []
    for a in algs:
        vals = [r.busbw for r in records if r.algorithm == a]
        avg.append(f"{sum(vals) / len(vals):.3f} ({a})")
    return [
        f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
        f"# Avg bus bandwidth    : {'  '.join(avg)}  GB/s",
        "#",
    ]


def write_json(path: str, payload: dict) -> None:
    with write_output(path) as f:
        json.dump(payload, f, indent=1)
        f.write("\n")


def write_csv(path: str, records: Sequence[BenchRecord]) -> None:
    """One row per record; the machine description becomes backend and cpu columns."""
    rows = []
    for r in records:
        d = r.as_dict()
        m = d.pop("machine")
        d["backend"], d["cpu"] = m.get("backend"), m.get("cpu")
        rows.append(d)
    with write_output(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["collective"])
        w.writeheader()
        w.writerows(rows)


def plot_collectives(path: str, records: Sequence[BenchRecord]) -> None:
    """busbw against size, one line per algorithm (solid out of place, dashed in place),
    one panel per collective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    colls = list(dict.fromkeys(r.collective for r in records))
    cols = min(2, len(colls))
    rows = -(-len(colls) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(colls) :]:
        ax.set_visible(False)
    for ax, coll in zip(axes.flat, colls):
        recs = [r for r in records if r.collective == coll and r.size > 0]
        for i, alg in enumerate(dict.fromkeys(r.algorithm for r in recs)):
            for placement, style in (("out-of-place", "-"), ("in-place", "--")):
                pts = [
                    (r.size, r.busbw)
                    for r in recs
                    if r.algorithm == alg and r.placement == placement
                ]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(
                        xs, ys, style, marker="o", ms=3, color=f"C{i}", label=f"{alg} ({placement})"
                    )
        ax.set_xscale("log", base=2)
        # tick labels people read at a glance: 64 B, 1 KiB, 1 MiB, 64 MiB
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(int(round(v)))))
        ax.set_xlabel("size")
        ax.set_ylabel("bus bandwidth (GB/s)")
        r0 = recs[0] if recs else records[0]
        ax.set_title(f"{coll}, {r0.devices} ({r0.ranks} ranks), {r0.dtype}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with output_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


# -- training ------------------------------------------------------------------------------


def bucket_cells(p: dict) -> list[object]:
    """A bucket sweep's row (the console table and the Markdown tables share it)."""
    overlap = p.get("overlap")
    return [
        p["devices"],
        p["ranks"],
        f"{p['bucket_mb']:g}",
        f"{p['examples_per_s']:,.0f}",
        f"{p['step_ms']:.2f}",
        f"{100 * p['comm_fraction']:.0f}%",
        f"{p['exposed_ms']:.2f}",
        "-" if overlap is None else f"{100 * overlap:.0f}%",
    ]


BUCKET_HEADER = (
    "devices",
    "ranks",
    "bucket MiB",
    "examples/s",
    "step ms",
    "comm",
    "exposed ms",
    "overlap",
)


def bucket_table(points: Sequence[dict]) -> list[str]:
    fmt = "{:<16} {:>5} {:>10} {:>12} {:>8} {:>6} {:>10} {:>8}"
    return [fmt.format(*BUCKET_HEADER)] + [fmt.format(*bucket_cells(p)) for p in points]


def plot_buckets(path: str, points: Sequence[dict]) -> None:
    """Step time and exposed communication against the bucket size, one line per device
    set and scaling mode (0, no buckets, first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = sorted({p["bucket_mb"] for p in points})
    where = {mb: i for i, mb in enumerate(sizes)}
    lines = dict.fromkeys((p["devices"], p["scaling"]) for p in points)
    for i, (devices, scaling) in enumerate(lines):
        pts = sorted(
            (p for p in points if (p["devices"], p["scaling"]) == (devices, scaling)),
            key=lambda p: p["bucket_mb"],
        )
        xs = [where[p["bucket_mb"]] for p in pts]
        label = f"{devices} ({scaling})"
        a1.plot(xs, [p["step_ms"] for p in pts], "-o", color=f"C{i}", label=label)
        a2.plot(xs, [p["exposed_ms"] for p in pts], "-o", color=f"C{i}", label=label)
    a1.set_ylabel("step time (ms)")
    a2.set_ylabel("exposed communication per step (ms)")
    for ax in (a1, a2):
        ax.set_xticks(range(len(sizes)), [f"{mb:g}" for mb in sizes])
        ax.set_ylim(bottom=0)
    _finish_pair(
        fig, (a1, a2), "gradient bucket size (MiB; 0: one all-reduce after backward)", path
    )


def train_cells(p: dict, times: str = "x") -> list[object]:
    """A training point's row (the console table and the Markdown tables share it)."""
    return [
        p["devices"],
        p["ranks"],
        p["scaling"],
        p["per_rank_batch"],
        p["effective_batch"],
        f"{p['examples_per_s']:,.0f}",
        f"{p['speedup']:.2f}{times}",
        f"{100 * p['efficiency']:.0f}%",
        f"{100 * p['comm_fraction']:.0f}%",
    ]


def train_table(points: Sequence[dict]) -> list[str]:
    fmt = "{:<16} {:>5} {:>7} {:>9} {:>9} {:>12} {:>8} {:>10} {:>6}"
    lines = [
        fmt.format(
            "devices",
            "ranks",
            "scaling",
            "per-rank",
            "effective",
            "examples/s",
            "speedup",
            "efficiency",
            "comm",
        ),
        fmt.format("", "", "", "batch", "batch", "", "", "", ""),
    ]
    lines += [fmt.format(*train_cells(p)) for p in points]
    return lines


def plot_train(path: str, points: Sequence[dict]) -> None:
    """Examples/s and efficiency against device count, one line per scaling mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, mode in enumerate(dict.fromkeys(p["scaling"] for p in points)):
        pts = [p for p in points if p["scaling"] == mode]
        xs = [p["ranks"] for p in pts]
        a1.plot(xs, [p["examples_per_s"] for p in pts], "-o", color=f"C{i}", label=mode)
        a2.plot(xs, [100 * p["efficiency"] for p in pts], "-o", color=f"C{i}", label=mode)
    a1.set_ylabel("examples/s")
    a2.set_ylabel("scaling efficiency (%)")
    _finish_pair(fig, (a1, a2), "devices", path)


def _finish_pair(fig: Figure, axes: Sequence[Axes], xlabel: str, path: str) -> None:
    """The training plots' common end: labels, grid and legend on both panels, saved."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with output_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
