"""Reference models with forward and backward written by hand against numpy or CuPy.

A model is a description, not a container: it declares its parameter shapes
(:meth:`Model.shapes`, for :class:`~nccltree.params.FlatParams`), initialises them
(:meth:`Model.init`, seeded on the host so every rank and backend starts from bitwise the
same values) and computes the loss and gradients of a batch into ``params.grad_views``.
Parameters live only in the FlatParams, so one model object can serve every rank.

The backward pass announces each parameter's gradient as soon as it is written (last layer
first, in :meth:`Model.gradient_order`), so a data-parallel driver can start communicating
it while the earlier layers are still being computed.

The array module is the params' ``xp`` (numpy, or CuPy on a CUDA device); the loss is
softmax cross-entropy averaged over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import DTypeLike

from ._validate import check_int, check_shape
from .memory import ShapeLike
from .params import FlatParams

if TYPE_CHECKING:
    from .backends.base import Array, Device

# -- shared pieces ------------------------------------------------------------------------

#: What a backward pass calls with each parameter's name once its gradient is final.
Ready = Callable[[str], None]
#: What a forward pass keeps for the backward pass of the same batch.
Cache = dict[str, Any]


def _he_normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    # He et al. 2015: keeps the activation variance through ReLU layers.
    return rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)


def _xavier_uniform(
    rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, fan_out: int
) -> np.ndarray:
    # Glorot & Bengio 2010, for the last (linear, pre-softmax) layer.
    a = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-a, a, size=shape)


def _softmax_xent(xp: Any, logits: Any, y: Any) -> tuple[float, Any]:
    """Mean cross-entropy of ``logits`` (N, K) against labels ``y`` and its gradient.

    Stable: the row maximum is subtracted before exponentiating, so large logits never
    overflow. ``logits`` is overwritten with the gradient (saving an (N, K) buffer).
    """
    n = logits.shape[0]
    rows = xp.arange(n)
    logits -= logits.max(axis=1, keepdims=True)
    picked = logits[rows, y]
    xp.exp(logits, out=logits)
    sums = logits.sum(axis=1)
    loss = float((xp.log(sums) - picked).mean())
    logits /= sums[:, None]
    logits[rows, y] -= 1.0
    logits *= 1.0 / n
    return loss, logits


def _linear_grads(
    xp: Any, params: FlatParams, layer: str, dout: Any, x_in: Any, ready: Ready
) -> None:
    """Write the gradients of the linear layer ``layer`` (``x_in @ weight.T + bias``) for
    the output gradient ``dout`` into ``params.grad_views``, announcing each when written.
    """
    # Straight into the flat grad buffer: no temporaries per parameter.
    xp.matmul(dout.T, x_in, out=params.grad_views[f"{layer}.weight"])
    ready(f"{layer}.weight")
    dout.sum(axis=0, out=params.grad_views[f"{layer}.bias"])
    ready(f"{layer}.bias")


def _ignore(name: str) -> None:
    """The ``ready`` callback when nobody listens."""


def _check_batch(xp: Any, params: FlatParams, x: Any, y: Any | None) -> tuple[Any, Any]:
    x = xp.asarray(x, dtype=params.dtype)
    if x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty batch (N, ...), got shape {x.shape}")
    if y is not None:
        y = xp.asarray(y)
        if y.shape != (x.shape[0],) or y.dtype.kind not in "iu":
            raise ValueError(
                f"y must be integer labels of shape ({x.shape[0]},), got {y.dtype} {y.shape}"
            )
    return x, y


@runtime_checkable
class TrainableModel(Protocol):
    """What :class:`~nccltree.parallel.DataParallel` needs of a model: the protocol any
    model follows, whatever computes it (the reference models below, a torch module
    behind an adapter: docs/examples/torch_dataparallel.py).

    * **Parameters are one flat buffer.** ``make_params(dtype=, device=)`` returns a
      :class:`~nccltree.params.FlatParams` (usually ``FlatParams(shapes, dtype=dtype,
      device=device)``): one contiguous ``data`` and one ``grad`` buffer with a view per
      parameter. The driver makes one per rank, all-reduces ``grad`` (whole, or in
      buckets) and the solver updates ``data`` in place, so the model must read its
      parameters from ``params.views`` on every call (views, never copies kept across
      calls).
    * ``init(params, seed=0)`` writes the initial values (called on rank 0 only; a
      broadcast copies them to the other ranks).
    * ``loss_and_grad(params, x, y, ready=None)`` returns the batch's mean loss (a float)
      and overwrites every parameter's gradient in ``params.grad_views`` (the gradient of
      that mean). **The gradient callback:** when ``ready`` is given it calls
      ``ready(name)`` once per parameter as soon as that gradient is final, ideally in
      reverse layout order (the last layer first), so that buckets
      (``bucket_bytes > 0``) are communicated while backward still runs; a parameter
      never announced is communicated after the call returns.
    """

    def make_params(self, dtype: DTypeLike = ..., device: Device | None = ...) -> FlatParams:
        """A zero FlatParams of the model's parameters on ``device``."""
        ...

    def init(self, params: FlatParams, seed: int = ...) -> None:
        """Write the initial parameter values, from ``seed``."""
        ...

    def loss_and_grad(
        self, params: FlatParams, x: Array, y: Array, ready: Ready | None = ...
    ) -> float:
        """The mean loss of the batch; the gradients into ``params.grad_views``."""
        ...


