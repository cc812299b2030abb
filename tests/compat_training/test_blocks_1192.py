"""The public names of 1.19.2's ``onnxblock.blocks`` and ``artifacts`` that onnxgrad lacked:
``Linear``, ``LabelEncoder``, ``SequenceConstruct``, ``ReduceAllL2``, ``ort_format=True``,
``OptimizationStyle`` and ``convert_onnx_models_to_ort``; each checked by what it computes."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxgrad.compat.training as og
from onnxgrad.compat.training import onnxblock
from onnxgrad.errors import InputError
from onnxgrad.testing import check_gradients

from . import scenarios
from .test_no_gradients import RTOL, cross_entropy64, mlp64, session, weights


def empty_model(*inputs: onnx.ValueInfoProto) -> onnx.ModelProto:
    graph = helper.make_graph([], "empty", list(inputs), [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class Forward(onnxblock.ForwardBlock):
    """A ForwardBlock around a function of the block's input names."""

    def __init__(self, fn) -> None:
        super().__init__()
        self._fn = fn

    def build(self, *names):
        return self._fn(*names)


def test_linear_is_a_gemm_with_new_random_parameters():
    np.random.seed(0)
    linear = onnxblock.blocks.Linear(4, 2, alpha=0.5, beta=2.0)
    block = Forward(linear)
    with onnxblock.base(empty_model(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]))):
        out = block("x")
    model = block.to_model_proto()
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (weight,) = [n for n in inits if n.startswith("onnx::linear.weight::")]
    (bias,) = [n for n in inits if n.startswith("onnx::linear.bias::")]
    assert inits[weight].shape == (4, 2) and inits[bias].shape == (2,)
    assert inits[weight].dtype == np.float32
    assert [n.op_type for n in model.graph.node] == ["Gemm"]
    np.random.seed(0)
    np.testing.assert_array_equal(inits[weight], np.random.randn(4, 2).astype(np.float32))  # N(0, 1) draws
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    (y,) = session(model).run([out], {"x": x})
    expected = 0.5 * x.astype(np.float64) @ inits[weight] + 2.0 * inits[bias]
    np.testing.assert_allclose(y, expected, rtol=RTOL, atol=RTOL)
    no_bias = Forward(onnxblock.blocks.Linear(4, 2, bias=False))
    with onnxblock.base(empty_model(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]))):
        no_bias("x")
    assert len(no_bias.to_model_proto().graph.initializer) == 1
    with pytest.raises(InputError, match="Linear needs sizes >= 1"):
        onnxblock.blocks.Linear(0, 2)


def test_linear_head_trains_through_generate_artifacts(tmp_path):
    """The MLP with a Linear head added by a ForwardBlock; the head's weight trained alone: its
    gradient matches torch's."""
    np.random.seed(2)
    head = Forward(onnxblock.blocks.Linear(3, 2))
    with onnxblock.base(scenarios.mlp()):
        head("logits")
    model = head.to_model_proto()
    w = weights(model)
    name = next(n for n in w if n.startswith("onnx::linear.weight::"))
    bias = next(n for n in w if n.startswith("onnx::linear.bias::"))
    og.artifacts.generate_artifacts(
        model, requires_grad=[name], loss=og.artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path
    )
    state = og.api.CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = og.api.Module(tmp_path / "training_model.onnx", state)
    x, labels = scenarios.data("classes", n=8)
    labels = labels % 2
    loss = module(x, labels)
    weight = torch.from_numpy(w[name]).requires_grad_()
    logits = torch.from_numpy(mlp64(w, x.astype(np.float64))) @ weight + torch.from_numpy(w[bias])
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels))
    expected.backward()
    np.testing.assert_allclose(loss, float(expected.detach()), rtol=RTOL)
    np.testing.assert_allclose(state.parameters[name].grad, weight.grad.numpy(), rtol=RTOL, atol=1e-7)


def test_label_encoder_maps_the_labels_before_the_loss():
    """Class labels 521..523 mapped to 0..2 in the graph, then cross entropy: the same loss as on
    the mapped labels; the ai.onnx.ml opset is added."""
    model = scenarios.mlp()
    assert not any(o.domain == "ai.onnx.ml" for o in model.opset_import)

    class EncodedCrossEntropy(onnxblock.TrainingBlock):
        def __init__(self) -> None:
            super().__init__()
            self.encode = onnxblock.blocks.LabelEncoder(
                default_int64=0, keys_int64s=[521, 522, 523], values_int64s=[0, 1, 2]
            )
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, output_name):
            raw = helper.make_tensor_value_info("raw_labels", TensorProto.INT64, ["batch"])
            self.base.graph.input.append(raw)
            return self.loss(output_name, self.encode("raw_labels"))

    block = EncodedCrossEntropy()
    block.requires_grad("fc2.bias")
    with onnxblock.base(model):
        block("logits")
    training, evaluation = block.to_model_proto()
    assert any(o.domain == "ai.onnx.ml" and o.version == 2 for o in training.opset_import)
    (encoder,) = [n for n in training.graph.node if n.op_type == "LabelEncoder"]
    assert encoder.domain == "ai.onnx.ml"
    x, labels = scenarios.data("classes", n=8)
    feeds = {"input": x, "raw_labels": labels + 521}
    feeds["fc2.bias"] = weights(scenarios.mlp())["fc2.bias"].astype(np.float32)
    loss, _grad = session(training).run(None, feeds)
    expected = cross_entropy64(mlp64(weights(scenarios.mlp()), x.astype(np.float64)), labels)
    np.testing.assert_allclose(loss, expected, rtol=RTOL)
    (eval_loss,) = session(evaluation).run(None, feeds)
    np.testing.assert_allclose(eval_loss, expected, rtol=RTOL)
    with pytest.raises(InputError, match="exactly one of keys_"):
        onnxblock.blocks.LabelEncoder(values_int64s=[1])
    with pytest.raises(InputError, match="2 keys but 1 values"):
        onnxblock.blocks.LabelEncoder(keys_strings=["a", "b"], values_int64s=[1])


