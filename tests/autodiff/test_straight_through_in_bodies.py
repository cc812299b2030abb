"""The straight-through GradientWarning names a rounding node inside an If branch or a Loop body
as it names one in the main graph (planted bug 6 of issue 39): a child scope tells its root."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.errors import GradientWarning
from tests.models import make_model

F32 = np.float32
INITS = {"w": np.array([0.5, -1, 2, 0.3], F32), "scale": np.array(0.1, F32), "zp": np.array(0, np.int8)}


def _fake_quant(name: str, out: str) -> list[onnx.NodeProto]:
    """``out = DequantizeLinear(QuantizeLinear(w))``, the rounding node called ``name``."""
    return [
        helper.make_node("QuantizeLinear", ["w", "scale", "zp"], [f"{out}_q"], name=name),
        helper.make_node("DequantizeLinear", [f"{out}_q", "scale", "zp"], [out], name=f"{name}_dequant"),
    ]


def _vi(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _in_if() -> onnx.ModelProto:
    then = helper.make_graph(
        [*_fake_quant("quant_in_then", "wq"), helper.make_node("Mul", ["x", "wq"], ["t"])],
        "then",
        [],
        [_vi("t", TensorProto.FLOAT, [4])],
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["e"])], "else", [], [_vi("e", TensorProto.FLOAT, [4])]
    )
    node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)
    return make_model([node], [("c", np.bool_, []), ("x", F32, [4])], [("y", F32, [4])], INITS, opset=19)


def _in_loop() -> onnx.ModelProto:
    body = helper.make_graph(
        [
            *_fake_quant("quant_in_body", "wq"),
            helper.make_node("Mul", ["v", "wq"], ["v2"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            _vi("i", TensorProto.INT64, []),
            _vi("cond_in", TensorProto.BOOL, []),
            _vi("v", TensorProto.FLOAT, [4]),
        ],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("v2", TensorProto.FLOAT, [4])],
    )
    node = helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)
    return make_model([node], [("n", np.int64, []), ("x", F32, [4])], [("y", F32, [4])], INITS, opset=19)


def test_a_rounding_node_in_an_if_branch_is_named():
    x = np.array([1, 2, 3, 4], F32)
    with pytest.warns(
        GradientWarning, match=r"1 rounding node\(s\) \('quant_in_then'\) pass the gradient straight"
    ):
        grads = onnxgrad.gradients(_in_if(), {"c": np.array(True), "x": x}, wrt=["w"])
    np.testing.assert_allclose(grads["w"], x, rtol=1e-6)  # straight through: d(x * w) / dw


def test_a_rounding_node_in_a_loop_body_is_named():
    x = np.array([1, 2, 3, 4], F32)
    with pytest.warns(
        GradientWarning, match=r"1 rounding node\(s\) \('quant_in_body'\) pass the gradient straight"
    ):
        onnxgrad.gradients(_in_loop(), {"n": np.array(2), "x": x}, wrt=["w"])
