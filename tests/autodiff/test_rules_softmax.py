"""Gradient checks of the softmax rules (rules/softmax.py): Softmax and LogSoftmax, both semantics
(opset 13's one axis, the flattened trailing dims before), against float64 finite differences and
torch autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F
from onnx import TensorProto, helper

from onnxgrad.testing import check_gradients, check_op
from tests.autodiff.conftest import versus_torch
from tests.autodiff.random_data import rnd  # one generator per test (conftest.py)


# ---- softmax family -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
def test_softmax(op: str, opset: int, axis: int | None) -> None:
    attrs = {} if axis is None else {"axis": axis}
    check_op(op, [rnd(2, 3, 4)], attrs=attrs, opset=opset)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_dynamic_and_versus_torch(op: str) -> None:
    x = rnd(3, 2, 4)
    check_op(op, [x], attrs={"axis": 1}, opset=13, dynamic=True)
    check_op(op, [x], attrs={"axis": -2}, opset=11, dynamic=True)  # flattened over [1, 3)
    fn = F.softmax if op == "Softmax" else F.log_softmax
    versus_torch(op, [x], {"axis": 1}, lambda t: fn(t, dim=1), opset=13)
    # pre-13 semantics: one softmax over the flattened trailing dims
    versus_torch(op, [x], {"axis": 1}, lambda t: fn(t.reshape(3, -1), dim=1).reshape(3, 2, 4), opset=11)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_of_unknown_rank(op: str) -> None:
    """Pre-13 semantics on a value whose rank is unknown: computed on its 2-D Flatten."""
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node(op, ["r"], ["s"], axis=1),
        helper.make_node("Identity", ["s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 4]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [None, None, None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    feeds = {"x": rnd(2, 3, 4), "shape": np.array([2, 4, 3], dtype=np.int64)}
    result = check_gradients(model, feeds, wrt=["x"])
    assert result.ok, result.report()
