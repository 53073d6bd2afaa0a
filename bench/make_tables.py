"""Turn benchmark JSON into Markdown tables.

Usage: python bench/make_tables.py FILE.json [FILE.json ...] [--out FILE.md] [--full]

Reads the JSON of ``bench/collectives_table.py`` (the all_reduce comparison with MPICH,
numpy, copy bandwidth and the barrier), of ``nccltree-bench collectives --json`` and of
``nccltree-bench train --json``, and prints the tables docs/performance.md and
docs/benchmarks.md show. Given several runs of the comparison, it prints the first in
full and the spread of the target ratios over all of them.
"""

from __future__ import annotations

import argparse
import json
import sys

from nccltree.cli._common import human_bytes
from nccltree.cli._common import markdown_table as md_table
from nccltree.cli._output import train_cells


def fmt_us(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def _bound_verdict(run: dict, ok: bool) -> str:
    # a bound on one core's np.copyto rate is one a multi-threaded engine can beat: no
    # "met" against it (runs that measured only that rate)
    if "nt_copy" in run:
        return _verdict(ok)
    return "within, vs np.copyto" if ok else "**over**"


def _copy_rate(n: str, run: dict) -> str:
    if "nt_copy" in run:
        c = run["nt_copy"]
        return f"cpu:{n}: `nt_copy` with {c['threads']} thread(s) {c['bandwidth']:.2f} GB/s"
    return f"cpu:{n}: `np.copyto` {run['copy']['bandwidth']:.2f} GB/s"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


# -- the all_reduce comparison --------------------------------------------------------------


def comparison_tables(d: dict) -> list[str]:
    algs = d["algorithms"]
    m = d["machine"]
    out = [
        f"Measured on {m['cpu']} ({m['cpu_count']} cores), Python {m['python']}, "
        f"numpy {m['numpy']}; {d['dtype']} {d['op']}; load average before/after "
        f"{d['load_average']['before'][0]:.2f}/{d['load_average']['after'][0]:.2f}. "
        "Cells: median time (µs) · busbw (GB/s, nccl-tests' 2(n-1)/n factor).",
        "",
    ]
    for n, run in d["runs"].items():
        recs = run["records"]
        mpi = {r["size"]: r for r in run["mpi"].get("rows", [])}
        numpy_rows = {r["size"]: r for r in run["numpy"]}
        for placement in ("in-place", "out-of-place"):
            cols = list(algs)
            if placement == "in-place":
                cols += ["MPICH", "numpy sum+copy"]
            rows = []
            for size in d["sizes"]:
                row = [human_bytes(size)]
                for a in algs:
                    r = next(
                        (
                            x
                            for x in recs
                            if x["size"] == size
                            and x["algorithm"] == a
                            and x["placement"] == placement
                        ),
                        None,
                    )
                    row.append("" if r is None else f"{fmt_us(r['time_us'])} · {r['busbw']:.2f}")
                if placement == "in-place":
                    for src in (mpi, numpy_rows):
                        r = src.get(size)
                        row.append(
                            "" if r is None else f"{fmt_us(r['time_us'])} · {r['busbw']:.2f}"
                        )
                rows.append(row)
            wrong = sum(x["wrong"] or 0 for x in recs if x["placement"] == placement)
            out += [f"**all_reduce, cpu:{n} ({n} ranks), {placement}** (#wrong: {wrong})", ""]
            out += md_table(["size", *cols], rows)
            out.append("")
        if "error" in run["mpi"]:
            out += [f"MPICH run failed: {run['mpi']['error']}", ""]
    out += targets_tables(d)
    return out


def targets_tables(d: dict) -> list[str]:
    t = d["targets"]
    biggest = human_bytes(d["sizes"][-1])
    rows = []
    for n, run in d["runs"].items():
        for b in run["summary"]["bounds"]:
            rows.append(
                [
                    n,
                    b["algorithm"],
                    b["placement"],
                    f"{b['bytes_over_size']:.0f} S",
                    f"{b['bound_us'] / 1e3:.2f}",
                    f"{b['time_us'] / 1e3:.2f}",
                    f"{b['ratio']:.2f}",
                    f"{b['min_bytes_ratio']:.2f}" if "min_bytes_ratio" in b else "-",
                    _bound_verdict(run, b["ratio"] <= t["bound_ratio_max"]),
                ]
            )
    copies = ", ".join(_copy_rate(n, run) for n, run in d["runs"].items())
    out = [
        f"**{biggest}: time against the byte-count bound** (bytes the plan reads and "
        f"writes ÷ the copy bandwidth measured in the same run, {copies}; the minimum-bytes "
        f"ratio divides by the fewest bytes any algorithm moves; target "
        f"≤ {t['bound_ratio_max']}×)",
        "",
    ]
    out += md_table(
        [
            "ranks",
            "algorithm",
            "placement",
            "bytes moved",
            "bound (ms)",
            "measured (ms)",
            "ratio",
            "vs min bytes",
            "target",
        ],
        rows,
        "lllrrrrrl",
    )
    rows = []
    for n, run in d["runs"].items():
        s = run["summary"].get("mpi")
        if not s:
            continue
        b, bi = s["best"], s["best_in_place"]
        rows.append(
            [
                n,
                f"{b['algorithm']} ({b['placement']})",
                f"{b['busbw']:.2f}",
                f"{bi['algorithm']}: {bi['busbw']:.2f}",
                f"{s['mpi_busbw']:.2f}",
                f"{s['best_ratio']:.2f}",
                _verdict(s["best_ratio"] >= t["mpi_ratio_min"]),
            ]
        )
    out += [
        "",
        f"**{biggest}: best bus bandwidth against MPICH** (`Allreduce(MPI.IN_PLACE)`, "
        f"same rank count; target ≥ {t['mpi_ratio_min']}×)",
        "",
    ]
    out += md_table(
        ["ranks", "best", "busbw (GB/s)", "best in place", "MPICH busbw", "ratio", "target"],
        rows,
        "llrrrrl",
    )
    rows = []
    for n, run in d["runs"].items():
        for s in run["summary"]["small"]:
            rows.append(
                [
                    n,
                    s["algorithm"],
                    s["placement"],
                    fmt_us(s["time_us"]),
                    fmt_us(s["barrier_us"]),
                    f"{s['ratio']:.2f}",
                    _verdict(s["ratio"] <= t["barrier_ratio_max"]),
                ]
            )
    small = human_bytes(d["sizes"][0])
    out += [
        "",
        f"**{small}: latency against a bare `threading.Barrier` round trip** of "
        f"the same thread count (target ≤ {t['barrier_ratio_max']}×)",
        "",
    ]
    out += md_table(
        ["ranks", "algorithm", "placement", "time (µs)", "barrier (µs)", "ratio", "target"],
        rows,
        "lllrrrl",
    )
    return out + [""]


# -- nccltree-bench outputs ---------------------------------------------------------------


def _find(rs: list[dict], size: int, alg: str, placement: str) -> dict | None:
    return next(
        (
            x
            for x in rs
            if x["size"] == size and x["algorithm"] == alg and x["placement"] == placement
        ),
        None,
    )


def _full_cell(r: dict | None) -> str:
    if r is None:
        return ""
    wrong = "N/A" if r["wrong"] is None else r["wrong"]
    return f"{fmt_us(r['time_us'])} · {r['algbw']:.2f} · {r['busbw']:.2f} · {wrong}"


def _busbw(r: dict | None) -> str:
    return "" if r is None else f"{r['busbw']:.2f}"


def _time(r: dict | None) -> str:
    return "" if r is None else fmt_us(r["time_us"])


def collectives_tables(d: dict, full: bool = False) -> list[str]:
    """Per collective: busbw out of place / in place for each algorithm side by side
    (``full``: every column of every record, a row per size x algorithm)."""
    recs = d["records"]
    out = []
    m = d["machine"]
    for coll in dict.fromkeys(r["collective"] for r in recs):
        rs = [r for r in recs if r["collective"] == coll]
        r0 = rs[0]
        algs = list(dict.fromkeys(r["algorithm"] for r in rs))
        sizes = list(dict.fromkeys(r["size"] for r in rs))
        wrong = sum(r["wrong"] or 0 for r in rs)
        title = (
            f"**{coll}, {r0['devices']} ({r0['ranks']} ranks, {m['backend']}), "
            f"{r0['dtype']} {r0['op']}**, median of {r0['iters']} iterations, "
            f"#wrong {wrong}"
        )
        if full:
            out += [title + "; time µs · algbw · busbw (GB/s) · #wrong", ""]
            rows = [
                [
                    human_bytes(s),
                    a,
                    _full_cell(_find(rs, s, a, "out-of-place")),
                    _full_cell(_find(rs, s, a, "in-place")),
                ]
                for s in sizes
                for a in algs
            ]
            out += md_table(["size", "algorithm", "out of place", "in place"], rows, "llrr")
        else:
            out += [
                title + "; busbw (GB/s) out of place / in place, and the in-place time (µs)",
                "",
            ]
            rows = [
                [
                    human_bytes(s),
                    *(
                        f"{_busbw(_find(rs, s, a, 'out-of-place'))} / "
                        f"{_busbw(_find(rs, s, a, 'in-place'))}"
                        for a in algs
                    ),
                    *(_time(_find(rs, s, a, "in-place")) for a in algs),
                ]
                for s in sizes
            ]
            out += md_table(
                ["size", *(f"{a} busbw" for a in algs), *(f"{a} µs" for a in algs)], rows
            )
        out.append("")
    return out


def train_tables(d: dict) -> list[str]:
    rows = [train_cells(p, times="×") for p in d["points"]]
    p0 = d["points"][0]
    c = d.get("config", {})
    blas = c.get("blas_threads") or "cores // ranks"
    data = c.get("data") or (f"synthetic, {c.get('features')} features" if c else "")
    hidden = f" ({c['hidden']} hidden)" if c.get("model") == "mlp" else ""
    out = [
        f"**training, model {p0['model']}{hidden}, algorithm {p0['algorithm']}, "
        f"{data}, BLAS threads per rank: {blas}**"
        + (f", {c['iters']} timed iterations after {c['warmup']}" if c else ""),
        "",
    ]
    out += md_table(
        [
            "devices",
            "ranks",
            "scaling",
            "per-rank batch",
            "effective batch",
            "examples/s",
            "speedup",
            "efficiency",
            "comm",
        ],
        rows,
        "lrlrrrrrr",
    )
    return out + [""]


def tables(d: dict, full: bool = False) -> list[str]:
    tool = d.get("tool", "")
    if tool.endswith("collectives_table.py"):
        return comparison_tables(d)
    if tool == "nccltree-bench collectives":
        return collectives_tables(d, full)
    if tool == "nccltree-bench train":
        return train_tables(d)
    raise ValueError(f"unknown benchmark JSON (tool {tool!r})")


def spread_table(ds: list[dict]) -> list[str]:
    """The three ratios of several comparison runs side by side: min - max per row."""
    t = ds[0]["targets"]
    rows: dict[tuple, list[float]] = {}
    for d in ds:
        for n, run in d["runs"].items():
            s = run["summary"]
            for b in s["bounds"]:
                key = (
                    f"{human_bytes(d['sizes'][-1])} time / bound (≤ {t['bound_ratio_max']})",
                    n,
                    b["algorithm"],
                    b["placement"],
                )
                rows.setdefault(key, []).append(b["ratio"])
            if "mpi" in s:
                key = (
                    f"{human_bytes(d['sizes'][-1])} best busbw / MPICH (≥ {t['mpi_ratio_min']})",
                    n,
                    "best",
                    "",
                )
                rows.setdefault(key, []).append(s["mpi"]["best_ratio"])
            for x in s["small"]:
                key = (
                    f"{human_bytes(d['sizes'][0])} time / barrier (≤ {t['barrier_ratio_max']})",
                    n,
                    x["algorithm"],
                    x["placement"],
                )
                rows.setdefault(key, []).append(x["ratio"])
    body = [
        [k[0], k[1], k[2], k[3], f"{min(v):.2f} – {max(v):.2f}", len(v)] for k, v in rows.items()
    ]
    out = [f"**Spread over {len(ds)} runs** (min – max of each ratio)", ""]
    return (
        out
        + md_table(
            ["ratio (target)", "ranks", "algorithm", "placement", "range", "runs"], body, "llllrr"
        )
        + [""]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="benchmark JSON files")
    p.add_argument("--out", help="write the Markdown here (default: stdout)")
    p.add_argument(
        "--full",
        action="store_true",
        help="nccltree-bench collectives: every column, a row per size x algorithm",
    )
    args = p.parse_args(argv)
    lines: list[str] = []
    comparisons = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("tool", "").endswith("collectives_table.py"):
            comparisons.append(d)
            if len(comparisons) > 1:
                continue  # later runs of the comparison only enter the spread table
        lines += tables(d, args.full)
    if len(comparisons) > 1:
        lines += spread_table(comparisons)
    text = "\n".join(lines).rstrip() + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
