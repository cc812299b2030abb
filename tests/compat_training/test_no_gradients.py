"""What 1.19.2 built without any parameter to train, and the gradient of a graph input.

1.19.2's ``TrainingBlock`` and ``generate_artifacts`` with no ``requires_grad`` (or a model without
parameters) build a training model that computes the loss in training mode and no gradient; a
graph input named in ``requires_grad`` gets its gradient ``<input>_grad`` as an output. The
references are float64 numpy and torch computations of the same small networks.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxgrad.compat.training as og
from onnxgrad.compat.training import onnxblock
from onnxgrad.errors import InputError

from . import scenarios

# float32 sums of at most a few dozen terms of magnitude ~1: a few float32 ulps, bounded generously
RTOL = 1e-5


def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}


def mlp64(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """scenarios.mlp's forward in float64."""
    h = np.maximum(x @ w["fc1.weight"] + w["fc1.bias"], 0.0)
    return h @ w["fc2.weight"] + w["fc2.bias"]


class MSEBlock(onnxblock.TrainingBlock):
    def __init__(self) -> None:
        super().__init__()
        self.loss = onnxblock.loss.MSELoss()

    def build(self, output_name):
        return self.loss(output_name)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_training_block_without_requires_grad_builds_the_loss_and_no_gradient():
    model = scenarios.mlp()
    w = weights(model)
    block = MSEBlock()
    with onnxblock.base(model):
        loss_name = block("logits")
    training, evaluation = block.to_model_proto()
    assert block.parameters() == ([], [])
    assert [i.name for i in training.graph.input] == ["input", "target"]
    assert [o.name for o in training.graph.output] == [loss_name]
    assert not any(o.name.endswith("_grad") for o in training.graph.output)
    x, y = scenarios.data("floats", n=8)
    expected = np.mean((mlp64(w, x.astype(np.float64)) - y) ** 2)
    for built in (training, evaluation):
        (loss,) = session(built).run(None, {"input": x, "target": y})
        assert loss.shape == ()
        np.testing.assert_allclose(loss, expected, rtol=RTOL)


