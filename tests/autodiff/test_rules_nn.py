"""Gradient checks of the reduction, softmax and neural-network rules (rules/reduce.py, softmax.py,
conv.py, pool.py, norm.py, elementwise.py).

Each rule is checked against float64 central finite differences: through onnxruntime where it has
float64 kernels, else through onnx.reference on tiny shapes plus one float32 onnxruntime check. A
few layers are also compared with torch autograd in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import check_gradients, check_op, node_model, run_model
from tests.autodiff.random_data import pos, rnd  # one generator per test (conftest.py)

F32 = np.float32


def f32(*arrays: np.ndarray | None) -> list[np.ndarray | None]:
    return [None if a is None else a.astype(F32) for a in arrays]


def axes_arr(axes: Sequence[int]) -> np.ndarray:
    return np.array(axes, dtype=np.int64)


# ---- harness helpers ------------------------------------------------------------------------
def dynamic_model(
    op: str, inputs: Sequence[np.ndarray | None], dims: dict[int, Sequence[int]], **kw: Any
) -> onnx.ModelProto:
    """A one-node model where input i has symbolic dims at positions ``dims[i]``, the rest static.

    (``node_model(dynamic=True)`` makes every dim of every input symbolic, weights included.)
    """
    model = node_model(op, inputs, **kw)
    for inp in model.graph.input:
        for j in dims.get(int(inp.name[2:]), ()):
            inp.type.tensor_type.shape.dim[j].dim_param = f"{inp.name}_d{j}"
    del model.graph.value_info[:]
    ranks = [len(out.type.tensor_type.shape.dim) for out in model.graph.output]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    model = onnx.shape_inference.infer_shapes(model)
    for out, rank in zip(model.graph.output, ranks):
        if not out.type.tensor_type.HasField("shape"):  # inference gave up: rank only
            for _ in range(rank):
                out.type.tensor_type.shape.dim.add()
    return model


def check_model(model: onnx.ModelProto, inputs: Sequence[np.ndarray | None], **kw: Any) -> None:
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    wrt = [n for n, v in feeds.items() if v.dtype.kind == "f"]
    result = check_gradients(model, feeds, wrt=wrt, **kw)
    assert result.ok, result.report()


def grads(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    wrt: Sequence[str],
    backend: testing.Backend = "onnxruntime",
    seed: int = 0,
) -> tuple[Any, Any, dict]:
    """Forward output 0, the cotangent used and the gradients of ``wrt`` of a model."""
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(wrt))
    out = run_model(graphs.forward, backend)(feeds)
    name = model.graph.output[0].name
    cot = np.random.default_rng(seed).standard_normal(out[name].shape).astype(out[name].dtype)
    bfeeds = {s: out[s] if s in out else feeds[s] for s in graphs.saved}
    bfeeds[graphs.grad_inputs[name]] = cot
    res = run_model(graphs.backward, backend)(bfeeds)
    return out[name], cot, {w: res[graphs.grad_outputs[w]] for w in wrt}


def versus_torch(
    op: str,
    inputs: list[np.ndarray],
    attrs: dict[str, Any],
    fn: Callable[..., torch.Tensor],
    backend: testing.Backend = "onnxruntime",
    opset: int = 18,
    needs: Sequence[int] | None = None,
) -> None:
    """Compare output and input gradients of a one-node model with torch autograd (float64)."""
    model = node_model(op, inputs, attrs=attrs, opset=opset)
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    wrt = [f"in{i}" for i in (needs if needs is not None else range(len(inputs)))]
    y, cot, ours = grads(model, feeds, wrt, backend)
    ts = [torch.tensor(a, requires_grad=f"in{i}" in wrt) for i, a in enumerate(inputs)]
    ty = fn(*ts)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    for w in wrt:
        expected = ts[int(w[2:])].grad
        np.testing.assert_allclose(ours[w], expected.numpy(), rtol=1e-8, atol=1e-10, err_msg=w)


# ---- reductions -----------------------------------------------------------------------------
REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceLogSum",
]


def reduce_input(op: str, *shape: int) -> np.ndarray:
    return pos(*shape) if op == "ReduceLogSum" else rnd(*shape)


def reduce_case(
    op: str, opset: int, x: np.ndarray, axes: Sequence[int] | None, **attrs: Any
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Inputs and attributes of a reduction in the form of its opset: axes attribute or input."""
    axes_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes is None:
        return [x], attrs
    if axes_input:
        return [x, axes_arr(axes)], attrs
    return [x], {**attrs, "axes": list(axes)}


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [11, 13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [-1, 0], None], ids=["one", "negative", "all"])
def test_reduce(op: str, opset: int, keepdims: int, axes: list[int] | None) -> None:
    inputs, attrs = reduce_case(op, opset, reduce_input(op, 2, 3, 4), axes, keepdims=keepdims)
    check_op(op, inputs, attrs=attrs, opset=opset)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_dynamic(op: str, keepdims: int) -> None:
    for opset, axes in ((11, [0, -1]), (18, [-2]), (18, None)):
        inputs, attrs = reduce_case(op, opset, reduce_input(op, 3, 2, 4), axes, keepdims=keepdims)
        check_op(op, inputs, attrs=attrs, opset=opset, dynamic=True)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_empty_axes(op: str, noop: int) -> None:
    """Empty or absent axes: every axis, or the identity (the op's elementwise part) with noop."""
    x = reduce_input(op, 2, 3)
    opset = 13 if op == "ReduceSum" else 18
    for inputs in ([x, axes_arr([])], [x]):
        for keepdims in (0, 1):
            check_op(op, inputs, attrs={"noop_with_empty_axes": noop, "keepdims": keepdims}, opset=opset)


