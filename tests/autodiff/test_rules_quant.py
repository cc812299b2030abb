"""Quantization rules (rules/quant.py) and the quantized= switch of build_gradient.

DequantizeLinear in its scale is checked against finite differences (it is linear there); the
rounding ops against PyTorch's fake-quantize backward (the straight-through estimator); quantized
models made by onnxruntime's own tools against the exact straight-through gradient computed by hand
from their dequantized weights, and against the float model within the quantization error.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError, GradientWarning, InputError
from onnxgrad.testing import check_gradients, model_values, run_gradients
from tests.autodiff.random_data import rng
from tests.models import make_model

F32 = np.float32


def _dq_model(attrs: dict, x: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> onnx.ModelProto:
    node = helper.make_node("DequantizeLinear", ["x", "scale", "zp"], ["y"], name="dq", **attrs)
    return make_model(
        [node],
        [("x", x.dtype, list(x.shape))],
        [("y", F32, list(x.shape))],
        {"scale": scale, "zp": zp},
        opset=21,
    )


# (attributes, scale shape, what the scale is shared by): per tensor, per axis, per block of 2 along
# the last axis (5 = 2 + 2 + 1: the last block is short)
LAYOUTS = {
    "tensor": ({}, ()),
    "axis": ({"axis": 1}, (4,)),
    "block": ({"axis": 2, "block_size": 2}, (3, 4, 3)),
}


def _expanded(v: np.ndarray, layout: str) -> np.ndarray:
    """A scale or zero point broadcast to x's (3, 4, 5) shape, by the ONNX definition."""
    if layout == "tensor":
        return v
    if layout == "axis":
        return v.reshape(1, 4, 1)
    return np.repeat(v, 2, axis=2)[:, :, :5]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dequantize_scale_gradient(layout: str) -> None:
    """d scale = sum of dy (x - zp) over the elements sharing it: finite differences agree, and
    so does the sum written out in float64."""
    attrs, shape = LAYOUTS[layout]
    r = rng()
    x = r.integers(-128, 128, (3, 4, 5)).astype(np.int8)
    scale = r.uniform(0.05, 0.2, shape).astype(F32)
    zp = r.integers(-3, 4, shape).astype(np.int8)
    m = _dq_model(attrs, x, scale, zp)
    result = check_gradients(m, {"x": x}, wrt=["scale"])
    assert result.ok, result.report()
    dy = r.standard_normal((3, 4, 5)).astype(F32)
    graphs = build_gradient(m, trainable=["scale"])
    _, grads = run_gradients(graphs, {"x": x}, {"y": dy})
    per_element = dy.astype(np.float64) * (x.astype(np.float64) - _expanded(zp.astype(np.float64), layout))
    if layout == "tensor":
        want = per_element.sum()
    elif layout == "axis":
        want = per_element.sum(axis=(0, 2))
    else:
        want = np.pad(per_element, [(0, 0), (0, 0), (0, 1)]).reshape(3, 4, 3, 2).sum(axis=3)
    np.testing.assert_allclose(grads["scale"], want, rtol=1e-5, atol=1e-5 * np.abs(per_element).sum())
    assert np.abs(grads["scale"]).min() > 0  # the old rule gave exactly zero


def _qdq_model(
    x_shape: tuple[int, ...], scale: np.ndarray, zp: np.ndarray, axis: int | None = None, opset: int = 21
) -> onnx.ModelProto:
    attrs = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], name="quant", **attrs),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], name="dequant", **attrs),
    ]
    return make_model(
        nodes,
        [("x", F32, list(x_shape))],
        [("y", F32, list(x_shape))],
        {"scale": scale, "zp": zp},
        opset=opset,
    )