class Model:
    """The interface of every reference model (a :class:`TrainableModel`)."""

    name: str = ""
    classes: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes by name, in layout order (for FlatParams)."""
        raise NotImplementedError

    def gradient_order(self) -> tuple[str, ...]:
        """Parameter names in the order the backward pass writes (and announces) their
        gradients: the last layer first."""
        raise NotImplementedError

    def make_params(
        self, dtype: DTypeLike = np.float32, device: Device | None = None
    ) -> FlatParams:
        """A zero FlatParams with this model's shapes (call :meth:`init` to initialise)."""
        return FlatParams(self.shapes(), dtype=dtype, device=device)

    def init(self, params: FlatParams, seed: int = 0) -> None:
        """Initialise ``params`` from ``seed``: identical on every rank and backend."""
        rng = np.random.default_rng(seed)
        params.load(self._initial_values(rng))

    def _initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def forward(self, params: FlatParams, x: Any) -> Any:
        """Logits (N, classes) of the batch ``x``."""
        xp = params.xp
        x, _ = _check_batch(xp, params, x, None)
        return self._forward(xp, params, x, cache=None)

    def predict(self, params: FlatParams, x: Any) -> Any:
        """Predicted class indices (N,) of the batch ``x``, as an ``xp`` array."""
        return self.forward(params, x).argmax(axis=1)

    def loss_and_grad(
        self,
        params: FlatParams,
        x: Any,
        y: Any,
        ready: Ready | None = None,
    ) -> float:
        """Mean softmax cross-entropy of ``(x, y)``; writes the gradients of every
        parameter into ``params.grad_views`` (overwriting them).

        ``ready(name)`` is called once per parameter, in :meth:`gradient_order`, as soon
        as its gradient is final: the backward pass never writes it again (on a GPU, the
        kernels that write it are queued on the current stream)."""
        xp = params.xp
        x, y = _check_batch(xp, params, x, y)
        cache: Cache = {}
        logits = self._forward(xp, params, x, cache=cache)
        loss, dlogits = _softmax_xent(xp, logits, y)
        self._backward(xp, params, dlogits, cache, _ignore if ready is None else ready)
        return loss

    def _forward(self, xp: Any, params: FlatParams, x: Any, cache: Cache | None) -> Any:
        raise NotImplementedError

    def _backward(self, xp: Any, params: FlatParams, dout: Any, cache: Cache, ready: Ready) -> None:
        raise NotImplementedError


# -- fully connected models ---------------------------------------------------------------


