"""Optional values, SequenceMap, and the quantization / decoding ops that stop gradients.

``Optional`` wraps a tensor and ``OptionalGetElement`` unwraps it: each is the other's adjoint, so
the gradient passes through them like Identity. The engine types values as tensors or sequences of
tensors only, so a gradient through an optional value works when it flows straight from an
``OptionalGetElement`` back to an ``Optional`` (nothing optional is saved or zero-filled); anything
needing the optional's type (a zero gradient for it, an optional sequence) is refused.

SequenceMap runs a graph per element: its rule would differentiate the body per element like Loop;
it is refused with :class:`~onnxgrad.errors.GradientNotImplementedError`.
"""

from __future__ import annotations

from ...errors import GradientNotImplementedError
from ..builder import GradBuilder, Var
from ..registry import NodeContext, rule, zero

Grads = list[Var | None]

zero("OptionalHasElement", note="a boolean: whether the optional holds a value")
zero(
    "DequantizeLinear",
    "QuantizeLinear",
    "DynamicQuantizeLinear",
    "ConvInteger",
    "QLinearConv",
    note="quantization: integer outputs, or (DequantizeLinear) integer inputs; through a rounding the "
    "gradient is zero almost everywhere (use a straight-through estimator for quantization-aware "
    "training)",
)
zero("BitCast", note="reinterprets the bits: not a differentiable function of the value")
zero("Unique", note="the unique values are a selection with integer indices and counts: not differentiated")
zero("ImageDecoder", note="decodes encoded bytes (uint8) into pixels: no gradient")
zero("MelWeightMatrix", note="a constant matrix computed from integer sizes and frequency bounds")


def _refuse(n: NodeContext, reason: str) -> GradientNotImplementedError:
    return GradientNotImplementedError(
        f"no gradient for node {n.node.name!r} (op {n.node.op_type!r}): {reason}"
    )


@rule("Optional")
def optional_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``o = Optional(x)``: ``dx = OptionalGetElement(do)``."""
    if not n.inputs or n.inputs[0] is None:
        return []  # an empty optional: nothing to differentiate
    x = n.inputs[0]
    if x.sequence:
        raise _refuse(n, "optional sequences are not supported, only optional tensors")
    return [g.op("OptionalGetElement", n.dy, dtype=x.dtype, shape=x.shape)]


@rule("OptionalGetElement")
def optional_get_element_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``y = OptionalGetElement(o)``: ``do = Optional(dy)``; on a plain tensor (opset 18+) ``dx = dy``."""
    if n.y.sequence:
        raise _refuse(n, "optional sequences are not supported, only optional tensors")
    # ONNX shape inference types tensors but the engine does not keep optional types: an input it
    # could not type (no rank) is the optional; a typed one is a tensor and the op is Identity.
    if n.x.rank is not None:
        return [n.dy]
    return [g.op("Optional", n.dy, dtype=n.y.dtype, shape=n.y.shape)]


@rule("SequenceMap")
def sequence_map_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """Refused: the body would have to be differentiated per element (as Loop does)."""
    raise _refuse(
        n,
        "SequenceMap is not differentiable in onnxgrad yet; rewrite it as a Loop over the sequence "
        "(Loop is supported) or mark the values before it as not trainable",
    )