def test_generate_artifacts_without_requires_grad(tmp_path):
    model = scenarios.mlp()
    w = weights(model)
    og.artifacts.generate_artifacts(model, loss=og.artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    state = og.api.CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert len(state.parameters) == 0 and list(state.parameters) == []
    module = og.api.Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    assert module.input_names() == ["input", "target"]
    assert module.get_parameters_size() == 0 and module.get_parameters_size(False) == 0
    buffer = module.get_contiguous_parameters()
    assert isinstance(buffer, ort.OrtValue) and buffer.numpy().shape == (0,)
    module.copy_buffer_to_parameters(buffer)  # an empty buffer fits zero parameters
    x, y = scenarios.data("floats", n=8)
    expected = np.mean((mlp64(w, x.astype(np.float64)) - y) ** 2)
    np.testing.assert_allclose(module(x, y), expected, rtol=RTOL)
    module.eval()
    np.testing.assert_allclose(module(x, y), expected, rtol=RTOL)
    # an optimizer over no parameter: its steps count and change nothing
    with_optimizer = tmp_path / "adamw"
    scenarios._generate(og, str(with_optimizer), scenarios.mlp(), og.artifacts.LossType.MSELoss)
    optimizer = og.api.Optimizer(with_optimizer / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.5)
    module.train()
    before = module(x, y)
    optimizer.step()
    optimizer.step()
    assert optimizer.get_learning_rate() == 0.5
    np.testing.assert_array_equal(module(x, y), before)
    og.api.CheckpointState.save_checkpoint(state, tmp_path / "again", include_optimizer_state=True)
    again = og.api.CheckpointState.load_checkpoint(tmp_path / "again")
    assert len(again.parameters) == 0
    assert again._group().step == 2


def dropout_classifier(ratio: float = 0.5) -> onnx.ModelProto:
    """x[N, 5] -> Dropout(ratio, training_mode=True, as torch exports TRAINING) -> logits: no
    parameter at all."""
    nodes = [helper.make_node("Dropout", ["x", "ratio", "mode"], ["logits", "mask"], name="drop")]
    inits = [
        numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
        numpy_helper.from_array(np.array(True), "mode"),
    ]
    graph = helper.make_graph(
        nodes,
        "drop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def cross_entropy64(logits: np.ndarray, labels: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


def test_model_without_parameters_trains_in_training_mode_and_evaluates_without_dropout(tmp_path):
    og.artifacts.generate_artifacts(
        dropout_classifier(),
        loss=og.artifacts.LossType.CrossEntropyLoss,
        artifact_directory=tmp_path,
        additional_output_names=["logits"],
    )
    evaluation = onnx.load(tmp_path / "eval_model.onnx")
    (drop,) = [n for n in evaluation.graph.node if n.op_type == "Dropout"]
    # 1.19.2's eval model: the training_mode input left empty (inference), the ratio kept
    assert list(drop.input) == ["x", "ratio", ""]
    assert not [i for i in evaluation.graph.initializer if i.data_type == TensorProto.BOOL]
    assert len(evaluation.graph.output) == 2  # the loss and the additional output

    state = og.api.CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = og.api.Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 5)) + 1.0).astype(np.float32)  # no exact zeros
    labels = rng.integers(0, 5, 64).astype(np.int64)
    loss, logits = module(x, labels)
    kept = logits != 0
    # training mode: each element dropped or scaled by 1 / (1 - ratio); the loss is of those logits
    np.testing.assert_allclose(logits[kept], 2.0 * x[kept], rtol=RTOL)
    assert 0.2 < kept.mean() < 0.8  # 320 draws of p = 0.5
    np.testing.assert_allclose(loss, cross_entropy64(logits, labels), rtol=RTOL)
    module.eval()
    loss, logits = module(x, labels)
    np.testing.assert_array_equal(logits, x)  # inference: Dropout is the identity
    np.testing.assert_allclose(loss, cross_entropy64(x, labels), rtol=RTOL)


def test_eval_model_of_batchnorm_without_requires_grad(tmp_path):
    og.artifacts.generate_artifacts(
        scenarios.bn_net(), loss=og.artifacts.LossType.MSELoss, artifact_directory=tmp_path
    )
    evaluation = onnx.load(tmp_path / "eval_model.onnx")
    (bn,) = [n for n in evaluation.graph.node if n.op_type == "BatchNormalization"]
    assert helper.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 0
    assert len(bn.output) == 1
    training = onnx.load(tmp_path / "training_model.onnx")
    (bn,) = [n for n in training.graph.node if n.op_type == "BatchNormalization"]
    assert helper.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 1
    # the train step normalizes with the batch statistics, the eval step with the running ones
    state = og.api.CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = og.api.Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    w = weights(scenarios.bn_net())
    x, y = scenarios.data("one", n=8)
    h = x.astype(np.float64) @ w["fc1.weight"]
    batch = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)
    running = h / np.sqrt(1.0 + 1e-5)  # running mean 0, running variance 1, scale 1, shift 0
    for norm, step in ((batch, module.train), (running, module.eval)):
        step()
        expected = np.mean((np.maximum(norm, 0.0) @ w["fc2.weight"] - y) ** 2)
        np.testing.assert_allclose(module(x, y), expected, rtol=RTOL)


