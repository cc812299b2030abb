"""Models with external data: load, train and save back with external data."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.errors import InputError, ModelError


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(6, 16)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
        numpy_helper.from_array(rng.normal(size=(16, 1)).astype(np.float32) * 0.3, "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m"]),
        helper.make_node("Add", ["m", "b1"], ["a"]),
        helper.make_node("Tanh", ["a"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _save_external(model: onnx.ModelProto, folder, name: str = "model.onnx") -> str:
    path = os.path.join(folder, name)
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    return path


def _external(path: str) -> list[str]:
    m = onnx.load(path, load_external_data=False)
    return [t.name for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL]


def test_forward_backward_trains_a_model_with_external_data(tmp_path) -> None:
    path = _save_external(_mlp(), tmp_path)
    assert set(_external(path)) == {"w1", "b1", "w2"}  # forced, threshold 0
    fb = onnxgrad.ForwardBackward(path)
    ref = onnxgrad.ForwardBackward(_mlp())
    x = np.random.default_rng(1).normal(size=(32, 6)).astype(np.float32)
    t = np.sin(x.sum(1, keepdims=True)).astype(np.float32)
    g, g0 = (
        fb.forward({"x": x}).backward([np.ones((32, 1), np.float32)]),
        ref.forward({"x": x}).backward([np.ones((32, 1), np.float32)]),
    )
    for k in g0:
        np.testing.assert_array_equal(g[k], g0[k])
    losses = []
    for _ in range(30):  # plain gradient descent on the squared error
        res = fb.forward({"x": x})
        err = res.outputs[0] - t
        losses.append(float((err**2).mean()))
        grads = res.backward([2 * err / len(x)])
        fb.set_parameters({k: v - 0.1 * grads[k] for k, v in fb.parameters.items()})
    assert losses[-1] < 0.5 * losses[0]
    # saved back with external data, then loaded again: the trained values
    out = onnxgrad.save_model(
        fb.to_onnx(), tmp_path / "out" / "trained.onnx", external_data=True, size_threshold=0
    )
    assert os.path.exists(str(out) + ".data")
    assert set(_external(out)) == {"w1", "b1", "w2"}
    again = onnxgrad.ForwardBackward(out)
    for k, v in fb.parameters.items():
        np.testing.assert_array_equal(again.parameters[k], v)


def test_onnx_module_and_build_gradient_read_external_data(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    path = _save_external(_mlp(), tmp_path)
    assert onnxgrad.build_gradient(path).trainable == ["w1", "b1", "w2"]
    m = OnnxModule(path)
    y = m(torch.ones(3, 6))
    y.sum().backward()
    assert m.w1.grad is not None and m.w1.grad.shape == (6, 16)
    onnxgrad.save_model(m.to_onnx(), tmp_path / "m.onnx", external_data=True, size_threshold=0)
    assert _external(str(tmp_path / "m.onnx"))


def test_save_model_auto_and_caller_model_unchanged(tmp_path, monkeypatch) -> None:
    model = _mlp()
    before = model.SerializeToString()
    onnxgrad.save_model(model, tmp_path / "small.onnx")  # small: one file
    assert not os.path.exists(tmp_path / "small.onnx.data")
    from onnxgrad import storage

    monkeypatch.setattr(storage, "PROTOBUF_LIMIT", storage._MARGIN + 100)  # as if above 2 GB
    onnxgrad.save_model(model, tmp_path / "big.onnx", size_threshold=0)
    assert set(_external(str(tmp_path / "big.onnx"))) == {"w1", "b1", "w2"}
    assert model.SerializeToString() == before
    with pytest.raises(InputError, match="file name"):
        onnxgrad.save_model(model, tmp_path / "x.onnx", external_data=True, location="../w.bin")


def test_external_data_outside_the_folder_is_refused(tmp_path) -> None:
    path = _save_external(_mlp(), tmp_path)
    m = onnx.load(path, load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../weights.bin"
    os.makedirs(tmp_path / "sub")
    onnx.save(m, tmp_path / "sub" / "evil.onnx")
    with pytest.raises(ModelError, match="outside"):
        onnxgrad.ForwardBackward(str(tmp_path / "sub" / "evil.onnx"))
