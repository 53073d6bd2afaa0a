"""The command lines' one exit-status convention, each status from each command line, and
the shared pieces behind it (progress line, host-runtime guard, tables)."""

from __future__ import annotations

import io
import signal

import pytest

import nccltree as nt
from nccltree._errors import CommError
from nccltree.cli import _common
from nccltree.cli import bench as bench_cli
from nccltree.cli import data as data_cli
from nccltree.cli import train as train_cli
from nccltree.cli._common import EXIT_STATUS_EPILOG, ExitStatus
from nccltree.comm import World
from nccltree.models import Model

TRAIN = ["--devices", "cpu:2", "--synthetic", "256", "--eval-every", "0", "--iters", "3"]
BENCH = [
    "collectives",
    "--devices",
    "cpu:2",
    "-b",
    "8",
    "-e",
    "64",
    "-f",
    "8",
    "-n",
    "1",
    "-w",
    "0",
]


def test_the_statuses():
    assert [int(s) for s in ExitStatus] == [0, 1, 2, 3, 130, 141, 143]
    assert ExitStatus.INTERRUPTED == 128 + signal.SIGINT
    assert ExitStatus.BROKEN_PIPE == 128 + signal.SIGPIPE
    assert ExitStatus.TERMINATED == 128 + signal.SIGTERM
    assert "143 terminated (SIGTERM)" in EXIT_STATUS_EPILOG


@pytest.mark.parametrize(
    "parser",
    [
        train_cli.build_parser(),
        bench_cli.build_parser(),
        data_cli.build_parser(),
        *(
            action.choices[name]
            for action in bench_cli.build_parser()._subparsers._group_actions
            for name in ("collectives", "train", "topo")
        ),
    ],
    ids=lambda p: p.prog,
)
def test_every_help_documents_the_statuses(parser):
    text = " ".join(parser.format_help().split())
    assert " ".join(_common.EXIT_STATUS_EPILOG.split()) in text


# -- nccltree-train --------------------------------------------------------------------------


def test_train_statuses(capsys, monkeypatch, tmp_path):
    assert train_cli.main([*TRAIN, "--quiet"]) == ExitStatus.OK
    capsys.readouterr()
    # usage: a bad flag (argparse's), a value the library refuses, a device this machine
    # lacks -- and nothing ran
    for argv in (
        ["--model", "rnn"],
        ["--batch-size", "3", "--scaling", "strong"],
        ["--devices", "gpu:99"],
    ):
        assert train_cli.main([*TRAIN, *argv]) == ExitStatus.USAGE
        out, err = capsys.readouterr()
        assert out == "" and "nccltree-train: error:" in err
    # wrong results: a missed --target-accuracy
    assert train_cli.main([*TRAIN, "--quiet", "--target-accuracy", "101"]) == ExitStatus.WRONG
    assert "below the target 101%" in capsys.readouterr().out
    # a failure once the run started: a rank raises
    original = Model.loss_and_grad

    def failing(self, params, x, y):
        if params.device.index == 1:
            raise FloatingPointError("injected")
        return original(self, params, x, y)

    monkeypatch.setattr(Model, "loss_and_grad", failing)
    assert train_cli.main([*TRAIN, "--timeout", "20"]) == ExitStatus.FAILURE
    assert "nccltree-train: error: rank 1 of 2 failed" in capsys.readouterr().err


