"""Ctrl-C during a World's collective: the caller's ``except KeyboardInterrupt`` sees a
``KeyboardInterrupt`` (not a ``CommError`` wrapping one), and the World, which may have
run part of the plan, is closed for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends.host import HostEvent
from nccltree.comm.executor import Program


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def test_an_interrupt_inline_is_a_keyboard_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    with nt.World(nt.devices("cpu:2"), algorithm="tree") as world:
        xs = [np.ones(64, np.float32) for _ in range(2)]
        monkeypatch.setattr(Program, "run_inline", _interrupt)
        with pytest.raises(KeyboardInterrupt) as got:
            world.all_reduce(xs)
        assert got.value.__cause__ is None
        assert world.aborted
        monkeypatch.undo()
        with pytest.raises(nt.CommError):
            world.all_reduce(xs)


def test_an_interrupt_while_waiting_is_a_keyboard_interrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with nt.World(nt.devices("cpu:2"), algorithm="ring", inline_bytes=0) as world:
        xs = [np.ones(1 << 12, np.float32) for _ in range(2)]
        monkeypatch.setattr(HostEvent, "synchronize", _interrupt)
        with pytest.raises(KeyboardInterrupt):
            world.all_reduce(xs)
        assert world.aborted


@pytest.mark.subprocess
def test_ctrl_c_in_a_loop_of_all_reduces_exits_130_with_a_keyboard_interrupt(tmp_path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy as np
            import nccltree as nt
            with nt.World(nt.devices("cpu:2"), algorithm="tree") as world:
                xs = [np.ones(1 << 20, np.float32) for _ in range(2)]
                print("ready", flush=True)
                try:
                    while True:
                        world.all_reduce(xs)
                except KeyboardInterrupt:
                    print("caught KeyboardInterrupt", flush=True)
                    sys.exit(130)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # never left behind, whatever failed
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "caught KeyboardInterrupt" in out
    assert "CommError" not in err