def test_custom_loss_composition_without_requires_grad():
    """A weighted sum of two cross entropies on a two-output model (1.19.2's composition test),
    no parameter trained: the training model computes that sum."""
    two = scenarios.mlp()
    g = two.graph
    g.node.append(helper.make_node("Neg", ["logits"], ["other"], name="neg"))
    g.output.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, ["batch", 3]))

    class WeightedAverage(onnxblock.TrainingBlock):
        def __init__(self) -> None:
            super().__init__()
            self.loss1, self.loss2 = onnxblock.loss.CrossEntropyLoss(), onnxblock.loss.CrossEntropyLoss()
            self.w1, self.w2 = onnxblock.blocks.Constant(0.25), onnxblock.blocks.Constant(0.75)
            self.mul1, self.mul2, self.add = (
                onnxblock.blocks.Mul(),
                onnxblock.blocks.Mul(),
                onnxblock.blocks.Add(),
            )

        def build(self, first, second):
            return self.add(
                self.mul1(self.w1(), self.loss1(first, labels_name="labels1")),
                self.mul2(self.w2(), self.loss2(second, labels_name="labels2")),
            )

    block = WeightedAverage()
    with onnxblock.base(two):
        block("logits", "other")
    training, _ = block.to_model_proto()
    assert [i.name for i in training.graph.input] == ["input", "labels1", "labels2"]
    x, labels = scenarios.data("classes", n=8)
    logits = mlp64(weights(scenarios.mlp()), x.astype(np.float64))
    (loss,) = session(training).run(None, {"input": x, "labels1": labels, "labels2": labels[::-1].copy()})
    expected = 0.25 * cross_entropy64(logits, labels) + 0.75 * cross_entropy64(-logits, labels[::-1])
    assert loss.shape == (1,)  # Constant blocks are [1]-shaped, as in 1.19.2
    np.testing.assert_allclose(loss[0], expected, rtol=RTOL)


