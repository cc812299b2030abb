"""OnnxModule(master_weights=True) on a float16 ONNX model: float32 parameters cast to float16 at
each forward, so that torch.amp.GradScaler and torch optimizers train it as a torch float16
forward with float32 master weights; to_onnx writes float16 back."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.errors import InputError
from onnxgrad.model.graph import to_array
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.torch import OnnxModule

F16 = np.float16
IN, HIDDEN, OUT, N, STEPS, LR = 8, 16, 4, 32, 10, 0.1


def _half_mlp() -> onnx.ModelProto:
    """x [N, 8] -> MatMul W1 + b1 -> Relu -> MatMul W2 -> y, all float16 (opset 17, IR 8)."""
    r = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((r.standard_normal((IN, HIDDEN)) * 0.4).astype(F16), "W1"),
        numpy_helper.from_array((r.standard_normal(HIDDEN) * 0.1).astype(F16), "b1"),
        numpy_helper.from_array((r.standard_normal((HIDDEN, OUT)) * 0.4).astype(F16), "W2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "half_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", OUT])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    r = np.random.default_rng(1)
    x = torch.from_numpy(r.standard_normal((N, IN)).astype(F16))
    target = torch.from_numpy(r.standard_normal((N, OUT)).astype(np.float32))
    return x, target


def _train(forward: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor]) -> list[float]:
    """STEPS steps of SGD under a GradScaler (init_scale 2^10): the scaled loss's backward, the
    unscale (which refuses float16 gradients), the step; the losses before each step."""
    x, target = _batch()
    opt = torch.optim.SGD(params, lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x).float(), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def test_grad_scaler_and_sgd_train_float32_masters_as_torch_does() -> None:
    model = _half_mlp()
    module = OnnxModule(model, master_weights=True)
    params = dict(module.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    # the same loop in plain torch: float32 masters, the forward in float16
    inits = {t.name: torch.from_numpy(to_array(t).astype(np.float32)) for t in model.graph.initializer}
    ref = {k: v.clone().requires_grad_(True) for k, v in inits.items()}

    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2 = (ref[k].half() for k in ("W1", "b1", "W2"))
        return torch.relu(x @ w1 + b1) @ w2

    want = _train(torch_forward, list(ref.values()))
    got = _train(module, list(params.values()))
    assert got[-1] < 0.8 * got[0]  # it trains
    assert_allclose_scaled(got, want, rtol=2e-3)  # float16 forwards of two libraries (measured 2e-4)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params.values())
    for tname, onnx_name in module.onnx_names.items():
        assert_allclose_scaled(module.get_parameter(tname).detach(), ref[onnx_name].detach(), rtol=1e-2)
    # written back in float16: the masters rounded
    out = module.to_onnx()
    written = {t.name: t for t in out.graph.initializer}
    for tname, onnx_name in module.onnx_names.items():
        assert written[onnx_name].data_type == TensorProto.FLOAT16
        rounded = module.get_parameter(tname).detach().half().numpy()
        np.testing.assert_array_equal(to_array(written[onnx_name]), rounded)


def test_without_master_weights_grad_scaler_refuses_the_float16_gradients() -> None:
    """What master_weights is for: torch's GradScaler refuses the float16 parameters' gradients."""
    module = OnnxModule(_half_mlp())
    assert {p.dtype for p in module.parameters()} == {torch.float16}
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _train(module, list(module.parameters()))


def test_master_weights_survive_a_deepcopy_and_leave_float32_models_as_they_are() -> None:
    module = OnnxModule(_half_mlp(), master_weights=True)
    clone = copy.deepcopy(module)
    x, _ = _batch()
    torch.testing.assert_close(clone(x), module(x), rtol=0, atol=0)
    assert clone(x).dtype == torch.float16
    float_model = _half_mlp()
    for t in float_model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(to_array(t).astype(np.float32), t.name))
    for v in (*float_model.graph.input, *float_model.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT
    plain = OnnxModule(float_model, master_weights=True)
    assert {p.dtype for p in plain.parameters()} == {torch.float32}


def test_master_weights_takes_the_trainers_values() -> None:
    """True, False or "auto", as Trainer(master_weights=), decided by the same rule."""
    auto = OnnxModule(_half_mlp(), master_weights="auto")  # a float16 model: master weights
    assert {p.dtype for p in auto.parameters()} == {torch.float32}
    with pytest.raises(InputError, match=r"master_weights must be True, False or 'auto', got 'yes'"):
        OnnxModule(_half_mlp(), master_weights="yes")  # type: ignore[arg-type]
