"""Turn benchmark JSON into Markdown tables.

Usage: python bench/make_tables.py FILE.json [FILE.json ...] [--out FILE.md]

Reads the JSON of ``bench/collectives_table.py`` (the all_reduce comparison with MPICH,
numpy, copy bandwidth and the barrier), of ``nccltree-bench collectives --json`` and of
``nccltree-bench train --json``, and prints the tables docs/performance.md and
docs/benchmarks.md show.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence


def human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def fmt_us(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]],
             align: str | None = None) -> list[str]:
    """Markdown table; ``align`` has an ``l`` or ``r`` per column (default: first left)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


# -- the issue-3 comparison ---------------------------------------------------------------


def comparison_tables(d: dict) -> list[str]:
    algs = d["algorithms"]
    m = d["machine"]
    out = [f"Measured on {m['cpu']} ({m['cpu_count']} cores), Python {m['python']}, "
           f"numpy {m['numpy']}; {d['dtype']} {d['op']}; load average before/after "
           f"{d['load_average']['before'][0]:.2f}/{d['load_average']['after'][0]:.2f}. "
           "Cells: median time (µs) · busbw (GB/s, nccl-tests' 2(n-1)/n factor).", ""]
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
                    r = next((x for x in recs if x["size"] == size and x["algorithm"] == a
                              and x["placement"] == placement), None)
                    row.append("" if r is None else f"{fmt_us(r['time_us'])} · {r['busbw']:.2f}")
                if placement == "in-place":
                    for src in (mpi, numpy_rows):
                        r = src.get(size)
                        row.append("" if r is None else f"{fmt_us(r['time_us'])} · {r['busbw']:.2f}")
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
            rows.append([n, b["algorithm"], b["placement"], f"{b['bytes_over_size']:.0f} S",
                         f"{b['bound_us'] / 1e3:.2f}", f"{b['time_us'] / 1e3:.2f}",
                         f"{b['ratio']:.2f}", _verdict(b["ratio"] <= t["bound_ratio_max"])])
    copies = ", ".join(f"cpu:{n}: {run['copy']['bandwidth']:.2f} GB/s"
                       for n, run in d["runs"].items())
    out = [f"**{biggest}: time against the byte-count bound** (bytes the plan reads and "
           f"writes ÷ `np.copyto` bandwidth measured in the same run, {copies}; target "
           f"≤ {t['bound_ratio_max']}×)", ""]
    out += md_table(["ranks", "algorithm", "placement", "bytes moved", "bound (ms)",
                     "measured (ms)", "ratio", "target"], rows, "lllrrrrl")
    rows = []
    for n, run in d["runs"].items():
        s = run["summary"].get("mpi")
        if not s:
            continue
        b, bi = s["best"], s["best_in_place"]
        rows.append([n, f"{b['algorithm']} ({b['placement']})", f"{b['busbw']:.2f}",
                     f"{bi['algorithm']}: {bi['busbw']:.2f}", f"{s['mpi_busbw']:.2f}",
                     f"{s['best_ratio']:.2f}", _verdict(s["best_ratio"] >= t["mpi_ratio_min"])])
    out += ["", f"**{biggest}: best bus bandwidth against MPICH** (`Allreduce(MPI.IN_PLACE)`, "
            f"same rank count; target ≥ {t['mpi_ratio_min']}×)", ""]
    out += md_table(["ranks", "best", "busbw (GB/s)", "best in place", "MPICH busbw",
                     "ratio", "target"], rows, "llrrrrl")
    rows = []
    for n, run in d["runs"].items():
        for s in run["summary"]["small"]:
            rows.append([n, s["algorithm"], s["placement"], fmt_us(s["time_us"]),
                         fmt_us(s["barrier_us"]), f"{s['ratio']:.2f}",
                         _verdict(s["ratio"] <= t["barrier_ratio_max"])])
    small = human_bytes(d["sizes"][0])
    out += ["", f"**{small}: latency against a bare `threading.Barrier` round trip** of "
            f"the same thread count (target ≤ {t['barrier_ratio_max']}×)", ""]
    out += md_table(["ranks", "algorithm", "placement", "time (µs)", "barrier (µs)",
                     "ratio", "target"], rows, "lllrrrl")
    return out + [""]


# -- nccltree-bench outputs ---------------------------------------------------------------


def collectives_tables(d: dict) -> list[str]:
    recs = d["records"]
    out = []
    m = d["machine"]
    for coll in dict.fromkeys(r["collective"] for r in recs):
        rs = [r for r in recs if r["collective"] == coll]
        r0 = rs[0]
        out += [f"**{coll}, {r0['devices']} ({r0['ranks']} ranks, {m['backend']}), "
                f"{r0['dtype']} {r0['op']}** — median of {r0['iters']} iterations; "
                "time µs · algbw · busbw (GB/s) · #wrong", ""]
        rows = []
        keys = list(dict.fromkeys((r["size"], r["algorithm"]) for r in rs))
        for size, alg in keys:
            row = [human_bytes(size), alg]
            for placement in ("out-of-place", "in-place"):
                r = next((x for x in rs if x["size"] == size and x["algorithm"] == alg
                          and x["placement"] == placement), None)
                row.append("" if r is None else
                           f"{fmt_us(r['time_us'])} · {r['algbw']:.2f} · {r['busbw']:.2f} · "
                           f"{'N/A' if r['wrong'] is None else r['wrong']}")
            rows.append(row)
        out += md_table(["size", "algorithm", "out of place", "in place"], rows, "llrr")
        out.append("")
    return out


def train_tables(d: dict) -> list[str]:
    rows = [[p["devices"], p["ranks"], p["scaling"], p["per_rank_batch"], p["effective_batch"],
             f"{p['examples_per_s']:,.0f}", f"{p['speedup']:.2f}×",
             f"{100 * p['efficiency']:.0f}%", f"{100 * p['comm_fraction']:.0f}%"]
            for p in d["points"]]
    p0 = d["points"][0]
    out = [f"**training, model {p0['model']}, algorithm {p0['algorithm']}**", ""]
    out += md_table(["devices", "ranks", "scaling", "per-rank batch", "effective batch",
                     "examples/s", "speedup", "efficiency", "comm"], rows, "lrlrrrrrr")
    return out + [""]


def tables(d: dict) -> list[str]:
    tool = d.get("tool", "")
    if tool.endswith("collectives_table.py"):
        return comparison_tables(d)
    if tool == "nccltree-bench collectives":
        return collectives_tables(d)
    if tool == "nccltree-bench train":
        return train_tables(d)
    raise ValueError(f"unknown benchmark JSON (tool {tool!r})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="benchmark JSON files")
    p.add_argument("--out", help="write the Markdown here (default: stdout)")
    args = p.parse_args(argv)
    lines: list[str] = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            lines += tables(json.load(f))
    text = "\n".join(lines).rstrip() + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