def runtime_axes_model(op: str, x: np.ndarray, axes: list[int], **attrs: Any) -> onnx.ModelProto:
    """A reduction whose axes are a graph input: nothing about them is known when building."""
    model = node_model(op, [x, axes_arr(axes)], attrs=attrs)
    init = model.graph.initializer.pop()
    model.graph.input.append(helper.make_tensor_value_info(init.name, TensorProto.INT64, [None]))
    del model.graph.value_info[:]
    if attrs.get("keepdims", 1) or (not axes and attrs.get("noop_with_empty_axes")):
        rank = x.ndim
    else:
        rank = x.ndim - len(axes) if axes else 0
    out = model.graph.output[0].type.tensor_type
    out.ClearField("shape")
    out.shape.SetInParent()  # a shape of that rank, every dim unknown
    for _ in range(rank):
        out.shape.dim.add()
    return model


@pytest.mark.parametrize(
    "op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceProd", "ReduceL2", "ReduceLogSumExp"]
)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_axes_at_run_time(op: str, keepdims: int) -> None:
    x = reduce_input(op, 2, 3, 4)
    for axes in ([0, -1], [1], []):
        model = runtime_axes_model(op, x, axes, keepdims=keepdims)
        check_model(model, [x, axes_arr(axes)])
    model = runtime_axes_model(op, x, [], keepdims=keepdims, noop_with_empty_axes=1)
    check_model(model, [x, axes_arr([])])


def test_reduce_prod_with_zeros() -> None:
    """One zero in a slice: its gradient is the product of the others; two zeros: all zero."""
    x = rnd(3, 4)
    x[0, 1] = 0.0
    x[1, 0] = x[1, 2] = 0.0
    check_op("ReduceProd", [x, axes_arr([1])], attrs={"keepdims": 0})
    check_op("ReduceProd", [x, axes_arr([-2])], attrs={"keepdims": 1})
    check_op("ReduceProd", [x], attrs={"keepdims": 0})


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_extremum_ties_split_evenly(op: str) -> None:
    """Tied extrema share the gradient evenly, as torch.amax / torch.amin."""
    x = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 0.0], [-1.0, -1.0, 5.0, -1.0]])
    model = node_model(op, [x, axes_arr([1])], attrs={"keepdims": 0})
    y, cot, ours = grads(model, {"in0": x}, ["in0"])
    t = torch.tensor(x, requires_grad=True)
    ty = (torch.amax if op == "ReduceMax" else torch.amin)(t, dim=1)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy())
    np.testing.assert_allclose(ours["in0"], t.grad.numpy(), rtol=1e-12)