def _away_from_ties(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``x`` moved off the points where x / scale is half an integer (onnxruntime divides, torch
    multiplies by the inverse: the two may round those differently)."""
    v = x / scale
    frac = v - np.floor(v)
    return np.where(np.abs(frac - 0.5) < 0.05, (np.floor(v) + 0.3) * scale, x).astype(F32)


@pytest.mark.parametrize(("dtype", "qmin", "qmax", "zp"), [(np.int8, -128, 127, 3), (np.uint8, 0, 255, 128)])
def test_qdq_matches_torch_fake_quantize_per_tensor(dtype: type, qmin: int, qmax: int, zp: int) -> None:
    """QuantizeLinear -> DequantizeLinear under quantized="ste": dx is torch's fake-quantize
    backward (dy where not clamped, 0 where clamped), d scale its learnable (LSQ) backward."""
    r = rng()
    scale = F32(0.05)
    x = _away_from_ties(r.standard_normal((4, 6)).astype(F32) * 4, scale)  # some values clamp
    m = _qdq_model(x.shape, np.array(scale), np.array(zp, dtype))
    dy = r.standard_normal(x.shape).astype(F32)
    graphs = build_gradient(m, trainable=["scale"], inputs_requiring_grad=["x"])
    out, grads = run_gradients(graphs, {"x": x}, {"y": dy})

    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_tensor_affine(xt, float(scale), zp, qmin, qmax)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(out["y"], yt.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)
    assert 0 < (grads["x"] == 0).sum() < x.size  # both cases occur

    xt = torch.tensor(x, requires_grad=True)
    st = torch.tensor([float(scale)], requires_grad=True)
    zt = torch.tensor([float(zp)], requires_grad=True)
    yt = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, qmin, qmax, 1.0)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)
    want = float(st.grad.numpy()[0])
    assert abs(float(grads["scale"]) - want) <= 1e-4 * np.abs(dy * x / scale).sum()


def test_qdq_matches_torch_fake_quantize_per_channel() -> None:
    """Per-channel QuantizeLinear -> DequantizeLinear (axis 0): torch's per-channel fake-quantize
    backward in x, its learnable per-channel backward in the scales."""
    r = rng()
    scale = np.array([0.02, 0.05, 0.1], F32)
    zp = np.array([0, -5, 7], np.int8)
    x = r.standard_normal((3, 8)).astype(F32) * 3
    x = _away_from_ties(x, scale[:, None])
    m = _qdq_model(x.shape, scale, zp, axis=0)
    dy = r.standard_normal(x.shape).astype(F32)
    graphs = build_gradient(m, trainable=["scale"], inputs_requiring_grad=["x"])
    _, grads = run_gradients(graphs, {"x": x}, {"y": dy})

    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_channel_affine(
        xt, torch.tensor(scale), torch.tensor(zp.astype(np.int32)), 0, -128, 127
    )
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)
    assert 0 < (grads["x"] == 0).sum() < x.size

    st = torch.tensor(scale, requires_grad=True)
    zt = torch.tensor(zp.astype(F32), requires_grad=True)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch._fake_quantize_learnable_per_channel_affine(xt, st, zt, 0, -128, 127, 1.0)
    yt.backward(torch.tensor(dy))
    bound = 1e-4 * np.abs(dy * x / scale[:, None]).sum(axis=1)
    assert np.all(np.abs(grads["scale"] - st.grad.numpy()) <= bound)


def test_float8_dequantize_is_linear_in_x() -> None:
    """QuantizeLinear to float8 (e4m3fn, saturating) then DequantizeLinear: dx = dy where |x / scale|
    is within float8's range (448), 0 where it saturates; the float8 tensor carries the gradient."""
    r = rng()
    scale = F32(0.5)
    x = (r.standard_normal((5, 4)) * 100).astype(F32)
    x[0, 0], x[1, 1] = 300.0, -400.0  # beyond 448 * 0.5: saturated
    fp8 = np.array(0, dtype=np.float32)
    zp = numpy_helper.from_array(fp8, "zp")
    zp = helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0.0])
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], name="quant"),
        helper.make_node("DequantizeLinear", ["q", "scale"], ["y"], name="dequant"),
    ]
    graph = helper.make_graph(
        nodes,
        "fp8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 4])],
        [numpy_helper.from_array(np.array(scale), "scale"), zp],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    dy = r.standard_normal(x.shape).astype(F32)
    graphs = build_gradient(m, trainable=[], inputs_requiring_grad=["x"])
    _, grads = run_gradients(graphs, {"x": x}, {"y": dy})
    inside = np.abs(x / scale) <= 448
    assert not inside[0, 0] and not inside[1, 1] and inside.sum() == x.size - 2
    np.testing.assert_allclose(grads["x"], np.where(inside, dy, 0), rtol=1e-6, atol=1e-7)


# ---- models quantized by onnxruntime -----------------------------------------------------------
def _float_mlp(r: np.random.Generator) -> onnx.ModelProto:
    inits = {
        "W1": (r.standard_normal((8, 16)) * 0.5).astype(F32),
        "b1": (r.standard_normal(16) * 0.1).astype(F32),
        "W2": (r.standard_normal((16, 4)) * 0.5).astype(F32),
        "b2": (r.standard_normal(4) * 0.1).astype(F32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["z"], name="mm2"),
        helper.make_node("Add", ["z", "b2"], ["y"], name="add2"),
    ]
    return make_model(nodes, [("x", F32, ["N", 8])], [("y", F32, ["N", 4])], inits, opset=17)


def _quantize(
    tmp_path: Path, model: onnx.ModelProto, how: str, calibration: list[np.ndarray]
) -> onnx.ModelProto:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    src, dst = tmp_path / "float.onnx", tmp_path / f"{how}.onnx"
    onnx.save(model, src)
    if how == "dynamic":
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
    else:

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.batches = iter([{"x": b} for b in calibration])

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.batches, None)

        quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ)
    return onnx.load(dst)


