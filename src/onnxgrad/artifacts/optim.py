"""The optimizers of :mod:`onnxgrad.train.optim` written as ONNX nodes.

Each update is the numpy optimizer's, operation for operation and in the same order, so that the
one-graph step gives the same numbers: the scalars that numpy computes in Python floats (bias
corrections, ``-lr / bias1``, ``1 - lr wd``) are computed here in double from the ``lr`` (double)
and ``step`` (int64, the number of updates already made) inputs, then cast to the parameter's type,
as numpy rounds a Python float meeting a float32 array. Tensor arithmetic stays in the parameter's
type. ``scalar_dtype=FLOAT`` computes those scalars in float32 instead (after one Cast of ``lr`` and
of ``step``), for runtimes without float64 kernels: WebGPU (:mod:`onnxgrad.artifacts.webgpu`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx import TensorProto

from ..errors import InputError, NotFoundError
from ..model.emit import Emitter
from ..train.optim import SGD, Adam, AdamW, Optimizer

__all__ = ["OPTIMIZERS", "STATE_KEYS", "emit_updates", "hyperparameters"]

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
DOUBLE = TensorProto.DOUBLE


@dataclass(frozen=True)
class Param:
    name: str  # the graph input holding the parameter
    grad: str  # the value holding its gradient
    dtype: int  # ONNX element type


def hyperparameters(optimizer: str, options: dict) -> dict:
    """The optimizer's hyperparameters with defaults filled in, validated by the numpy class."""
    import numpy as np

    key = optimizer.lower()
    if key not in OPTIMIZERS:
        raise InputError(f"unknown optimizer {optimizer!r}; expected one of {list(OPTIMIZERS)}")
    cls = OPTIMIZERS[key]
    probe = cls({"p": np.zeros(1, np.float32)}, lr=1e-3, **options)  # validates, fills defaults
    if key == "sgd":
        return {
            "momentum": probe.momentum,
            "dampening": probe.dampening,
            "nesterov": bool(probe.nesterov),
            "weight_decay": probe.weight_decay,
        }
    return {"betas": list(probe.betas), "eps": probe.eps, "weight_decay": probe.weight_decay}


def STATE_KEYS(optimizer: str, hyper: dict) -> list[str]:
    """The state tensors each parameter carries, in order (same names as the numpy state)."""
    if optimizer == "sgd":
        return ["momentum_buffer"] if hyper["momentum"] else []
    return ["exp_avg", "exp_avg_sq"]


def emit_updates(
    e: Emitter,
    optimizer: str,
    hyper: dict,
    params: list[Param],
    state: dict[tuple[str, str], str],
    lr: str,
    step: str,
    scalar_dtype: int = DOUBLE,
) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """Append the update nodes: (param -> its new value, (param, key) -> new state value).

    ``scalar_dtype``: the type the per-step scalars are computed in (DOUBLE as numpy, or FLOAT).
    """
    if scalar_dtype not in (DOUBLE, TensorProto.FLOAT):
        raise InputError(f"optimizer scalars are computed in double or float, not type {scalar_dtype}")
    scalars = _Scalars(e, lr, step, scalar_dtype)
    new_params: dict[str, str] = {}
    new_state: dict[tuple[str, str], str] = {}
    for p in params:
        if optimizer == "sgd":
            new_params[p.name] = _sgd(e, hyper, p, state, new_state, scalars)
        else:
            new_params[p.name] = _adam(e, optimizer, hyper, p, state, new_state, scalars)
    return new_params, new_state


class _Scalars:
    """Scalars (double, or float with ``dtype=FLOAT``) computed once per graph, cast once per
    parameter type."""

    def __init__(self, e: Emitter, lr: str, step: str, dtype: int = DOUBLE) -> None:
        self.e, self.step, self.dtype = e, step, dtype
        self.lr = lr if dtype == DOUBLE else e.op("Cast", lr, to=dtype)
        self._cache: dict[tuple, str] = {}

    def double(self, key: str) -> str:
        if (key,) in self._cache:
            return self._cache[(key,)]
        e = self.e
        if key == "t":  # the 1-based index of this update, as Adam's state["step"]
            out = e.op("Add", e.op("Cast", self.step, to=self.dtype), e.const(1.0, self.dtype))
        elif key == "neg_lr":
            out = e.op("Neg", self.lr)
        elif key == "first":  # no update made yet: SGD's momentum buffer starts as the gradient
            out = e.op("Equal", self.step, e.const(0, TensorProto.INT64))
        else:
            raise NotFoundError(f"no shared update value {key!r}; have 't', 'neg_lr', 'first'")
        self._cache[(key,)] = out
        return out

    def cast(self, value: str, dtype: int) -> str:
        key = ("cast", value, dtype)
        if key not in self._cache:
            self._cache[key] = value if dtype == self.dtype else self.e.op("Cast", value, to=dtype)
        return self._cache[key]

    def memo(self, key: tuple, make) -> str:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