def test_reduce_l2_at_zero_is_zero() -> None:
    x = np.zeros((2, 3))
    x[1] = [1.0, -2.0, 2.0]
    model = node_model("ReduceL2", [x, axes_arr([1])], attrs={"keepdims": 0})
    _, cot, ours = grads(model, {"in0": x}, ["in0"])
    np.testing.assert_allclose(ours["in0"][0], 0.0)
    np.testing.assert_allclose(ours["in0"][1], cot[1] * x[1] / 3.0)


# ---- softmax family -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
def test_softmax(op: str, opset: int, axis: int | None) -> None:
    attrs = {} if axis is None else {"axis": axis}
    check_op(op, [rnd(2, 3, 4)], attrs=attrs, opset=opset)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_dynamic_and_versus_torch(op: str) -> None:
    x = rnd(3, 2, 4)
    check_op(op, [x], attrs={"axis": 1}, opset=13, dynamic=True)
    check_op(op, [x], attrs={"axis": -2}, opset=11, dynamic=True)  # flattened over [1, 3)
    fn = F.softmax if op == "Softmax" else F.log_softmax
    versus_torch(op, [x], {"axis": 1}, lambda t: fn(t, dim=1), opset=13)
    # pre-13 semantics: one softmax over the flattened trailing dims
    versus_torch(op, [x], {"axis": 1}, lambda t: fn(t.reshape(3, -1), dim=1).reshape(3, 2, 4), opset=11)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_of_unknown_rank(op: str) -> None:
    """Pre-13 semantics on a value whose rank is unknown: computed on its 2-D Flatten."""
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node(op, ["r"], ["s"], axis=1),
        helper.make_node("Identity", ["s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 4]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [None, None, None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    feeds = {"x": rnd(2, 3, 4), "shape": np.array([2, 4, 3], dtype=np.int64)}
    result = check_gradients(model, feeds, wrt=["x"])
    assert result.ok, result.report()


def test_hardmax_has_zero_gradient() -> None:
    check_op("Hardmax", [rnd(3, 4, dtype=F32)], attrs={"axis": -1}, opset=13)


# ---- Conv -----------------------------------------------------------------------------------
CONV_CASES = [
    # (x shape, w shape, attrs)
    ((2, 3, 7), (4, 3, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((2, 4, 5, 6), (6, 2, 3, 2), {"group": 2}),
    ((1, 4, 6, 5), (6, 2, 3, 2), {"group": 2, "strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2]}),
    ((2, 3, 5, 5), (6, 1, 3, 3), {"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]}),  # depthwise
    ((1, 2, 4, 3, 4), (2, 2, 2, 2, 2), {"strides": [2, 1, 2], "pads": [1, 0, 1, 0, 1, 1]}),
    ((1, 2, 7, 6), (3, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 7, 6), (3, 2, 2, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 2, 6, 5), (3, 2, 3, 2), {"auto_pad": "VALID", "strides": [2, 2], "dilations": [1, 2]}),
    ((1, 2, 5, 5), (2, 2, 3, 3), {"kernel_shape": [3, 3], "strides": [3, 2], "pads": [2, 0, 0, 2]}),
]
CONV_IDS = [
    "1d",
    "group",
    "group-geometry",
    "depthwise",
    "3d",
    "same-upper",
    "same-lower",
    "valid",
    "kernel-attr",
]


@pytest.mark.parametrize(("xs", "ws", "attrs"), CONV_CASES, ids=CONV_IDS)
def test_conv_reference(xs: tuple, ws: tuple, attrs: dict) -> None:
    """float64 through onnx.reference (onnxruntime has no float64 Conv), bias included."""
    check_op("Conv", [rnd(*xs), rnd(*ws), rnd(ws[0])], attrs=attrs, backend="reference")


@pytest.mark.parametrize(("xs", "ws", "attrs"), CONV_CASES, ids=CONV_IDS)
def test_conv_onnxruntime(xs: tuple, ws: tuple, attrs: dict) -> None:
    inputs = f32(rnd(*xs), rnd(*ws), rnd(ws[0]))
    check_op("Conv", inputs, attrs=attrs)
    check_op("Conv", inputs[:2], attrs=attrs, opset=11)


@pytest.mark.parametrize(
    ("xs", "ws", "attrs"),
    [CONV_CASES[i] for i in (0, 2, 3, 4)],
    ids=["1d", "group-geometry", "depthwise", "3d"],
)
def test_conv_dynamic(xs: tuple, ws: tuple, attrs: dict) -> None:
    """Batch and spatial dims unknown when building: dX is padded to X's size at run time."""
    inputs = f32(rnd(*xs), rnd(*ws), rnd(ws[0]))
    model = dynamic_model("Conv", inputs, {0: range(len(xs)) if len(xs) < 5 else (0, 2, 3)}, attrs=attrs)
    check_model(model, inputs)
    model = dynamic_model("Conv", inputs, {0: (0,)}, attrs=attrs)  # batch only
    check_model(model, inputs)


def test_conv_dynamic_weight_shape() -> None:
    inputs = f32(rnd(2, 4, 6, 5), rnd(6, 2, 3, 2))
    attrs = {"group": 2, "strides": [2, 2], "pads": [1, 1, 0, 0]}
    check_model(dynamic_model("Conv", inputs, {0: (0, 2, 3), 1: (0, 2, 3)}, attrs=attrs), inputs)


def test_conv_same_padding_dynamic() -> None:
    inputs = f32(rnd(1, 2, 5, 6), rnd(3, 2, 3, 3))
    # stride 1: SAME pads do not depend on the input size
    model = dynamic_model("Conv", inputs, {0: (0, 2, 3)}, attrs={"auto_pad": "SAME_LOWER"})
    check_model(model, inputs)
    model = dynamic_model("Conv", inputs, {0: (0, 2, 3)}, attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]})
    with pytest.raises(GradientNotImplementedError, match="auto_pad"):
        build_gradient(model, inputs_requiring_grad=["in0"])


def test_conv_versus_torch() -> None:
    x, w, b = rnd(2, 4, 6, 5), rnd(6, 2, 3, 2), rnd(6)
    attrs = {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 0], "dilations": [1, 2]}
    versus_torch(
        "Conv",
        [x, w, b],
        attrs,
        lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
        backend="reference",
    )


# ---- pooling --------------------------------------------------------------------------------
MAXPOOL_CASES = [
    ((2, 3, 8), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ((2, 3, 6, 5), {"kernel_shape": [3, 3], "strides": [1, 1]}),  # overlapping windows
    ((1, 2, 6, 5), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 5, 6), {"kernel_shape": [2, 3], "strides": [1, 2], "storage_order": 1}),
    (
        (1, 2, 3, 4, 5),
        {"kernel_shape": [2, 2, 3], "strides": [1, 2, 1], "storage_order": 1, "pads": [0, 1, 1, 1, 0, 1]},
    ),
    ((1, 2, 7, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    # windows that do not overlap (the gradient is a MaxUnpool)
    ((2, 3, 6, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((1, 2, 7, 5), {"kernel_shape": [2, 2], "strides": [2, 3]}),  # rows and columns left out
    ((1, 2, 7, 5), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 0, 0, 1]}),
    ((1, 2, 7, 8), {"kernel_shape": [2, 2], "strides": [3, 2], "dilations": [2, 1]}),
    ((1, 2, 5, 6), {"kernel_shape": [2, 3], "strides": [2, 3], "storage_order": 1}),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 2, 3], "auto_pad": "SAME_UPPER"}),
    # kernel <= stride, yet dilated windows overlap: stride < (kernel - 1) * dilation + 1
    ((1, 2, 7, 7), {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2]}),
    ((2, 3, 9), {"kernel_shape": [3], "strides": [4], "dilations": [2]}),
    ((1, 2, 7, 9), {"kernel_shape": [2, 3], "strides": [3, 3], "dilations": [2, 2]}),  # one axis only
]
MAXPOOL_IDS = ["1d", "overlap", "geometry", "ceil", "column-major", "3d-column-major", "same"]
MAXPOOL_IDS += ["disjoint", "disjoint-gaps", "disjoint-ceil", "disjoint-dilated", "disjoint-column-major"]
MAXPOOL_IDS += ["disjoint-3d-same", "overlap-dilated", "overlap-dilated-1d", "overlap-dilated-one-axis"]


@pytest.mark.parametrize(("xs", "attrs"), MAXPOOL_CASES, ids=MAXPOOL_IDS)
def test_max_pool(xs: tuple, attrs: dict) -> None:
    x = rnd(*xs)
    check_op("MaxPool", [x], attrs=attrs)
    check_op("MaxPool", [x], attrs=attrs, dynamic=True)
    check_op("MaxPool", [x], attrs=attrs, opset=12)


def test_max_pool_indices_already_used() -> None:
    """A model that outputs the Indices itself: the rule reads that output."""
    attrs = {"kernel_shape": [2, 2], "strides": [1, 1]}
    check_op("MaxPool", [rnd(2, 2, 4, 5)], attrs=attrs, n_outputs=2, output_dtypes=[np.float64, np.int64])


def test_max_pool_before_opset_8_is_unsupported() -> None:
    model = node_model("MaxPool", [rnd(1, 1, 4, 4)], attrs={"kernel_shape": [2, 2]}, opset=7)
    with pytest.raises(GradientNotImplementedError, match="opset 8"):
        build_gradient(model, inputs_requiring_grad=["in0"])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(("xs", "attrs"), MAXPOOL_CASES, ids=MAXPOOL_IDS)
def test_max_pool_float32_routes_like_float64(xs: tuple, attrs: dict, dynamic: bool) -> None:
    """In float32, disjoint windows route dY with a MaxUnpool (float64 keeps the scatter-add, whose
    gradient is checked above): both must put the same values at the same places."""
    x = rnd(*xs)
    x[..., :2] = 0.0  # ties inside windows
    ours: dict[str, dict] = {}
    for dtype in (np.float32, np.float64):
        model = node_model("MaxPool", [x.astype(dtype)], attrs=attrs, dynamic=dynamic)
        _, _, res = grads(model, {"in0": x.astype(dtype)}, ["in0"])
        ours[np.dtype(dtype).name] = res["in0"]
        bwd = build_gradient(model, inputs_requiring_grad=["in0"]).backward
        unpool = "MaxUnpool" in {node.op_type for node in bwd.graph.node}
        strides, kernel = attrs.get("strides", [1] * len(attrs["kernel_shape"])), attrs["kernel_shape"]
        dilations = attrs.get("dilations", [1] * len(kernel))
        disjoint = all(s >= (k - 1) * d + 1 for s, k, d in zip(strides, kernel, dilations))
        if dynamic:  # unknown sizes: only unpadded windows without ceil mode are sure to fit
            disjoint = disjoint and not attrs.get("pads") and "auto_pad" not in attrs
            disjoint = disjoint and not attrs.get("ceil_mode")
        assert unpool == (disjoint and dtype == np.float32)
    np.testing.assert_allclose(ours["float32"], ours["float64"], rtol=1e-6, atol=1e-6)


def test_max_pool_disjoint_windows_with_ties_versus_torch() -> None:
    """Windows of equal values (as after a ReLU): the gradient goes to the first maximum only."""
    x = np.maximum(rnd(2, 3, 6, 8), 0.0)
    x[:, :, :2, :2] = 0.0
    versus_torch("MaxPool", [x], {"kernel_shape": [2, 2], "strides": [2, 2]}, lambda t: F.max_pool2d(t, 2))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool_dilated_windows_sharing_their_maximum_versus_torch(dtype: type) -> None:
    """kernel 2 <= stride 2, dilation 2: each window spans 3 elements, neighbours share one. The
    shared element is the maximum of 4 windows: its gradient is the sum of their 4 dY (a
    MaxUnpool, fit for disjoint windows only, would keep one)."""
    x = rnd(2, 3, 5, 5).astype(dtype)
    x[:, :, 2, 2] = 10.0
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2]}
    model = node_model("MaxPool", [x], attrs=attrs)
    _, cot, ours = grads(model, {"in0": x}, ["in0"])
    np.testing.assert_allclose(ours["in0"][:, :, 2, 2], cot.sum(axis=(2, 3)), rtol=1e-6)
    versus_torch("MaxPool", [x], attrs, lambda t: F.max_pool2d(t, 2, stride=2, dilation=2))


def test_max_pool_versus_torch() -> None:
    versus_torch(
        "MaxPool",
        [rnd(2, 3, 7, 6)],
        {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 1, 1, 0]},
        # ONNX pads [1, 1, 1, 0]: 1 before H and W, 1 after H, 0 after W
        lambda t: F.max_pool2d(F.pad(t, (1, 0, 1, 1), value=-np.inf), (3, 2), stride=(2, 1)),
    )