def _dequantized(model: onnx.ModelProto, name: str) -> np.ndarray:
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    return (inits[f"{name}_quantized"] - inits[f"{name}_zero_point"]) * inits[f"{name}_scale"]


def test_dynamic_int8_model_input_gradient(tmp_path: Path) -> None:
    """quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(scales) chain: dx is
    exactly d/dx of dequant(x_q) @ dequant(W) with the rounding passed straight through, and the
    float model's dx within the quantization error (the old rules gave all zeros)."""
    r = rng()
    fm = _float_mlp(r)
    qm = _quantize(tmp_path, fm, "dynamic", [])
    assert {n.op_type for n in qm.graph.node} >= {"DynamicQuantizeLinear", "MatMulInteger"}
    x = r.standard_normal((6, 8)).astype(F32)
    dy = r.standard_normal((6, 4)).astype(F32)
    got = onnxgrad.gradients(qm, {"x": x}, {"y": dy}, wrt=["x"])["x"]
    relu = model_values(qm, {"x": x})["hb"] > 0  # the quantized forward's own ReLU pattern
    want = ((dy @ _dequantized(qm, "W2").T) * relu) @ _dequantized(qm, "W1").T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = onnxgrad.gradients(fm, {"x": x}, {"y": dy}, wrt=["x"])["x"]
    assert np.linalg.norm(got - exact) <= 0.1 * np.linalg.norm(exact)
    # the default parameters upstream of the first quantized product get gradients too
    grads = onnxgrad.gradients(qm, {"x": x}, {"y": dy})
    assert "b1" in grads and np.abs(grads["b1"]).max() > 0


