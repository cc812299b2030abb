"""What onnxruntime-training users asked for and never got, through the same API: models at opset
19 and 21, a custom YOLO-style loss with ReduceMin and ReduceMax blocks (1.19.2's onnxblock had
neither), a small UNet with Resize and a DistilBERT classifier."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
import onnxgrad.compat.training as og
from onnxgrad.compat.training import onnxblock
from onnxgrad.testing import check_gradients

from . import scenarios
from .test_scenarios import close

DATA = Path(__file__).resolve().parents[1] / "data" / "ort_training"


@pytest.mark.parametrize("opset", [19, 21])
def test_newer_opsets_give_the_1192_numbers(opset, tmp_path):
    """The MLP written at opset 19 or 21 trains to the losses 1.19.2 gave at opset 17."""
    with open(DATA / "recorded.json") as f:
        theirs = json.load(f)["adamw_cross_entropy"]
    work = str(tmp_path / "w")
    scenarios._generate(og, work, scenarios.mlp(opset=opset), og.artifacts.LossType.CrossEntropyLoss)
    state, module, opt = scenarios._session(og, work)
    x, y = scenarios.data("classes")
    close(scenarios._train(module, opt, x, y, 0.01), theirs["losses"])
    close(scenarios._params(state), theirs["params"])


def build_loss_model(model: onnx.ModelProto, loss: onnxblock.Block) -> onnx.ModelProto:
    """``model`` with ``loss`` appended, as a ForwardBlock builds it (the loss its only output)."""

    class WithLoss(onnxblock.ForwardBlock):
        def build(self, output_name):
            return loss(output_name)

    block = WithLoss()
    with onnxblock.base(model):
        block(model.graph.output[0].name)
    return block.to_model_proto()


class YoloStyleLoss(onnxblock.Block):
    """Box regression (MSE), the worst box error (ReduceMax of |error|) and a confidence term that
    pushes the least confident score up (-ReduceMin of the sigmoid)."""

    def __init__(self):
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()
        self.sub, self.add = onnxblock.blocks.Sub(), onnxblock.blocks.Add()
        self.abs, self.neg = onnxblock.blocks.Abs(), onnxblock.blocks.Neg()
        self.worst = onnxblock.blocks.ReduceMax(keepdims=False)
        self.least = onnxblock.blocks.ReduceMin(keepdims=False)
        self.sigmoid = onnxblock.blocks.Sigmoid()

    def build(self, output_name):
        box = self.mse(output_name, "target")
        worst = self.worst(self.abs(self.sub(output_name, "target")))
        confidence = self.neg(self.least(self.sigmoid(output_name)))
        return self.add(self.add(box, worst), confidence)


def test_yolo_style_loss_with_reduce_min_max(tmp_path):
    x, y = scenarios.data("floats", n=64)
    feeds = {"input": x[:8], "target": y[:8]}
    # the loss model: onnxgrad's gradients of it against float64 finite differences
    loss_model = build_loss_model(scenarios.mlp(), YoloStyleLoss())
    assert {n.op_type for n in loss_model.graph.node} >= {"ReduceMax", "ReduceMin", "Sigmoid"}
    result = check_gradients(loss_model, feeds, wrt=scenarios.PARAMS)
    assert result.ok, result
    expected = onnxgrad.gradients(loss_model, feeds, wrt=scenarios.PARAMS)
    # the same gradients through the compat API, then training brings the loss down
    work = str(tmp_path / "yolo")
    scenarios._generate(og, work, scenarios.mlp(), YoloStyleLoss(), og.artifacts.OptimType.SGD)
    state, module, opt = scenarios._session(og, work)
    first = float(module(feeds["input"], feeds["target"]))
    for name in scenarios.PARAMS:
        close(state.parameters[name].grad, expected[name], rtol=1e-5)
    before = scenarios._eval(module, x, y)
    scenarios._train(module, opt, x, y, 0.05)
    assert scenarios._eval(module, x, y) < before
    assert np.isfinite(first)


def _export(module, inputs: tuple, names: list[str]) -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, inputs, buf, input_names=names, output_names=["output"], dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
        )  # fmt: skip
    return onnx.load_from_string(buf.getvalue())


def _floats(model: onnx.ModelProto) -> list[str]:
    return [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]


def test_small_unet_with_resize(tmp_path):
    """Conv, MaxPool, an upsampling Resize and a skip Concat: the gradients of the first step are
    torch's, and training brings the loss down."""
    torch = pytest.importorskip("torch")

    class UNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.mid = torch.nn.Conv2d(4, 8, 3, padding=1)
            self.up = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.out = torch.nn.Conv2d(12, 1, 3, padding=1)

        def forward(self, x):
            skip = torch.relu(self.down(x))
            mid = torch.relu(self.mid(torch.nn.functional.max_pool2d(skip, 2)))
            return self.out(torch.cat([self.up(mid), skip], 1))

    torch.manual_seed(0)
    net = UNet()
    x = torch.randn(2, 1, 8, 8)
    target = torch.randn(2, 1, 8, 8)
    model = _export(net, (x,), ["input"])
    assert "Resize" in {n.op_type for n in model.graph.node}
    params = _floats(model)
    work = str(tmp_path / "unet")
    og.artifacts.generate_artifacts(
        model, requires_grad=params, loss=og.artifacts.LossType.MSELoss,
        optimizer=og.artifacts.OptimType.AdamW, artifact_directory=work,
    )  # fmt: skip
    state, module, opt = scenarios._session(og, work)
    loss = float(module(x.numpy(), target.numpy()))
    torch_loss = torch.nn.functional.mse_loss(net(x), target)
    torch_loss.backward()
    close(loss, float(torch_loss.detach()), rtol=1e-5)
    named = dict(net.named_parameters())
    assert set(params) == set(named)
    for name in params:
        close(state.parameters[name].grad, named[name].grad.numpy(), rtol=1e-4)
    opt.set_learning_rate(1e-2)
    opt.step()
    module.lazy_reset_grad()
    losses = [loss]
    for _ in range(20):
        losses.append(float(module(x.numpy(), target.numpy())))
        opt.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow  # about 15 s on 2 shared cores
