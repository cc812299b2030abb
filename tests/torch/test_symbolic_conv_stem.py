"""A ResNet-style stem exported with dynamic H and W, trained through each door, against torch.

Conv 7x7 stride 2 pad 3 -> BatchNorm -> ReLU -> MaxPool 3 stride 2 pad 1 -> Conv 3x3 stride 2 pad 1,
exported by both exporters with the batch, H and W symbolic, fed odd and even sizes. The strided,
padded Convs leave the last rows of their padded input unread on some sizes: their input gradient
once lost its last row and column there (issue 37 §0), 30-70 % off torch before the first Conv.
Gradients of the input and of every weight, in training mode (batch statistics), against torch's
in float64, through ``ForwardBackward`` and ``OnnxModule``, and one SGD step of ``Trainer`` and of
the one-graph training step (``artifacts.generate`` + ``Runner``), the weights after it against
torch's (at 32x32 and 33x31, sizes where the second Conv's input gradient lost its last row). The
dynamo export takes about 12 s (once per session).
"""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.testing import assert_allclose_scaled

torch = pytest.importorskip("torch")

SIZES = [(32, 32), (33, 31), (18, 20)]  # even (the last rows unread), odd, mixed
RTOL = 2e-5  # float32 against float64, five layers deep: reorders cost ~1e-6, the bug 0.3


def _stem() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, stride=2, padding=1),
        torch.nn.Conv2d(8, 6, 3, stride=2, padding=1),
    )
    with torch.no_grad():  # distinct values: no weight looks like a copy of another
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 1.5)
    return net.eval()


@functools.cache
def _exported(exporter: str) -> bytes:
    """The stem exported with N, H and W symbolic (BatchNorm kept apart from the Conv)."""
    net, x = _stem(), torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            buf = io.BytesIO()
            torch.onnx.export(
                net, (x,), buf, dynamo=False, input_names=["x"], output_names=["y"],
                dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}}, do_constant_folding=False,
            )  # fmt: skip
            return buf.getvalue()
        dims = {0: torch.export.Dim("N"), 2: torch.export.Dim("H"), 3: torch.export.Dim("W")}
        program = torch.onnx.export(
            net, (x,), dynamo=True, verbose=False, optimize=False, input_names=["x"], output_names=["y"],
            dynamic_shapes=(dims,),
        )  # fmt: skip
        return program.model_proto.SerializeToString()


def _model(exporter: str) -> onnx.ModelProto:
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")  # what torch.onnx.export(dynamo=True) runs on
    model = onnx.load_from_string(_exported(exporter))
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims[2] and dims[3], f"H and W are not symbolic: {dims}"
    return model


def _torch_grads(hw: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Input, output cotangent and torch's float64 gradients (input as "x", then every parameter)."""
    gen = np.random.default_rng(seed)
    x = gen.standard_normal((2, 3, *hw)).astype(np.float32)
    net = _stem().double().train()
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = net(tx)
    gy = gen.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(gy, dtype=torch.float64))
    want = {"x": tx.grad.numpy()}  # type: ignore[union-attr]
    want.update({k: p.grad.numpy() for k, p in net.named_parameters()})  # type: ignore[union-attr]
    return x, gy, want


def _assert_matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray], where: str) -> None:
    assert set(got) == set(want), where
    for name, w in want.items():
        assert_allclose_scaled(got[name], w, rtol=RTOL, err_msg=f"{where}: {name}")


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_forward_backward_matches_torch(exporter: str, hw: tuple[int, int]) -> None:
    fb = onnxgrad.ForwardBackward(_model(exporter), inputs_requiring_grad=["x"])
    x, gy, want = _torch_grads(hw, seed=1)
    got = fb.forward({"x": x}, training=True).backward({"y": gy})
    _assert_matches({k: np.asarray(v) for k, v in got.items()}, want, f"{exporter} ForwardBackward {hw}")


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_onnx_module_matches_torch(exporter: str, hw: tuple[int, int]) -> None:
    from onnxgrad.torch import OnnxModule

    module = OnnxModule(_model(exporter)).train(True)
    x, gy, want = _torch_grads(hw, seed=2)
    tx = torch.tensor(x, requires_grad=True)
    y = module(tx)
    y.backward(torch.tensor(gy))
    got = {module.onnx_names[k]: p.grad.numpy() for k, p in module.named_parameters()}
    got["x"] = tx.grad.numpy()  # type: ignore[union-attr]
    _assert_matches(got, want, f"{exporter} OnnxModule {hw}")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_one_graph_step_matches_torch(exporter: str, tmp_path) -> None:
    """``artifacts.generate`` + ``Runner``: one SGD step on mean((y - target)^2) at 33x31 leaves
    the weights where torch's step leaves them (float64, batch statistics)."""
    from onnxgrad.artifacts import Runner, generate

    lr = 0.5
    generate(_model(exporter), loss="mse", optimizer="sgd", lr=lr, out_dir=str(tmp_path))
    runner = Runner(str(tmp_path))
    before = {k: v.copy() for k, v in runner.parameters.items()}
    gen = np.random.default_rng(3)
    x = gen.standard_normal((2, 3, 33, 31)).astype(np.float32)
    net = _stem().double().train()
    y = net(torch.tensor(x, dtype=torch.float64))
    target = gen.standard_normal(tuple(y.shape)).astype(np.float32)
    ((y - torch.tensor(target, dtype=torch.float64)) ** 2).mean().backward()
    runner.step({"x": x, "target": target})
    after = runner.parameters
    assert set(after) == {k for k, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        step = after[name].astype(np.float64) - before[name]
        assert_allclose_scaled(step, -lr * p.grad.numpy(), rtol=RTOL, err_msg=name)  # type: ignore[union-attr]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_trainer_step_matches_torch(exporter: str) -> None:
    """``Trainer``: one SGD step (one batch of 2 images, 32x32) on mean((y - target)^2) leaves the
    weights where torch's step leaves them."""
    from onnxgrad.train import Trainer

    lr = 0.5
    trainer = Trainer(
        _model(exporter), loss="mse", optimizer="sgd", lr=lr, batch_size=2, shuffle=False, progress=False
    )
    before = {k: v.copy() for k, v in trainer.parameters.items()}
    gen = np.random.default_rng(4)
    x = gen.standard_normal((2, 3, 32, 32)).astype(np.float32)
    net = _stem().double().train()
    y = net(torch.tensor(x, dtype=torch.float64))
    target = gen.standard_normal(tuple(y.shape)).astype(np.float32)
    ((y - torch.tensor(target, dtype=torch.float64)) ** 2).mean().backward()
    trainer.fit({"x": x, "target": target}, epochs=1)
    after = trainer.parameters
    assert set(after) == {k for k, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        step = after[name].astype(np.float64) - before[name]
        assert_allclose_scaled(step, -lr * p.grad.numpy(), rtol=RTOL, err_msg=name)  # type: ignore[union-attr]