class MLP(Model):
    """Fully connected layers with ReLU between them: ``in -> hidden... -> classes``.

    Parameters ``fc{i}.weight`` (out, in) and ``fc{i}.bias`` (out,), as Caffe's
    InnerProduct layer. Inputs of any shape (N, ...) are flattened to (N, in_features).
    With no hidden layers this is softmax regression.
    """

    name = "mlp"

    def __init__(self, in_features: int, hidden: ShapeLike = (256,), classes: int = 10):
        self.in_features = check_int(in_features, "in_features", min=1)
        self.hidden = check_shape(hidden, "hidden", min=1)
        self.classes = check_int(classes, "classes", min=2)
        self.sizes = (self.in_features, *self.hidden, self.classes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({' -> '.join(map(str, self.sizes))})"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:], strict=True)):
            shapes[f"fc{i}.weight"] = (fan_out, fan_in)
            shapes[f"fc{i}.bias"] = (fan_out,)
        return shapes

    def gradient_order(self) -> tuple[str, ...]:
        return tuple(
            f"fc{i}.{kind}"
            for i in range(len(self.sizes) - 2, -1, -1)
            for kind in ("weight", "bias")
        )

    def _initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        values = {}
        last = len(self.sizes) - 2
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:], strict=True)):
            shape = (fan_out, fan_in)
            w = (
                _xavier_uniform(rng, shape, fan_in, fan_out)
                if i == last
                else _he_normal(rng, shape, fan_in)
            )
            values[f"fc{i}.weight"] = w
            values[f"fc{i}.bias"] = np.zeros(fan_out)
        return values

    def _forward(self, xp: Any, params: FlatParams, x: Any, cache: Cache | None) -> Any:
        h = x.reshape(x.shape[0], -1)
        if h.shape[1] != self.in_features:
            raise ValueError(
                f"{self!r} takes {self.in_features} input features, the batch has {h.shape[1]}"
            )
        layers = len(self.sizes) - 1
        acts = [h]
        for i in range(layers):
            h = h @ params.views[f"fc{i}.weight"].T
            h += params.views[f"fc{i}.bias"]
            if i < layers - 1:
                xp.maximum(h, 0, out=h)
            acts.append(h)
        if cache is not None:
            cache["acts"] = acts
        return h

    def _backward(self, xp: Any, params: FlatParams, dout: Any, cache: Cache, ready: Ready) -> None:
        acts = cache["acts"]
        for i in range(len(self.sizes) - 2, -1, -1):
            x_in = acts[i]
            _linear_grads(xp, params, f"fc{i}", dout, x_in, ready)
            if i > 0:
                dout = dout @ params.views[f"fc{i}.weight"]
                dout *= x_in > 0  # ReLU: the layer input is the previous ReLU's output
        cache.clear()


class SoftmaxRegression(MLP):
    """Multinomial logistic regression: one linear layer and softmax (``fc0``)."""

    name = "softmax"

    def __init__(self, in_features: int, classes: int = 10):
        super().__init__(in_features, hidden=(), classes=classes)


# -- convolutional model ------------------------------------------------------------------


def _im2col(xp: Any, x: Any, k: int, pad: int) -> Any:
    """(N, H, W, C) -> (N*Ho*Wo, k*k*C) patches for a stride-1 ``k`` x ``k`` convolution.

    Channels-last keeps every patch row a contiguous copy of C values, and makes the
    convolution one GEMM over the whole batch.
    """
    n, h, w, c = x.shape
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    xpad = xp.zeros((n, h + 2 * pad, w + 2 * pad, c), dtype=x.dtype)
    xpad[:, pad : pad + h, pad : pad + w, :] = x
    cols = xp.empty((n, ho, wo, k, k, c), dtype=x.dtype)
    for i in range(k):
        for j in range(k):
            cols[:, :, :, i, j, :] = xpad[:, i : i + ho, j : j + wo, :]
    return cols.reshape(n * ho * wo, k * k * c)


def _col2im(xp: Any, cols: Any, shape: tuple[int, ...], k: int, pad: int) -> Any:
    """The adjoint of :func:`_im2col`: sums patch gradients back into (N, H, W, C)."""
    n, h, w, c = shape
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    cols = cols.reshape(n, ho, wo, k, k, c)
    dpad = xp.zeros((n, h + 2 * pad, w + 2 * pad, c), dtype=cols.dtype)
    for i in range(k):
        for j in range(k):
            dpad[:, i : i + ho, j : j + wo, :] += cols[:, :, :, i, j, :]
    return dpad[:, pad : pad + h, pad : pad + w, :]