def test_static_qdq_model_input_gradient(tmp_path: Path) -> None:
    """quantize_static (QDQ): the activations' QuantizeLinear -> DequantizeLinear pass dx straight
    through where not clamped; checked against the straight-through gradient by hand and against the
    float model within the quantization error."""
    r = rng()
    fm = _float_mlp(r)
    x = r.standard_normal((6, 8)).astype(F32)
    qm = _quantize(tmp_path, fm, "static", [x, r.standard_normal((6, 8)).astype(F32)])
    dy = r.standard_normal((6, 4)).astype(F32)
    got = onnxgrad.gradients(qm, {"x": x}, {"y": dy}, wrt=["x"])["x"]
    values = model_values(qm, {"x": x})
    inits = {i.name: numpy_helper.to_array(i) for i in qm.graph.initializer}

    def kept(node_input: str, value: np.ndarray) -> np.ndarray:
        """The straight-through mask of the QuantizeLinear of ``value``."""
        s, z = inits[f"{node_input}_scale"], inits[f"{node_input}_zero_point"]
        q = np.round(value / s) + z
        info = np.iinfo(z.dtype)
        return (q >= info.min) & (q <= info.max)

    g = dy * kept("y", values["y_QuantizeLinear_Input"])
    g = g * kept("z", values["z"])
    # onnxruntime folds the ReLU into r's quantization (zero point -128: negatives clamp)
    assert "Relu" not in {n.op_type for n in qm.graph.node}
    g = (g @ _dequantized(qm, "W2").T) * kept("r", values["r"])
    g = (g * kept("h", values["h"])) @ _dequantized(qm, "W1").T
    want = g * kept("x", x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = onnxgrad.gradients(fm, {"x": x}, {"y": dy}, wrt=["x"])["x"]
    assert np.linalg.norm(got - exact) <= 0.15 * np.linalg.norm(exact)


# ---- the switch ------------------------------------------------------------------------------
def _quantized_weight_model() -> onnx.ModelProto:
    """y = x * DequantizeLinear(QuantizeLinear(w)): a trainable weight fake-quantized."""
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "scale", "zp"], ["q"], name="quant_w"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["wq"], name="dequant_w"),
        helper.make_node("Mul", ["x", "wq"], ["y"], name="mul"),
    ]
    inits = {"w": np.array([0.5, -1, 2, 0.3], F32), "scale": np.array(0.1, F32), "zp": np.array(0, np.int8)}
    return make_model(nodes, [("x", F32, [4])], [("y", F32, [4])], inits, opset=19)


def test_switch_ste_zero_refuse() -> None:
    m = _quantized_weight_model()
    x = np.array([1, 2, 3, 4], F32)
    # the straight-through estimator is a documented rule, not the derivative: it says so, naming the node
    with pytest.warns(
        GradientWarning, match=r"1 rounding node\(s\) \('quant_w'\) pass the gradient straight through"
    ):
        ste = onnxgrad.gradients(m, {"x": x}, wrt=["w", "x"])
    np.testing.assert_allclose(ste["w"], x, rtol=1e-6)  # straight through: d(x * w) / dw
    np.testing.assert_allclose(ste["x"], [0.5, -1, 2, 0.3], rtol=1e-6)

    with pytest.warns(GradientWarning, match=r"'w' by node 'quant_w' \(QuantizeLinear\).*quantized='zero'"):
        zero = onnxgrad.gradients(m, {"x": x}, wrt=["w", "x"], quantized="zero")
    np.testing.assert_array_equal(zero["w"], np.zeros(4, F32))
    np.testing.assert_allclose(zero["x"], [0.5, -1, 2, 0.3], rtol=1e-6)

    with pytest.raises(
        GradientNotImplementedError, match=r"'quant_w' \(op 'QuantizeLinear', opset 19\) rounds"
    ):
        onnxgrad.gradients(m, {"x": x}, wrt=["w"], quantized="refuse")
    # nothing rounds on the path of x alone, and DequantizeLinear's scale gradient is exact
    refused = build_gradient(m, trainable=[], inputs_requiring_grad=["x"], quantized="refuse")
    assert refused.quantized == "refuse"
    with pytest.raises(InputError, match=r"quantized must be one of \['ste', 'zero', 'refuse'\], got 'STE'"):
        build_gradient(m, quantized="STE")


