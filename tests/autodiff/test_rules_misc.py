"""Optional ops and the SequenceMap refusal (rules/sequence.py), and the stop-gradient declarations
(rules/nondiff.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.autodiff.registry import lookup, supported_ops
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import check_gradients, run_gradients

D = TensorProto.DOUBLE
ZERO_OPS = [
    "OptionalHasElement",
    "BitCast",
    "ConvInteger",
    "QLinearConv",
    "DequantizeLinear",
    "QuantizeLinear",
    "DynamicQuantizeLinear",
    "Unique",
    "ImageDecoder",
    "MelWeightMatrix",
]


def model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list, opset: int = 18, inits=()
) -> onnx.ModelProto:
    m = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    m.ir_version = ir_version_for(m.opset_import)
    return m


@pytest.mark.parametrize("op", ZERO_OPS)
def test_zero_declarations(op: str) -> None:
    r = lookup("", op, 26)
    assert r is not None and r.kind == "zero" and r.note
    assert supported_ops()[op] == "zero"


def test_optional_round_trip_passes_gradient() -> None:
    """``y = tanh(OptionalGetElement(Optional(x)))``: the gradient is tanh's, through both ops.

    onnxruntime only: onnx.reference 1.23's Optional turns a tensor into a list."""
    x = helper.make_tensor_value_info("x", D, [3, 2])
    y = helper.make_tensor_value_info("y", D, [3, 2])
    nodes = [
        helper.make_node("Optional", ["x"], ["o"]),
        helper.make_node("OptionalGetElement", ["o"], ["t"]),
        helper.make_node("Tanh", ["t"], ["y"]),
    ]
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 2))}
    res = check_gradients(model(nodes, [x], [y]), feeds, wrt=["x"])
    assert res.ok, res.report()
    np.testing.assert_allclose(res.analytic["x"], res.numeric["x"], rtol=1e-6)


def test_optional_get_element_on_tensor_is_identity() -> None:
    """OptionalGetElement-18 accepts a plain tensor: then it is Identity."""
    x = helper.make_tensor_value_info("x", D, [4])
    y = helper.make_tensor_value_info("y", D, [4])
    nodes = [helper.make_node("OptionalGetElement", ["x"], ["t"]), helper.make_node("Exp", ["t"], ["y"])]
    feeds = {"x": np.linspace(-1, 1, 4)}
    res = check_gradients(model(nodes, [x], [y]), feeds, wrt=["x"])
    assert res.ok, res.report()


def test_optional_has_element_stops_gradient() -> None:
    """``y = x * Cast(OptionalHasElement(Optional(x)))``: only the direct path carries a gradient."""
    x = helper.make_tensor_value_info("x", D, [3])
    y = helper.make_tensor_value_info("y", D, [3])
    nodes = [
        helper.make_node("Optional", ["x"], ["o"]),
        helper.make_node("OptionalHasElement", ["o"], ["h"]),
        helper.make_node("Cast", ["h"], ["hf"], to=D),
        helper.make_node("Mul", ["x", "hf"], ["y"]),
    ]
    graphs = build_gradient(model(nodes, [x], [y]), inputs_requiring_grad=["x"])
    _, grads = run_gradients(graphs, {"x": np.arange(3.0)})
    np.testing.assert_array_equal(grads["x"], np.ones(3))


def test_sequence_map_refused() -> None:
    body = helper.make_graph(
        [helper.make_node("Tanh", ["e"], ["r"])],
        "body",
        [helper.make_tensor_value_info("e", D, [3])],
        [helper.make_tensor_value_info("r", D, [3])],
    )
    x = helper.make_tensor_value_info("x", D, [2, 3])
    y = helper.make_tensor_value_info("y", D, [6])
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0, keepdims=0),
        helper.make_node("SequenceMap", ["s"], ["m"], body=body, name="smap"),
        helper.make_node("ConcatFromSequence", ["m"], ["y"], axis=0),
    ]
    with pytest.raises(GradientNotImplementedError, match=r"'smap' \(op 'SequenceMap'\).*Loop"):
        build_gradient(model(nodes, [x], [y]), inputs_requiring_grad=["x"])


def test_quantize_dequantize_stops_gradient() -> None:
    """A QDQ pair between a weight and the output: the weight gets a zero gradient, the rest flows."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    inits = [
        numpy_helper.from_array(np.float32([0.5, -1, 2, 0.3]), "w"),
        numpy_helper.from_array(np.float32(0.1), "scale"),
        numpy_helper.from_array(np.int8(0), "zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "scale", "zp"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["wq"]),
        helper.make_node("Mul", ["x", "wq"], ["y"]),
    ]
    graphs = build_gradient(model(nodes, [x], [y], inits=inits), trainable=["w"], inputs_requiring_grad=["x"])
    xv = np.float32([1, 2, 3, 4])
    _, grads = run_gradients(graphs, {"x": xv})
    np.testing.assert_array_equal(grads["w"], np.zeros(4, np.float32))
    np.testing.assert_allclose(grads["x"], np.float32([0.5, -1, 2, 0.3]), rtol=1e-6)
