"""A Dropout in training mode drops whether or not its mask is read: onnxruntime's EliminateDropout
removes a Dropout whose mask no one reads, training mode or not, so a training forward that keeps
no mask (nothing before the Dropout trains; no gradient asked) ran without dropout."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.runtime.runner import drops_in_training


def input_dropout_model() -> onnx.ModelProto:
    """x -> MatMul(W1) -> Dropout(0.5) -> MatMul(W2), as torch exports a Linear, a Dropout and a
    Linear (the Dropout's mask declared); with W1 frozen, the backward never reads the mask."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["a"]),
            helper.make_node("Dropout", ["a", "ratio"], ["h", "mask"]),
            helper.make_node("MatMul", ["h", "W2"], ["y"]),
        ],
        "input_dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [
            numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
            numpy_helper.from_array(np.eye(16, dtype=np.float32), "W1"),
            numpy_helper.from_array(np.ones((16, 4), np.float32), "W2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_a_training_forward_drops_though_no_mask_is_kept():
    fb = onnxgrad.ForwardBackward(input_dropout_model(), trainable=["W2"])
    x = {"x": np.ones((64, 16), np.float32)}
    train = [fb.forward(x, training=True).outputs[0] for _ in range(2)]
    # kept units are scaled by 2: sums of 16 ones, each 0 or 2, are not all 16 as without dropout
    assert not np.array_equal(train[0], train[1])
    assert set(np.unique(train[0])) <= set(range(0, 33, 2)) and np.std(train[0]) > 0
    np.testing.assert_array_equal(fb.forward(x, training=False).outputs[0], np.full((64, 4), 16.0))


def test_onnx_module_drops_in_training_mode_under_no_grad():
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    m = OnnxModule(input_dropout_model(), trainable=["W2"])
    x = torch.ones(64, 16)
    with torch.no_grad():
        a, b = m(x), m(x)
    assert not torch.equal(a, b)  # as torch's Dropout in .train(), gradient or not
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), torch.full((64, 4), 16.0))


def test_drops_in_training_reads_the_mode():
    model = input_dropout_model()
    assert not drops_in_training(model)  # no training_mode input: inference
    node = model.graph.node[1]
    node.input.append("mode")
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "mode"))
    assert drops_in_training(model)
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array(False), "mode"))
    assert not drops_in_training(model)
