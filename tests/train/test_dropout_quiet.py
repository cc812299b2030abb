"""A model with Dropout trains without onnxruntime's "Removing initializer" warnings: the inference
variant carries no training_mode flag nothing reads."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.autodiff.modes import set_training_mode
from onnxgrad.train import Trainer


def _dropout_mlp() -> onnx.ModelProto:
    r = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(3):
        inits += [
            numpy_helper.from_array((r.normal(size=(8, 8)) * 0.3).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.array(0.1, np.float32), f"ratio{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Dropout", [f"m{i}", f"ratio{i}"], [f"d{i}"], name=f"drop{i}"),
        ]
        prev = f"d{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_inference_twin_of_the_training_copy_has_no_unread_initializer() -> None:
    train = set_training_mode(_dropout_mlp(), True).model
    assert any(len(n.input) > 2 for n in train.graph.node if n.op_type == "Dropout")
    for model in (set_training_mode(train, False).model, set_training_mode(_dropout_mlp(), False).model):
        read = {i for n in model.graph.node for i in n.input}
        assert [t.name for t in model.graph.initializer if t.name not in read] == []


def test_trainer_on_dropout_prints_no_removing_initializer(capfd) -> None:
    x = np.random.default_rng(1).normal(size=(32, 8)).astype(np.float32)
    for one_graph in (True, False):
        trainer = Trainer(
            _dropout_mlp(), loss="mse", lr=1e-3, batch_size=8, progress=False, one_graph=one_graph
        )
        trainer.fit({"x": x, "target": x}, {"x": x, "target": x}, epochs=1)
        trainer.evaluate({"x": x, "target": x})
    assert "Removing initializer" not in capfd.readouterr().err
