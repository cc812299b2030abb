"""Elementwise ops: a table of formulas (one per input), like PyTorch's derivatives.yaml, then the
variadic Sum, Mean, Max, Min, and Cast, Where, Clip and Dropout.

Parameter names say what a formula reads: ``x`` (or ``a``, ``b``) the inputs, ``y`` the output,
``dy`` the output gradient, any other name the node attribute of that name. Reading ``y`` instead of
``x`` is a deliberate choice: it keeps the output alive for the backward, which the next node
usually saves anyway, and lets the input be freed.

Where PyTorch (``tools/autograd/derivatives.yaml``) makes a choice, at kinks and ties, so do these
rules: a kink takes the derivative of the branch torch's backward kernel picks there, and
Max/Min split the gradient evenly between tied inputs (see :func:`max_min`).

Dropout in training mode reads the mask its forward node draws.

onnxruntime's activations (``com.microsoft``: Gelu, FastGelu, QuickGelu, BiasGelu, BiasAdd) use the
same derivatives (FastGelu the tanh form of Gelu's), and SwiGLU (opset 28) is here too.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ...model.contrib_schemas import MS_DOMAIN
from ...model.graph import FLOAT_TYPES
from ..builder import (
    GradBuilder,
    Var,
    abs_,
    cast,
    cos,
    erf,
    exp,
    log,
    sigmoid,
    sign,
    sin,
    sqrt,
    tanh,
    where,
)
from ..registry import NodeContext, formulas, rule
from .common import Grads, first_only, node_label, optional_input, sum_to_scalar

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# fmt: off
# ---- unary ----------------------------------------------------------------------------------
formulas("Identity",   lambda dy: dy)
formulas("Neg",        lambda dy: -dy)
formulas("Exp",        lambda y, dy: dy * y)
formulas("Log",        lambda x, dy: dy / x)
formulas("Sqrt",       lambda y, dy: dy / (y * 2))
formulas("Reciprocal", lambda y, dy: -dy * y * y)
formulas("Abs",        lambda x, dy: dy * sign(x))
formulas("Relu",       lambda y, dy: dy * cast(y > 0, dy))  # Where with a scalar is 2x slower in onnxruntime
formulas("LeakyRelu",  lambda x, dy, alpha: where(x > 0, dy, dy * alpha))
formulas("Elu",        lambda x, y, dy, alpha=1.0: where(x > 0, dy, dy * (y + alpha)))
formulas("Sigmoid",    lambda y, dy: dy * y * (1 - y))
formulas("Tanh",       lambda y, dy: dy * (1 - y * y))
formulas("Softplus",   lambda x, dy: dy * sigmoid(x))
formulas("Erf",        lambda x, dy: dy * TWO_OVER_SQRT_PI * exp(-(x * x)))
formulas("Sin",        lambda x, dy: dy * cos(x))
formulas("Cos",        lambda x, dy: -dy * sin(x))
formulas("Tan",        lambda y, dy: dy * (y * y + 1))
formulas("Asin",       lambda x, dy: dy / sqrt(1 - x * x))
formulas("Acos",       lambda x, dy: -dy / sqrt(1 - x * x))
formulas("Atan",       lambda x, dy: dy / (x * x + 1))
formulas("Sinh",       lambda x, dy: dy * x.g.Cosh(x))
formulas("Cosh",       lambda x, dy: dy * x.g.Sinh(x))
formulas("Asinh",      lambda x, dy: dy / sqrt(x * x + 1))
formulas("Acosh",      lambda x, dy: dy / sqrt(x * x - 1))
formulas("Atanh",      lambda x, dy: dy / (1 - x * x))
formulas("Softsign",   lambda x, dy: dy / (abs_(x) + 1) ** 2)
# Kinks as torch: Selu/Celu take the x <= 0 branch at 0 (elu_backward; y > 0 iff x > 0), Shrink and
# ThresholdedRelu pass no gradient at |x| == lambd / x == alpha (softshrink/threshold_backward),
# HardSigmoid none at its corners (hardsigmoid_backward), HardSwish the outer pieces at -3 and 3
# (0 and dy, as hardswish_backward in torch 2.x).
formulas("Selu",       lambda y, dy, alpha, gamma: where(y > 0, dy * gamma, dy * (y + alpha * gamma)))
formulas("Celu",       lambda y, dy, alpha=1.0: where(y > 0, dy, dy * (y / alpha + 1)))
formulas("Shrink",     lambda x, dy, lambd=0.5: where(abs_(x) > lambd, dy, 0))
formulas("ThresholdedRelu", lambda x, dy, alpha=1.0: where(x > alpha, dy, 0))
formulas("HardSigmoid", lambda y, dy, alpha: where(y.g.And(y > 0, y < 1), dy * alpha, 0))
formulas("HardSwish",  lambda x, dy: where(x <= -3, 0, where(x < 3, dy * (x / 3 + 0.5), dy)))

# ---- binary, with broadcasting undone --------------------------------------------------------
formulas("Add", lambda dy: dy, lambda dy: dy, broadcast=True)
formulas("Sub", lambda dy: dy, lambda dy: -dy, broadcast=True)
formulas("Mul", lambda b, dy: dy * b, lambda a, dy: dy * a, broadcast=True)
formulas("Div", lambda b, dy: dy / b, lambda b, y, dy: -dy * y / b, broadcast=True)
# PRelu: slope broadcasts to x (unidirectionally); at x == 0 the slope branch, as torch.
formulas("PRelu", lambda a, b, dy: where(a > 0, dy, dy * b), lambda a, dy: where(a > 0, 0, dy * a),
         broadcast=True)
# Mod: y = a - b * q with q = trunc(a / b) (fmod=1, floats) or floor(a / b) (fmod=0), so
# da = dy and db = -dy * q; q is read back from the exact forward result as round((a - y) / b).
formulas("Mod", lambda dy: dy, lambda a, b, y, dy: -dy * b.g.Round((a - y) / b), broadcast=True)
# d/da a^b = b a^(b-1); d/db a^b = a^b log a, taken as 0 where a == 0 and b >= 0 (as PyTorch does).
# fmt: on


def _pow_exponent_grad(a, b, y, dy):
    """dy * a^b * log(a), with 0 where a == 0 and b >= 0, in b's dtype."""
    g = a.g
    zero_base = g.op("And", g.op("Equal", a, 0), g.op("GreaterOrEqual", b, g.const(0, b.dtype)))
    return cast(where(zero_base, 0, dy * y * log(a)), b)


