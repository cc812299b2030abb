"""Rules for the ``ai.onnx.ml`` ops that scikit-learn converters (skl2onnx) emit on a float path.

skl2onnx converts ``LinearRegression`` to ``LinearRegressor`` (float32 inputs) and
``StandardScaler`` to ``Scaler``. Both keep their parameters in node *attributes*, so nothing in
them is trainable: the rules only carry the gradient back to the input ``X``, which is what lets a
pipeline such as ``StandardScaler -> MLPRegressor`` differentiate with respect to its features. To
train the coefficients of a linear model, convert it with ``black_op={'LinearRegressor'}`` so that
they become initializers of a ``MatMul`` + ``Add``.

Both ops return ``tensor(float)`` whatever the input type, so the gradient is cast back to the
input's dtype (double inputs).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ..builder import GradBuilder, cast
from ..registry import NodeContext, rule
from .common import Grads

ML = "ai.onnx.ml"


@rule("LinearRegressor", domain=ML)
def linear_regressor(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = X C^T + b with C of shape (targets, features): dX = dY C."""
    if not n.needs[0]:
        return [None]
    post = n.attr("post_transform", "NONE")
    if post != "NONE":
        raise GradientNotImplementedError(
            f"LinearRegressor {n.node.name!r}: post_transform={post!r} has no gradient rule, only 'NONE'"
        )
    targets = int(n.attr("targets", 1))
    coefs = np.asarray(n.attr("coefficients", []), dtype=np.float32).reshape((targets, -1))
    x, dy = n.x, n.dy
    if dy.dtype != TensorProto.FLOAT:  # the output is float by the spec; be safe anyway
        dy = g.Cast(dy, to=TensorProto.FLOAT)
    dx = g.MatMul(dy, g.const(coefs, TensorProto.FLOAT))  # (N, targets) @ (targets, features)
    if x.rank != 2:  # a 1-D input is read as one row: give the gradient the input's shape back
        dx = g.reshape(dx, x)
    return [cast(dx, x)]


@rule("Scaler", domain=ML)
def scaler(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = (X - offset) * scale, per feature (or one value for all): dX = dY * scale."""
    if not n.needs[0]:
        return [None]
    scale = np.asarray(n.attr("scale", [1.0]), dtype=np.float32)
    dy = n.dy
    if dy.dtype != TensorProto.FLOAT:
        dy = g.Cast(dy, to=TensorProto.FLOAT)
    dx = dy * g.const(scale, TensorProto.FLOAT)  # broadcasts over the last (feature) axis
    return [cast(dx, n.x)]
