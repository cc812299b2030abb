"""Forward rewrites before differentiation: same values, same gradients, cheaper backward."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad.testing import assert_allclose_scaled, check_gradients, run_gradients
from tests.autodiff.random_data import rng  # one generator per test (conftest.py)
from tests.models import make_model


def conv_relu_pool(dtype: type = np.float64, pool: dict | None = None, extra: str | None = None):
    """x -> Conv -> Relu -> MaxPool -> y; ``extra``: "output" makes the ReLU a graph output too,
    "reuse" feeds it to a second node, "indices" makes the pool's Indices an output."""
    pool = pool if pool is not None else {"kernel_shape": [2, 2], "strides": [2, 2]}
    pool_out = ["y", "i"] if extra == "indices" else ["y"]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], pool_out, **pool),
    ]
    outputs = [("y", dtype, ["N", 3, None, None])]
    if extra == "output":
        outputs.append(("r", dtype, ["N", 3, 6, 7]))
    if extra == "reuse":
        nodes.append(helper.make_node("ReduceSum", ["r"], ["s"], keepdims=0))
        outputs.append(("s", dtype, []))
    if extra == "indices":
        outputs.append(("i", np.int64, ["N", 3, None, None]))
    gen = rng()
    inits = {"w": gen.standard_normal((3, 2, 3, 3)).astype(dtype), "b": gen.standard_normal(3).astype(dtype)}
    return make_model(nodes, [("x", dtype, ["N", 2, 6, 7])], outputs, inits)


def forward_ops(model) -> list[str]:
    return [n.op_type for n in onnxgrad.build_gradient(model).forward.graph.node if n.op_type != "Shape"]


def test_relu_then_maxpool_is_swapped_with_the_same_values_and_gradients():
    model = conv_relu_pool()
    assert forward_ops(model) == ["Conv", "MaxPool", "Relu"]
    x = rng().standard_normal((2, 2, 6, 7))
    x[0, :, :3, :3] = -5.0  # windows where the ReLU gives all zeros (ties in MaxPool(Relu))
    graphs = onnxgrad.build_gradient(model)
    assert "r" not in graphs.saved  # the full-size ReLU output is no longer kept for the backward
    # float32 in onnxruntime (no float64 Conv there): the same values as the model itself
    model32 = conv_relu_pool(np.float32)
    x32 = x.astype(np.float32)
    sess = ort.InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"])
    got = onnxgrad.ForwardBackward(model32).forward({"x": x32}).outputs[0]
    # (onnxruntime picks another Conv kernel once ReLU no longer follows it: float32 rounding)
    assert_allclose_scaled(got, sess.run(None, {"x": x32})[0], rtol=1e-5)
    res = check_gradients(model, {"x": x}, wrt=["x", "w", "b"], backend="reference")
    assert res.ok, res.report()


