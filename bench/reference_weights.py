"""Digests of the weights four reference trainings end with: the check that a restructuring
changed no arithmetic.

Usage: python bench/reference_weights.py [--json FILE] [--check FILE]

Trains, with ``nccltree-train`` on the host backend and the built-in synthetic task:

* ``tree-mlp``: cpu:2, tree, MLP;
* ``ring-mlp``: cpu:4, ring, MLP;
* ``direct-root-softmax``: cpu:3, direct, softmax, the root-update mode;
* ``auto-cnn``: cpu:4, auto, CNN;

and prints the SHA-256 of each run's ``final.npz`` (every array's name and bytes, in name
order). Run it on two commits and compare: equal digests mean the two commits train
bitwise alike. ``--check FILE`` compares with digests written earlier by ``--json FILE``
and exits 1 on any difference. The digests depend on numpy and its BLAS (and so on the
CPU): compare runs of one machine and one environment, never against a number recorded
elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_COMMON = ["--seed", "0", "--quiet"]
CONFIGS: dict[str, list[str]] = {
    "tree-mlp": ["--devices", "cpu:2", "--algorithm", "tree", "--model", "mlp",
                 "--iters", "60", "--batch-size", "16", "--synthetic", "2048"],
    "ring-mlp": ["--devices", "cpu:4", "--algorithm", "ring", "--model", "mlp",
                 "--iters", "60", "--batch-size", "16", "--synthetic", "2048"],
    "direct-root-softmax": ["--devices", "cpu:3", "--algorithm", "direct",
                            "--update-mode", "root", "--model", "softmax", "--iters", "60",
                            "--batch-size", "16", "--synthetic", "2048"],
    "auto-cnn": ["--devices", "cpu:4", "--algorithm", "auto", "--model", "cnn",
                 "--iters", "20", "--batch-size", "8", "--synthetic", "512"],
}  # fmt: skip


def digest(npz: Path) -> str:
    """SHA-256 over every array's name and bytes, in name order."""
    h = hashlib.sha256()
    with np.load(npz) as z:
        for name in sorted(z.files):
            h.update(name.encode())
            h.update(np.ascontiguousarray(z[name]).tobytes())
    return h.hexdigest()


def train_digests() -> dict[str, str]:
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="reference-weights-") as tmp:
        for name, flags in CONFIGS.items():
            run = Path(tmp) / name
            cmd = [sys.executable, "-m", "nccltree.cli.train", *flags, *_COMMON, "--out", str(run)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            out[name] = digest(run / "final.npz")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write the digests as JSON")
    p.add_argument("--check", metavar="FILE", help="compare with digests written by --json")
    args = p.parse_args(argv)
    got = train_digests()
    for name, h in got.items():
        print(f"{name:22s} {h}")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=2) + "\n")
    if args.check:
        want = json.loads(Path(args.check).read_text())
        bad = [n for n in CONFIGS if want.get(n) != got[n]]
        if bad:
            print(f"differ from {args.check}: {', '.join(bad)}", file=sys.stderr)
            return 1
        print(f"all {len(CONFIGS)} equal to {args.check}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
