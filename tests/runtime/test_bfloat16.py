"""bfloat16 models through ForwardBackward: numpy has no bfloat16, onnx gives such tensors the
``ml_dtypes.bfloat16`` type, and onnxruntime's numpy bridge knows neither; parameters, feeds,
outputs and gradients cross as their bits. onnxruntime's CPU provider has bfloat16 kernels for few
ops (Cast among them), so the model computes in float32 between Casts, as mixed-precision graphs do."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import ForwardBackward
from onnxgrad.errors import OnnxGradRuntimeError

BF16 = np.dtype(ml_dtypes.bfloat16)
N_IN, N_OUT = 4, 3


def bfloat16_linear(*, cast: bool = True, seed: int = 0) -> onnx.ModelProto:
    """``y = x W + b`` with ``x``, ``W``, ``b`` and ``y`` in bfloat16. ``cast``: computed in float32
    between Casts (what onnxruntime's CPU provider runs); else MatMul and Add in bfloat16."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N_IN, N_OUT)).astype(BF16)
    b = rng.standard_normal(N_OUT).astype(BF16)
    f32 = TensorProto.FLOAT
    if cast:
        nodes = [
            helper.make_node("Cast", ["x"], ["xf"], to=f32),
            helper.make_node("Cast", ["W"], ["Wf"], to=f32),
            helper.make_node("Cast", ["b"], ["bf"], to=f32),
            helper.make_node("MatMul", ["xf", "Wf"], ["h"]),
            helper.make_node("Add", ["h", "bf"], ["yf"]),
            helper.make_node("Cast", ["yf"], ["y"], to=TensorProto.BFLOAT16),
        ]
    else:
        nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "linear_bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N", N_IN])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N", N_OUT])],
        initializer=[numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def within_bfloat16_rounding(got: np.ndarray, want64: np.ndarray, scale64: np.ndarray, k: int) -> None:
    """``got`` (bfloat16) is ``want64`` rounded to bfloat16, up to one bfloat16 ulp where a float32
    sum of ``k`` terms (of magnitudes summing to ``scale64``) may land on the other side of a
    rounding boundary: ``|got - want| <= 2^-8 |want| (rounding) + 2^-7 |want| (one ulp more)
    + k 2^-24 scale (float32 accumulation)``."""
    assert got.dtype == BF16
    bound = 3 * 2.0**-8 * np.abs(want64) + k * 2.0**-24 * scale64
    err = np.abs(got.astype(np.float64) - want64)
    assert np.all(err <= bound), (err, bound)


def test_forward_backward_in_bfloat16():
    model = bfloat16_linear()
    fb = ForwardBackward(model, inputs_requiring_grad=["x"])
    params = fb.parameters
    assert {k: v.dtype for k, v in params.items()} == {"W": BF16, "b": BF16}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name in ("W", "b"):  # the same bits as the model's
        np.testing.assert_array_equal(params[name].view(np.uint16), inits[name].view(np.uint16))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, N_IN)).astype(BF16)
    g = rng.standard_normal((5, N_OUT)).astype(BF16)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    w64, b64 = params["W"].astype(np.float64), params["b"].astype(np.float64)

    result = fb.forward({"x": x})
    (y,) = result.outputs
    within_bfloat16_rounding(y, x64 @ w64 + b64, np.abs(x64) @ np.abs(w64) + np.abs(b64), N_IN + 1)
    grads = result.backward({"y": g})
    assert {k: v.dtype for k, v in grads.items()} == {"W": BF16, "b": BF16, "x": BF16}
    within_bfloat16_rounding(grads["W"], x64.T @ g64, np.abs(x64).T @ np.abs(g64), len(x))
    within_bfloat16_rounding(grads["b"], g64.sum(0), np.abs(g64).sum(0), len(x))
    within_bfloat16_rounding(grads["x"], g64 @ w64.T, np.abs(g64) @ np.abs(w64).T, N_OUT)


def test_bfloat16_kernels_onnxruntime_lacks_are_a_clear_error():
    """MatMul in bfloat16: onnxruntime's CPU provider has no kernel; the error says so (no bare
    crash converting arrays). Where some provider has one, the result is the float64 one rounded."""
    x = np.random.default_rng(2).standard_normal((2, N_IN)).astype(BF16)
    try:
        fb = ForwardBackward(bfloat16_linear(cast=False))
        (y,) = fb.forward({"x": x}).outputs
    except OnnxGradRuntimeError as exc:
        assert "onnxruntime cannot load" in str(exc) and "implementation" in str(exc)
    else:
        w64, b64 = (fb.parameters[n].astype(np.float64) for n in ("W", "b"))
        x64 = x.astype(np.float64)
        within_bfloat16_rounding(y, x64 @ w64 + b64, np.abs(x64) @ np.abs(w64) + np.abs(b64), N_IN + 1)
        pytest.skip("this onnxruntime has bfloat16 MatMul on the CPU")
