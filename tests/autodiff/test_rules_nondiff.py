"""Ops that stop the gradient: accepted anywhere in a graph, contributing nothing.

Each model computes ``y = x * cast(op(x...))``: the op's result acts as a constant, so dy/dx is
exactly that constant (as float) — a gradient flowing through the op would change it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
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
