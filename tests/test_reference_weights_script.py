"""bench/reference_weights.py: the digest reads every array by name, and ``--check`` fails
on a digest that differs (the training itself is stubbed here: what it produces is the
script's business on the machine where it runs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "reference_weights.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("reference_weights", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_digest_covers_names_and_bytes(script, tmp_path):
    a, b = np.arange(6, dtype=np.float32), np.ones(3, np.float32)
    np.savez(tmp_path / "one.npz", w=a, b=b)
    np.savez(tmp_path / "same.npz", b=b, w=a)  # written in another order
    np.savez(tmp_path / "renamed.npz", v=a, b=b)
    bumped = a.copy()
    bumped[5] = np.nextafter(bumped[5], np.float32(10))
    np.savez(tmp_path / "bumped.npz", w=bumped, b=b)
    d = {p.stem: script.digest(p) for p in tmp_path.glob("*.npz")}
    assert d["one"] == d["same"]
    assert len({d["one"], d["renamed"], d["bumped"]}) == 3


def test_check_reports_a_difference(script, tmp_path, monkeypatch, capsys):
    fake = {name: f"{i:064x}" for i, name in enumerate(script.CONFIGS)}
    monkeypatch.setattr(script, "train_digests", lambda: dict(fake))
    saved = tmp_path / "d.json"
    assert script.main(["--json", str(saved)]) == 0
    assert json.loads(saved.read_text()) == fake
    assert script.main(["--check", str(saved)]) == 0
    first = next(iter(script.CONFIGS))
    saved.write_text(json.dumps({**fake, first: "f" * 64}))
    assert script.main(["--check", str(saved)]) == 1
    assert first in capsys.readouterr().err
