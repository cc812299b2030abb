"""Every op that stops gradients: its outputs are integers, booleans, shapes, random draws, or
piecewise-constant functions of its inputs (derivative zero almost everywhere).

Declaring them keeps a gradient path from failing with "no rule" when such an op sits between a
trainable value and an output (``Shape -> ConstantOfShape``, ``Greater -> Where``...): the engine
treats their outputs as not requiring a gradient.
"""

from __future__ import annotations

from ...model.graph import RANDOM_OPS
from ..builder import BOOL_OPS
from ..registry import zero

zero(
    "Constant",
    "Shape",
    "Size",
    "ConstantOfShape",
    "EyeLike",
    note="shapes, sizes and constants: they depend on shapes or attributes, not on values",
)
zero(*sorted(BOOL_OPS), "NonZero", note="boolean results or indices: not differentiable")
zero(
    "ArgMax",
    "ArgMin",
    "NonMaxSuppression",
    "Hardmax",
    note="indices or one-hot selections: piecewise constant",
)
zero(
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    note="piecewise constant: the derivative is zero almost everywhere",
)
zero(*sorted(RANDOM_OPS), note="random draws: independent of the input values")
zero("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", note="integer bit operations")
zero(
    "StringNormalizer",
    "StringConcat",
    "StringSplit",
    "RegexFullMatch",
    "TfIdfVectorizer",
    note="string and text ops: no floating-point path",
)
zero("HannWindow", "HammingWindow", "BlackmanWindow", note="window functions of an integer size")
zero("SequenceLength", "SequenceEmpty", note="a length, or a sequence made from nothing")
zero("OptionalHasElement", note="a boolean: whether the optional holds a value")
zero(
    "QLinearConv",
    "QLinearMatMul",
    note="quantized products with a quantized (rounded) result: no gradient (the QuantizeLinear, "
    "DequantizeLinear, MatMulInteger and ConvInteger of QDQ and dynamically quantized models have "
    "rules: rules/quant.py)",
)
zero("BitCast", note="reinterprets the bits: not a differentiable function of the value")
zero("ImageDecoder", note="decodes encoded bytes (uint8) into pixels: no gradient")
zero("MelWeightMatrix", note="a constant matrix computed from integer sizes and frequency bounds")