def test_switch_reaches_the_front_ends() -> None:
    """ForwardBackward, OnnxModule and Trainer take quantized= as build_gradient does."""
    from onnxgrad.torch import OnnxModule
    from onnxgrad.train import Trainer

    m = _quantized_weight_model()
    x = np.array([1, 2, 3, 4], F32)
    with pytest.warns(GradientWarning, match="'w' by node 'quant_w'"):
        fb = onnxgrad.ForwardBackward(m, trainable=["w"], quantized="zero")
    assert fb.graphs.quantized == "zero"
    with pytest.raises(GradientNotImplementedError, match="quant_w"):
        onnxgrad.ForwardBackward(m, trainable=["w"], quantized="refuse")
    module = OnnxModule(m, trainable=["w"])
    module(torch.tensor(x)).sum().backward()
    np.testing.assert_allclose(dict(module.named_parameters())["w"].grad.numpy(), x, rtol=1e-6)
    with pytest.raises(GradientNotImplementedError, match="quant_w"):
        OnnxModule(m, trainable=["w"], quantized="refuse")(torch.tensor(x))
    with pytest.raises(InputError, match="quantized must be one of"):
        OnnxModule(m, quantized="nope")
    with pytest.raises(GradientNotImplementedError, match="quant_w"):
        Trainer(m, loss="mse", trainable=["w"], quantized="refuse", progress=False)


def test_training_through_fake_quantized_weight_lowers_the_loss() -> None:
    """A fake-quantized weight trained with the straight-through estimator: the loss goes down
    (under the old zero rule it could not move)."""
    m = _quantized_weight_model()
    fb = onnxgrad.ForwardBackward(m, trainable=["w"])
    x = np.array([1, 2, 3, 4], F32)
    target = np.array([2.0, 2.0, -3.0, 1.0], F32)
    losses = []
    for _ in range(20):
        res = fb.forward({"x": x}, training=True)
        err = res.outputs[0] - target
        losses.append(float((err**2).sum()))
        grads = res.backward({"y": 2 * err})
        fb.parameters["w"] -= 0.02 * grads["w"]
    assert losses[-1] < 0.1 * losses[0]


# ---- the warning of a cut gradient -------------------------------------------------------------
def test_cut_gradient_warns_once_naming_value_and_op() -> None:
    """y = x * Floor(w) + b: w's only path crosses Floor (zero almost everywhere): one warning."""
    nodes = [
        helper.make_node("Floor", ["w"], ["fw"], name="floor_w"),
        helper.make_node("Mul", ["x", "fw"], ["xw"], name="mul"),
        helper.make_node("Add", ["xw", "b"], ["y"], name="add"),
    ]
    inits = {"w": np.array([1.5, 2.5], F32), "b": np.array([0.1, 0.2], F32)}
    m = make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], inits)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = build_gradient(m, trainable=["w", "b"])
    cut = [w for w in caught if issubclass(w.category, GradientWarning)]
    assert len(cut) == 1
    assert "1 trainable value(s) get a zero gradient" in str(cut[0].message)
    assert "'w' by node 'floor_w' (Floor)" in str(cut[0].message)
    _, grads = run_gradients(graphs, {"x": np.ones(2, F32)})
    np.testing.assert_array_equal(grads["w"], np.zeros(2, F32))


