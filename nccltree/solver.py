"""SGD with Caffe's update rule, learning-rate policies and solver callbacks.

The update is Caffe's ``SGDSolver::ComputeUpdateValue`` + ``Net::Update`` with L2
regularisation::

    g += weight_decay * w;   v = momentum * v + rate * g;   w -= v

done by one fused native kernel over the whole flat parameter buffer (one pass over memory
instead of Caffe's three BLAS calls per blob).
"""

from __future__ import annotations

import bisect
import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ._errors import NcclTreeError
from ._validate import check_int, check_real
from .params import FlatParams

if TYPE_CHECKING:
    from .backends.base import Array

T = TypeVar("T")

LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")

# The solver parameters each policy reads (Caffe's names); the others are ignored, as in
# Caffe, so a command line may pass all of them whatever the policy.
_POLICY_NEEDS: dict[str, tuple[str, ...]] = {
    "fixed": (),
    "step": ("gamma", "stepsize"),
    "exp": ("gamma",),
    "inv": ("gamma", "power"),
    "multistep": ("gamma", "stepvalue"),
    "poly": ("power", "max_iter"),
    "sigmoid": ("gamma", "stepsize"),
}


def check_policy(lr_policy: str, **given: object) -> None:
    """ValueError when ``lr_policy`` is unknown or a parameter it needs (``gamma``,
    ``power``, ``stepsize``, ``stepvalue``, ``max_iter``) is None in ``given``."""
    if lr_policy not in _POLICY_NEEDS:
        raise ValueError(f"lr_policy must be one of {', '.join(LR_POLICIES)}; got {lr_policy!r}")
    missing = [k for k in _POLICY_NEEDS[lr_policy] if given.get(k) is None]
    if missing:
        raise ValueError(f"lr_policy {lr_policy!r} needs {' and '.join(missing)}")


class Diverged(NcclTreeError):
    """Training diverged: the loss, or the gradient an update would apply, is not finite.
    Raised by :meth:`SGD.iteration` before the update, so the parameters and the solver
    state are still those of :attr:`iter` (0-based: ``iter + 1`` is the iteration that
    diverged)."""

    def __init__(self, iter: int, what: str) -> None:
        super().__init__(
            f"training diverged at iteration {iter + 1}: {what}; the update was not applied"
        )
        self.iter = iter


@runtime_checkable
class SolverCallback(Protocol):
    """What the solver calls around each iteration (Caffe's ``Solver::Callback``).

    A data-parallel driver registers one per rank with :meth:`SGD.add_callback` (as Caffe's
    ``P2PSync`` does with ``solver_->add_callback(this)``) and then runs
    :meth:`SGD.iteration`: the solver owns the loop, the callback the communication.
    """

    def on_start(self) -> None:
        """Before the forward/backward pass of an iteration."""

    def on_gradients_ready(self) -> None:
        """After the backward pass, before the update."""


@runtime_checkable
class GradientCallback(SolverCallback, Protocol):
    """A callback that also takes gradients one parameter at a time, as the backward pass
    writes them (:meth:`SGD.gradient_ready`): a driver that starts communicating a bucket
    of gradients while backward still computes the earlier layers."""

    def on_gradient_ready(self, name: str) -> None:
        """``params.grad_views[name]`` holds its final gradient for this iteration."""


class Callback:
    """A SolverCallback that does nothing; subclass it and override what you need."""

    def on_start(self) -> None:
        """Before the forward pass of an iteration (nothing here)."""

    def on_gradients_ready(self) -> None:
        """After the backward pass, before the update (nothing here)."""


def _given(value: T | None) -> T:
    """A policy parameter that ``__init__`` required for the policy in force."""
    assert value is not None, "the lr_policy's parameters are checked in __init__"
    return value