formulas(
    "Pow",
    lambda a, b, dy: dy * cast(b, a) * a ** (cast(b, a) - 1),
    _pow_exponent_grad,
    broadcast=True,
)


def _gelu(x, dy, approximate="none"):
    """Gelu (opset 20): exact (erf) or tanh approximation, as torch.nn.functional.gelu."""
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * SQRT_2_OVER_PI
        t = inner.g.op("Tanh", inner)
        d_inner = (x * x * (3 * 0.044715) + 1) * SQRT_2_OVER_PI
        return dy * ((t + 1) * 0.5 + x * 0.5 * (1 - t * t) * d_inner)
    cdf = (erf(x * (1 / math.sqrt(2))) + 1) * 0.5
    pdf = exp(x * x * -0.5) * INV_SQRT_2PI
    return dy * (cdf + x * pdf)


formulas("Gelu", _gelu)


def _mish(x, dy):
    """y = x tanh(softplus(x)): dy (t + x sigmoid(x) (1 - t^2)), t = tanh(softplus(x)), as torch."""
    t = tanh(x.g.Softplus(x))
    return dy * (t + x * sigmoid(x) * (1 - t * t))


def _swish(x, dy, alpha=1.0):
    """y = x sigmoid(alpha x): dy (s + alpha x s (1 - s)), s = sigmoid(alpha x)."""
    s = sigmoid(x * alpha)
    return dy * (s + x * alpha * s * (1 - s))


formulas("Mish", _mish)
formulas("Swish", _swish, since=24)


# ---- variadic, with broadcasting undone ------------------------------------------------------
@rule("Sum")
def sum_(g: GradBuilder, n: NodeContext) -> Grads:
    """y = x1 + x2 + ...: dxi = dy, summed back to each input's shape."""
    return [
        g.unbroadcast(n.dy, x, n.y.shape) if need else None  # type: ignore[arg-type]
        for x, need in zip(n.inputs, n.needs)
    ]


@rule("Mean")
def mean(g: GradBuilder, n: NodeContext) -> Grads:
    """y = (x1 + ... + xk) / k: dxi = dy / k, summed back to each input's shape."""
    k = len(n.inputs)
    # scaled after un-broadcasting: on the smaller tensor
    return [
        (g.unbroadcast(n.dy, x, n.y.shape) / k if k > 1 else n.dy)  # type: ignore[arg-type]
        if need
        else None
        for x, need in zip(n.inputs, n.needs)
    ]


