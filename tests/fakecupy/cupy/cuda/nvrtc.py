"""Fake ``cupy.cuda.nvrtc`` (``cupy_backends/cuda/libs/nvrtc.pyx`` of CuPy 14.2).

"Compiling" checks the options and the source's ``#include`` lines and writes a fake image
(see ``fakecupy._kernels``) naming the kernels the source defines, the target
architecture and whether ``-ftz=true`` was in force (the last ``-ftz`` option wins, as in
NVRTC). Such a cubin or PTX can be written to a file and loaded with
``cupy.RawModule(path=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import _core, _kernels
from ..._core import as_intptr

NVRTC_SUCCESS = 0
NVRTC_ERROR_INVALID_INPUT = 3
NVRTC_ERROR_INVALID_PROGRAM = 4
NVRTC_ERROR_INVALID_OPTION = 5
NVRTC_ERROR_COMPILATION = 6

_MESSAGES = {
    0: "NVRTC_SUCCESS",
    3: "NVRTC_ERROR_INVALID_INPUT",
    4: "NVRTC_ERROR_INVALID_PROGRAM",
    5: "NVRTC_ERROR_INVALID_OPTION",
    6: "NVRTC_ERROR_COMPILATION",
}

#: architectures this NVRTC knows (nvrtcGetSupportedArchs)
SUPPORTED_ARCHS = (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)


class NVRTCError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{_MESSAGES.get(status, 'NVRTC_ERROR_UNKNOWN')} ({status})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status,))


def check_status(status: int) -> None:
    if status != 0:
        raise NVRTCError(status)


@dataclass
class _Program:
    src: str
    name: str
    include_names: list[str]
    log: str = ""
    image: bytes | None = None
    kind: str = ""
    options: list[str] = field(default_factory=list)


def getVersion() -> tuple[int, int]:
    return (13, 0)


def getSupportedArchs() -> tuple[int, ...]:
    return SUPPORTED_ARCHS


def createProgram(
    src: str, name: str, headers: Sequence[bytes], include_names: Sequence[bytes]
) -> int:
    if not isinstance(src, str) or not isinstance(name, str):
        raise TypeError("src and name must be str")
    assert len(headers) == len(include_names)
    f = _core.active()
    handle = f.new_handle()
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in include_names]
    f.programs[handle] = _Program(src, name, names)
    return handle


def _program(prog: int) -> _Program:
    p = _core.active().programs.get(as_intptr(prog, "prog"))
    if p is None:
        raise NVRTCError(NVRTC_ERROR_INVALID_PROGRAM)
    return p


def destroyProgram(prog: int) -> None:
    f = _core.active()
    if f.programs.pop(as_intptr(prog, "prog"), None) is None:
        raise NVRTCError(NVRTC_ERROR_INVALID_PROGRAM)


def _option_value(opt: str, *names: str) -> str | None:
    for n in names:
        if opt.startswith(n + "="):
            return opt[len(n) + 1 :]
    return None


def compileProgram(prog: int, options: Sequence[str]) -> None:
    p = _program(prog)
    opts = [o if isinstance(o, str) else o.decode() for o in options]
    arch = "compute_52"
    ftz = False
    for o in opts:
        a = _option_value(o, "-arch", "--gpu-architecture")
        if a is not None:
            arch = a
            continue
        z = _option_value(o, "-ftz", "--ftz")
        if z is not None:
            if z not in ("true", "false"):
                raise NVRTCError(NVRTC_ERROR_INVALID_OPTION)
            ftz = z == "true"
        elif o in ("--use_fast_math", "-use_fast_math"):
            ftz = True
        elif not o.startswith("-"):
            raise NVRTCError(NVRTC_ERROR_INVALID_OPTION)
    kind, _, num = arch.partition("_")
    if (
        kind not in ("sm", "compute")
        or not num.isdigit()
        or int(num) not in SUPPORTED_ARCHS + (52,)
    ):
        p.log = f"nvrtc: error: invalid value for --gpu-architecture (-arch): {arch}\n"
        raise NVRTCError(NVRTC_ERROR_INVALID_OPTION)
    missing = _kernels.missing_includes(p.src, p.include_names)
    if missing:
        p.log = f'{p.name}(1): catastrophic error: cannot open source file "{missing[0]}"\n'
        raise NVRTCError(NVRTC_ERROR_COMPILATION)
    p.options = opts
    p.kind = "cubin" if kind == "sm" else "ptx"
    p.image = _kernels.make_image(p.kind, [arch], _kernels.kernel_names(p.src), ftz)
    p.log = ""


def getPTX(prog: int) -> bytes:
    p = _program(prog)
    if p.image is None:
        raise NVRTCError(NVRTC_ERROR_INVALID_INPUT)
    doc = _kernels.parse_image(p.image)
    assert doc is not None
    arch = doc["archs"][0].replace("sm_", "compute_")
    return _kernels.make_image("ptx", [arch], doc["kernels"], doc["ftz"])


def getCUBIN(prog: int) -> bytes:
    p = _program(prog)
    if p.image is None:
        raise NVRTCError(NVRTC_ERROR_INVALID_INPUT)
    return p.image if p.kind == "cubin" else b""  # no cubin for a virtual architecture


def getProgramLog(prog: int) -> str:
    return _program(prog).log
