"""Optimizers that update numpy parameter arrays in place, with the math of ``torch.optim``.

They work on the live buffers of :attr:`onnxgrad.ForwardBackward.parameters`: an update made by
:meth:`Optimizer.step` is what the next forward sees, with no copy. Apart from the optimizer state
(momentum, moments), each parameter gets at most two scratch buffers, allocated once; a step
allocates nothing else. ``lr`` is a number or a schedule (:mod:`onnxgrad.train.schedules`, or any
callable ``step -> lr``), read once per step: changing it never rebuilds anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import InputError
from .schedules import LearningRate, as_schedule

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm", "clip_grad_value"]


class Optimizer:
    """Base class: holds the parameters by name, their state and scratch buffers.

    ``params``: name -> float numpy array, updated in place. Replacing an array elsewhere (e.g. with
    ``ForwardBackward.set_parameters``) detaches it from the optimizer: build a new one then.
    ``lr``: a number, or a schedule ``step -> lr`` evaluated at :attr:`iterations` on each step.
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: LearningRate) -> None:
        self.params: dict[str, np.ndarray] = {}
        for name, p in params.items():
            if not isinstance(p, np.ndarray) or not np.issubdtype(p.dtype, np.floating):
                raise InputError(f"parameter {name!r} must be a floating-point numpy array")
            if not p.flags.writeable:
                raise InputError(f"parameter {name!r} is read-only: it cannot be updated in place")
            self.params[name] = p
        self.schedule = as_schedule(lr)
        self.iterations = 0  # updates made so far: the step the schedule is evaluated at
        self.lr = self._scheduled_lr()
        self.state: dict[str, dict[str, Any]] = {name: {} for name in self.params}
        self._scratch: dict[str, list[np.ndarray]] = {name: [] for name in self.params}

    def _scheduled_lr(self) -> float:
        lr = float(self.schedule(self.iterations))
        _check_non_negative(lr=lr)
        return lr

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        """Apply one update from ``grads`` (name -> gradient); parameters without one are left."""
        unknown = [k for k in grads if k not in self.params]
        if unknown:
            raise InputError(f"gradients given for {unknown}, which are not optimizer parameters")
        checked = []
        for name, grad in grads.items():
            p = self.params[name]
            grad = np.asarray(grad)
            if grad.shape != p.shape:
                raise InputError(f"gradient of {name!r} has shape {grad.shape}, the parameter has {p.shape}")
            checked.append((name, p, grad))
        self.lr = self._scheduled_lr()
        for name, p, grad in checked:
            self._update(name, p, grad)
        self.iterations += 1

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step counter and a copy of the per-parameter state (momenta, moments, counts)."""
        state = {
            name: {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in s.items()}
            for name, s in self.state.items()
        }
        return {"iterations": self.iterations, "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, so the next step is the one that would have come."""
        state = state_dict["state"]
        if set(state) != set(self.params):
            raise InputError(
                f"the optimizer state is for parameters {sorted(state)}, "
                f"this optimizer has {sorted(self.params)}"
            )
        for name, values in state.items():
            p = self.params[name]
            restored = {}
            for key, value in values.items():
                if isinstance(value, np.ndarray):
                    if value.shape != p.shape:
                        raise InputError(f"state {key!r} of {name!r} has shape {value.shape}, not {p.shape}")
                    value = np.array(value, dtype=p.dtype, copy=True)
                restored[key] = value
            self.state[name] = restored
        self.iterations = int(state_dict["iterations"])
        self.lr = self._scheduled_lr()

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        raise NotImplementedError

    def _buffer(self, name: str, index: int) -> np.ndarray:
        """Scratch buffer ``index`` of parameter ``name``, allocated on first use."""
        bufs = self._scratch[name]
        while len(bufs) <= index:
            bufs.append(np.empty_like(self.params[name]))
        return bufs[index]

    def _decayed(self, name: str, p: np.ndarray, grad: np.ndarray, weight_decay: float) -> np.ndarray:
        """``grad + weight_decay * p`` (L2 penalty, as torch), in scratch buffer 1 when needed."""
        if not weight_decay:
            return grad
        d = self._buffer(name, 1)
        np.multiply(p, weight_decay, out=d)
        d += grad
        return d


