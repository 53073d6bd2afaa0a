"""Fake ``cupy.cuda.driver`` (``cupy_backends/cuda/api/driver.pyx``): the error type of
module loads and kernel launches."""

from __future__ import annotations

from typing import Any

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_IMAGE = 200
CUDA_ERROR_NO_BINARY_FOR_GPU = 209
CUDA_ERROR_FILE_NOT_FOUND = 301
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_ILLEGAL_ADDRESS = 700

_NAMES = {
    1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    200: ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
    209: (
        "CUDA_ERROR_NO_BINARY_FOR_GPU",
        "no kernel image is available for execution on the device",
    ),
    301: ("CUDA_ERROR_FILE_NOT_FOUND", "file not found"),
    400: ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
    500: ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    700: ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
}


class CUDADriverError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        name, msg = _NAMES.get(status, (f"CUDA_ERROR_{status}", "unknown error"))
        super().__init__(f"{name}: {msg}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status,))