def _pool_windows(x: Any) -> Any:
    """(N, H, W, C) -> (N, H//2, W//2, C, 4): the 2x2 stride-2 windows (odd edges dropped)."""
    n, h, w, c = x.shape
    h2, w2 = h // 2, w // 2
    win = x[:, : 2 * h2, : 2 * w2, :].reshape(n, h2, 2, w2, 2, c)
    return win.transpose(0, 1, 3, 5, 2, 4).reshape(n, h2, w2, c, 4)


def _unpool(xp: Any, dwin: Any, shape: tuple[int, ...]) -> Any:
    """The adjoint of :func:`_pool_windows`: (N, H//2, W//2, C, 4) -> (N, H, W, C)."""
    n, h, w, c = shape
    h2, w2 = h // 2, w // 2
    dx = xp.zeros(shape, dtype=dwin.dtype)
    dx[:, : 2 * h2, : 2 * w2, :] = (
        dwin.reshape(n, h2, w2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(n, 2 * h2, 2 * w2, c)
    )
    return dx


class ConvNet(Model):
    """A small convolutional net for (C, H, W) inputs.

    Each stage is a stride-1 ``kernel`` x ``kernel`` convolution ("same" padding, im2col +
    GEMM), ReLU and a 2x2 stride-2 pool (``pool="max"`` or ``"avg"``; an odd last row or
    column is dropped); then one linear layer to the classes. Parameters
    ``conv{i}.weight`` (F, C, k, k), ``conv{i}.bias`` (F,), ``fc.weight``
    (classes, C*H*W of the last stage, flattened in C, H, W order), ``fc.bias``: the
    layouts of Caffe and PyTorch, so exported weights mean the same there.
    """

    name = "cnn"

    def __init__(
        self,
        input_shape: ShapeLike,
        classes: int = 10,
        channels: ShapeLike = (8, 16),
        kernel: int = 3,
        pool: str = "max",
    ):
        shape = check_shape(input_shape, "input_shape", min=1)
        if len(shape) == 2:
            shape = (1, *shape)
        if len(shape) != 3:
            raise ValueError(f"input_shape must be (C, H, W) or (H, W), got {input_shape!r}")
        self.input_shape = shape
        self.classes = check_int(classes, "classes", min=2)
        self.channels = check_shape(channels, "channels", min=1)
        if not self.channels:
            raise ValueError("channels must list at least one convolution")
        self.kernel = check_int(kernel, "kernel", min=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (for 'same' padding), got {kernel}")
        if pool not in ("max", "avg"):
            raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
        self.pool = pool
        c, h, w = self.input_shape
        for _ in self.channels:
            h, w = h // 2, w // 2
            if h == 0 or w == 0:
                raise ValueError(
                    f"input {self.input_shape} is too small for {len(self.channels)} "
                    "2x2 pooling stages"
                )
        self.features = self.channels[-1] * h * w

    def __repr__(self) -> str:
        return (
            f"ConvNet(input={self.input_shape}, channels={self.channels}, "
            f"kernel={self.kernel}, pool={self.pool!r}, classes={self.classes})"
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        c_in, k = self.input_shape[0], self.kernel
        for i, c_out in enumerate(self.channels):
            shapes[f"conv{i}.weight"] = (c_out, c_in, k, k)
            shapes[f"conv{i}.bias"] = (c_out,)
            c_in = c_out
        shapes["fc.weight"] = (self.classes, self.features)
        shapes["fc.bias"] = (self.classes,)
        return shapes

    def gradient_order(self) -> tuple[str, ...]:
        convs = (
            f"conv{i}.{kind}"
            for i in range(len(self.channels) - 1, -1, -1)
            for kind in ("weight", "bias")
        )
        return ("fc.weight", "fc.bias", *convs)

    def _initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        values = {}
        for name, shape in self.shapes().items():
            if name.endswith(".bias"):
                values[name] = np.zeros(shape)
            elif name.startswith("conv"):
                values[name] = _he_normal(rng, shape, math.prod(shape[1:]))
            else:
                values[name] = _xavier_uniform(rng, shape, shape[1], shape[0])
        return values

    def _wmat(self, params: FlatParams, i: int) -> Any:
        # (F, C, k, k) -> (k*k*C, F), matching the channels-last patch order of _im2col.
        w = params.views[f"conv{i}.weight"]
        return w.transpose(2, 3, 1, 0).reshape(-1, w.shape[0])

    def _forward(self, xp: Any, params: FlatParams, x: Any, cache: Cache | None) -> Any:
        n, k = x.shape[0], self.kernel
        if math.prod(x.shape[1:]) != math.prod(self.input_shape):
            raise ValueError(
                f"{self!r} takes inputs of shape (N, *{self.input_shape}) (or flattened), "
                f"got {x.shape}"
            )
        x = x.reshape(n, *self.input_shape)
        h = x.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        stages = []
        for i, f in enumerate(self.channels):
            shape = h.shape
            cols = _im2col(xp, h, k, k // 2)
            y = cols @ self._wmat(params, i)
            y += params.views[f"conv{i}.bias"]
            xp.maximum(y, 0, out=y)
            y = y.reshape(shape[0], shape[1], shape[2], f)
            win = _pool_windows(y)
            if self.pool == "max":
                arg = win.argmax(axis=-1)
                h = xp.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
            else:
                arg = None
                h = win.mean(axis=-1)
            stages.append((shape, cols, y, arg))
        flat = xp.ascontiguousarray(h.transpose(0, 3, 1, 2)).reshape(n, -1)
        logits = flat @ params.views["fc.weight"].T
        logits += params.views["fc.bias"]
        if cache is not None:
            cache.update(stages=stages, flat=flat, pooled_shape=h.shape)
        return logits

    def _backward(self, xp: Any, params: FlatParams, dout: Any, cache: Cache, ready: Ready) -> None:
        _linear_grads(xp, params, "fc", dout, cache["flat"], ready)
        n, h2, w2, c = cache["pooled_shape"]
        dh = (dout @ params.views["fc.weight"]).reshape(n, c, h2, w2).transpose(0, 2, 3, 1)
        for i in range(len(self.channels) - 1, -1, -1):
            shape, cols, y, arg = cache["stages"][i]
            if self.pool == "max":
                dwin = (xp.arange(4) == arg[..., None]) * dh[..., None]
            else:
                dwin = xp.broadcast_to(dh[..., None] * 0.25, (*dh.shape, 4))
            dy = _unpool(xp, dwin.astype(y.dtype, copy=False), y.shape)
            dy *= y > 0
            dy = dy.reshape(-1, y.shape[-1])
            gw = params.grad_views[f"conv{i}.weight"]
            # dW in patch order (k*k*C, F) -> (F, C, k, k), written into the grad view.
            gw[...] = (
                (cols.T @ dy).reshape(self.kernel, self.kernel, shape[3], -1).transpose(3, 2, 0, 1)
            )
            ready(f"conv{i}.weight")
            dy.sum(axis=0, out=params.grad_views[f"conv{i}.bias"])
            ready(f"conv{i}.bias")
            if i > 0:
                dh = _col2im(xp, dy @ self._wmat(params, i).T, shape, self.kernel, self.kernel // 2)
        cache.clear()


# -- registry -----------------------------------------------------------------------------


def _build_softmax(input_shape: tuple[int, ...], classes: int, **kw: Any) -> Model:
    return SoftmaxRegression(math.prod(input_shape), classes, **kw)


def _build_mlp(input_shape: tuple[int, ...], classes: int, **kw: Any) -> Model:
    return MLP(math.prod(input_shape), classes=classes, **kw)


def _build_cnn(input_shape: tuple[int, ...], classes: int, **kw: Any) -> Model:
    return ConvNet(input_shape, classes, **kw)


MODELS: dict[str, Callable[..., Model]] = {
    "softmax": _build_softmax,
    "mlp": _build_mlp,
    "cnn": _build_cnn,
}


def build_model(name: str, input_shape: ShapeLike, classes: int, **kw: Any) -> Model:
    """The model registered as ``name`` ("softmax", "mlp", "cnn") for inputs of
    ``input_shape`` (one example, e.g. ``(C, H, W)`` or ``(features,)``) and ``classes``.

    Keyword arguments (``kw``) go to the model: ``hidden=[...]`` for mlp; ``channels``, ``kernel``,
    ``pool`` for cnn.
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {name!r}")
    return MODELS[name](check_shape(input_shape, "input_shape", min=1), classes, **kw)