AVGPOOL_CASES = [
    ((2, 3, 7), {"kernel_shape": [3], "strides": [2], "pads": [1, 1], "count_include_pad": 0}),
    ((1, 2, 5, 6), {"kernel_shape": [3, 3]}),
    ((1, 2, 6, 5), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1}),
    ((1, 2, 6, 5), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 0}),
    (
        (1, 2, 6, 6),
        {
            "kernel_shape": [3, 3],
            "strides": [2, 2],
            "pads": [1, 1, 1, 1],
            "ceil_mode": 1,
            "count_include_pad": 1,
        },
    ),
    ((1, 2, 7, 7), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    (
        (1, 1, 3, 4, 4),
        {"kernel_shape": [2, 2, 2], "strides": [1, 2, 2], "pads": [1, 0, 1, 0, 1, 1], "count_include_pad": 0},
    ),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "auto_pad": "SAME_LOWER", "strides": [2, 2]}),
]
AVGPOOL_IDS = ["1d", "plain", "include-pad", "exclude-pad", "ceil-include-pad", "ceil", "3d", "same"]


@pytest.mark.parametrize(("xs", "attrs"), AVGPOOL_CASES, ids=AVGPOOL_IDS)
def test_average_pool(xs: tuple, attrs: dict) -> None:
    x = rnd(*xs)
    check_op("AveragePool", [x], attrs=attrs, backend="reference")
    check_op("AveragePool", [x.astype(F32)], attrs=attrs)
    model = dynamic_model("AveragePool", [x.astype(F32)], {0: (0, 1)}, attrs=attrs)
    check_model(model, [x.astype(F32)])