def test_train_interrupted(capsys, monkeypatch):
    # in process: Ctrl-C in the middle of fit (a real SIGINT: test_train_cli's Ctrl-C test)
    from nccltree.parallel import DataParallel

    def interrupted(self, data, iters, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(DataParallel, "fit", interrupted)
    assert train_cli.main(TRAIN) == ExitStatus.INTERRUPTED
    assert "interrupted (SIGINT) at iteration 0; no snapshot was written" in capsys.readouterr().err


# -- nccltree-bench --------------------------------------------------------------------------


# the benchmark calls every collective through the World's one driver-side method


class _OffByOne(World):
    def _driver(self, collective, *args, **kw):
        res = super()._driver(collective, *args, **kw)
        if collective == "all_reduce":
            res[-1][...] += 1
        return res


class _Failing(World):
    def _driver(self, collective, *args, **kw):
        if collective == "all_reduce":
            raise CommError("injected: the link went down")
        return super()._driver(collective, *args, **kw)


class _Interrupted(World):
    def _driver(self, collective, *args, **kw):
        if collective == "all_reduce":
            raise KeyboardInterrupt
        return super()._driver(collective, *args, **kw)


@pytest.mark.parametrize(
    "world, argv, status, message",
    [
        (World, [], ExitStatus.OK, None),
        (World, ["-f", "1"], ExitStatus.USAGE, "nccltree-bench collectives: error:"),
        (World, ["--devices", "gpu:99"], ExitStatus.USAGE, "nccltree-bench collectives: error:"),
        (_Failing, [], ExitStatus.FAILURE, "injected: the link went down"),
        (_OffByOne, [], ExitStatus.WRONG, "wrong element"),
        (_Interrupted, [], ExitStatus.INTERRUPTED, "interrupted"),
    ],
    ids=["ok", "usage", "no-such-device", "failure", "wrong", "interrupted"],
)
def test_bench_statuses(capsys, tmp_path, world, argv, status, message):
    def factory(devices, algorithm):
        return world(devices, algorithm=algorithm)

    quiet = ["--quiet", "--json", str(tmp_path / "r.json")]
    assert bench_cli.main([*BENCH, *quiet, *argv], world_factory=factory) == status
    err = capsys.readouterr().err
    if message is not None:
        assert message in err
    else:
        assert err == ""


def test_bench_argparse_statuses(capsys):
    assert bench_cli.main(["collectives", "-n", "many"]) == ExitStatus.USAGE
    assert bench_cli.main(["topo", "--help"]) == ExitStatus.OK
    assert bench_cli.main(["topo", "--preset", "dgx1"]) == ExitStatus.OK
    assert bench_cli.main(["topo", "--smi", "/nonexistent/topo.txt"]) == ExitStatus.USAGE
    capsys.readouterr()


# -- nccltree-data ---------------------------------------------------------------------------


def test_data_statuses(capsys, monkeypatch, tmp_path):
    db = str(tmp_path / "db")
    assert data_cli.main(["make", "synthetic", db, "--n", "8"]) == ExitStatus.OK
    assert data_cli.main(["make", "synthetic", db, "--n", "0"]) == ExitStatus.USAGE
    assert data_cli.main(["info", str(tmp_path / "missing")]) == ExitStatus.USAGE
    # an existing database without --overwrite: refused before anything is made or written
    assert data_cli.main(["make", "synthetic", db, "--n", "8"]) == ExitStatus.USAGE
    assert "overwrite" in capsys.readouterr().err

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(nt.data, "db_info", interrupted)
    assert data_cli.main(["info", db]) == ExitStatus.INTERRUPTED
    assert "interrupted" in capsys.readouterr().err


# -- the shared pieces -----------------------------------------------------------------------


def test_checking_turns_errors_into_usage_errors():
    with pytest.raises(_common.UsageError, match="bad value") as ei:
        with _common.checking():
            raise ValueError("bad value")
    assert isinstance(ei.value.__cause__, ValueError)
    with pytest.raises(KeyboardInterrupt), _common.checking():
        raise KeyboardInterrupt
    with pytest.raises(RuntimeError), _common.checking():  # a bug keeps its traceback
        raise RuntimeError("bug")


def test_open_devices_stops_the_host_runtime_however_the_block_ends():
    with pytest.raises(RuntimeError), _common.open_devices("cpu:2") as devs:
        assert len(devs) == 2 and not devs[0].runtime.closed
        raise RuntimeError("the block fails")
    assert devs[0].runtime.closed


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line():
    tty = _Tty()
    p = _common.Progress(tty, quiet=False)
    p.show("a", log=False)
    p.message("note")
    p.show("b", log=False, last=True)
    assert tty.getvalue() == "\r\x1b[2Ka\r\x1b[2Knote\n\r\x1b[2Kb\n"
    plain = io.StringIO()
    p = _common.Progress(plain, quiet=False)
    p.show("skipped", log=False)
    p.show("kept", log=True)
    p.show("last", log=False, last=True)
    p.finish()
    assert plain.getvalue() == "kept\nlast\n"
    quiet = io.StringIO()
    p = _common.Progress(quiet, quiet=True)
    p.show("x", log=True, last=True)
    p.message("y")
    assert quiet.getvalue() == ""


def test_tables():
    assert _common.human_bytes(3 << 10) == "3 KiB" and _common.human_bytes(3000) == "3000 B"
    assert _common.markdown_table(["a", "b"], [[1, "x"]]) == [
        "| a | b |",
        "| :--- | ---: |",
        "| 1 | x |",
    ]
    with pytest.raises(ValueError, match="align"):
        _common.markdown_table(["a", "b"], [], "l")
