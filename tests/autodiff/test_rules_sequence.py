"""Gradient rules of the optional and sequence ops (rules/sequence.py): Optional and
OptionalGetElement pass the gradient, SequenceMap is refused."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import check_gradients
from tests.autodiff.conftest import D, graph_model


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
    res = check_gradients(graph_model(nodes, [x], [y]), feeds, wrt=["x"])
    assert res.ok, res.report()
    np.testing.assert_allclose(res.analytic["x"], res.numeric["x"], rtol=1e-6)


def test_optional_get_element_on_tensor_is_identity() -> None:
    """OptionalGetElement-18 accepts a plain tensor: then it is Identity."""
    x = helper.make_tensor_value_info("x", D, [4])
    y = helper.make_tensor_value_info("y", D, [4])
    nodes = [helper.make_node("OptionalGetElement", ["x"], ["t"]), helper.make_node("Exp", ["t"], ["y"])]
    feeds = {"x": np.linspace(-1, 1, 4)}
    res = check_gradients(graph_model(nodes, [x], [y]), feeds, wrt=["x"])
    assert res.ok, res.report()


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
        build_gradient(graph_model(nodes, [x], [y]), inputs_requiring_grad=["x"])