@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_dilations_and_ceil_onnxruntime(include_pad: int) -> None:
    """Dilations (opset 19) and ceil-mode windows that onnx.reference sizes differently."""
    x = rnd(1, 2, 7, 6, dtype=F32)
    attrs = {
        "kernel_shape": [2, 3],
        "strides": [3, 2],
        "dilations": [2, 1],
        "pads": [1, 0, 0, 1],
        "ceil_mode": 1,
        "count_include_pad": include_pad,
    }
    check_op("AveragePool", [x], attrs=attrs, opset=19)


def test_average_pool_needs_static_spatial_dims() -> None:
    model = dynamic_model(
        "AveragePool", [rnd(1, 2, 4, 4, dtype=F32)], {0: (2, 3)}, attrs={"kernel_shape": [2, 2]}
    )
    with pytest.raises(GradientNotImplementedError, match="static"):
        build_gradient(model, inputs_requiring_grad=["in0"])


@pytest.mark.parametrize("include_pad", [False, True])
def test_average_pool_versus_torch(include_pad: bool) -> None:
    versus_torch(
        "AveragePool",
        [rnd(2, 3, 7, 6)],
        {
            "kernel_shape": [3, 3],
            "strides": [2, 2],
            "pads": [1, 1, 1, 1],
            "count_include_pad": int(include_pad),
        },
        lambda t: F.avg_pool2d(t, 3, stride=2, padding=1, count_include_pad=include_pad),
        backend="reference",
    )


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 3), (1, 2, 2, 3, 2)], ids=["1d", "2d", "3d"])
def test_global_pool(op: str, shape: tuple) -> None:
    x = rnd(*shape)
    if op == "GlobalAveragePool" or len(shape) == 4:  # onnx.reference's GlobalMaxPool is 2-D only
        check_op(op, [x], backend="reference")
    check_op(op, [x.astype(F32)])
    check_op(op, [x.astype(F32)], dynamic=True)