def test_swapped_gradients_match_torch():
    model = conv_relu_pool(np.float64, {"kernel_shape": [3, 2], "strides": [3, 2], "pads": [1, 0, 1, 0]})
    x = rng().standard_normal((2, 2, 6, 7))
    x[1, :, :3, :] = -5.0
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dy = rng().standard_normal((2, 3, 2, 3))
    _, got = run_gradients(
        onnxgrad.build_gradient(model, inputs_requiring_grad=["x"]), {"x": x}, {"y": dy}, "reference"
    )
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, params["w"], params["b"]))
    r = F.relu(F.conv2d(tx, tw, tb, padding=1))
    ty = F.max_pool2d(F.pad(r, (0, 0, 1, 1), value=-np.inf), (3, 2), stride=(3, 2))
    ty.backward(torch.tensor(dy))
    for name, t in (("x", tx), ("w", tw), ("b", tb)):
        np.testing.assert_allclose(got[name], t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize(
    ("extra", "pool"),
    [
        ("output", None),  # the ReLU output is a model output
        ("reuse", None),  # another node reads it
        ("indices", None),  # the pool's Indices are used: they would change
        (None, {"kernel_shape": [2, 2], "pads": [2, 2, 2, 2]}),  # windows of padding alone
    ],
    ids=["relu-is-output", "relu-reused", "indices-used", "padding-only-windows"],
)
def test_relu_and_maxpool_stay_when_swapping_would_change_something(extra, pool):
    assert forward_ops(conv_relu_pool(pool=pool, extra=extra))[:3] == ["Conv", "Relu", "MaxPool"]


def batch_norm_model(shape: tuple, opset: int, training: int = 1, stats_out: bool = True, dtype=np.float64):
    c = shape[1]
    outs = ["y", "rm", "rv"] if training else ["y"]  # onnxruntime: all three when training
    attrs = {"training_mode": training, "momentum": 0.8, "epsilon": 1e-3}
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outs, **attrs)
    outputs = [("y", dtype, list(shape))] + ([("rm", dtype, [c]), ("rv", dtype, [c])] if stats_out else [])
    inits = {
        "s": rng().standard_normal(c).astype(dtype),
        "b": rng().standard_normal(c).astype(dtype),
        "m": rng().standard_normal(c).astype(dtype),
        "v": rng().uniform(0.5, 2.0, c).astype(dtype),
    }
    return make_model([node], [("x", dtype, list(shape))], outputs, inits, opset=opset)


@pytest.mark.parametrize("opset", [15, 18])
@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (4, 3, 5, 2)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("stats_out", [True, False], ids=["stats", "y_only"])
def test_training_batch_norm_forward_is_centered_with_onnxruntime_values(opset, shape, stats_out):
    model = batch_norm_model(shape, opset, stats_out=stats_out)
    assert "BatchNormalization" not in forward_ops(model)
    x = rng().standard_normal(shape) * 0.5 + 3.0
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})
    got = onnxgrad.ForwardBackward(model).forward({"x": x}).outputs
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    if not stats_out:  # (finite differences would see the running statistics depend on x)
        res = check_gradients(model, {"x": x}, wrt=["x", "s", "b"])
        assert res.ok, res.report()


def test_inference_batch_norm_is_left_to_onnxruntime():
    assert forward_ops(batch_norm_model((4, 3, 5), 15, training=0, stats_out=False)) == ["BatchNormalization"]


U32 = float(np.finfo(np.float32).eps) / 2  # the unit roundoff of float32: 2^-24


