"""``nccltree-bench``: the command line over the benchmark driver, train and topo."""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from nccltree.cli import bench as cli
from nccltree.comm import World
from nccltree.comm import bench as drv

SMI_DIR = Path(__file__).resolve().parent / "data" / "smi"
TINY = ["-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1"]


class OffByOne(World):
    """A deliberately broken all_reduce: the sum is one too large on the last rank."""

    def _driver(self, collective, *args, **kw):
        res = super()._driver(collective, *args, **kw)
        if collective == "all_reduce":
            res[-1][...] += 1
        return res


def run(argv, capsys, **kw):
    code = cli.main(argv, **kw)
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line and not line.startswith("#")]


# -- collectives --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.slow
def test_collectives_table_json_and_csv(n, tmp_path, capsys):
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    code, out, err = run(
        [
            "collectives",
            "--devices",
            f"cpu:{n}",
            "--algorithm",
            "tree,ring,direct",
            "--collective",
            "allreduce,all_gather,broadcast,reduce,reduce_scatter",
            *TINY,
            "--json",
            str(js),
            "--csv",
            str(cs),
        ],
        capsys,
    )
    assert code == 0, err
    assert "# Out of bounds values : 0 OK" in out and "Avg bus bandwidth" in out
    assert "out-of-place" in out and "#wrong" in out
    rows = table_rows(out)
    # 5 collectives x 4 sizes (8, 64, 512, 4096 B) x 3 algorithms
    assert len(rows) == 5 * 4 * 3
    for row in rows:
        size, count, dtype, op, root, alg = row[:6]
        assert dtype == "float32" and alg in ("tree", "ring", "direct")
        assert row[9] == "0" and row[13] == "0"  # #wrong, both placements
    data = json.loads(js.read_text())
    recs = data["records"]
    assert len(recs) == 2 * len(rows) and data["machine"]["backend"] == "host"
    for r in recs:
        factor = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0,
            "reduce": 1.0,
        }[r["collective"]]
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["wrong"] == 0 and r["machine"]["device_names"][0] == "cpu:0"
    with open(cs, newline="") as f:
        rows_csv = list(csv.DictReader(f))
    assert len(rows_csv) == len(recs)
    assert {"size", "algbw", "busbw", "wrong", "placement", "backend"} <= set(rows_csv[0])


def test_table_busbw_column_matches_algbw_times_factor(capsys):
    code, out, _ = run(
        [
            "collectives",
            "--devices",
            "cpu:3",
            "--algorithm",
            "tree",
            "-b",
            "64K",
            "-e",
            "256K",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
        ],
        capsys,
    )
    assert code == 0
    for row in table_rows(out):
        for algbw, busbw in ((row[7], row[8]), (row[11], row[12])):
            assert float(busbw) == pytest.approx(float(algbw) * 4 / 3, abs=0.011)


def test_broken_algorithm_gives_wrong_count_and_exit_code(capsys):
    made = []

    def factory(devices, algorithm):
        made.append(algorithm)
        return OffByOne(devices, algorithm=algorithm)

    code, out, err = run(
        ["collectives", "--devices", "cpu:2", *TINY], capsys, world_factory=factory
    )
    assert made == ["tree"]
    assert code == 3  # wrong results: worse than a crash, and told apart from one
    wrong = [int(row[9]) + int(row[13]) for row in table_rows(out)]
    assert wrong and all(w > 0 for w in wrong)
    assert "FAILED" in out and "wrong element" in err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--collective", "allscatter"], "accepted: all_reduce"),
        (["-b", "1M", "-e", "8"], "larger than"),
        (["-f", "1"], "stepfactor must be > 1"),
        (["-f", "0.5"], "stepfactor must be > 1"),
        (["--devices", "cpu:0"], "accepted forms"),
        (["--devices", "tpu:1"], "accepted forms"),
        (["--algorithm", "tree,bogus"], "accepted: tree, ring"),
        (["-o", "avg,bogus"], "accepted: sum"),
        (["-d", "complex64"], "accepted: float16"),
        (["-r", "5"], r"-r/--root must be in \[0, 2\), got 5"),
        (["-e", "64Q"], "K, M, G"),
        (["--json", "/nonexistent-dir/x.json"], "does not exist"),
    ],
)
def test_bad_flags_error_before_anything_runs(argv, match, capsys):
    made = []

    def counting(devices, algorithm):
        made.append(algorithm)
        return World(devices, algorithm=algorithm)

    # an injected factory takes any algorithm name, so the name check needs the default
    factory = None if "--algorithm" in argv else counting
    code, out, err = run(
        ["collectives", "--devices", "cpu:2", *argv], capsys, world_factory=factory
    )
    assert code == 2
    assert out == ""  # no header, no table: nothing ran
    assert made == []
    assert err.startswith("nccltree-bench collectives: error:")
    assert re.search(match, err), err


