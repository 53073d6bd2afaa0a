"""Fake ``cupy.cuda.compiler``: the exception ``cupy.RawModule(code=...)`` raises when the
source does not compile."""

from __future__ import annotations


class CompileException(Exception):
    def __init__(
        self, msg: str, source: str, name: str, options: tuple[str, ...], backend: str = "nvrtc"
    ) -> None:
        self._msg = msg
        self.source = source
        self.name = name
        self.options = options
        self.backend = backend
        super().__init__()

    def __str__(self) -> str:
        return self._msg