def test_no_warning_for_shape_only_or_unused_initializers() -> None:
    """An initializer used only for its shape (Shape -> Reshape) or its type (CastLike's target),
    and one used nowhere on the path to an output, are not cut: no warning."""
    nodes = [
        helper.make_node("Shape", ["like"], ["s"], name="shape"),
        helper.make_node("Reshape", ["x", "s"], ["xr"], name="reshape"),
        helper.make_node("CastLike", ["xr", "typed"], ["xc"], name="castlike"),
        helper.make_node("Mul", ["xc", "w"], ["y"], name="mul"),
        helper.make_node("Neg", ["unused"], ["dead"], name="neg"),
    ]
    inits = {
        "like": np.zeros((2, 3), F32),
        "typed": np.zeros(1, F32),
        "w": np.ones((2, 3), F32),
        "unused": np.ones(2, F32),
    }
    m = make_model(nodes, [("x", F32, [6])], [("y", F32, [2, 3])], inits)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientWarning)
        graphs = build_gradient(m, trainable=["like", "typed", "w", "unused"])
    _, grads = run_gradients(graphs, {"x": np.arange(6, dtype=F32)})
    assert not np.any(grads["like"]) and not np.any(grads["typed"]) and np.any(grads["w"])


def test_rule_without_gradient_for_a_float_input_warns() -> None:
    """A rule that returns no gradient for a float input (Resize's scales) cuts it: a warning."""
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize", mode="nearest")]
    inits = {"scales": np.array([1, 1, 2, 2], F32)}
    m = make_model(nodes, [("x", F32, [1, 1, 2, 2])], [("y", F32, [1, 1, 4, 4])], inits)
    with pytest.warns(GradientWarning, match=r"'scales' by node 'resize' \(Resize\)"):
        build_gradient(m, trainable=["scales"], inputs_requiring_grad=["x"])