@rule("Max", "Min")
def max_min(g: GradBuilder, n: NodeContext) -> Grads:
    """y = max(x1, ..., xk) (or min): the gradient goes to the inputs equal to y, split evenly
    between ties: dxi = dy * [xi == y] / #{j : xj == y}. For two inputs this is
    torch.maximum/minimum's rule (half each on a tie); for more, torch.amax/amin's."""
    if len(n.inputs) == 1:
        return [n.dy if n.needs[0] else None]
    if not any(n.needs):
        return [None] * len(n.inputs)
    y = n.y
    masks = [g.Cast(g.Equal(x, y), to=y.dtype) for x in n.inputs]  # type: ignore[arg-type]
    share = n.dy / g.Sum(*masks)
    return [
        g.unbroadcast(share * m, x, y.shape) if need else None  # type: ignore[arg-type]
        for x, m, need in zip(n.inputs, masks, n.needs)
    ]


# ---- casts, selection, clamping --------------------------------------------------------------
@rule("Cast", "CastLike")
def cast_(g: GradBuilder, n: NodeContext) -> Grads:
    """A change of element type: dx = dy cast back to x's type. An integer x needs a gradient only
    when it stands for a real number (a quantized tensor, rules/quant.py): dx = dy, kept float."""
    if n.x.dtype not in FLOAT_TYPES:
        return first_only(n, n.dy)
    return first_only(n, cast(n.dy, n.x))


@rule("Where")
def where_(g: GradBuilder, n: NodeContext) -> Grads:
    """y = cond ? a : b: da = dy where cond, db = dy elsewhere, both un-broadcast; none for cond."""
    cond, a, b = n.inputs
    grads: Grads = [None, None, None]
    if n.needs[1]:
        grads[1] = g.unbroadcast(where(cond, n.dy, 0), a, n.y.shape)  # type: ignore[arg-type]
    if n.needs[2]:
        grads[2] = g.unbroadcast(where(cond, 0, n.dy), b, n.y.shape)  # type: ignore[arg-type]
    return grads


@rule("Clip")
def clip(g: GradBuilder, n: NodeContext) -> Grads:
    """y = min(max(x, lo), hi): dx = dy where lo <= x <= hi (inclusive, as torch.clamp);
    dlo = sum(dy where x < lo), dhi = sum(dy where x > hi)."""
    x, dy = n.x, n.dy
    if n.opset < 11:  # bounds are attributes
        lo_a, hi_a = n.attr("min"), n.attr("max")
        lo = None if lo_a is None else g.const(lo_a, x.dtype)
        hi = None if hi_a is None else g.const(hi_a, x.dtype)
    else:
        lo = n.inputs[1] if len(n.inputs) > 1 else None
        hi = n.inputs[2] if len(n.inputs) > 2 else None
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        inside = [x >= lo] if lo is not None else []
        inside += [x <= hi] if hi is not None else []
        mask = g.And(*inside) if len(inside) == 2 else inside[0] if inside else None
        grads[0] = dy if mask is None else where(mask, dy, 0)
    if lo is not None and n.opset >= 11 and n.needs[1]:
        grads[1] = sum_to_scalar(g, where(x < lo, dy, 0), lo)
    if hi is not None and n.opset >= 11 and n.needs[2]:
        grads[2] = sum_to_scalar(g, where(x > hi, dy, 0), hi)
    return grads


# ---- Dropout --------------------------------------------------------------------------------
def _dropout_training(n: NodeContext) -> bool | Var:
    """Whether a Dropout node trains: a bool when known while building, else its run-time flag."""
    if n.opset < 7:
        return not n.attr("is_test", 0)
    if n.opset < 12 or len(n.node.input) < 3 or not n.node.input[2]:
        return False  # opset 7-11 Dropout is the identity at inference; no flag means inference
    flag = n.const_input(2)
    if flag is None:
        return n.inputs[2]  # type: ignore[return-value]
    return bool(np.asarray(flag).reshape(-1)[0])