def torch_mlp_input_grad(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The MSE loss of scenarios.mlp and its gradient in the input, by torch in float64."""
    w = {k: torch.from_numpy(v) for k, v in weights(model).items()}
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    out = torch.relu(xt @ w["fc1.weight"] + w["fc1.bias"]) @ w["fc2.weight"] + w["fc2.bias"]
    loss = torch.mean((out - torch.from_numpy(y.astype(np.float64))) ** 2)
    loss.backward()
    return float(loss.detach()), xt.grad.numpy()


@pytest.mark.parametrize("also", [[], ["fc2.bias"]])
def test_requires_grad_on_a_graph_input_outputs_its_gradient(also):
    model = scenarios.mlp()
    block = MSEBlock()
    block.requires_grad("input")
    for name in also:
        block.requires_grad(name)
    with onnxblock.base(model):
        loss_name = block("logits")
    training, _ = block.to_model_proto()
    # 1.19.2's order: loss outputs, then gradients in graph-input order (the user input first)
    assert [o.name for o in training.graph.output] == [loss_name, "input_grad", *(f"{n}_grad" for n in also)]
    assert [[t.name for t in group] for group in block.parameters()] == [also, []]
    x, y = scenarios.data("floats", n=8)
    feeds = {"input": x, "target": y}
    feeds.update(
        {n: numpy_helper.to_array(t) for t in scenarios.mlp().graph.initializer for n in also if t.name == n}
    )
    loss, grad, *rest = session(training).run(None, feeds)
    expected_loss, expected_grad = torch_mlp_input_grad(scenarios.mlp(), x, y)
    np.testing.assert_allclose(loss, expected_loss, rtol=RTOL)
    assert grad.shape == x.shape
    np.testing.assert_allclose(grad, expected_grad, rtol=RTOL, atol=RTOL * np.abs(expected_grad).max())
    if also:  # fc2.bias: d mean((out - y)^2) / d bias = 2 mean over the batch and outputs of (out - y)
        out = mlp64(weights(scenarios.mlp()), x.astype(np.float64))
        np.testing.assert_allclose(rest[0], 2 * (out - y).sum(0) / out.size, rtol=RTOL, atol=1e-7)


def test_requires_grad_on_an_unknown_name():
    block = MSEBlock()
    block.requires_grad("nope")
    model = scenarios.mlp()
    with (
        pytest.raises(
            InputError,
            match=r"^requires_grad names \['nope'\] that are neither initializers nor graph inputs of the",
        ),
        onnxblock.base(model),
    ):
        block("logits")


def test_eval_model_dropout_keeps_its_inputs_with_an_empty_training_mode(tmp_path):
    """The MLP with a Dropout on its logits (2 inputs: no training_mode given), all parameters
    trained: the eval Dropout keeps its inputs as given; 1.19.2 emptied a third one."""
    model = scenarios.mlp()
    g = model.graph
    g.node[-1].output[0] = "pre"
    g.node.append(helper.make_node("Dropout", ["pre", "ratio"], ["logits"], name="drop"))
    g.initializer.append(numpy_helper.from_array(np.array(0.25, np.float32), "ratio"))
    og.artifacts.generate_artifacts(
        model, requires_grad=scenarios.PARAMS, loss=og.artifacts.LossType.MSELoss, artifact_directory=tmp_path
    )
    evaluation = onnx.load(tmp_path / "eval_model.onnx")
    (drop,) = [n for n in evaluation.graph.node if n.op_type == "Dropout"]
    assert list(drop.input) == ["pre", "ratio"]
    assert not [i for i in evaluation.graph.initializer if i.data_type == TensorProto.BOOL]
    training = onnx.load(tmp_path / "training_model.onnx")
    (drop,) = [n for n in training.graph.node if n.op_type == "Dropout"]
    (mode,) = [i for i in training.graph.initializer if i.name == drop.input[2]]
    assert numpy_helper.to_array(mode).item() is True  # training mode on in the training model
    dropout_classifier_eval = onnx.load(tmp_path / "eval_model.onnx")
    x, y = scenarios.data("floats", n=8)
    feeds = {
        "input": x,
        "target": y,
        **{k: v.astype(np.float32) for k, v in weights(scenarios.mlp()).items()},
    }
    (loss,) = session(dropout_classifier_eval).run(None, feeds)
    expected = np.mean((mlp64(weights(scenarios.mlp()), x.astype(np.float64)) - y) ** 2)
    np.testing.assert_allclose(loss, expected, rtol=RTOL)


def test_generate_artifacts_with_an_input_in_requires_grad_trains_the_same(tmp_path):
    """The input's gradient is one more output of the training model; Module returns the loss
    outputs only (1.19.2's Module leaves gradients out) and trains to the same numbers."""
    x, y = scenarios.data("classes")
    losses = []
    for name, requires_grad in (("plain", scenarios.PARAMS), ("input", ["input", *scenarios.PARAMS])):
        work = str(tmp_path / name)
        scenarios._generate(
            og, work, scenarios.mlp(), og.artifacts.LossType.CrossEntropyLoss, requires_grad=requires_grad
        )
        state, module, optimizer = scenarios._session(og, work)
        assert len(state.parameters) == 4
        assert module.input_names() == ["input", "labels"] and len(module.output_names()) == 1
        losses.append(scenarios._train(module, optimizer, x, y, 0.01))
    training = onnx.load(tmp_path / "input" / "training_model.onnx")
    assert [o.name for o in training.graph.output][1:3] == ["input_grad", "fc1.weight_grad"]
    assert losses[0] == losses[1]


def test_retrieving_before_building_is_1192s_runtime_error():
    block = MSEBlock()
    with pytest.raises(
        RuntimeError,
        match=r"^Please build the training model first before trying to retrieve the parameters\.$",
    ):
        block.parameters()
    with pytest.raises(
        RuntimeError,
        match=r"^Please build the training and eval models first before trying to retrieve them\.$",
    ):
        block.to_model_proto()

    class Loss(onnxblock.ForwardBlock):
        def build(self, output_name):
            return onnxblock.loss.MSELoss()(output_name)

    with pytest.raises(
        RuntimeError, match=r"^Please build the forward model first before trying to retrieve it\.$"
    ):
        Loss().to_model_proto()