class SGD:
    """Stochastic gradient descent over a :class:`FlatParams`, as Caffe's ``SGDSolver``.

    ``params`` are the parameters it updates (their gradients are read from
    ``params.grad``). ``lr`` is Caffe's ``base_lr``; ``momentum`` and ``weight_decay``
    are Caffe's (the update is ``g += weight_decay * w; v = momentum * v + rate * g;
    w -= v``, ``rate`` the policy's learning rate at the iteration). ``lr_policy`` is
    one of fixed, step, exp, inv, multistep, poly, sigmoid, with Caffe's formulas
    (``iter`` is :attr:`iter`)::

        fixed      lr
        step       lr * gamma ** floor(iter / stepsize)
        exp        lr * gamma ** iter
        inv        lr * (1 + gamma * iter) ** (-power)
        multistep  lr * gamma ** (number of stepvalue entries <= iter)
        poly       lr * (1 - iter / max_iter) ** power     (0 from max_iter on)
        sigmoid    lr / (1 + exp(-gamma * (iter - stepsize)))

    A policy's parameters are required (ValueError names the missing ones); parameters
    it does not use are ignored.

    ``clip_gradients`` (Caffe's ``clip_gradients``; None: off): before the update, when
    the L2 norm of the whole gradient exceeds it, every gradient is scaled by
    ``clip_gradients / norm`` (Caffe's ``SGDSolver::ClipGradients``; the norm is summed in
    float64, Caffe sums it in the parameters' dtype). ``callbacks`` are SolverCallback objects, run in order
    by :meth:`iteration`; :attr:`callback_s` is the time spent inside them, of which
    :attr:`gradients_ready_s` inside ``on_gradients_ready`` (from the end of the backward
    pass to the update: the communication the backward pass did not hide).

    ``check_finite`` (default on): :meth:`iteration` raises :class:`Diverged` when the
    loss is not finite (before the callbacks, so before any communication) or when the
    gradient it is about to apply is not (after them, before the update). A NaN would
    otherwise spread silently through every later step.
    """

    def __init__(
        self,
        params: FlatParams,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_policy: str = "fixed",
        *,
        gamma: float | None = None,
        power: float | None = None,
        stepsize: int | None = None,
        stepvalue: Sequence[int] | None = None,
        max_iter: int | None = None,
        clip_gradients: float | None = None,
        callbacks: Iterable[SolverCallback] = (),
        check_finite: bool = True,
    ) -> None:
        if not isinstance(params, FlatParams):
            raise TypeError(f"params must be a FlatParams, got {type(params).__name__}")
        self.params = params
        self.base_lr = check_real(lr, "lr", min=0.0)
        self.momentum = check_real(momentum, "momentum", min=0.0)
        if self.momentum >= 1.0:  # the history would grow without bound
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum:g}")
        self.weight_decay = check_real(weight_decay, "weight_decay", min=0.0)
        check_policy(
            lr_policy,
            gamma=gamma,
            power=power,
            stepsize=stepsize,
            stepvalue=stepvalue,
            max_iter=max_iter,
        )
        self.lr_policy = lr_policy
        # Sigmoid uses a negative gamma on purpose, for a decaying rate.
        needs = _POLICY_NEEDS[lr_policy]
        self.gamma = self._policy_real(
            "gamma", gamma, lr_policy, "gamma" in needs and lr_policy != "sigmoid"
        )
        self.power = self._policy_real("power", power, lr_policy, "power" in needs)
        self.stepsize = None if stepsize is None else check_int(stepsize, "stepsize", min=1)
        self.max_iter = None if max_iter is None else check_int(max_iter, "max_iter", min=1)
        self.stepvalue = None if stepvalue is None else self._check_stepvalue(stepvalue)
        self.clip_gradients = (
            None
            if clip_gradients is None
            else check_real(clip_gradients, "clip_gradients", min=0.0)
        )

        self.check_finite = bool(check_finite)
        self.last_grad_norm: float | None = None  # before clipping, with clip_gradients
        self.iter = 0
        self.history = self._zeros_like_data()
        # Seconds spent inside the callbacks' hooks, over the solver's life: for a
        # synchronising callback, the time its rank spends communicating.
        self.callback_s = 0.0
        self.gradients_ready_s = 0.0
        self._callbacks: list[SolverCallback] = []
        self._ready_hooks: list[Callable[[str], None]] = []
        for cb in callbacks:
            self.add_callback(cb)
        self._kernel = self._update_kernel()

    # -- validation -----------------------------------------------------------------------
    @staticmethod
    def _policy_real(
        name: str, value: float | None, policy: str, nonnegative: bool
    ) -> float | None:
        """``gamma`` or ``power``: >= 0 where the policy uses it so (a negative gamma makes
        step/exp/multistep flip sign and inv blow up, a negative power blows up inv and
        poly), any finite number where the policy ignores it."""
        if value is None:
            return None
        if nonnegative:
            return check_real(value, f"{name} for lr_policy {policy!r}", min=0.0)
        return check_real(value, name)

    @staticmethod
    def _check_stepvalue(stepvalue: Sequence[int]) -> tuple[int, ...]:
        if isinstance(stepvalue, (str, bytes)) or not isinstance(stepvalue, Iterable):
            raise TypeError(f"stepvalue must be a list of ints, got {stepvalue!r}")
        values = tuple(check_int(v, f"stepvalue[{i}]", min=0) for i, v in enumerate(stepvalue))
        if not values or any(b <= a for a, b in zip(values[:-1], values[1:], strict=True)):
            # Caffe advances one step per iteration, so it needs increasing values too.
            raise ValueError(f"stepvalue must be a non-empty increasing list, got {list(values)}")
        return values

    # -- buffers and kernel ---------------------------------------------------------------
    def _zeros_like_data(self) -> Any:
        p = self.params
        if p.device is None:
            return np.zeros(p.size, dtype=p.dtype)
        return p.device.zeros((p.size,), p.dtype)

    def _update_kernel(self) -> Callable[..., Any]:
        device = self.params.device
        if device is not None:
            return device.sgd_update
        from . import _native

        def kernel(w: Any, g: Any, v: Any, lr: float, momentum: float, wd: float) -> None:
            _native.sgd_update(w, g, v, lr, momentum, wd, nthreads=1)

        return kernel

    # -- learning rate --------------------------------------------------------------------
    def learning_rate(self) -> float:
        """The learning rate at the current iteration (Caffe's ``GetLearningRate``)."""
        it = self.iter
        base, policy = self.base_lr, self.lr_policy
        if policy == "fixed":
            return base
        if policy == "step":
            return base * _given(self.gamma) ** (it // _given(self.stepsize))
        if policy == "exp":
            return base * _given(self.gamma) ** it
        if policy == "inv":
            return base * (1.0 + _given(self.gamma) * it) ** (-_given(self.power))
        if policy == "multistep":
            return base * _given(self.gamma) ** bisect.bisect_right(_given(self.stepvalue), it)
        if policy == "poly":
            # Caffe's formula is undefined past max_iter (a negative base); the rate is 0.
            frac = max(0.0, 1.0 - it / _given(self.max_iter))
            return base * frac ** _given(self.power)
        # sigmoid
        return base * (1.0 / (1.0 + math.exp(-_given(self.gamma) * (it - _given(self.stepsize)))))

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> None:
        """Apply one update from ``params.grad`` and advance :attr:`iter`.

        The kernel may overwrite ``params.grad`` (Caffe leaves the update value there).
        """
        p = self.params
        if self.clip_gradients is not None:
            self._clip(p.grad, self.clip_gradients)
        self._kernel(
            p.data, p.grad, self.history, self.learning_rate(), self.momentum, self.weight_decay
        )
        self.iter += 1

    def _clip(self, grad: Array, clip: float) -> None:
        """Caffe's rule: scale every gradient by ``clip / norm`` when the L2 norm of
        them all is above ``clip``. The squares are summed in float64 by numpy's pairwise
        sum (the same on every rank and every run, whatever the BLAS threads)."""
        xp = self.params.xp
        norm = math.sqrt(float(xp.square(grad, dtype=xp.float64).sum()))
        if norm > clip:
            grad *= grad.dtype.type(clip / norm)
        self.last_grad_norm = norm

    def add_callback(self, callback: SolverCallback) -> None:
        """Append a callback; it runs after those added before it."""
        for method in ("on_start", "on_gradients_ready"):
            if not callable(getattr(callback, method, None)):
                raise TypeError(
                    f"a solver callback needs on_start() and on_gradients_ready(); "
                    f"{callback!r} lacks {method}()"
                )
        self._callbacks.append(callback)
        self._update_ready_hooks()

    def _update_ready_hooks(self) -> None:
        self._ready_hooks = [
            cb.on_gradient_ready for cb in self._callbacks if isinstance(cb, GradientCallback)
        ]

    @property
    def takes_gradients(self) -> bool:
        """Whether a callback takes gradients one parameter at a time (then pass
        :meth:`gradient_ready` to the backward pass)."""
        return bool(self._ready_hooks)

    def gradient_ready(self, name: str) -> None:
        """Pass ``name`` (a parameter whose gradient the backward pass has just written)
        to every callback with an ``on_gradient_ready``; call it from inside
        ``compute_grads``. The time is added to :attr:`callback_s`."""
        hooks = self._ready_hooks
        if not hooks:
            return
        t0 = time.perf_counter()
        try:
            for hook in hooks:
                hook(name)
        finally:
            self.callback_s += time.perf_counter() - t0

    def remove_callback(self, callback: SolverCallback) -> None:
        """Remove a callback added before (ValueError if it is not registered)."""
        for i, cb in enumerate(self._callbacks):
            if cb is callback:
                del self._callbacks[i]
                self._update_ready_hooks()
                return
        raise ValueError(f"{callback!r} is not a callback of this solver")

    @property
    def callbacks(self) -> tuple[SolverCallback, ...]:
        """The callbacks :meth:`iteration` runs, in order."""
        return tuple(self._callbacks)

    def iteration(self, compute_grads: Callable[[], T], *, update: bool = True) -> T:
        """One training iteration, as Caffe's ``Solver::Step`` body: the one loop.

        Runs every callback's ``on_start``, then ``compute_grads()`` (which fills
        ``params.grad`` and returns the loss), every callback's ``on_gradients_ready``, then
        :meth:`step`. Returns what ``compute_grads`` returned. The time inside the hooks is
        added to :attr:`callback_s`.

        ``update=False`` advances :attr:`iter` without touching the parameters: for a
        replica whose parameters come from elsewhere (the non-root ranks of a root-update
        sync, which its next ``on_start`` refreshes).

        Gradient readiness finer than the whole buffer: ``compute_grads`` may announce each
        parameter as the backward pass writes it (:meth:`gradient_ready`), which passes it
        to the callbacks that take them, inside this same iteration (to overlap
        communication with the backward pass).

        With :attr:`check_finite`, a loss (a real number) or a gradient to apply that is
        not finite raises :class:`Diverged` before anything is updated.
        """
        self._call_timed([cb.on_start for cb in self._callbacks])
        loss = compute_grads()
        if self.check_finite and isinstance(loss, numbers.Real) and not math.isfinite(loss):
            raise Diverged(self.iter, f"the loss is {float(loss)}")
        t0 = self.callback_s
        self._call_timed([cb.on_gradients_ready for cb in self._callbacks])
        self.gradients_ready_s += self.callback_s - t0
        if update:
            if self.check_finite and not bool(np.isfinite(self.params.grad).all()):
                raise Diverged(self.iter, "the gradient holds values that are not finite")
            self.step()
        else:
            self.iter += 1
        return loss

    def _call_timed(self, hooks: list[Callable[[], None]]) -> None:
        """Call the callbacks' ``hooks`` in order, timing them into :attr:`callback_s`."""
        if not hooks:
            return
        t0 = time.perf_counter()
        try:
            for hook in hooks:
                hook()
        finally:
            self.callback_s += time.perf_counter() - t0

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The iteration and a host copy of the momentum history (Caffe's SolverState)."""
        p = self.params
        if p.device is None:
            history = self.history.copy()
        else:
            history = np.asarray(p.device.to_host(self.history))
        return {"iter": self.iter, "history": history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``, :meth:`state_dict` output, bitwise (checked before anything
        is written)."""
        try:
            it, history = state["iter"], state["history"]
        except (KeyError, TypeError):
            raise ValueError("state must be a dict with 'iter' and 'history'") from None
        # np.savez gives the iteration back as a 0-d array: its scalar is checked
        it = check_int(np.asarray(it)[()], "state 'iter'", min=0)
        history = np.asarray(history)
        p = self.params
        if history.shape != (p.size,) or history.dtype != p.dtype:
            raise ValueError(
                f"state 'history' must be a {p.dtype} array of shape ({p.size},), "
                f"got {history.dtype} {history.shape}"
            )
        if p.device is None or p.device.xp is np:
            self.history[...] = history
        else:
            with p.device.activate():
                self.history[...] = p.device.from_host(np.ascontiguousarray(history))
        self.iter = it