def test_global_max_pool_ties() -> None:
    x = np.array([[[[1.0, 4.0], [4.0, 0.0]], [[2.0, 1.0], [0.0, -1.0]]]])
    model = node_model("GlobalMaxPool", [x.astype(F32)])
    _, cot, ours = grads(model, {"in0": x.astype(F32)}, ["in0"])
    expected = np.zeros_like(x)
    expected[0, 0, 0, 1] = expected[0, 0, 1, 0] = cot[0, 0, 0, 0] / 2
    expected[0, 1, 0, 0] = cot[0, 1, 0, 0]
    np.testing.assert_allclose(ours["in0"], expected, rtol=1e-6)


# ---- normalization --------------------------------------------------------------------------
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


# ---- Dropout --------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [10, 12, 13])
def test_dropout_inference_is_identity(opset: int) -> None:
    x = rnd(3, 4)
    check_op("Dropout", [x], opset=opset)
    if opset >= 12:
        check_op("Dropout", [x, np.array(0.5), np.array(False)], opset=opset, constant={1})
        check_op(
            "Dropout",
            [x, None, np.array(False)],
            opset=opset,
            n_outputs=2,
            output_dtypes=[np.float64, np.bool_],
        )


def test_layers_in_a_small_network() -> None:
    """Conv -> BatchNorm -> MaxPool -> GlobalAveragePool -> Softmax, weights trainable."""
    w = numpy_helper.from_array(rnd(4, 2, 3, 3, dtype=F32), "w")
    stats = [
        numpy_helper.from_array(a.astype(F32), n)
        for a, n in ((rnd(4), "s"), (rnd(4), "b"), (rnd(4), "m"), (pos(4), "v"))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
        helper.make_node("MaxPool", ["n"], ["p"], kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Softmax", ["f"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[w, *stats],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    result = check_gradients(model, {"x": rnd(2, 2, 5, 5, dtype=F32)}, wrt=["x", "w", "s", "b"])
    assert result.ok, result.report()


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_ceil_mode_window_starting_in_padding(op: str) -> None:
    # ONNX shape inference keeps a last window that onnxruntime drops: the backward must follow
    # the shapes onnxruntime produces.
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)
    check_op(op, [rnd(1, 2, 5, 5, dtype=F32)], attrs=attrs)  # no float64 AveragePool in onnxruntime


def test_random_data_depend_only_on_the_test(request: pytest.FixtureRequest) -> None:
    """Each test draws from its own generator: data do not depend on the tests run before."""
    from tests.autodiff.random_data import seeded

    want = seeded(request.node.nodeid)
    np.testing.assert_array_equal(rnd(2, 3), want.standard_normal((2, 3)))
    np.testing.assert_array_equal(pos(4), want.random(4) + 0.5)
