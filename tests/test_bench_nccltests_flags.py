"""``nccltree-bench collectives`` takes nccl-tests' command lines: -g, -t, -i, -d all,
-o all, -a, -N, -z, -T, the "Using devices" header, and refuses what cannot apply."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from nccltree.cli import bench as cli
from nccltree.comm import World, _ops
from nccltree.comm import bench as drv

FAST = ["-n", "1", "-w", "0"]


def run(argv, capsys, **kw):
    code = cli.main(["collectives", *argv], **kw)
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line and not line.startswith("#")]


@pytest.fixture
def no_gpus(monkeypatch):
    """The default kind is virtual CPU devices, whatever the machine has."""
    import nccltree.backends as backends

    monkeypatch.setattr(backends, "gpu_count", lambda: 0)


@pytest.mark.subprocess
def test_pasted_nccl_tests_line_runs_as_a_subprocess():
    # all_reduce_perf -b 8 -e 1K -f 2 -g 2, with nccltree-bench collectives in front
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "nccltree.cli.bench", "collectives"]
    res = subprocess.run(
        [*cmd, "-b", "8", "-e", "1K", "-f", "2", "-g", "2", *FAST],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    sizes = [int(r[0]) for r in rows(res.stdout)]
    assert sizes == [8 << k for k in range(8)]
    assert "# Using devices" in res.stdout
    assert "nGpus 2" in res.stdout


def test_g_takes_the_first_n_default_devices_and_names_them(no_gpus, capsys):
    code, out, _ = run(["-g", "3", "-e", "8", *FAST], capsys)
    assert code == 0
    ranks = re.findall(
        r"^#  Rank +(\d+) Group +(\d+) Pid +(\d+) on (\S+) device +(\d+) \[(\S+)\] (.*)$",
        out,
        re.M,
    )
    assert [(r[0], r[1], r[4], r[5]) for r in ranks] == [
        ("0", "0", "0", "cpu:0"),
        ("1", "0", "1", "cpu:1"),
        ("2", "0", "2", "cpu:2"),
    ]
    assert all(int(r[2]) == os.getpid() and "host backend" in r[6] for r in ranks)
    assert "cpu:3 (3 ranks" in out


def test_g_with_devices_must_agree(no_gpus, capsys):
    code, out, _ = run(["-g", "2", "--devices", "cpu:2", "-e", "8", *FAST], capsys)
    assert code == 0 and "cpu:2 (2 ranks" in out
    code, out, err = run(["-g", "3", "--devices", "cpu:2"], capsys)
    assert code == 2 and out == ""
    assert "-g 3 asks for 3 local rank(s) but --devices cpu:2 names 2" in err
    assert len(err.strip().splitlines()) == 1


def test_g_more_gpus_than_visible_is_refused(monkeypatch, capsys):
    import nccltree.backends as backends

    monkeypatch.setattr(backends, "gpu_count", lambda: 2)
    code, _, err = run(["-g", "4"], capsys)
    assert code == 2 and "asks for 4 GPU(s) but 2 are visible" in err


def test_t_maps_to_t_times_g_ranks_in_groups(no_gpus, capsys):
    code, out, _ = run(["-t", "2", "-g", "2", "-e", "8", *FAST], capsys)
    assert code == 0
    groups = re.findall(r"^#  Rank +(\d+) Group +(\d+)", out, re.M)
    assert groups == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]
    assert "nThread 2 nGpus 2" in out


def test_i_steps_in_bytes_and_excludes_f(capsys):
    code, out, _ = run(["--devices", "cpu:2", "-b", "8", "-e", "40", "-i", "16", *FAST], capsys)
    assert code == 0
    assert [int(r[0]) for r in rows(out)] == [8, 24, 40]
    assert "step: 16(bytes)" in out
    code, _, err = run(["-f", "2", "-i", "8"], capsys)
    assert code == 2 and "not allowed with argument -f/--stepfactor" in err
    code, _, err = run(["--devices", "cpu:2", "-i", "0"], capsys)
    assert code == 2 and "-i/--stepbytes must be >= 1 byte" in err


def test_d_all_and_o_all_run_every_valid_pair(tmp_path, capsys):
    js = tmp_path / "r.json"
    argv = ["--devices", "cpu:2", "-b", "16", "-e", "16", "-d", "all", "-o", "all"]
    code, out, _ = run([*argv, *FAST, "--json", str(js)], capsys)
    assert code == 0
    pairs = {(r["dtype"], r["op"]) for r in json.loads(js.read_text())["records"]}
    floats = {"float16", "float32", "float64", "bfloat16"}
    want = {(str(d), o) for d in _ops.DTYPES for o in _ops.OPS if o != "mean" or str(d) in floats}
    assert pairs == want
    assert all(r[-1] == "0" for r in rows(out))  # every result checked and right


def test_o_avg_is_mean_and_comma_lists(capsys):
    code, out, _ = run(
        ["--devices", "cpu:2", "-e", "8", "-o", "avg,max", "-d", "float,double", *FAST], capsys
    )
    assert code == 0
    assert [(r[2], r[3]) for r in rows(out)] == [
        ("float32", "mean"),
        ("float32", "max"),
        ("float64", "mean"),
        ("float64", "max"),
    ]


def test_non_reducing_collective_runs_once_per_dtype_under_o_all(capsys):
    code, out, _ = run(
        ["--devices", "cpu:2", "-e", "8", "--collective", "all_gather", "-o", "all", *FAST],
        capsys,
    )
    assert code == 0 and len(rows(out)) == 1


def test_a_picks_how_rank_times_aggregate(capsys, tmp_path):
    assert [drv.aggregate_times([3.0, 1.0, 2.0], cli.AVERAGE_MODES[a]) for a in range(4)] == [
        3.0,
        2.0,
        1.0,
        3.0,
    ]
    js = tmp_path / "r.json"
    code, out, _ = run(
        ["--devices", "cpu:2", "-e", "8", "-a", "2", *FAST, "--json", str(js)], capsys
    )
    assert code == 0 and "min over ranks" in out
    assert json.loads(js.read_text())["config"]["average"] == 2
    code, _, err = run(["-a", "4"], capsys)
    assert code == 2 and "invalid choice: 4" in err


def test_N_runs_the_sweep_that_many_times(capsys):
    code, out, _ = run(["--devices", "cpu:2", "-b", "8", "-e", "16", "-N", "3", *FAST], capsys)
    assert code == 0
    assert [int(r[0]) for r in rows(out)] == [8, 16] * 3
    assert "3 cycles" in out
    code, _, err = run(["-N", "0"], capsys)
    assert code == 2 and "-N/--run_cycles" in err


def test_c_z_and_T_are_accepted(capsys):
    for z in ("0", "1"):
        code, out, _ = run(
            ["--devices", "cpu:2", "-e", "8", "-z", z, "-c", "1", "-T", "30", *FAST], capsys
        )
        assert code == 0 and "every call blocking" in out
    code, out, _ = run(["--devices", "cpu:2", "-e", "8", "-c", "0", *FAST], capsys)
    assert code == 0 and rows(out)[0][-1] == "N/A" and "validation: 0" in out
    code, _, err = run(["-z", "2"], capsys)
    assert code == 2
    code, _, err = run(["--devices", "cpu:2", "-T", "0"], capsys)
    assert code == 2 and "-T/--timeout must be > 0" in err


@pytest.mark.parametrize("flags, off", [(f, off) for f, off, _ in cli.REFUSED])
def test_inapplicable_flags_refused_with_a_reason_unless_off(flags, off, capsys):
    made = []

    def counting(devices, algorithm):
        made.append(algorithm)
        return World(devices, algorithm=algorithm)

    code, out, err = run(["--devices", "cpu:2", flags[0], "2"], capsys, world_factory=counting)
    assert code == 2 and out == "" and made == []
    assert err.startswith(f"nccltree-bench collectives: error: {flags[0]}/{flags[1]} 2 cannot")
    assert len(err.strip().splitlines()) == 1
    code, _, _ = run(["--devices", "cpu:2", "-e", "8", flags[1], off, *FAST], capsys)
    assert code == 0


def test_help_documents_the_nccl_tests_flags(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for flag in ("-g", "-t", "-i", "-a", "-N", "-z", "-T", "-G", "-p", "-m", "local ranks"):
        assert flag in out


def test_driver_variants_cycles_and_aggregate():
    variants = [("float32", "sum"), ("int32", "max")]
    with drv.Benchmark(
        "cpu:2", sizes=[8], iters=1, warmup=0, variants=variants, cycles=2, aggregate="mean"
    ) as bench:
        assert bench.total == 2 * 2 * 2
        recs = list(bench)
        assert str(bench.dtype) == "float32" and bench.op == "sum"  # back to the first
    assert [(r.dtype, r.op) for r in recs[::2]] == variants * 2
    assert all(r.wrong == 0 for r in recs)
    with pytest.raises(TypeError, match="needs a floating-point dtype"):
        drv.Benchmark("cpu:2", variants=[("int32", "mean")])
    with pytest.raises(ValueError, match="accepted: rank0, mean, min, max"):
        drv.Benchmark("cpu:2", aggregate="median")
    with pytest.raises(ValueError, match="cycles"):
        drv.Benchmark("cpu:2", cycles=0)
