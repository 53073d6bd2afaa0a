"""The command lines under bad input: flags named in every message, no abbreviations, a
closed stdout, outputs checked before the work, a sweep bounded by the memory it needs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

import nccltree as nt
from nccltree.cli import _common
from nccltree.cli import bench as cli
from nccltree.cli._common import ExitStatus
from nccltree.comm import World
from nccltree.comm import bench as drv
from nccltree.comm.collectives import COLLECTIVES

ROOT = Path(__file__).resolve().parent.parent
BENCH = ["collectives", *"--devices cpu:2 -b 8 -e 64 -f 8 -n 1 -w 0".split()]
TRAIN = ["train", "--devices", "cpu:1", "--iters", "1", "-w", "0", "--records", "64"]
TRAIN += ["--batch-size", "8", "--features", "16", "--hidden", "8"]


def run(argv, capsys, **kw):
    code = cli.main(argv, **kw)
    out, err = capsys.readouterr()
    return code, out, err


class _Counting(World):
    calls = 0

    def _driver(self, collective, *args, **kw):
        type(self).calls += collective == "all_reduce"
        return super()._driver(collective, *args, **kw)


def _counting(devices, algorithm):
    return _Counting(devices, algorithm=algorithm)


# -- abbreviations -----------------------------------------------------------------------


def test_the_parser_factory_refuses_abbreviations_in_every_subcommand():
    p = _common.make_parser("tool", "a tool")
    sub = p.add_subparsers(dest="command")
    c = sub.add_parser("run")
    c.add_argument("--snapshot-every", type=int)
    assert p.parse_args(["run", "--snapshot-every", "5"]).snapshot_every == 5
    for argv in (["run", "--snapshot", "5"], ["run", "--snapshot=5"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    assert _common.EXIT_STATUS_EPILOG in p.format_help().replace("\n", " ") or (
        " ".join(_common.EXIT_STATUS_EPILOG.split()) in " ".join(p.format_help().split())
    )


@pytest.mark.parametrize(
    "argv",
    [
        [*BENCH, "--maxb", "64"],  # -e/--maxbytes
        [*BENCH, "--qui"],  # --quiet
        ["topo", "--pre", "dgx1"],  # --preset
        [*TRAIN, "--batch", "8"],  # --batch-size
    ],
)
def test_bench_takes_no_abbreviated_flag(argv, capsys):
    code, out, err = run(argv, capsys)
    assert code == ExitStatus.USAGE and out == ""
    assert "unrecognized arguments" in err


@pytest.mark.parametrize(
    "tool, argv",
    [
        ("train", ["--snapshot", "500"]),  # to a Caffe user -snapshot FILE means resume
        ("train", ["--batch", "8"]),
        ("data", ["info", "--verif", "db"]),
        ("data", ["make", "synthetic", "out", "--class", "10"]),  # --classes
    ],
)
def test_train_and_data_take_no_abbreviated_flag(tool, argv, capsys):
    import importlib

    main = importlib.import_module(f"nccltree.cli.{tool}").main
    assert main(argv) == ExitStatus.USAGE
    assert "unrecognized arguments" in capsys.readouterr().err


# -- messages name the flag --------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["-n", "-1"], "-n/--iters"),
        (["-n", "0"], "-n/--iters"),
        (["-w", "-3"], "-w/--warmup-iters"),
        (["-c", "-1"], "-c/--check"),
        (["-r", "5"], "-r/--root"),
    ],
)
def test_collectives_messages_name_the_flag(argv, flag, capsys):
    code, out, err = run([*BENCH, *argv], capsys, world_factory=_counting)
    assert code == ExitStatus.USAGE and out == ""
    assert flag in err, err


def test_os_errors_are_reported_without_errno(capsys):
    _common.report_error("tool", NotADirectoryError(20, "Not a directory", "/etc/passwd/x"))
    err = capsys.readouterr().err
    assert err == "tool: error: /etc/passwd/x: not a directory\n"


# -- bench train: one line, before training -------------------------------------------------


def test_train_hidden_zero_is_a_usage_error_naming_the_flag(capsys):
    code, out, err = run([*TRAIN, "--hidden", "0"], capsys)
    assert code == ExitStatus.USAGE and out == ""
    assert "--hidden" in err and "Traceback" not in err


def test_train_cnn_on_flat_records_is_refused_before_training(tmp_path, capsys):
    db = str(tmp_path / "flat")
    x, y = nt.data.synthetic(64, shape=(16,), classes=4)
    nt.data.write_lmdb(db, x, y)
    code, out, err = run([*TRAIN, "--model", "cnn", "--data", db], capsys)
    assert code == ExitStatus.USAGE and out == ""
    assert "--model cnn" in err and "(16,)" in err


def test_train_cnn_on_the_synthetic_task_trains(capsys):
    code, out, err = run([*TRAIN, "--model", "cnn", "--quiet", "--json", os.devnull], capsys)
    assert code == ExitStatus.OK, err


# -- outputs checked first; --quiet alone refused --------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--csv"])
def test_unwritable_outputs_are_refused_before_the_sweep(flag, tmp_path, capsys):
    _Counting.calls = 0
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for target, words in (
        (tmp_path, "is a directory"),
        (a_file / "r.out", "not a directory"),
        (tmp_path / "missing" / "r.out", "does not exist"),
    ):
        code, out, err = run([*BENCH, flag, str(target)], capsys, world_factory=_counting)
        assert code == ExitStatus.USAGE and out == "", err
        assert f"{flag} {target}" in err and words in err, err
        assert "Errno" not in err
    assert _Counting.calls == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused_before_the_sweep(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, out, err = run([*BENCH, "--json", str(ro / "r.json")], capsys)
    finally:
        ro.chmod(0o700)
    assert code == ExitStatus.USAGE and "cannot be written" in err


def test_topo_dot_target_checked_before_printing(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, out, err = run(["topo", "--preset", "dgx1", "--dot", str(a_file / "t.dot")], capsys)
    assert code == ExitStatus.USAGE and out == ""
    assert "--dot" in err and "not a directory" in err and "Errno" not in err


def test_quiet_without_an_output_file_is_refused(capsys):
    code, out, err = run([*BENCH, "--quiet"], capsys, world_factory=_counting)
    assert code == ExitStatus.USAGE and out == ""
    assert "--quiet" in err and "--json" in err


def test_outputs_are_replaced_whole(tmp_path, capsys):
    js = tmp_path / "r.json"
    js.write_text("previous")
    code, _, err = run([*BENCH, "--quiet", "--json", str(js)], capsys)
    assert code == ExitStatus.OK, err
    assert js.read_text().startswith("{")
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # no temporary file left


# -- a closed stdout ----------------------------------------------------------------------


def test_run_main_exits_quietly_on_a_closed_pipe(capsys):
    def body(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    code = _common.run_main(_common.make_parser("tool", "t"), [], body)
    assert code == ExitStatus.BROKEN_PIPE == 128 + 13
    assert capsys.readouterr().err == ""


@pytest.mark.subprocess
def test_a_closed_stdout_ends_the_command_like_a_unix_tool():
    argv = [sys.executable, "-m", "nccltree.cli.bench", "topo", "--preset", "dgx1"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # `| head -0`: the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == ExitStatus.BROKEN_PIPE
    assert err == ""


# -- ./dev --------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_dev_help_prints_the_usage_only():
    res = subprocess.run(
        [str(ROOT / "dev"), "--help"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "./dev test" in res.stdout
    assert "set -euo" not in res.stdout and "#" not in res.stdout


# -- memory ------------------------------------------------------------------------------


def _plans_bound(bench: drv.Benchmark, coll: str, size: int) -> None:
    """The estimate's scratch and staging cover what the plans allocate."""
    need = bench.memory_needed(size)
    c = COLLECTIVES[coll]
    count = c.count_for(size // bench.dtype.itemsize, bench.n)
    for alg, world in bench.worlds.items():
        for in_place in (False, True):
            plan = world.plan(coll, count, in_place=in_place, dtype=bench.dtype)
            got = max(plan.scratch.values(), default=0) + max(plan.stage.values(), default=0)
            assert got * bench.dtype.itemsize <= need.scratch_per_rank[alg], (alg, coll, in_place)


@pytest.mark.parametrize("preset", [None, "k80x4", "dgx1"])
@pytest.mark.parametrize("coll", list(COLLECTIVES))
@pytest.mark.slow
def test_the_estimate_covers_every_plans_scratch_and_staging(preset, coll):
    topo = nt.Topology.preset(preset) if preset else None
    devs = nt.devices(f"cpu:{topo.n if topo else 3}")
    try:

        def factory(devices, algorithm):
            return World(devices, algorithm=algorithm, topology=topo)

        with drv.Benchmark(
            devs, ["tree", "ring", "direct"], [coll], world_factory=factory
        ) as bench:
            for size in (64, 4096 + 256, 1 << 20, 96 << 20):
                _plans_bound(bench, coll, size)
    finally:
        devs[0].runtime.shutdown()


@pytest.mark.parametrize("coll", list(COLLECTIVES))
@pytest.mark.slow
def test_the_estimate_covers_what_a_sweep_allocates(coll):
    size = 4 << 20
    with drv.Benchmark(
        "cpu:3", ["tree", "ring"], [coll], [size // 4, size], iters=1, warmup=0
    ) as b:
        need = b.memory_needed(size).host_bytes
        tracemalloc.start()
        try:
            assert sum(r.wrong or 0 for r in b) == 0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak <= need, (peak, need)
    assert need <= 4 * peak, (peak, need)  # a bound, not a wild guess


def test_sizes_that_do_not_fit_are_dropped():
    with drv.Benchmark("cpu:2", sizes=[1 << 10, 1 << 20, 1 << 30, 1 << 40]) as b:
        budget = b.memory_needed(1 << 20).host_bytes
        dropped = b.fit_memory(host_available=int(budget / drv.MEMORY_HEADROOM) + 1)
        assert dropped == [1 << 30, 1 << 40] and b.sizes == [1 << 10, 1 << 20]
        assert b.fit_memory(host_available=1) == [1 << 10, 1 << 20] and b.sizes == []


def test_available_memory_is_the_kernels_figure():
    avail = drv.available_memory()
    assert avail is None or 0 < avail <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_huge_maxbytes_is_lowered_to_what_fits(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(drv, "available_memory", lambda: 64 << 20)
    js = tmp_path / "r.json"
    argv = [*BENCH[:3], "-b", "1K", "-e", "1T", "-f", "64", "-n", "1", "-w", "0"]
    code, out, err = run([*argv, "--json", str(js)], capsys)
    assert code == ExitStatus.OK, err
    assert "-e/--maxbytes 1 TiB needs about" in err and "the sweep stops at" in err
    sizes = [r["size"] for r in __import__("json").loads(js.read_text())["records"]]
    assert sizes and max(sizes) <= 16 << 20
    assert "lowered from 1 TiB" in out


def test_a_sweep_whose_smallest_size_does_not_fit_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(drv, "available_memory", lambda: 1 << 20)
    _Counting.calls = 0
    code, out, err = run(
        [*BENCH[:3], "-b", "1G", "-e", "1T", "-n", "1", "-w", "0"], capsys, world_factory=_counting
    )
    assert code == ExitStatus.USAGE and out == ""
    assert "-b/--minbytes 1 GiB needs about" in err and "available" in err
    assert _Counting.calls == 0


def test_the_estimate_counts_every_rank():
    small, big = (drv.Benchmark(f"cpu:{n}", sizes=[1 << 20]) for n in (2, 8))
    with small, big:
        assert big.memory_needed(1 << 20).host_bytes > 2 * small.memory_needed(1 << 20).host_bytes


def test_host_devices_need_host_memory_only():
    with drv.Benchmark("cpu:4", sizes=[1 << 20]) as b:
        assert b.memory_needed(1 << 20).device_bytes == {}


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 2, "peer": True}], indirect=True)
def test_device_memory_is_bounded_per_gpu(fake_cupy):
    # ranks sharing one GPU share its memory: the bound is per physical device
    with drv.Benchmark("gpu:0,0,1", sizes=[1 << 20], algorithms=["ring"]) as b:
        need = b.memory_needed(1 << 20)
        one = need.buffers_per_rank + need.scratch_per_rank["ring"]
        assert need.device_bytes == {0: 2 * one, 1: one}
        assert b.fit_memory(host_available=1 << 40, device_available={0: 1 << 40, 1: 1}) == [
            1 << 20
        ]
    with drv.Benchmark("gpu:0,1", sizes=[1 << 20]) as b:
        assert b.fit_memory() == []  # the fake's GPUs have 64 GiB free