def test_sequence_construct_and_reduce_all_l2():
    """ReduceAllL2 of two tensors (the global gradient norm of clipping) in standard ops: the value
    numpy gives, and gradients that pass finite differences; SequenceConstruct holds them both."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])
    norm, seq = onnxblock.blocks.ReduceAllL2(), onnxblock.blocks.SequenceConstruct()
    block = Forward(lambda x, y: (norm(x, y), seq(x, y)))
    with onnxblock.base(empty_model(a, b)):
        norm_name, seq_name = block("a", "b")
    model = block.to_model_proto()
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)  # no com.microsoft kernel
    rng = np.random.default_rng(4)
    feeds = {
        "a": rng.standard_normal((2, 3)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
    }
    value, sequence = session(model).run([norm_name, seq_name], feeds)
    expected = np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in feeds.values()))
    assert value.shape == ()
    np.testing.assert_allclose(value, expected, rtol=RTOL)
    assert len(sequence) == 2
    np.testing.assert_array_equal(sequence[0], feeds["a"])
    np.testing.assert_array_equal(sequence[1], feeds["b"])
    # the norm's gradient in both inputs: a / norm, b / norm, checked against finite differences
    only_norm = Forward(lambda x, y: onnxblock.blocks.ReduceAllL2()(x, y))
    with onnxblock.base(empty_model(a, b)):
        only_norm("a", "b")
    result = check_gradients(only_norm.to_model_proto(), feeds, wrt=["a", "b"])
    assert result.ok, result


def test_ort_format_writes_each_model_beside_it(tmp_path):
    og.artifacts.generate_artifacts(
        scenarios.mlp(),
        requires_grad=scenarios.PARAMS,
        loss=og.artifacts.LossType.MSELoss,
        optimizer=og.artifacts.OptimType.AdamW,
        artifact_directory=tmp_path,
        ort_format=True,
    )
    for name in ("training_model", "eval_model", "optimizer_model"):
        assert (tmp_path / f"{name}.onnx").is_file() and (tmp_path / f"{name}.ort").is_file()
    # the ORT-format eval model computes what the ONNX one does
    x, y = scenarios.data("floats", n=8)
    feeds = {"input": x, "target": y}
    feeds.update({t.name: numpy_helper.to_array(t) for t in scenarios.mlp().graph.initializer})
    from_ort = ort.InferenceSession(str(tmp_path / "eval_model.ort"), providers=["CPUExecutionProvider"])
    from_onnx = ort.InferenceSession(str(tmp_path / "eval_model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(from_ort.run(None, feeds)[0], from_onnx.run(None, feeds)[0])
    expected = np.mean((mlp64(weights(scenarios.mlp()), x.astype(np.float64)) - y) ** 2)
    np.testing.assert_allclose(from_ort.run(None, feeds)[0], expected, rtol=RTOL)


def test_artifacts_reexports_the_ort_format_converter(tmp_path):
    from onnxruntime.tools import convert_onnx_models_to_ort as stock

    assert og.artifacts.OptimizationStyle is stock.OptimizationStyle
    assert og.artifacts.convert_onnx_models_to_ort.__wrapped__ is stock.convert_onnx_models_to_ort
    assert [s.name for s in og.artifacts.OptimizationStyle] == ["Fixed", "Runtime"]
    path = tmp_path / "mlp.onnx"
    onnx.save(scenarios.mlp(), path)
    og.artifacts.convert_onnx_models_to_ort(
        path, output_dir=tmp_path, optimization_styles=[og.artifacts.OptimizationStyle.Fixed]
    )
    x = scenarios.data("floats", n=4)[0]
    (logits,) = ort.InferenceSession(str(tmp_path / "mlp.ort"), providers=["CPUExecutionProvider"]).run(
        None, {"input": x}
    )
    np.testing.assert_allclose(
        logits, mlp64(weights(scenarios.mlp()), x.astype(np.float64)), rtol=RTOL, atol=1e-6
    )
    assert os.path.isfile(tmp_path / "mlp.onnx")