def test_distilbert_classifier(tmp_path):
    """A DistilBERT sequence classifier (built from a small config, offline): its loss is torch's,
    its gradients onnxgrad's checked ones, and training fits a batch."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(
        vocab_size=50, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.DistilBertForSequenceClassification(config)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, ids):
            return self.net(input_ids=ids).logits

    ids = torch.randint(3, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 1])
    model = _export(Logits(), (ids,), ["input_ids"])
    params = _floats(model)
    work = str(tmp_path / "bert")
    og.artifacts.generate_artifacts(
        model, requires_grad=params, loss=og.artifacts.LossType.CrossEntropyLoss,
        optimizer=og.artifacts.OptimType.AdamW, artifact_directory=work,
    )  # fmt: skip
    state, module, opt = scenarios._session(og, work)
    feeds = (ids.numpy(), labels.numpy())
    first = float(module(*feeds))
    with torch.no_grad():
        close(first, float(torch.nn.functional.cross_entropy(Logits()(ids), labels)), rtol=1e-5)
    loss_model = build_loss_model(model, onnxblock.loss.CrossEntropyLoss())
    expected = onnxgrad.gradients(loss_model, {"input_ids": feeds[0], "labels": feeds[1]}, wrt=params)
    for name in params:
        close(state.parameters[name].grad, expected[name], rtol=1e-5)
    opt.set_learning_rate(1e-2)
    losses = [first]
    for _ in range(15):
        opt.step()
        module.lazy_reset_grad()
        losses.append(float(module(*feeds)))
    assert losses[-1] < 0.5 * losses[0], losses