@rule("Dropout")
def dropout(g: GradBuilder, n: NodeContext) -> Grads:
    """Inference: dx = dy. Training: y = x mask / (1 - ratio), so dx = dy mask / (1 - ratio).

    The mask is the forward node's own Mask output (added to it when the model does not use it):
    the backward drops exactly what the forward dropped. With ``training_mode`` or ``ratio`` known
    only at run time, the scale is computed from them (1 when not training: the mask is then all
    true); ``where`` keeps dropped positions exactly 0.
    """
    grads: Grads = [None] * len(n.inputs)
    if not n.needs[0]:
        return grads
    training = _dropout_training(n)
    if training is False:
        grads[0] = n.dy
        return grads
    if n.opset < 12:
        raise GradientNotImplementedError(
            f"{node_label(n)}: Dropout before opset 7 in training mode (is_test=0) is not supported; "
            "convert the model to opset 12 or later (Dropout with a training_mode input)"
        )
    x, dy = n.x, n.dy
    mask = g.extra_output(n.node, 1, TensorProto.BOOL, x.shape)
    ratio_var = n.inputs[1] if len(n.inputs) > 1 else None
    ratio = n.const_input(1)
    scale: Var | float
    if ratio_var is not None and ratio is None:  # ratio computed at run time
        scale = g.Reciprocal(1.0 - cast(ratio_var, x))
    else:
        r = 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])
        scale = 1.0 / (1.0 - r) if r < 1.0 else 0.0  # ratio 1 drops everything (the mask is all false)
    if isinstance(training, Var):  # not training: y = x and the mask is all true, so no scaling
        scale = where(training, g.const(scale, x.dtype) if isinstance(scale, float) else scale, 1.0)
    scaled = dy if isinstance(scale, float) and scale == 1.0 else dy * scale
    grads[0] = where(mask, scaled, 0)
    return grads


# ---- onnxruntime's activations (com.microsoft) ---------------------------------------------------
# Gelu (erf form), FastGelu (tanh form): the derivative of the standard Gelu rule
formulas("Gelu", lambda x, dy: _gelu(x, dy), domain=MS_DOMAIN)


def _quick_gelu(x: Var, dy: Var, alpha: float = 1.702) -> Var:
    """y = x sigmoid(alpha x): dy (s + alpha x s (1 - s))."""
    s = sigmoid(x * alpha)
    return dy * (s + x * alpha * s * (1 - s))


formulas("QuickGelu", _quick_gelu, domain=MS_DOMAIN)


def _biased(g: GradBuilder, n: NodeContext, dx: Var) -> Grads:
    """[dX, dbias] of an op of X + bias (bias optional, broadcast over the leading axes)."""
    bias = optional_input(n, 1)
    db = g.unbroadcast(dx, bias, n.y.shape) if bias is not None and n.needs[1] else None
    return [dx if n.needs[0] else None, db][: len(n.inputs)]


@rule("FastGelu", domain=MS_DOMAIN)
def fast_gelu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = gelu_tanh(X + bias): dX = dy gelu_tanh'(X + bias), dbias = dX summed over the rows."""
    u = n.x if optional_input(n, 1) is None else n.x + n.inputs[1]
    return _biased(g, n, _gelu(u, n.dy, approximate="tanh"))


@rule("BiasGelu", domain=MS_DOMAIN)
def bias_gelu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = gelu(A + B) (erf form): dA = dy gelu'(A + B), dB = dA summed over the rows."""
    return _biased(g, n, _gelu(n.x + n.inputs[1], n.dy))


@rule("BiasAdd", domain=MS_DOMAIN)
def bias_add(g: GradBuilder, n: NodeContext) -> Grads:
    """y = X + bias + skip: dX = dskip = dy, dbias = dy summed over (N, S)."""
    dy = n.dy
    bias, skip = n.inputs[1], n.inputs[2]
    return [
        dy if n.needs[0] else None,
        g.unbroadcast(dy, bias, n.y.shape) if n.needs[1] else None,  # type: ignore[arg-type]
        g.unbroadcast(dy, skip, n.y.shape) if n.needs[2] else None,  # type: ignore[arg-type]
    ]


# ---- SwiGLU ---------------------------------------------------------------------------------
@rule("SwiGLU", since=28)
def swiglu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = a sigmoid(alpha a) b: da = dy b s (1 + alpha a (1 - s)), db = dy a s, s = sigmoid(alpha a)."""
    a, b = n.inputs[0], n.inputs[1]
    assert a is not None and b is not None
    alpha = float(n.attr("alpha", 1.0))
    s = sigmoid(a * alpha if alpha != 1.0 else a)
    da = n.dy * b * s * (a * alpha * (1.0 - s) + 1.0) if n.needs[0] else None
    db = n.dy * a * s if n.needs[1] else None
    return [da, db]
