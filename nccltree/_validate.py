"""Argument checks, one rule everywhere.

- Integers: Python ``int`` and numpy integers are accepted; ``bool`` is refused (``True``
  is an ``int`` to Python, never a count or a rank to a user); floats are refused, even
  integral ones. Wrong type: ``TypeError``; out of range: ``ValueError``.
- Real numbers: ``int``, ``float`` and numpy reals are accepted, ``bool`` is refused; NaN
  is refused always, and infinities wherever a finite number is meant (the default).
- Timeouts: a wait's (:func:`check_timeout`: None, or a finite number >= 0) and a
  communicator's (:func:`check_call_timeout`: a finite number > 0, what every call may
  take), the same for a World, a process group, a trainer and the command lines.
- Names from a fixed set (a reduction op, an algorithm): :func:`check_choice`, one
  message naming the accepted values.

Every message names the argument and shows the value it got, so a caller can tell which
of several arguments was wrong.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np

__all__ = [
    "check_call_timeout",
    "check_choice",
    "check_index",
    "check_int",
    "check_real",
    "check_shape",
    "check_timeout",
    "is_int",
]


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bool (and everything else)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: object, name: str, *, min: int | None = None, max: int | None = None) -> int:
    """``value`` as an ``int``, in ``[min, max]`` where given."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)  # type: ignore[call-overload]  # is_int checked it is an integer
    if (min is not None and v < min) or (max is not None and v > max):
        raise ValueError(f"{name} must be {_range(min, max)}, got {v}")
    return v


def check_index(value: object, name: str, size: int) -> int:
    """``value`` as an index into ``size`` things: an integer in ``[0, size)``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)  # type: ignore[call-overload]  # is_int checked it is an integer
    if not 0 <= v < size:
        raise ValueError(f"{name} must be in [0, {size}), got {v}")
    return v


def check_real(
    value: object,
    name: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a ``float``: not NaN, finite unless ``finite=False``, and in
    ``[min, max]`` (``(min, max]`` with ``min_open``) where given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"{name} must be a number, got NaN")
    if finite and math.isinf(v):
        raise ValueError(f"{name} must be finite, got {v}")
    low_bad = min is not None and (v <= min if min_open else v < min)
    if low_bad or (max is not None and v > max):
        raise ValueError(f"{name} must be {_range(min, max, min_open)}, got {v:g}")
    return v


def check_shape(shape: object, name: str = "shape", *, min: int = 0) -> tuple[int, ...]:
    """``shape`` (an integer or a sequence of integers, each >= ``min``) as a tuple of
    ``int``."""
    if is_int(shape):
        return (check_int(shape, name, min=min),)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(
            f"{name} must be an integer or a sequence of integers, got {shape!r} "
            f"({type(shape).__name__})"
        )
    return tuple(check_int(d, f"{name}[{i}]", min=min) for i, d in enumerate(shape))


def check_timeout(value: object, name: str = "timeout") -> float | None:
    """A timeout in seconds: None (the default bound applies), or a finite number >= 0."""
    if value is None:
        return None
    return check_real(value, name, min=0.0)


def check_call_timeout(value: object, name: str = "timeout") -> float:
    """The seconds a communicator gives each call before it fails: a finite number > 0."""
    return check_real(value, name, min=0.0, min_open=True)


def check_choice(value: object, what: str, accepted: Iterable[str]) -> str:
    """``value`` if it is one of the names ``accepted``; else ``ValueError("unknown
    {what} {value!r}; accepted: ...")``."""
    names = tuple(accepted)
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"unknown {what} {value!r}; accepted: {', '.join(names)}")
    return value


def _range(min: float | None, max: float | None, min_open: bool = False) -> str:
    if min is not None and max is not None:
        return f"in {'(' if min_open else '['}{min:g}, {max:g}]"
    if min is not None:
        return f"{'>' if min_open else '>='} {min:g}"
    return f"<= {max:g}"