def test_conv_integer_chain_input_gradient() -> None:
    """DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul(scales), as quantize_dynamic writes a
    Conv: dx is torch's gradient of conv2d(x, dequant(W)) (the rounding of x straight through)."""
    r = rng()
    w_q = r.integers(100, 156, (3, 2, 3, 3)).astype(np.uint8)
    w_zp, w_scale = np.uint8(128), F32(0.02)
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
        helper.make_node("ConvInteger", ["xq", "w", "xz", "wz"], ["acc"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "ws"], ["s"]),
        helper.make_node("Mul", ["accf", "s"], ["y"]),
    ]
    inits = {"w": w_q, "wz": np.array(w_zp), "ws": np.array(w_scale)}
    m = make_model(nodes, [("x", F32, [2, 2, 5, 5])], [("y", F32, [2, 3, 5, 5])], inits)
    x = r.standard_normal((2, 2, 5, 5)).astype(F32)
    dy = r.standard_normal((2, 3, 5, 5)).astype(F32)
    got = onnxgrad.gradients(m, {"x": x}, {"y": dy}, wrt=["x"])["x"]
    xt = torch.tensor(x, requires_grad=True)
    w = torch.tensor((w_q.astype(np.float32) - float(w_zp)) * w_scale)
    torch.nn.functional.conv2d(xt, w, padding=1).backward(torch.tensor(dy))
    want = xt.grad.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _qdq_activations_mlp() -> onnx.ModelProto:
    """x -> QDQ -> MatMul(w1) -> QDQ -> Relu -> MatMul(w2) -> y: statically quantized activations
    around float weights (where LoRA adapters go)."""
    r = np.random.default_rng(1)
    inits = {
        "w1": (r.standard_normal((6, 8)) * 0.4).astype(F32),
        "w2": (r.standard_normal((8, 3)) * 0.4).astype(F32),
        "s_x": np.array(0.03, F32),
        "s_h": np.array(0.05, F32),
        "zp": np.array(0, np.int8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_x", "zp"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "s_x", "zp"], ["xd"], name="dq_x"),
        helper.make_node("MatMul", ["xd", "w1"], ["h"], name="mm1"),
        helper.make_node("QuantizeLinear", ["h", "s_h", "zp"], ["hq"], name="q_h"),
        helper.make_node("DequantizeLinear", ["hq", "s_h", "zp"], ["hd"], name="dq_h"),
        helper.make_node("Relu", ["hd"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    return make_model(nodes, [("x", F32, ["N", 6])], [("y", F32, ["N", 3])], inits, opset=19)


def test_lora_on_statically_quantized_model_trains() -> None:
    """LoRA adapters on the weight before a quantized activation: with the straight-through
    estimator they get gradients and the loss goes down; with quantized="zero" the adapter of w1 is
    cut (a GradientWarning names it) and only w2's adapter trains."""
    from onnxgrad import lora
    from onnxgrad.train import Trainer

    adapted = lora.add_adapters(_qdq_activations_mlp(), ["w1"], rank=2)
    r = np.random.default_rng(0)
    x = r.uniform(-1, 1, (64, 6)).astype(F32)
    y = np.tanh(x[:, :3] * 2).astype(F32)
    data = {"x": x, "target": y}
    trainer = Trainer(adapted, loss="mse", lr=2e-2, progress=False, batch_size=16)
    first = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=10)
    assert trainer.evaluate(data)["loss"] < 0.7 * first
    with pytest.warns(GradientWarning, match=r"by node 'q_h' \(QuantizeLinear\)"):
        Trainer(adapted, loss="mse", progress=False, quantized="zero")


@pytest.mark.parametrize("quantized", ["ste", "zero"])
def test_switch_inside_an_if_branch(quantized: str) -> None:
    """A fake-quantized weight inside an If branch follows the switch of the build."""
    branch_nodes = [
        helper.make_node("QuantizeLinear", ["w", "scale", "zp"], ["q"], name="quant_in_branch"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["wq"], name="dequant_in_branch"),
    ]
    then = helper.make_graph(
        branch_nodes, "then", [], [helper.make_tensor_value_info("wq", TensorProto.FLOAT, [4])]
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["wi"])],
        "else",
        [],
        [helper.make_tensor_value_info("wi", TensorProto.FLOAT, [4])],
    )
    nodes = [
        helper.make_node("If", ["cond"], ["wb"], name="if", then_branch=then, else_branch=other),
        helper.make_node("Mul", ["x", "wb"], ["y"], name="mul"),
    ]
    inits = {"w": np.array([0.5, -1, 2, 0.3], F32), "scale": np.array(0.1, F32), "zp": np.array(0, np.int8)}
    m = make_model(nodes, [("x", F32, [4]), ("cond", np.bool_, [])], [("y", F32, [4])], inits, opset=19)
    x = np.array([1, 2, 3, 4], F32)
    graphs = build_gradient(m, trainable=["w", "scale"], quantized=quantized)
    _, grads = run_gradients(graphs, {"x": x, "cond": np.array(True)})
    w, s = inits["w"].astype(np.float64), 0.1
    lsq = np.sum(x * (np.round(w / s) - w / s))  # torch's learnable fake-quantize, nothing clamped
    if quantized == "ste":
        np.testing.assert_allclose(grads["w"], x, rtol=1e-6)
        assert abs(float(grads["scale"]) - lsq) <= 1e-4 * np.abs(x * w / s).sum()
    else:
        assert not np.any(grads["w"]) and not np.any(grads["scale"])


def test_cast_to_integer_cuts_with_a_warning() -> None:
    """w -> Cast(int64) -> Cast(float) -> y: the integer Cast rounds w away; a warning names it."""
    nodes = [
        helper.make_node("Cast", ["w"], ["wi"], name="to_int", to=TensorProto.INT64),
        helper.make_node("Cast", ["wi"], ["wf"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "wf"], ["y"], name="mul"),
    ]
    m = make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], {"w": np.array([1.5, 2.5], F32)})
    with pytest.warns(GradientWarning, match=r"'w' by node 'to_int' \(Cast\)"):
        build_gradient(m, trainable=["w"])