def _float32_batch_norm_error(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(y - exact y, exact xh, exact y, scale as a column) of onnxgrad's training-mode forward on
    the float32 ``x`` (N, 3, H, W), exact meaning float64 on the same float32 values."""
    model = batch_norm_model(x.shape, 15, dtype=np.float32, stats_out=False)
    y = onnxgrad.ForwardBackward(model).forward({"x": x}).outputs[0].astype(np.float64)
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    x64 = x.astype(np.float64)
    mean, var = x64.mean((0, 2, 3), keepdims=True), x64.var((0, 2, 3), keepdims=True)
    col = (1, 3, 1, 1)
    xh = (x64 - mean) / np.sqrt(var + 1e-3)
    want = xh * inits["s"].reshape(col) + inits["b"].reshape(col)
    return y - want, xh, want, inits["s"].reshape(col)


def test_float32_batch_norm_of_a_channel_far_from_zero_has_no_rounding_noise():
    """mean 1000, std 1: onnxruntime's x * a + b leaves ~3e-5 of noise in y (the rounding of
    x * a, of the order of mean / std units in the last place of y); the centered form leaves the
    rounding of its own few operations on values of the size of y.

    Per channel, the float32 statistics make an affine error ``shift + gain * xh``: the mean's
    residual rounding, and the variance summed in whatever order the CPU's kernel uses (relative
    error up to ~N u). That part is fitted and removed per channel (this test removed only the
    shift, against a fixed 1e-6, and measured 2.7e-6 on a 16-thread AVX-512 Xeon). What remains
    is per element: ``xc - shift`` (one rounding of |xc|), ``xc * factor`` (one of |xh s|) and
    ``+ bias`` (one of |y|), so
    ``|noise| <= B = u max(2 |xh s| + |y|)``, and removing the least-squares fit of (1, xh) from a
    noise of size B moves it by at most B (1 + max |xh|) (mean |xh| <= rms xh = 1): the bound is
    B (2 + max |xh|), 7e-6 for these values (3e-7 measured), a fourth of the rms of onnxruntime's
    noise.
    """
    x = (rng().standard_normal((8, 3, 16, 16)) + 1000).astype(np.float32)
    err, xh, want, scale = _float32_batch_norm_error(x)
    noise = np.empty_like(err)
    for c in range(err.shape[1]):
        basis = np.stack([np.ones(xh[:, c].size), xh[:, c].ravel()], axis=1)
        coef, *_ = np.linalg.lstsq(basis, err[:, c].ravel(), rcond=None)
        noise[:, c] = err[:, c] - (basis @ coef).reshape(err[:, c].shape)
    bound = U32 * float((2 * np.abs(xh * scale) + np.abs(want)).max()) * (2 + float(np.abs(xh).max()))
    assert np.abs(noise).max() <= bound, (np.abs(noise).max(), bound)


def test_float32_batch_norm_output_carries_no_rounding_of_the_mean():
    """The forward's batch mean is rounded to float32, in an order of summation that depends on the
    CPU: taken once, that rounding shifts a whole channel of y (the 2.2e-1 gradient error of
    tests/torch/test_batchnorm_accuracy.py on an AVX-512 Xeon, whose kernel rounded the mean of a
    channel at 1000 one unit in the last place away from this machine's). Taken twice, as the
    backward does, the shift is the error of the mean of the differences x - m, which are exact.

    Built so that no float32 mean can be right: every x is 2^20 + 64 + k / 8 (k integer, so x is
    a float32 on a grid of spacing 1/8, the float32 spacing there), the sum of the k is N/2 mod N,
    so the exact mean lies halfway between two float32 values and any rounded mean is at least
    1/16 off (y shifted by |s| inv / 16 at least: 1e-2 with these scales).
    Bound on the shift with the second mean: the sum of N differences |d| in any order is off by
    at most gamma_N sum |d| (gamma_N = N u / (1 - N u), Higham's bound for any order), so the
    mean by gamma_N mean |d|, plus one rounding of the subtraction, times |s| inv; plus the per
    element roundings (u max(2 |xh s| + |y|), as above): 1e-5 to 1.3e-4 here.
    """
    n_per_channel = 8 * 16 * 16
    k = np.rint(rng().standard_normal((8, 3, 16, 16)) * 8).astype(np.int64)
    for c in range(3):  # the sum of the k of each channel: N/2 mod N
        k[0, c, 0, 0] += (n_per_channel // 2 - k[:, c].sum()) % n_per_channel
    x = (2.0**20 + 64 + k / 8).astype(np.float32)
    assert np.array_equal(x.astype(np.float64), 2.0**20 + 64 + k / 8)  # exactly on the grid
    err, xh, want, scale = _float32_batch_norm_error(x)
    shift = np.abs(err.mean((0, 2, 3)))
    inv = np.abs(xh / (x.astype(np.float64) - x.astype(np.float64).mean((0, 2, 3), keepdims=True)))
    inv, s = inv.max((0, 2, 3)), np.abs(scale).ravel()
    gamma = n_per_channel * U32 / (1 - n_per_channel * U32)
    d = np.abs(x.astype(np.float64) - x.astype(np.float64).mean((0, 2, 3), keepdims=True)).mean((0, 2, 3))
    per_element = U32 * float((2 * np.abs(xh * scale) + np.abs(want)).max())
    bound = s * inv * (gamma * d + U32 * np.abs(xh).max() / inv) + per_element
    assert (shift <= bound).all(), (shift, bound)
