"""The repaired wheels' checks (called by .ci/wheel): ``check_wheels.py FOLDER 3.10 ...``.

One wheel per Python version, tagged ``cpXY-cpXY-manylinux_2_34_x86_64``, carrying the
host library, the bundled libgomp, LICENSE, the CUDA source and both CPython extensions
built for its Python; the CUDA fatbin is reported (present where nvcc built it).
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path


def check(folder: Path, version: str) -> str:
    tag = "cp" + version.replace(".", "")
    found = sorted(folder.glob(f"nccltree-*-{tag}-{tag}-*.whl"))
    if len(found) != 1:
        raise SystemExit(
            f"error: want one wheel for Python {version}, found {[p.name for p in found]}"
        )
    path = found[0]
    if not re.fullmatch(rf"nccltree-[\w.]+-{tag}-{tag}-manylinux_2_34_x86_64\.whl", path.name):
        raise SystemExit(
            f"error: unexpected wheel name {path.name} (want {tag}-{tag}-manylinux_2_34_x86_64)"
        )
    names = zipfile.ZipFile(path).namelist()
    abi = tag[2:]
    checks = {
        "libgomp bundled": any(re.match(r"nccltree\.libs/libgomp[-.].*\.so", n) for n in names),
        "host library": any(n.startswith("nccltree/_lib/libnccltree_host") for n in names),
        "LICENSE": any(
            n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for n in names
        ),
        "CUDA source": "nccltree/_lib/nccltree_kernels.cu" in names,
        "_records": any(
            re.fullmatch(rf"nccltree/_records\.cpython-{abi}-.*\.so", n) for n in names
        ),
        "_small": any(re.fullmatch(rf"nccltree/_small\.cpython-{abi}-.*\.so", n) for n in names),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise SystemExit(f"error: {path.name}: missing {bad}")
    fatbin = "nccltree/_lib/nccltree_kernels.fatbin" in names
    return (
        f"wheel: {path.name}: "
        + ", ".join(checks)
        + f"; fatbin {'included' if fatbin else 'absent'}"
    )


def main() -> None:
    folder = Path(sys.argv[1])
    for version in sys.argv[2:]:
        print(check(folder, version))


if __name__ == "__main__":
    main()
