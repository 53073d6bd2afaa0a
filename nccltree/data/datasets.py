"""Datasets that need no network: a synthetic learnable task and scikit-learn's digits."""

from __future__ import annotations

from math import prod

import numpy as np

from .._validate import check_int, check_shape
from ..memory import ShapeLike

SPLITS = ("train", "test")

# The synthetic task's constants. Each class is a union of _MODES Gaussian blobs in a
# _LATENT-dimensional space (so no single hyperplane separates a class: a linear model
# stays well below an MLP), pushed through a fixed random tanh layer into the features.
_LATENT = 8
_MODES = 3
_SEPARATION = 2.5
_HIDDEN = 32
_NOISE = 0.1


def synthetic(
    n: int = 4096,
    shape: ShapeLike = (64,),
    classes: int = 10,
    seed: int = 0,
    *,
    split: str = "train",
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded, learnable classification task: ``(X float32 (n, *shape), y int64 (n,))``.

    ``seed`` fixes the task (blob centres and the feature map); ``split`` picks an
    independent sample of it (``"train"`` or ``"test"``), so a held-out set of the same
    task is ``synthetic(m, ..., split="test")``. The same arguments give the same arrays
    on every run. Labels are uniform over ``classes``.

    How hard it is (defaults, seed 0, held-out accuracy after training on the train
    split with SGD, lr 0.05, momentum 0.9, batch 32): an MLP 64-256-10 reaches about 93%
    within 100 steps and 94% within 300; a linear softmax classifier stays near 80-82%
    however long it trains; the Bayes limit is about 99%. Other seeds draw other tasks of
    similar difficulty (MLP 90-95% after 300 steps).
    """
    n = check_int(n, "n", min=1)
    classes = check_int(classes, "classes", min=1)
    seed = check_int(seed, "seed", min=0)
    shape = check_shape(shape, "shape", min=1)
    if not shape:
        raise ValueError("shape must hold at least one size; got ()")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    features = prod(shape)
    task = np.random.default_rng([seed, 0])
    centres = task.standard_normal((classes * _MODES, _LATENT)) * _SEPARATION
    a = task.standard_normal((_LATENT, _HIDDEN)) * (1.5 / np.sqrt(_LATENT))
    b = task.standard_normal(_HIDDEN) * 0.5
    w = task.standard_normal((_HIDDEN, features)) / np.sqrt(_HIDDEN)
    rng = np.random.default_rng([seed, 1 + SPLITS.index(split)])
    blob = rng.integers(0, classes * _MODES, n)
    z = centres[blob] + rng.standard_normal((n, _LATENT))
    x = np.tanh(z @ a + b) @ w + _NOISE * rng.standard_normal((n, features))
    return x.astype(np.float32).reshape((n, *shape)), (blob % classes).astype(np.int64)


def digits(split: str = "all") -> tuple[np.ndarray, np.ndarray]:
    """The 8×8 handwritten digits shipped inside scikit-learn (1797 images, 10 classes).

    Returns ``(X uint8 (n, 1, 8, 8) with values 0..16, y int64 (n,))``. ``split``:
    ``"all"``, or ``"train"`` / ``"test"``: a fixed 80/20 split of a seeded shuffle.
    Needs scikit-learn (``pip install 'nccltree[sklearn]'``); ImportError says so.
    """
    if split not in ("all", *SPLITS):
        raise ValueError(f"split must be 'all', 'train' or 'test'; got {split!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the digits dataset ships with scikit-learn, which is not installed: "
            "pip install 'nccltree[sklearn]' (or pip install scikit-learn)"
        ) from None
    d = load_digits()
    x = np.asarray(d.data).reshape(-1, 1, 8, 8).astype(np.uint8)
    y = np.asarray(d.target).astype(np.int64)
    if split != "all":
        order = np.random.default_rng(0).permutation(len(y))
        cut = int(round(0.8 * len(y)))
        idx = np.sort(order[:cut] if split == "train" else order[cut:])
        x, y = x[idx], y[idx]
    return x, y
