"""Elementwise gradients as a table of formulas (one per input), like PyTorch's derivatives.yaml.

Parameter names say what a formula reads: ``x`` (or ``a``, ``b``) the inputs, ``y`` the output,
``dy`` the output gradient, any other name the node attribute of that name. Reading ``y`` instead of
``x`` is a deliberate choice: it keeps the output alive for the backward, which the next node
usually saves anyway, and lets the input be freed.
"""

from __future__ import annotations

import math

from ..builder import cast, erf, exp, log, sigmoid, sign, where
from ..registry import formulas

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
formulas("Relu",       lambda y, dy: where(y > 0, dy, 0))
formulas("LeakyRelu",  lambda x, dy, alpha=0.01: where(x > 0, dy, dy * alpha))
formulas("Elu",        lambda x, y, dy, alpha=1.0: where(x > 0, dy, dy * (y + alpha)))
formulas("Sigmoid",    lambda y, dy: dy * y * (1 - y))
formulas("Tanh",       lambda y, dy: dy * (1 - y * y))
formulas("Softplus",   lambda x, dy: dy * sigmoid(x))
formulas("Erf",        lambda x, dy: dy * TWO_OVER_SQRT_PI * exp(-(x * x)))

# ---- binary, with broadcasting undone --------------------------------------------------------
formulas("Add", lambda dy: dy, lambda dy: dy, broadcast=True)
formulas("Sub", lambda dy: dy, lambda dy: -dy, broadcast=True)
formulas("Mul", lambda b, dy: dy * b, lambda a, dy: dy * a, broadcast=True)
formulas("Div", lambda b, dy: dy / b, lambda b, y, dy: -dy * y / b, broadcast=True)
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