def _check_non_negative(**values: float) -> None:
    for key, value in values.items():
        if not value >= 0:
            raise InputError(f"{key} must be >= 0, got {value}")


def _add_scaled(p: np.ndarray, alpha: float, x: np.ndarray, scratch: np.ndarray) -> None:
    """``p += alpha * x`` through ``scratch`` (which may be ``x`` itself), without allocating."""
    np.multiply(x, alpha, out=scratch)
    p += scratch


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay.

    Same update as ``torch.optim.SGD``: ``d = g + wd p``; ``b = d`` on the first step, then
    ``b = μ b + (1 - dampening) d``; ``d = d + μ b`` (Nesterov) or ``d = b``; ``p -= lr d``.
    """

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: LearningRate,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        _check_non_negative(momentum=momentum, weight_decay=weight_decay, dampening=dampening)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise InputError("Nesterov momentum requires momentum > 0 and dampening = 0")
        self.momentum, self.nesterov = float(momentum), nesterov
        self.weight_decay, self.dampening = float(weight_decay), float(dampening)

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        s = self._buffer(name, 0)
        d = self._decayed(name, p, grad, self.weight_decay)
        if not self.momentum:
            _add_scaled(p, -self.lr, d, s)
            return
        state = self.state[name]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = np.array(d, dtype=p.dtype, copy=True)
        else:
            buf *= self.momentum
            if self.dampening:
                _add_scaled(buf, 1.0 - self.dampening, d, s)
            else:
                buf += d
        if self.nesterov:  # p -= lr (d + μ b), as two scaled adds to stay allocation-free
            _add_scaled(p, -self.lr, d, s)
            _add_scaled(p, -self.lr * self.momentum, buf, s)
        else:
            _add_scaled(p, -self.lr, buf, s)


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay, the update of ``torch.optim.Adam``."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: LearningRate = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        beta1, beta2 = betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise InputError(f"betas must be in [0, 1), got {betas}")
        _check_non_negative(eps=eps, weight_decay=weight_decay)
        self.betas = (float(beta1), float(beta2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        self._adam(name, p, self._decayed(name, p, grad, self.weight_decay))

    def _adam(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        """``m ← β1 m + (1-β1) g``, ``v ← β2 v + (1-β2) g²``, ``p -= lr m̂ / (√v̂ + eps)``."""
        beta1, beta2 = self.betas
        state = self.state[name]
        if not state:
            state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
        state["step"] += 1
        m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        s = self._buffer(name, 0)
        np.subtract(g, m, out=s)  # m.lerp_(g, 1 - β1), as torch writes it
        _add_scaled(m, 1.0 - beta1, s, s)
        v *= beta2
        np.multiply(g, g, out=s)
        _add_scaled(v, 1.0 - beta2, s, s)
        bias1, bias2 = 1.0 - beta1**t, 1.0 - beta2**t
        np.sqrt(v, out=s)
        s /= math.sqrt(bias2)
        s += self.eps
        np.divide(m, s, out=s)
        _add_scaled(p, -self.lr / bias1, s, s)


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW``): ``p *= 1 - lr wd``, then Adam on
    the raw gradient. The decay follows the scheduled learning rate."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: LearningRate = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        if self.weight_decay:
            p *= 1.0 - self.lr * self.weight_decay
        self._adam(name, p, grad)


# ---- gradient clipping -------------------------------------------------------------------------
def clip_grad_norm(grads: dict[str, np.ndarray], max_norm: float, norm_type: float = 2.0) -> float:
    """Scale every gradient of ``grads`` by one factor so that their global norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``; returns the global norm before clipping.

    The global norm is the ``norm_type``-norm of the per-gradient norms (``inf``: the largest
    absolute value); the factor is ``max_norm / (norm + 1e-6)`` when below 1. Arrays are scaled in
    place (a read-only one is replaced in ``grads`` by a scaled copy). A non-finite norm raises
    :class:`InputError`: scaling by it would turn every gradient into NaN.
    """
    _check_positive(max_norm=max_norm, norm_type=norm_type)
    if not grads:
        return 0.0
    if math.isinf(norm_type):
        total = max(float(np.max(np.abs(g))) if g.size else 0.0 for g in grads.values())
    else:
        norms = [np.linalg.norm(g.ravel().astype(np.float64), ord=norm_type) for g in grads.values()]
        total = float(np.linalg.norm(np.asarray(norms), ord=norm_type))
    if not math.isfinite(total):
        raise InputError(f"the gradients' global norm is {total}: they cannot be clipped")
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for name, g in grads.items():
            if g.flags.writeable:
                g *= coef
            else:
                grads[name] = g * np.asarray(coef, dtype=g.dtype)
    return total


def clip_grad_value(grads: dict[str, np.ndarray], clip_value: float) -> None:
    """Clip every gradient element to ``[-clip_value, clip_value]``, as
    ``torch.nn.utils.clip_grad_value_`` (in place; a read-only array is replaced by a clipped copy)."""
    _check_positive(clip_value=clip_value)
    for name, g in grads.items():
        if g.flags.writeable:
            np.clip(g, -clip_value, clip_value, out=g)
        else:
            grads[name] = np.clip(g, -clip_value, clip_value)


def _check_positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise InputError(f"{key} must be > 0, got {value}")


class ElasticPenalty(Optimizer):
    """onnxcustom's ``ElasticLearningPenalty(l1, l2)``: another optimizer whose parameters are
    shrunk before each of its updates, ``W ← (1 - 2 l2) W - l1 sign(W)``.

    As in onnxcustom, the shrinking does not depend on the learning rate, and the gradient the
    inner optimizer applies is the data loss's alone (computed at the weights before the shrink).
    The penalty onnxcustom added to the loss it reported, ``l1 Σ|W| + l2 Σ W²``, is
    :meth:`penalty`. The defaults, 0.01 each, are what onnxcustom applied whatever it was given
    (its class defaulted to 0.5 but never passed its values to the ONNX functions, whose defaults
    were 0.01). ``optimizer``: the inner optimizer's class (:class:`SGD` by default), built
    with ``lr`` and ``options``. For the :class:`~onnxgrad.train.Trainer`, give the class and
    ``optimizer_options={"l1": ..., "l2": ...}``; for the scikit-learn estimators, a factory such as
    ``functools.partial(ElasticPenalty, lr=0.01, l1=1e-4, l2=1e-4)``.
    """

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: LearningRate,
        l1: float = 0.01,
        l2: float = 0.01,
        optimizer: type[Optimizer] = SGD,
        **options: Any,
    ) -> None:
        _check_non_negative(l1=l1, l2=l2)
        if l2 > 0.5:
            raise InputError(f"l2 must be <= 0.5 (the shrinking factor 1 - 2 l2 would be negative), got {l2}")
        self.inner = optimizer(params, lr=lr, **options)
        super().__init__(self.inner.params, self.inner.schedule)
        self.state = self.inner.state  # one state: checkpoints hold the inner optimizer's
        self.l1, self.l2 = float(l1), float(l2)

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        sign = self._buffer(name, 0)
        np.sign(p, out=sign)
        p *= 1.0 - 2.0 * self.l2
        _add_scaled(p, -self.l1, sign, sign)
        self.inner.lr, self.inner.iterations = self.lr, self.iterations
        self.inner._update(name, p, grad)

    def penalty(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """``Σ_W l1 Σ|W| + l2 Σ W²`` over ``params`` (default: the parameters it updates)."""
        values = self.params if params is None else params
        return float(
            sum(
                self.l1 * np.abs(w).sum(dtype=np.float64) + self.l2 * np.square(w, dtype=np.float64).sum()
                for w in values.values()
            )
        )