def test_argparse_errors_and_help_return_codes(capsys):
    code, _, err = run(["collectives", "-n", "many"], capsys)
    assert code == 2 and "argument -n/--iters: must be an integer >= 1, got 'many'" in err
    code, out, _ = run(["collectives", "--help"], capsys)
    assert code == 0 and "--stepfactor" in out and "busbw" in out
    code, _, err = run([], capsys)
    assert code == 2 and "collectives,train,topo" in err


def test_quiet_prints_nothing_but_writes_json(tmp_path, capsys):
    js = tmp_path / "q.json"
    code, out, err = run(
        ["collectives", "--devices", "cpu:2", *TINY, "--quiet", "--json", str(js)], capsys
    )
    assert code == 0 and out == "" and err == ""
    assert len(json.loads(js.read_text())["records"]) == 8


@pytest.mark.slow
def test_plot_is_drawn(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    code, _, err = run(
        [
            "collectives",
            "--devices",
            "cpu:2",
            "--algorithm",
            "tree,ring",
            *TINY,
            "--quiet",
            "--plot",
            str(png),
        ],
        capsys,
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if missing
    code, out, err = run(
        ["collectives", "--devices", "cpu:2", *TINY, "--plot", str(tmp_path / "x.png")], capsys
    )
    assert code == 2 and out == ""
    assert "needs matplotlib" in err and "pip install" in err
    assert not (tmp_path / "x.png").exists()


def test_progress_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = cli.SweepProgress(3, quiet=False, stream=tty)
    p.step("a")
    p.step("b")
    p.clear()
    assert "\r\x1b[2K[1/3] a" in tty.getvalue() and "[2/3] b" in tty.getvalue()
    plain = io.StringIO()
    p = cli.SweepProgress(2, quiet=False, stream=plain, every_s=0.0)
    p.step("x")
    assert plain.getvalue().startswith("[1/2] x")
    quiet = io.StringIO()
    p = cli.SweepProgress(2, quiet=True, stream=quiet, every_s=0.0)
    p.step("x")
    assert quiet.getvalue() == ""


def test_table_helpers():
    assert cli.human_bytes(8) == "8 B" and cli.human_bytes(64 << 20) == "64 MiB"
    assert cli.human_bytes(3000) == "3000 B"
    header = cli.table_header("all_reduce")
    assert header[0] == "# all_reduce" and "busbw" in header[2] and "(GB/s)" in header[3]
    rec = drv.BenchRecord(
        "all_reduce",
        "tree",
        "out-of-place",
        8,
        2,
        "float32",
        "sum",
        -1,
        2,
        12.5,
        0.0006,
        0.0006,
        None,
        1,
        0,
        1.0,
        "cpu:2",
    )
    assert cli.table_row([rec, rec]).split()[-1] == "N/A"


# -- train --------------------------------------------------------------------------------

TRAIN = [
    "train",
    "--iters",
    "2",
    "-w",
    "1",
    "--records",
    "128",
    "--features",
    "8",
    "--hidden",
    "8",
    "--batch-size",
    "8",
]


def test_train_table_and_json(tmp_path, capsys):
    js = tmp_path / "t.json"
    code, out, err = run(
        [*TRAIN, "--devices", "cpu:1", "cpu:2", "--scaling", "weak", "strong", "--json", str(js)],
        capsys,
    )
    assert code == 0, err
    assert "examples/s" in out and "efficiency" in out
    points = json.loads(js.read_text())["points"]
    assert [(p["devices"], p["scaling"]) for p in points] == [
        ("cpu:1", "weak"),
        ("cpu:1", "strong"),
        ("cpu:2", "weak"),
        ("cpu:2", "strong"),
    ]
    weak2, strong2 = points[2], points[3]
    assert (weak2["per_rank_batch"], weak2["effective_batch"]) == (8, 16)
    assert (strong2["per_rank_batch"], strong2["effective_batch"]) == (4, 8)
    for p in points:
        assert p["examples_per_s"] > 0 and 0 <= p["comm_fraction"] <= 1
        assert p["iters"] == 2
    assert points[0]["speedup"] == 1.0
    assert weak2["efficiency"] == pytest.approx(weak2["speedup"] / 2)


def test_train_json_describes_the_devices_measured(tmp_path, capsys):
    js = tmp_path / "t.json"
    code, _, err = run(
        [*TRAIN, "--devices", "cpu:1", "cpu:3", "--quiet", "--json", str(js)], capsys
    )
    assert code == 0, err
    data = json.loads(js.read_text())
    one, three = (p["machine"] for p in data["points"])
    assert one["device_names"] == ["cpu:0"]
    assert three["device_names"] == ["cpu:0", "cpu:1", "cpu:2"]
    # the top level describes the largest set measured, not a throw-away cpu:1
    assert data["machine"] == three and data["machine"]["backend"] == "host"


def test_train_bad_flags_fail_before_training(capsys):
    code, out, err = run([*TRAIN, "--devices", "cpu:1", "cpu:3", "--scaling", "strong"], capsys)
    assert code == 2 and out == "" and "split evenly" in err
    code, out, err = run([*TRAIN, "--devices", "cpu:1", "--model", "resnet"], capsys)
    assert code == 2 and "accepted: softmax, mlp, cnn" in err
    code, out, err = run([*TRAIN, "--devices", "cpu:x"], capsys)
    assert code == 2 and "accepted forms" in err


@pytest.mark.slow
def test_train_bucket_sweep_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    argv = [*TRAIN, "--devices", "cpu:3", "--bucket-mb", "0", "0.0001", "--repeat", "2",
            "--json", str(js), "--plot", str(png)]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "median of 2 interleaved runs" in out
    assert "bucket MiB" in out and "exposed ms" in out and "overlap" in out
    points = json.loads(js.read_text())["points"]
    assert [p["bucket_mb"] for p in points] == [0.0, 0.0001]
    for p in points:
        assert len(p["examples_per_s_runs"]) == 2
        assert p["examples_per_s"] == statistics.median(p["examples_per_s_runs"])
        assert 0.0 <= p["exposed_ms"] <= p["step_ms"]
    assert points[0]["overlap"] == 0.0
    assert points[1]["overlap"] == pytest.approx(
        1 - points[1]["exposed_ms"] / points[0]["exposed_ms"]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_without_the_unbucketed_point_reports_no_overlap(capsys):
    code, out, err = run([*TRAIN, "--devices", "cpu:2", "--bucket-mb", "0.001", "0.01"], capsys)
    assert code == 0, err
    rows = [ln for ln in out.splitlines() if ln.startswith("cpu:2")]
    assert len(rows) == 2 and all(ln.split()[-1] == "-" for ln in rows)


def test_train_float16_hook(tmp_path, capsys):
    js = tmp_path / "h.json"
    argv = [*TRAIN, "--devices", "cpu:2", "--comm-hook", "float16", "--json", str(js)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "gradients sent as float16" in out
    assert json.loads(js.read_text())["config"]["comm_hook"] == "float16"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--bucket-mb", "-1"], "--bucket-mb takes sizes >= 0 (MiB), got -1"),
        (["--bucket-mb", "nan"], "--bucket-mb takes sizes >= 0 (MiB), got nan"),
        (["--bucket-mb", "1", "1"], "--bucket-mb lists a size twice"),
        (["--repeat", "0"], "--repeat must be >= 1, got 0"),
        (["--comm-hook", "int8"], "invalid choice"),
    ],
)
def test_train_bad_bucket_flags(capsys, flags, message):
    code, out, err = run([*TRAIN, "--devices", "cpu:2", *flags], capsys)
    assert code == 2 and out == "" and message in err


# -- topo ---------------------------------------------------------------------------------


def test_topo_preset_with_dot(tmp_path, capsys):
    dot = tmp_path / "t.dot"
    code, out, _ = run(["topo", "--preset", "dgx1", "--dot", str(dot)], capsys)
    assert code == 0
    assert "GPU7" in out and "NV2" in out and "tree of 8 ranks, root 0" in out
    text = dot.read_text()
    assert text.startswith("digraph topology {") and text.rstrip().endswith("}")
    assert text.count("penwidth=3") == 7  # the tree's 7 edges are drawn bold
    assert text.count(" -> ") == 8 * 7 // 2  # every pair of GPUs once


def test_topo_from_smi_detected_and_root(capsys):
    code, out, _ = run(["topo", "--smi", str(SMI_DIR / "dgx1_v100.txt"), "--root", "3"], capsys)
    assert code == 0 and "root 3" in out and "parsed from" in out
    code, out, _ = run(["topo", "--devices", "cpu:3"], capsys)
    assert code == 0 and "cpu:2" in out and "tree of 3 ranks" in out


def test_topo_bad_flags(capsys):
    code, _, err = run(["topo", "--preset", "dgx9"], capsys)
    assert code == 2 and "dgx1" in err
    code, _, err = run(["topo", "--preset", "dgx1", "--root", "8"], capsys)
    assert code == 2 and "[0, 8)" in err
    code, _, err = run(["topo", "--preset", "dgx1", "--smi", "x"], capsys)
    assert code == 2 and "not allowed with" in err
