"""Ops that stop the gradient (rules/nondiff.py): accepted anywhere in a graph, contributing
nothing.

Each model of ``test_stop_gradient_op`` computes ``y = x * cast(op(x...))``: the op's result acts
as a constant, so dy/dx is exactly that constant (as float) — a gradient flowing through the op
would change it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.autodiff.registry import lookup, supported_ops
from onnxgrad.testing import check_gradients, check_op, run_gradients
from tests.autodiff.conftest import F32, D, assert_ok, graph_model, model
from tests.autodiff.random_data import rnd  # one generator per test (conftest.py)
from tests.models import make_model

X = np.array([[-1.5, 0.25, 2.0], [3.0, -0.5, 0.0], [1.0, 1.0, -2.0]])


def _bools(prefix):
    return [
        helper.make_node("Greater", ["x", "zero"], [f"{prefix}a"]),
        helper.make_node("Less", ["x", "one"], [f"{prefix}b"]),
    ]


CASES = {
    "Ceil": [helper.make_node("Ceil", ["x"], ["c"])],
    "Sign": [helper.make_node("Sign", ["x"], ["c"])],
    "IsInf": [helper.make_node("IsInf", ["x"], ["c"])],
    "GreaterOrEqual": [helper.make_node("GreaterOrEqual", ["x", "zero"], ["c"])],
    "LessOrEqual": [helper.make_node("LessOrEqual", ["x", "zero"], ["c"])],
    "ArgMin": [helper.make_node("ArgMin", ["x"], ["c"], axis=1, keepdims=1)],
    "EyeLike": [helper.make_node("EyeLike", ["x"], ["c"])],
    "Not": [*_bools("p"), helper.make_node("Not", ["pa"], ["c"])],
    "And": [*_bools("p"), helper.make_node("And", ["pa", "pb"], ["c"])],
    "Or": [*_bools("p"), helper.make_node("Or", ["pa", "pb"], ["c"])],
    "Xor": [*_bools("p"), helper.make_node("Xor", ["pa", "pb"], ["c"])],
}


EXPECTED = {
    "Ceil": np.ceil,
    "Sign": np.sign,
    "IsInf": np.isinf,
    "GreaterOrEqual": lambda x: x >= 0,
    "LessOrEqual": lambda x: x <= 0,
    "ArgMin": lambda x: np.argmin(x, axis=1)[:, None],
    "EyeLike": lambda x: np.eye(*x.shape),
    "Not": lambda x: ~(x > 0),
    "And": lambda x: (x > 0) & (x < 1),
    "Or": lambda x: (x > 0) | (x < 1),
    "Xor": lambda x: (x > 0) ^ (x < 1),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_stop_gradient_op(op):
    assert onnxgrad.supported_ops()[op] == "zero"
    nodes = [
        *CASES[op],
        helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x", "cf"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("x", np.float64, [3, 3])],
        [("y", np.float64, [3, 3])],
        {"zero": np.array(0.0), "one": np.array(1.0)},
    )
    onnx.checker.check_model(model, full_check=True)
    got = onnxgrad.gradients(model, {"x": X}, wrt=["x"])["x"]
    np.testing.assert_array_equal(got, np.broadcast_to(EXPECTED[op](X), X.shape).astype(float))


def test_stop_gradient_ops_are_declared_in_one_module():
    """Every zero-gradient declaration lives in rules/nondiff.py, and each rule names its module."""
    from onnxgrad.autodiff.registry import lookup, rules_table

    declared = [r for r in rules_table() if r.kind == "zero"]
    assert declared and {r.file for r in declared} == {"rules/nondiff.py"}
    assert lookup("", "Relu", 14).file == "rules/elementwise.py"  # a formula
    assert lookup("", "MaxPool", 12).file == "rules/pool.py"  # a rule


def test_hardmax_has_zero_gradient() -> None:
    check_op("Hardmax", [rnd(3, 4, dtype=F32)], attrs={"axis": -1}, opset=13)


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


@pytest.mark.parametrize("op", ZERO_OPS)
def test_zero_declarations(op: str) -> None:
    r = lookup("", op, 26)
    assert r is not None and r.kind == "zero" and r.note
    assert supported_ops()[op] == "zero"


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
    graphs = build_gradient(graph_model(nodes, [x], [y]), inputs_requiring_grad=["x"])
    _, grads = run_gradients(graphs, {"x": np.arange(3.0)})
    np.testing.assert_array_equal(grads["x"], np.ones(3))


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
    graphs = build_gradient(
        graph_model(nodes, [x], [y], inits=inits), trainable=["w"], inputs_requiring_grad=["x"]
    )
    xv = np.float32([1, 2, 3, 4])
    _, grads = run_gradients(graphs, {"x": xv})
    np.testing.assert_array_equal(grads["w"], np.zeros(4, np.float32))
    np.testing.assert_allclose(grads["x"], np.float32([0.5, -1, 2, 0.3]), rtol=1e-6)


# ---- ops that stop gradients -------------------------------------------------------------------
def test_nondifferentiable_ops_in_the_path():
    # y = Where(x > 0, x, zeros(shape(x))) + x * Floor(x) * Cast(ArgMax(x)) ; the stopped ops
    # (Shape, ConstantOfShape, Greater, Floor, ArgMax) contribute no gradient.
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node(
            "ConstantOfShape", ["s"], ["z"], value=numpy_helper.from_array(np.zeros(1, np.float64))
        ),
        helper.make_node("Greater", ["x", "z"], ["pos"]),
        helper.make_node("Where", ["pos", "x", "z"], ["relu"]),
        helper.make_node("Floor", ["x"], ["fl"]),
        helper.make_node("ArgMax", ["x"], ["am"], axis=1, keepdims=1),
        helper.make_node("Cast", ["am"], ["amf"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x", "fl"], ["t"]),
        helper.make_node("Mul", ["t", "amf"], ["u"]),
        helper.make_node("Add", ["relu", "u"], ["y"]),
    ]
    m = model(nodes, [("x", np.float64, ["n", 4])], [("y", np.float64, None)])
    x = away_from(away_from(rnd(3, 4) * 3, [0.0]), [-2.0, -1.0, 1.0, 2.0])
    assert_ok(check_gradients(m, {"x": x}))
    got = onnxgrad.gradients(m, {"x": x}, {"y": np.ones_like(x)}, wrt=["x"])
    am = np.argmax(x, axis=1)[:, None]
    np.testing.assert_allclose(got["x"], (x > 0) + np.floor(x) * am)


def test_nondiff_declarations():
    ops = onnxgrad.supported_ops()
    for op in (
        "Shape",
        "Size",
        "ConstantOfShape",
        "Equal",
        "ArgMax",
        "Floor",
        "Round",
        "NonZero",
        "RandomNormalLike",
        "BitwiseAnd",
        "Range",
        "OneHot",
        "IsNaN",
    ):
        assert ops[op] == "zero", op
    for op in ("Reshape", "Slice", "Gather", "Pad", "Tile", "Clip", "Where", "DepthToSpace"):
        assert ops[op] == "rule", op


# ---- no gradient ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["MatMulInteger", "QLinearMatMul"])
def test_integer_products_have_no_gradient(op: str) -> None:
    found = lookup("", op, 21)
    assert found is not None and found.kind == "zero"


def away_from(x: np.ndarray, points: list[float], gap: float = 0.05) -> np.ndarray:
    """``x`` with values near ``points`` (kinks) pushed away, so finite differences are exact."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x
