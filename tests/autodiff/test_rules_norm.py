"""Gradient checks of the normalization family (rules/norm.py).

Each rule against float64 central finite differences (onnxruntime where it has float64 kernels,
else onnx.reference on tiny shapes plus float32 onnxruntime), with symbolic shapes, and against
torch autograd in float64 where torch has the op.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from onnx.reference.op_run import OpRun

import onnxgrad.autodiff.rules.norm  # noqa: F401  (registers the rules until rules/__init__ does)
from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for, onnx_dtype
from onnxgrad.model.infer import infer_value_infos
from onnxgrad.testing import check_op, node_model
from tests.autodiff.conftest import F32, check_model, f32, grads, versus_torch
from tests.autodiff.random_data import pos, rnd  # one generator per test (conftest.py)

EPS = 2.0**-12  # an epsilon the float attribute holds exactly, for comparisons with torch


def typed_model(op: str, inputs: list[np.ndarray], dynamic: bool = False, **kw: Any) -> onnx.ModelProto:
    """A one-node model whose output has the type of input 0: ONNX infers no shape for
    GroupNormalization, nor for MeanVarianceNormalization-13 without ``axes``."""
    model = node_model(op, inputs, dynamic=dynamic, **kw)
    model.graph.output[0].type.CopyFrom(model.graph.input[0].type)
    return model


class LRN(OpRun):
    """onnx 1.23's LRN loops over the batch instead of the channels: the ONNX definition."""

    op_domain = ""

    def _run(self, x, alpha=1e-4, beta=0.75, bias=1.0, size=None):  # type: ignore[override]
        before, after = (size - 1) // 2, size // 2
        sq = np.pad(x * x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
        square_sum = sum(sq[:, k : k + x.shape[1]] for k in range(size))
        alpha, beta, bias = float(alpha), float(beta), float(bias)  # not float32 arithmetic
        return ((x / (bias + alpha / size * square_sum) ** beta).astype(x.dtype),)


class MeanVarianceNormalization(OpRun):
    """onnx.reference expands the ONNX function, whose float epsilon breaks float64 inputs."""

    op_domain = ""

    def _run(self, x, axes=None):  # type: ignore[override]
        axes = tuple(axes) if axes is not None else (0, 2, 3)
        mean = x.mean(axis=axes, keepdims=True)
        std = np.sqrt((x * x).mean(axis=axes, keepdims=True) - mean * mean)
        return (((x - mean) / (std + 1e-9)).astype(x.dtype),)


@pytest.fixture(autouse=True)
def precise_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnx.reference with the two kernels above."""
    base = testing._precise_ops
    monkeypatch.setattr(testing, "_precise_ops", lambda: [*base(), LRN, MeanVarianceNormalization])


# ---- InstanceNormalization ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 4, 3), (1, 2, 2, 3, 2)], ids=["1d", "2d", "3d"])
def test_instance_norm(shape: tuple) -> None:
    c = shape[1]
    inputs = [rnd(*shape), rnd(c), rnd(c)]
    attrs = {"epsilon": 1e-3}
    check_op("InstanceNormalization", inputs, attrs=attrs, backend="reference")  # no float64 in ORT
    check_op("InstanceNormalization", f32(*inputs), attrs=attrs)
    check_op("InstanceNormalization", f32(*inputs), attrs=attrs, dynamic=True)


def test_instance_norm_versus_torch() -> None:
    x, s, b = rnd(2, 3, 4, 3), rnd(3), rnd(3)
    versus_torch(
        "InstanceNormalization",
        [x, s, b],
        {"epsilon": EPS},
        lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=EPS),
        backend="reference",
    )


# ---- GroupNormalization ---------------------------------------------------------------------
def group_norm_case(opset: int, shape: tuple, groups: int, eps: float) -> tuple[list, dict[str, Any]]:
    """Inputs and attributes: per-group scale and bias at opset 18, per-channel at 21 (with the
    statistics in float64: the default ``stash_type`` computes them in float32)."""
    p = groups if opset == 18 else shape[1]
    attrs: dict[str, Any] = {"num_groups": groups, "epsilon": eps}
    if opset >= 21:
        attrs["stash_type"] = TensorProto.DOUBLE
    return [rnd(*shape), rnd(p), rnd(p)], attrs


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize(("shape", "groups"), [((2, 4, 3), 2), ((2, 6, 2, 3), 3), ((1, 4, 2, 2, 2), 4)])
def test_group_norm(opset: int, shape: tuple, groups: int) -> None:
    inputs, attrs = group_norm_case(opset, shape, groups, 1e-3)
    for dynamic in (False, True):
        check_model(typed_model("GroupNormalization", inputs, dynamic, attrs=attrs, opset=opset), inputs)
    if opset >= 21:  # the default stash_type in float32
        del attrs["stash_type"]
        check_model(typed_model("GroupNormalization", f32(*inputs), attrs=attrs, opset=opset), f32(*inputs))


@pytest.mark.parametrize("opset", [18, 21])
def test_group_norm_versus_torch(opset: int) -> None:
    """Opset 21 is torch's group_norm; opset 18 is torch's with scale and bias repeated per channel."""
    (x, s, b), attrs = group_norm_case(opset, (2, 6, 3, 2), 3, EPS)
    model = typed_model("GroupNormalization", [x, s, b], attrs=attrs, opset=opset)
    y, cot, ours = grads(model, {"in0": x, "in1": s, "in2": b}, ["in0", "in1", "in2"])
    ts = [torch.tensor(a, requires_grad=True) for a in (x, s, b)]
    ws, wb = (ts[1].repeat_interleave(2), ts[2].repeat_interleave(2)) if opset == 18 else ts[1:]
    ty = F.group_norm(ts[0], 3, ws, wb, eps=EPS)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    for i, t in enumerate(ts):
        np.testing.assert_allclose(ours[f"in{i}"], t.grad.numpy(), rtol=1e-8, atol=1e-10)


# ---- RMSNormalization -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "axis", "ps"), [((2, 3, 4), -1, (4,)), ((2, 3, 4), 1, (3, 4)), ((2, 3, 4), 1, (1, 4))]
)
def test_rms_norm(shape: tuple, axis: int, ps: tuple) -> None:
    inputs = [rnd(*shape), rnd(*ps)]
    attrs = {"axis": axis, "epsilon": 1e-3}
    check_op("RMSNormalization", inputs, attrs=attrs, opset=23)
    check_op("RMSNormalization", inputs, attrs=attrs, opset=23, dynamic=True)
    check_op("RMSNormalization", f32(*inputs), attrs=attrs, opset=23)


def test_rms_norm_versus_torch() -> None:
    x, s = rnd(2, 3, 4), rnd(3, 4)
    versus_torch(
        "RMSNormalization",
        [x, s],
        {"axis": 1, "epsilon": EPS},
        lambda x, s: F.rms_norm(x, (3, 4), s, eps=EPS),
        opset=23,
    )


# ---- MeanVarianceNormalization --------------------------------------------------------------
@pytest.mark.parametrize("opset", [9, 13])
@pytest.mark.parametrize("axes", [None, [1], [0, 2], [-1]], ids=["default", "one", "two", "negative"])
def test_mean_variance_norm(opset: int, axes: list[int] | None) -> None:
    # the last dim is 3, not 2: normalizing two values gives +-1 whatever they are (a zero gradient
    # that finite differences only see as noise)
    x = rnd(2, 3, 4, 3)
    attrs = {} if axes is None else {"axes": axes}
    for inputs, dynamic, backend in (
        ([x], False, "reference"),
        (f32(x), False, "onnxruntime"),
        (f32(x), True, "onnxruntime"),
    ):
        model = typed_model("MeanVarianceNormalization", inputs, dynamic, attrs=attrs, opset=opset)
        check_model(model, inputs, backend=backend)


def test_mean_variance_norm_constant_slice_is_finite() -> None:
    """std = 0: y = 0 and the gradient is (dy - mean(dy)) / eps there, not NaN."""
    x = rnd(2, 3, 2, 2)
    x[:, 1] = 0.5
    model = node_model("MeanVarianceNormalization", [x], attrs={"axes": [0, 2, 3]})
    _, cot, ours = grads(model, {"in0": x}, ["in0"], backend="reference")
    expected = (cot[:, 1] - cot[:, 1].mean()) / 1e-9
    np.testing.assert_allclose(ours["in0"][:, 1], expected, rtol=1e-6)
    assert np.isfinite(ours["in0"]).all()


# ---- LpNormalization ------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_norm(p: int, axis: int) -> None:
    x = rnd(3, 4, 2)
    check_op("LpNormalization", [x], attrs={"p": p, "axis": axis})
    check_op("LpNormalization", [x], attrs={"p": p, "axis": axis}, dynamic=True)
    check_op("LpNormalization", [x], attrs={"p": p, "axis": axis}, opset=22)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_norm_versus_torch(p: int) -> None:
    x = rnd(3, 4)
    versus_torch("LpNormalization", [x], {"p": p, "axis": 1}, lambda t: F.normalize(t, p=p, dim=1, eps=0.0))


def test_lp_norm_zero_slice_has_zero_gradient() -> None:
    x = rnd(3, 4)
    x[1] = 0.0
    model = node_model("LpNormalization", [x], attrs={"p": 2, "axis": 1})
    _, _, ours = grads(model, {"in0": x}, ["in0"])
    assert np.all(ours["in0"][1] == 0.0) and np.isfinite(ours["in0"]).all()


def test_lp_norm_other_p_is_unsupported() -> None:
    model = node_model("LpNormalization", [rnd(2, 3)], attrs={"p": 3})
    with pytest.raises(GradientNotImplementedError, match="p=3"):
        build_gradient(model, inputs_requiring_grad=["in0"])


# ---- LRN ------------------------------------------------------------------------------------
LRN_CASES: list[dict[str, Any]] = [
    {"size": 3},
    {"size": 2, "alpha": 0.1, "beta": 0.5, "bias": 2.0},  # even size: the window is lopsided
    {"size": 5, "alpha": 0.5, "beta": 0.75, "bias": 1.5},  # wider than half the channels
    {"size": 4, "alpha": 0.3, "beta": 1.2},
]


@pytest.mark.parametrize("attrs", LRN_CASES, ids=["3", "2", "5", "4"])
def test_lrn(attrs: dict[str, Any]) -> None:
    x = rnd(2, 4, 3, 2)  # onnxruntime and onnx.reference run LRN on 4-D inputs only
    check_op("LRN", [x], attrs=attrs, backend="reference")
    if attrs["size"] % 2:  # onnxruntime runs odd sizes only
        check_op("LRN", [x.astype(F32)], attrs=attrs)
        check_op("LRN", [x.astype(F32)], attrs=attrs, dynamic=True)


def test_lrn_versus_torch() -> None:
    """torch pads the window like ONNX for odd sizes."""
    x = rnd(2, 5, 3, 2)
    attrs = {"size": 3, "alpha": 0.25, "beta": 0.75, "bias": 1.5}  # exact in the float attributes
    versus_torch(
        "LRN",
        [x],
        attrs,
        lambda t: F.local_response_norm(t, 3, alpha=0.25, beta=0.75, k=1.5),
        backend="reference",
    )


# ---- LayerNormalization and BatchNormalization ----------------------------------------------
LAYERNORM_CASES = [
    ((2, 3, 4), -1, (4,), True),
    ((2, 3, 4), 1, (3, 4), True),
    ((2, 3, 4), -2, (3, 4), False),
    ((3, 5), 0, (3, 5), True),
    ((2, 3, 4), 1, (1, 4), True),  # scale and bias broadcast inside the normalized shape
]


@pytest.mark.parametrize(("xs", "axis", "ps", "bias"), LAYERNORM_CASES)
def test_layer_norm(xs: tuple, axis: int, ps: tuple, bias: bool) -> None:
    inputs = [rnd(*xs), rnd(*ps), rnd(*ps) if bias else None]
    attrs = {"axis": axis, "epsilon": 1e-3}
    check_op("LayerNormalization", inputs, attrs=attrs, opset=17, backend="reference")
    check_op("LayerNormalization", f32(*inputs), attrs=attrs, opset=17)
    check_op("LayerNormalization", f32(*inputs), attrs=attrs, opset=17, dynamic=True)


def test_layer_norm_statistics_as_outputs() -> None:
    """Gradients flowing into Mean and InvStdDev too (a model that outputs them)."""
    inputs = [rnd(2, 3, 4), rnd(4), rnd(4)]
    types = [np.float64, np.float32, np.float32]  # statistics in stash_type (float)
    for axis in (-1, 1):
        check_op(
            "LayerNormalization",
            inputs,
            attrs={"axis": axis},
            opset=17,
            n_outputs=3,
            output_dtypes=types,
            backend="reference",
        )


def test_layer_norm_versus_torch() -> None:
    x, s, b = rnd(2, 3, 4), rnd(3, 4), rnd(3, 4)
    versus_torch(
        "LayerNormalization",
        [x, s, b],
        {"axis": 1, "epsilon": 1e-5},
        lambda x, s, b: F.layer_norm(x, (3, 4), s, b, eps=1e-5),
        backend="reference",
        opset=17,
    )


def unranked_model(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], n_outputs: int = 1
) -> onnx.ModelProto:
    """``op`` on ``x = Reshape(in0, in{k})``, the target shape a graph input of unknown length: x's
    rank is unknown when the gradient graph is built (the rules build the axes at run time). Each
    output is reshaped to its static shape, as the ONNX checker wants graph outputs with a shape;
    the other inputs become ``in1``, ``in2``...; the last input ``in{k}`` takes ``x.shape``."""
    x, k = inputs[0], len(inputs)
    graph_inputs = [
        helper.make_tensor_value_info(f"in{i}", onnx_dtype(a.dtype), a.shape) for i, a in enumerate(inputs)
    ]
    graph_inputs.append(helper.make_tensor_value_info(f"in{k}", TensorProto.INT64, ["rank"]))
    axis = int(attrs.get("axis", -1)) % x.ndim
    shapes = [x.shape, *[x.shape[:axis] + (1,) * (x.ndim - axis)] * 2][:n_outputs]
    dtypes = [onnx_dtype(x.dtype), TensorProto.FLOAT, TensorProto.FLOAT]  # statistics in stash_type
    inner = ["y", "mean", "inv_std"][:n_outputs]
    nodes = [
        helper.make_node("Reshape", ["in0", f"in{k}"], ["x"]),
        helper.make_node(op, ["x", *[f"in{i}" for i in range(1, k)]], inner, **attrs),
    ]
    nodes += [helper.make_node("Reshape", [v, f"shape{j}"], [f"out{j}"]) for j, v in enumerate(inner)]
    outs = [helper.make_tensor_value_info(f"out{j}", dtypes[j], shapes[j]) for j in range(n_outputs)]
    inits = [numpy_helper.from_array(np.array(sh, np.int64), f"shape{j}") for j, sh in enumerate(shapes)]
    graph = helper.make_graph(nodes, f"unranked_{op}", graph_inputs, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = ir_version_for(model.opset_import)
    assert infer_value_infos(model)["x"].rank is None  # what the tests below are about
    return model


UNRANKED_CASES = [
    ((2, 3, 4), -1, (4,)),
    ((2, 3, 4), -2, (3, 4)),
    ((2, 2, 3, 4), -3, (2, 3, 4)),
    ((5, 3), -2, (5, 3)),
]


@pytest.mark.parametrize(("xs", "axis", "ps"), UNRANKED_CASES)
def test_layer_and_rms_norm_of_unknown_rank(xs: tuple, axis: int, ps: tuple) -> None:
    """x of unknown rank and a negative axis: the normalized axes are [axis, 0). Gradients of x,
    scale and bias, and of x through the Mean and InvStdDev outputs too (their normalized count
    taken from x's run-time shape), against finite differences."""
    x, scale, bias = rnd(*xs), rnd(*ps), rnd(*ps)
    shape = np.array(xs, np.int64)
    attrs = {"axis": axis, "epsilon": 1e-3}
    for args, backend in (([x, scale, bias], "reference"), (f32(x, scale, bias), "onnxruntime")):
        check_model(unranked_model("LayerNormalization", args, attrs), [*args, shape], backend=backend)
    stats = unranked_model("LayerNormalization", [x, scale], attrs, n_outputs=3)
    check_model(stats, [x, scale, shape], backend="reference")
    for args in ([x, scale], f32(x, scale)):
        check_model(unranked_model("RMSNormalization", args, attrs), [*args, shape])


@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization"])
def test_norm_of_unknown_rank_with_a_positive_axis_is_refused(op: str) -> None:
    """axis=1 of an input of unknown rank: which axes are normalized is not known."""
    model = unranked_model(op, [rnd(2, 3, 4), rnd(3, 4)], {"axis": 1})
    with pytest.raises(GradientNotImplementedError, match="the rank of its input must be known"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])


BATCHNORM_SHAPES = [(4, 3), (2, 3, 5), (2, 3, 4, 3), (1, 2, 3, 2, 2)]


@pytest.mark.parametrize("shape", BATCHNORM_SHAPES, ids=["0d", "1d", "2d", "3d"])
@pytest.mark.parametrize("opset", [9, 15])
def test_batch_norm_inference(shape: tuple, opset: int) -> None:
    c = shape[1]
    inputs = [rnd(*shape), rnd(c), rnd(c), rnd(c), pos(c)]
    check_op("BatchNormalization", inputs, attrs={"epsilon": 1e-3}, opset=opset)
    check_op("BatchNormalization", inputs, opset=opset, dynamic=True)


@pytest.mark.parametrize("spatial", [0, 1])
def test_batch_norm_opset7_spatial(spatial: int) -> None:
    """spatial=0 (before opset 9): statistics per (C, H, W) position, not per channel."""
    ps = (3,) if spatial else (3, 4, 2)
    inputs = [rnd(2, 3, 4, 2), rnd(*ps), rnd(*ps), rnd(*ps), pos(*ps)]
    check_op("BatchNormalization", inputs, attrs={"spatial": spatial}, opset=7)


def test_batch_norm_constant_statistics() -> None:
    inputs = [rnd(2, 3, 4), rnd(3), rnd(3), rnd(3), pos(3)]
    check_op("BatchNormalization", inputs, opset=15, constant={3, 4})


def test_batch_norm_versus_torch() -> None:
    x, s, b, m, v = rnd(2, 3, 4, 3), rnd(3), rnd(3), rnd(3), pos(3)
    versus_torch(
        "BatchNormalization",
        [x, s, b, m, v],
        {"epsilon": 1e-5},
        lambda x, s, b, m, v: F.batch_norm(x, m, v, s, b, training=False, eps=1e-5),
        opset=15,
        needs=[0, 1, 2],
    )  # torch has no gradient for the statistics