def test_blocked_qdq_matches_the_straight_through_gradient() -> None:
    """Blocked QuantizeLinear -> DequantizeLinear (blocks of 2 along the last axis, the last one
    short): dx = dy where not clamped, d scale = LSQ summed per block, as written out in numpy."""
    r = rng()
    scale = r.uniform(0.02, 0.05, (3, 3)).astype(F32)
    zp = r.integers(-4, 5, (3, 3)).astype(np.int8)
    s_full = np.repeat(scale, 2, axis=1)[:, :5].astype(np.float64)
    z_full = np.repeat(zp, 2, axis=1)[:, :5].astype(np.float64)
    x = _away_from_ties((r.standard_normal((3, 5)) * 4).astype(F32), s_full.astype(F32))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], name="quant", axis=1, block_size=2),
        helper.make_node(
            "DequantizeLinear", ["q", "scale", "zp"], ["y"], name="dequant", axis=1, block_size=2
        ),
    ]
    m = make_model(nodes, [("x", F32, [3, 5])], [("y", F32, [3, 5])], {"scale": scale, "zp": zp}, opset=21)
    dy = r.standard_normal(x.shape).astype(F32)
    graphs = build_gradient(m, trainable=["scale"], inputs_requiring_grad=["x"])
    _, grads = run_gradients(graphs, {"x": x}, {"y": dy})
    v = x / s_full
    q = np.round(v) + z_full
    kept = (q >= -128) & (q <= 127)
    assert 0 < kept.sum() < x.size
    np.testing.assert_allclose(grads["x"], np.where(kept, dy, 0), rtol=1e-5, atol=1e-6)
    per = dy * np.where(kept, np.round(v) - v, np.clip(q, -128, 127) - z_full)
    want = np.pad(per, [(0, 0), (0, 1)]).reshape(3, 3, 2).sum(axis=2)
    np.testing.assert_allclose(grads["scale"], want, rtol=1e-4, atol=1e-4 * np.abs(dy * v).sum())


def test_qdq_scale_gradients_are_lsq_not_the_derivative_almost_everywhere(tmp_path: Path) -> None:
    """A quantize_static model trained in its float scales only (the zero points are integers), as
    onnxcustom's QAT test sets it up. The output quantization ``y = s (q - zp)``, q = clamp(round(v)
    + zp), v = y_in / s, has the derivative almost everywhere ``sum dy (q - zp)`` in s; onnxgrad's
    straight-through gradient (the default, documented in rules/quant.py) is LSQ's, that minus
    ``sum dy v`` where not clamped. A report measured the gap (up to 887; 9.3 here) as an error: it
    is the straight-through term, by construction. Bound: the two sums cancel to their difference in
    float32 (onnxgrad.testing.cancellation_bound over the 2 N terms, of size up to max |dy v|)."""
    from onnxgrad.testing import cancellation_bound

    r = rng()
    x = r.standard_normal((6, 8)).astype(F32)
    qm = _quantize(tmp_path, _float_mlp(r), "static", [x, r.standard_normal((6, 8)).astype(F32)])
    inits = {i.name: numpy_helper.to_array(i) for i in qm.graph.initializer}
    scales = [n for n in inits if n.endswith("_scale")]
    dy = r.standard_normal((6, 4)).astype(F32)
    got = onnxgrad.gradients(qm, {"x": x}, {"y": dy}, wrt=scales)
    values = model_values(qm, {"x": x})
    s, zp = float(inits["y_scale"]), inits["y_zero_point"]
    q = values["y_QuantizeLinear_Output"].astype(np.float64) - float(zp)
    v = values["y_QuantizeLinear_Input"].astype(np.float64) / s
    info = np.iinfo(zp.dtype)
    rounded = np.round(v) + float(zp)
    kept = (rounded >= info.min) & (rounded <= info.max)
    dy64 = dy.astype(np.float64)
    almost_everywhere = float((dy64 * q).sum())
    straight_through = float((dy64 * v * kept).sum())
    bound = cancellation_bound(2 * dy.size, float(np.abs(dy64 * v).max()))
    assert abs(float(got["y_scale"]) - (almost_everywhere - straight_through)) <= bound
    assert abs(float(got["y_scale"]) - almost_everywhere) > 100 * bound  # the gap of the report