def _one_minus_power(e: Emitter, beta: float, t: str, dtype: int) -> str:
    """``1 - beta**t`` in float32 as ``-expm1(t ln beta)``, within a few ulps of the double value.

    ``1 - Pow(float32(beta), t)`` would lose digits twice: float32(0.999) is 1.3e-5 away from 0.999
    relative to ``1 - 0.999``, and the subtraction cancels. ``ln beta`` is taken in double here;
    expm1 is its Taylor series (Horner, 11 terms) where ``|u| < 0.5`` and ``exp(u) - 1`` elsewhere.
    """
    u = e.op("Mul", t, e.const(math.log(beta) if beta > 0 else -math.inf, dtype))
    series = e.const(1.0, dtype)
    for k in range(11, 1, -1):  # 1 + u/2 (1 + u/3 (... (1 + u/11)))
        series = e.op(
            "Add", e.const(1.0, dtype), e.op("Mul", e.op("Mul", u, e.const(1.0 / k, dtype)), series)
        )
    small = e.op("Mul", u, series)
    large = e.op("Sub", e.op("Exp", u), e.const(1.0, dtype))
    expm1 = e.op("Where", e.op("Greater", u, e.const(-0.5, dtype)), small, large)
    return e.op("Neg", expm1)


def _decayed(e: Emitter, p: Param, weight_decay: float) -> str:
    """``grad + wd p`` (torch's L2 form), as numpy writes it: ``p * wd`` then ``+= grad``."""
    if not weight_decay:
        return p.grad
    return e.op("Add", e.op("Mul", p.name, e.const(weight_decay, p.dtype)), p.grad)


def _sgd(e, hyper, p: Param, state, new_state, s: _Scalars) -> str:
    d = _decayed(e, p, hyper["weight_decay"])
    neg_lr = s.cast(s.double("neg_lr"), p.dtype)
    momentum = hyper["momentum"]
    if not momentum:
        return e.op("Add", p.name, e.op("Mul", d, neg_lr))
    buf = state[(p.name, "momentum_buffer")]
    scaled = e.op("Mul", buf, e.const(momentum, p.dtype))
    if hyper["dampening"]:
        later = e.op("Add", scaled, e.op("Mul", d, e.const(1.0 - hyper["dampening"], p.dtype)))
    else:
        later = e.op("Add", scaled, d)
    new_buf = e.op("Where", s.double("first"), d, later)
    new_state[(p.name, "momentum_buffer")] = new_buf
    if hyper["nesterov"]:  # p -= lr d; p -= lr μ b (two adds, as numpy)
        neg_lr_mu = s.memo(
            ("neg_lr_mu", p.dtype),
            lambda: s.cast(e.op("Mul", s.double("neg_lr"), e.const(momentum, s.dtype)), p.dtype),
        )
        first = e.op("Add", p.name, e.op("Mul", d, neg_lr))
        return e.op("Add", first, e.op("Mul", new_buf, neg_lr_mu))
    return e.op("Add", p.name, e.op("Mul", new_buf, neg_lr))


def _adam(e, optimizer, hyper, p: Param, state, new_state, s: _Scalars) -> str:
    beta1, beta2 = hyper["betas"]
    wd = hyper["weight_decay"]
    param = p.name
    if optimizer == "adamw":
        g = p.grad
        if wd:  # p *= 1 - lr wd, the factor computed in double
            decay = s.memo(
                ("decay", p.dtype),
                lambda: s.cast(
                    e.op("Sub", e.const(1.0, s.dtype), e.op("Mul", s.lr, e.const(wd, s.dtype))), p.dtype
                ),
            )
            param = e.op("Mul", param, decay)
    else:
        g = _decayed(e, p, wd)
    m, v = state[(p.name, "exp_avg")], state[(p.name, "exp_avg_sq")]
    # m.lerp_(g, 1 - β1): m + (1 - β1)(g - m); v = β2 v + (1 - β2) g²
    new_m = e.op("Add", m, e.op("Mul", e.op("Sub", g, m), e.const(1.0 - beta1, p.dtype)))
    new_v = e.op(
        "Add",
        e.op("Mul", v, e.const(beta2, p.dtype)),
        e.op("Mul", e.op("Mul", g, g), e.const(1.0 - beta2, p.dtype)),
    )
    new_state[(p.name, "exp_avg")], new_state[(p.name, "exp_avg_sq")] = new_m, new_v

    def bias(beta: float) -> str:  # 1 - β^t in double, or in float without the cancellation
        if s.dtype != DOUBLE:
            return _one_minus_power(e, beta, s.double("t"), s.dtype)
        return e.op("Sub", e.const(1.0, s.dtype), e.op("Pow", e.const(beta, s.dtype), s.double("t")))

    sqrt_bias2 = s.memo(("sqrt_bias2", p.dtype), lambda: s.cast(e.op("Sqrt", bias(beta2)), p.dtype))
    step_size = s.memo(
        ("step_size", p.dtype), lambda: s.cast(e.op("Div", s.double("neg_lr"), bias(beta1)), p.dtype)
    )
    denom = e.op("Add", e.op("Div", e.op("Sqrt", new_v), sqrt_bias2), e.const(hyper["eps"], p.dtype))
    return e.op("Add", param, e.op("Mul", e.op("Div", new_m, denom), step_size))
