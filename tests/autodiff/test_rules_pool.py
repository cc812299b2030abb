"""Gradient checks of the pooling rules (rules/pool.py): MaxPool, AveragePool, the global pools,
LpPool, GlobalLpPool, MaxRoiPool, RoiAlign and MaxUnpool.

Each rule against float64 central finite differences: through onnxruntime where it has float64
kernels, else through onnx.reference on tiny shapes (with the kernels below where onnx.reference lacks
the op or disagrees with onnxruntime) plus float32 onnxruntime checks; and against torch autograd in
float64 where torch has the op.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from onnx.reference.op_run import OpRun

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import assert_allclose_scaled, check_op, node_model
from tests.autodiff.conftest import (
    DECLARED,
    F32,
    check,
    check_feeds,
    check_model,
    dynamic_model,
    f32,
    gradients,
    grads,
    i64,
    runtime_inputs,
    symbolic,
    untyped_outputs_ranked,
    versus_torch,
)
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)

from .test_rules_linalg import torch_grads

REF = "reference"


# ---- MaxPool, AveragePool and the global pools ----------------------------------------------
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
    assert_allclose_scaled(ours["float32"], ours["float64"], rtol=1e-5)


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
    assert_allclose_scaled(ours["in0"][:, :, 2, 2], cot.sum(axis=(2, 3)), rtol=1e-6)
    versus_torch("MaxPool", [x], attrs, lambda t: F.max_pool2d(t, 2, stride=2, dilation=2))


# ---- float32 MaxPool whose windows tile X: argmax from the forward, the pool without Indices -------
TILED_CASES = [
    ((3, 2, 6, 8), [2, 2]),
    ((2, 2, 7, 5), [2, 2]),  # floor mode: the last row and column belong to no window
    ((2, 2, 6, 7), [3, 3]),
    ((2, 2, 4, 9), [1, 3]),
    ((2, 2, 9, 4), [3, 2]),
]


def _tied(shape: tuple[int, ...]) -> np.ndarray:
    """Small integers (ties in most windows), with the 2 x 2 windows of channel 0, image 0 tied on
    chosen positions (row-major 0..3): all four, 1 and 3, 2 and 3, 0 and 3, 1 and 2."""
    x = rng().integers(-2, 3, shape).astype(np.float32)
    patterns = [[5, 5, 5, 5], [1, 5, 0, 5], [1, 0, 5, 5], [5, 1, 0, 5], [0, 5, 5, 1]]
    for j, p in enumerate(patterns[: shape[3] // 2]):
        x[0, 0, :2, 2 * j : 2 * j + 2] = np.reshape(p, (2, 2))
    return x


def _tiled_pool(x: np.ndarray, kernel: list[int], symbolic_batch: bool) -> Any:
    attrs = {"kernel_shape": kernel, "strides": kernel}
    model = node_model("MaxPool", [x], attrs=attrs)
    return symbolic(model, {0: [0, 1]}) if symbolic_batch else model


def _at_indices(x: np.ndarray, kernel: list[int], dy: np.ndarray) -> np.ndarray:
    """dY scattered where onnxruntime's MaxPool (windows ``kernel``, stride ``kernel``) puts its
    Indices: the gradient the Indices route."""
    attrs = {"kernel_shape": kernel, "strides": kernel}
    model = node_model("MaxPool", [x], attrs=attrs, n_outputs=2, output_dtypes=[x.dtype, np.int64])
    indices = testing.run_model(model)({"in0": x})["out1"]
    out = np.zeros(x.size, dy.dtype)
    out[indices.ravel()] = dy.ravel()
    return out.reshape(x.shape)


@pytest.mark.parametrize("symbolic_batch", [False, True], ids=["static", "symbolic N C"])
@pytest.mark.parametrize(("xs", "kernel"), TILED_CASES, ids=[f"{xs}-{k}" for xs, k in TILED_CASES])
def test_tiled_max_pool_routes_ties_like_torch_and_onnxruntime(
    xs: tuple, kernel: list[int], symbolic_batch: bool
) -> None:
    """Each window's dY goes to its first maximum in row-major order, all of it, ties or not: what
    torch's max_pool2d and onnxruntime's MaxPool Indices pick. The values are copies of dY, so the
    gradient must equal theirs exactly."""
    x = _tied(xs)
    model = _tiled_pool(x, kernel, symbolic_batch)
    graphs = build_gradient(model, inputs_requiring_grad=["in0"])
    pools = [node for node in graphs.forward.graph.node if node.op_type == "MaxPool"]
    assert [len(node.output) for node in pools] == [1]  # no Indices: the fast kernel
    assert "ArgMax" in {node.op_type for node in graphs.forward.graph.node}
    assert "MaxUnpool" in {node.op_type for node in graphs.backward.graph.node}
    y, cot, ours = grads(model, {"in0": x}, ["in0"])
    t = torch.tensor(x.astype(np.float64), requires_grad=True)
    ty = F.max_pool2d(t, kernel)
    ty.backward(torch.tensor(cot.astype(np.float64)))
    np.testing.assert_array_equal(y, ty.detach().numpy())
    np.testing.assert_array_equal(ours["in0"], t.grad.numpy())
    np.testing.assert_array_equal(ours["in0"], _at_indices(x, kernel, cot))  # onnxruntime's choice
    assert np.count_nonzero(ours["in0"]) == np.count_nonzero(cot)  # one element per window


@pytest.mark.parametrize("opset", [10, 18])  # 10: the first whose Slice takes starts and ends as inputs
def test_tiled_max_pool_windows_of_the_example_ties(opset: int) -> None:
    """The chosen tie patterns of :func:`_tied` by hand: first maximum of each window gets dY; the
    last row and column, in no window, get nothing."""
    x = _tied((1, 1, 3, 11))
    model = node_model("MaxPool", [x], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, opset=opset)
    assert "ArgMax" in {
        n.op_type for n in build_gradient(model, inputs_requiring_grad=["in0"]).forward.graph.node
    }
    _, cot, ours = grads(model, {"in0": x}, ["in0"])
    first = [0, 1, 2, 0, 1]  # row-major position of the first maximum of each pattern
    expected = np.zeros((3, 11), np.float32)
    for j, p in enumerate(first):
        expected[p // 2, 2 * j + p % 2] = cot[0, 0, 0, j]
    np.testing.assert_array_equal(ours["in0"][0, 0], expected)


def test_tiled_max_pool_nan_goes_where_the_indices_point() -> None:
    """A NaN in a window: the gradient lands where onnxruntime's Indices point (the first element
    when it is the NaN, else the first maximum after it: both scans start from the first element
    and move on a strictly greater one)."""
    x = np.array([[[[np.nan, 1, 0, 2, 1, 4], [0, 0, 1, np.nan, np.nan, 0]]]], np.float32)
    _, cot, ours = grads(_tiled_pool(x, [2, 2], symbolic_batch=False), {"in0": x}, ["in0"])
    np.testing.assert_array_equal(ours["in0"], _at_indices(x, [2, 2], cot))


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [0, 0, 1, 1]},
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        {"kernel_shape": [2, 2], "strides": [3, 3]},
        {"kernel_shape": [2, 2], "strides": [2, 2], "storage_order": 1},
        {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [1, 2]},
    ],
)
def test_max_pool_other_windows_keep_the_indices(attrs: dict) -> None:
    """Windows that do not tile X (padding, ceil mode, gaps, column-major Indices, dilation) keep
    the forward's Indices output."""
    x = _tied((1, 2, 7, 9))
    model = node_model("MaxPool", [x], attrs=attrs)
    forward = build_gradient(model, inputs_requiring_grad=["in0"]).forward
    assert [len(n.output) for n in forward.graph.node if n.op_type == "MaxPool"] == [2]
    assert "ArgMax" not in {n.op_type for n in forward.graph.node}


@DECLARED
def test_max_pool_versus_torch(dims: Any) -> None:
    versus_torch(
        "MaxPool",
        [rnd(2, 3, 7, 6)],
        {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 1, 1, 0]},
        # ONNX pads [1, 1, 1, 0]: 1 before H and W, 1 after H, 0 after W
        lambda t: F.max_pool2d(F.pad(t, (1, 0, 1, 1), value=-np.inf), (3, 2), stride=(2, 1)),
        dims=dims,
    )


@DECLARED
@pytest.mark.parametrize("xs", [(2, 3, 8, 8), (1, 2, 9, 7)], ids=["even", "odd"])
def test_max_pool_resnet_stem_versus_torch(xs: tuple, dims: Any) -> None:
    """MaxPool 3, stride 2, pad 1 (ResNet's stem), static and symbolic H and W."""
    versus_torch(
        "MaxPool",
        [rnd(*xs)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        lambda t: F.max_pool2d(t, 3, stride=2, padding=1),
        dims=dims,
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
    for dims in ((0, 1), range(len(xs))):  # N and C, then every dim symbolic: run-time counts
        model = dynamic_model("AveragePool", [x.astype(F32)], {0: dims}, attrs=attrs)
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
    check_model(dynamic_model("AveragePool", [x], {0: (0, 2, 3)}, attrs=attrs, opset=19), [x])


# (onnxruntime's AveragePool fails when the SAME total is negative: W 6, stride 3, kernel 2 give -1)
@pytest.mark.parametrize("xs", [(2, 3, 8, 7), (1, 2, 5, 7)], ids=["8x7", "5x7"])
@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        ("AveragePool", {"auto_pad": "SAME_UPPER", "count_include_pad": 0}),
        ("AveragePool", {"auto_pad": "SAME_LOWER", "count_include_pad": 1}),
        ("LpPool", {"auto_pad": "SAME_UPPER", "p": 3}),
        ("LpPool", {"auto_pad": "SAME_LOWER", "p": 2}),
    ],
    ids=["avg-upper", "avg-lower-include-pad", "lp3-upper", "lp2-lower"],
)
def test_pool_same_strided_symbolic_sizes_equal_static(op: str, attrs: dict, xs: tuple) -> None:
    """SAME pads of strided windows computed from the run-time sizes (X padded in the backward):
    dX equals the static model's, and float64 finite differences; was refused."""
    attrs = {**attrs, "kernel_shape": [3, 2], "strides": [2, 3]}
    x = rnd(*xs, dtype=F32)
    static = node_model(op, [x], attrs=attrs)
    symbolic_model = dynamic_model(op, [x], {0: (0, 2, 3)}, attrs=attrs)
    cot = rnd(*testing.run_model(static)({"in0": x})["out0"].shape, dtype=F32)
    want = testing.run_gradients(
        build_gradient(static, inputs_requiring_grad=["in0"]), {"in0": x}, {"out0": cot}
    )
    got = testing.run_gradients(
        build_gradient(symbolic_model, inputs_requiring_grad=["in0"]), {"in0": x}, {"out0": cot}
    )
    assert_allclose_scaled(got[1]["in0"], want[1]["in0"], rtol=1e-5)
    check_model(symbolic_model, [x])


@DECLARED
@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("include_pad", [False, True])
@pytest.mark.parametrize("xs", [(2, 3, 7, 6), (1, 2, 8, 8)], ids=["odd", "even"])
def test_average_pool_versus_torch(xs: tuple, include_pad: bool, ceil: bool, dims: Any) -> None:
    """Static and symbolic H and W (where the window counts are computed at run time)."""
    versus_torch(
        "AveragePool",
        [rnd(*xs)],
        {
            "kernel_shape": [3, 3],
            "strides": [2, 2],
            "pads": [1, 1, 1, 1],
            "count_include_pad": int(include_pad),
            "ceil_mode": int(ceil),
        },
        lambda t: F.avg_pool2d(t, 3, stride=2, padding=1, count_include_pad=include_pad, ceil_mode=ceil),
        backend="reference",
        dims=dims,
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


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_ceil_mode_window_starting_in_padding(op: str) -> None:
    # ONNX shape inference keeps a last window that onnxruntime drops: the backward must follow
    # the shapes onnxruntime produces.
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)
    check_op(op, [rnd(1, 2, 5, 5, dtype=F32)], attrs=attrs)  # no float64 AveragePool in onnxruntime


# ---- onnx.reference kernels: missing (GlobalLpPool, MaxRoiPool) or padding-unaware (LpPool) ---
def _windows(
    shape: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    ceil: bool,
) -> Iterator[tuple[tuple[int, ...], list[np.ndarray]]]:
    """(output position, index arrays of the window along each axis, padding dropped)."""
    nsp = len(kernel)
    rows = []
    for i in range(nsp):
        h, k, s, d, pb, pe = shape[i], kernel[i], strides[i], dilations[i], pads[i], pads[nsp + i]
        span = h + pb + pe - (k - 1) * d - 1
        o = -(-span // s) + 1 if ceil else span // s + 1
        if ceil and (o - 1) * s >= h + pb:  # onnxruntime drops a window starting in the end padding
            o -= 1
        rows.append(o)
    for pos in itertools.product(*[range(o) for o in rows]):
        idx = []
        for i, o in enumerate(pos):
            j = o * strides[i] - pads[i] + np.arange(kernel[i]) * dilations[i]
            idx.append(j[(j >= 0) & (j < shape[i])])
        yield pos, idx


class LpPool(OpRun):
    op_domain = ""

    def _run(
        self,
        x,
        auto_pad=None,
        ceil_mode=None,
        dilations=None,
        kernel_shape=None,
        p=None,  # type: ignore[override]
        pads=None,
        strides=None,
    ):
        nsp = len(kernel_shape)
        assert auto_pad in (None, "NOTSET", "VALID")
        pads = pads or [0] * (2 * nsp)
        windows = list(
            _windows(
                x.shape[2:], kernel_shape, strides or [1] * nsp, dilations or [1] * nsp, pads, bool(ceil_mode)
            )
        )
        out = np.zeros((*x.shape[:2], *[max(w[0][i] for w in windows) + 1 for i in range(nsp)]), x.dtype)
        for pos, idx in windows:
            block = np.abs(x[(slice(None), slice(None), *np.ix_(*idx))]) ** (p or 2)
            out[(slice(None), slice(None), *pos)] = block.sum(axis=tuple(range(2, 2 + nsp))) ** (
                1.0 / (p or 2)
            )
        return (out,)


class GlobalLpPool(OpRun):
    op_domain = ""

    def _run(self, x, p=None):  # type: ignore[override]
        p = 2 if p is None else p
        axes = tuple(range(2, x.ndim))
        return ((np.abs(x) ** p).sum(axis=axes, keepdims=True) ** (1.0 / p),)


class MaxRoiPool(OpRun):
    """onnxruntime's kernel: corners rounded half away from zero, float32 bin edges."""

    op_domain = ""

    def _run(self, x, rois, pooled_shape=None, spatial_scale=None):  # type: ignore[override]
        ph, pw = pooled_shape
        scale = np.float32(1.0 if spatial_scale is None else spatial_scale)
        out = np.zeros((rois.shape[0], x.shape[1], ph, pw), x.dtype)
        h, w = x.shape[2:]
        for r, roi in enumerate(rois):
            c = roi[1:].astype(np.float32) * scale
            x1, y1, x2, y2 = (int(np.sign(v) * np.floor(abs(v) + np.float32(0.5))) for v in c)
            bh = np.float32(max(y2 - y1 + 1, 1)) / np.float32(ph)
            bw = np.float32(max(x2 - x1 + 1, 1)) / np.float32(pw)
            for i, j in itertools.product(range(ph), range(pw)):
                h0 = min(max(int(np.floor(np.float32(i) * bh)) + y1, 0), h)
                h1 = min(max(int(np.ceil(np.float32(i + 1) * bh)) + y1, 0), h)
                w0 = min(max(int(np.floor(np.float32(j) * bw)) + x1, 0), w)
                w1 = min(max(int(np.ceil(np.float32(j + 1) * bw)) + x1, 0), w)
                if h1 > h0 and w1 > w0:
                    out[r, :, i, j] = x[int(roi[0]), :, h0:h1, w0:w1].max(axis=(1, 2))
        return (out,)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run LpPool, GlobalLpPool and MaxRoiPool on onnx.reference with the kernels above."""
    base = testing._precise_ops
    monkeypatch.setattr(testing, "_precise_ops", lambda: [*base(), LpPool, GlobalLpPool, MaxRoiPool])


def test_reference_kernels_agree_with_onnxruntime(kernels: None) -> None:
    x = rnd(2, 3, 7, 6).astype(F32)
    rois = np.array([[0, 0.3, 0.6, 4.2, 5.1], [1, 1.1, 0.2, 6.5, 3.3], [1, -1.5, -0.7, 2.2, 8.1]], F32)
    cases = [
        ("LpPool", [x], {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "p": 3}, 18),
        (
            "LpPool",
            [x],
            {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
            18,
        ),
        ("GlobalLpPool", [x], {"p": 3}, 2),
        ("MaxRoiPool", [x, rois], {"pooled_shape": [2, 3], "spatial_scale": 0.9}, 1),
    ]
    for op, inputs, attrs, opset in cases:
        model = node_model(op, inputs, attrs=attrs, opset=opset)
        feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
        ours = testing.run_model(model, REF)(feeds)["out0"]
        assert_allclose_scaled(ours, testing.run_model(model)(feeds)["out0"], rtol=1e-5, err_msg=op)


# ---- LpPool and GlobalLpPool ----------------------------------------------------------------
def signed(*shape: int) -> np.ndarray:
    """|x| in [0.3, 1.5] with random signs: away from the kink of |x| (p = 1)."""
    return rng().uniform(0.3, 1.5, shape) * rng().choice([-1.0, 1.0], shape)


LP_CASES = [
    ((2, 2, 7), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ((1, 2, 5, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}),  # overlapping
    ((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((1, 1, 3, 4, 4), {"kernel_shape": [2, 2, 2], "strides": [1, 2, 2], "pads": [0, 1, 0, 1, 0, 1]}),
]


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize(("xs", "attrs"), LP_CASES, ids=["1d", "2d-overlap", "2d", "3d"])
def test_lp_pool(kernels: None, p: int, xs: tuple, attrs: dict) -> None:
    x = signed(*xs)
    check("LpPool", [x], {**attrs, "p": p}, opset=11, backend=REF)
    check("LpPool", f32(x), {**attrs, "p": p}, opset=11)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_dilations_and_ceil(kernels: None, p: int) -> None:
    """Opset 18 adds dilations and ceil_mode (a last window that starts in the padding is dropped)."""
    x = signed(1, 2, 7, 6)
    for attrs in (
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "p": p},
        {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 1], "ceil_mode": 1, "p": p},
    ):
        check("LpPool", [x], attrs, opset=18, backend=REF)
        check("LpPool", f32(x), attrs, opset=18)


def test_lp_pool_old_opsets_and_auto_pad(kernels: None) -> None:
    x = signed(1, 2, 5, 6)
    check("LpPool", [x], {"kernel_shape": [2, 3], "p": 2.0}, opset=1, backend=REF)  # p a float
    check("LpPool", [x], {"kernel_shape": [2, 3], "p": 3}, opset=2, backend=REF)
    for auto_pad in (
        "SAME_UPPER",
        "SAME_LOWER",
        "VALID",
    ):  # onnxruntime only: the kernel above has no auto_pad
        check("LpPool", f32(x), {"kernel_shape": [3, 2], "strides": [2, 1], "auto_pad": auto_pad, "p": 2})


@DECLARED
@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_versus_torch(kernels: None, p: int, dims: Any) -> None:
    x = np.abs(signed(2, 3, 7, 6))  # torch's lp_pool2d takes no absolute value
    attrs = {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "p": p}
    torch_grads(
        "LpPool",
        [x],
        attrs,
        lambda t: F.lp_pool2d(t, p, (3, 2), stride=2, ceil_mode=True),
        backend=REF,
        dims=dims,
    )


def test_lp_pool_window_of_zeros_has_zero_gradient() -> None:
    """y = 0 there: the norm's derivative does not exist; like torch, the gradient is 0, not NaN."""
    x = rnd(1, 1, 4, 4).astype(F32)
    x[0, 0, :2, :2] = 0.0
    model = node_model("LpPool", [x], attrs={"kernel_shape": [2, 2], "strides": [2, 2], "p": 2})
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    _, dx = testing.run_gradients(graphs, {"in0": x})
    assert np.all(np.isfinite(dx["in0"]))
    np.testing.assert_array_equal(dx["in0"][0, 0, :2, :2], 0.0)


@pytest.mark.parametrize(("xs", "attrs"), LP_CASES, ids=["1d", "2d-overlap", "2d", "3d"])
def test_lp_pool_symbolic_spatial_sizes(xs: tuple, attrs: dict) -> None:
    """Every dim symbolic, padded and overlapping windows: the spread is fitted to X at run time."""
    x = f32(signed(*xs))
    check_model(dynamic_model("LpPool", x, {0: range(len(xs))}, attrs={**attrs, "p": 3}), x)


@pytest.mark.parametrize(("p", "opset"), [(1, 2), (2, 2), (3, 2), (2.0, 1), (3.0, 1)])
def test_global_lp_pool(kernels: None, p: float, opset: int) -> None:
    x = signed(2, 3, 4, 3)
    check("GlobalLpPool", [x], {"p": p}, opset=opset, backend=REF)
    if opset >= 2:
        check("GlobalLpPool", f32(x), {"p": p}, opset=opset, dynamic=True)


def test_global_lp_pool_versus_torch(kernels: None) -> None:
    torch_grads(
        "GlobalLpPool",
        [rnd(2, 3, 4, 3)],
        {"p": 3},
        lambda t: torch.linalg.vector_norm(t, ord=3, dim=(2, 3), keepdim=True),
        backend=REF,
        opset=2,
    )


# ---- MaxRoiPool -----------------------------------------------------------------------------
ROIS5 = np.array(
    [
        [0, 0.3, 0.6, 4.2, 5.1],
        [1, 1.1, 0.2, 6.3, 3.3],
        [1, -1.7, -0.7, 2.2, 8.1],  # partly outside
        [0, 2.2, 2.2, 2.4, 2.3],  # smaller than the pooled shape: bins share rows
        [1, 9.0, 9.0, 12.0, 12.0],  # outside: every bin empty, output 0
    ]
)


@pytest.mark.parametrize(("pooled", "scale"), [([2, 3], 1.0), ([3, 2], 0.6)])
def test_max_roi_pool(kernels: None, pooled: list[int], scale: float) -> None:
    x = rnd(2, 3, 6, 7)
    attrs = {"pooled_shape": pooled, "spatial_scale": scale}
    check("MaxRoiPool", [x, ROIS5], attrs, opset=1, wrt=[0], backend=REF)
    check("MaxRoiPool", f32(x, ROIS5), attrs, opset=1, wrt=[0])
    model = symbolic(node_model("MaxRoiPool", f32(x, ROIS5), attrs=attrs, opset=1), {0: (0, 2, 3), 1: (0,)})
    check_model(model, f32(x, ROIS5), wrt=[0])


def test_max_roi_pool_versus_torch(kernels: None) -> None:
    """The forward as torch.amax over each bin (bins as the kernel above computes them)."""
    x = rnd(2, 3, 6, 7)
    attrs = {"pooled_shape": [2, 3], "spatial_scale": 1.0}
    bins = _roi_bins(ROIS5, (2, 3), 1.0, (6, 7))

    def forward(t: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(ROIS5), 3, 2, 3, dtype=t.dtype)
        for (r, i, j), (b, h0, h1, w0, w1) in bins.items():
            out[r, :, i, j] = torch.amax(t[b, :, h0:h1, w0:w1], dim=(1, 2))
        return out

    torch_grads("MaxRoiPool", [x, ROIS5], attrs, forward, backend=REF, opset=1, wrt=[0])


def _roi_bins(rois: np.ndarray, pooled: tuple, scale: float, size: tuple) -> dict:
    """{(roi, i, j): (image, h0, h1, w0, w1)} for the non-empty bins, as onnxruntime has them."""
    out = {}
    for r, roi in enumerate(rois):
        x1, y1, x2, y2 = (int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in roi[1:].astype(F32) * F32(scale))
        bh = F32(max(y2 - y1 + 1, 1)) / F32(pooled[0])
        bw = F32(max(x2 - x1 + 1, 1)) / F32(pooled[1])
        for i, j in itertools.product(range(pooled[0]), range(pooled[1])):
            h0 = min(max(int(np.floor(F32(i) * bh)) + y1, 0), size[0])
            h1 = min(max(int(np.ceil(F32(i + 1) * bh)) + y1, 0), size[0])
            w0 = min(max(int(np.floor(F32(j) * bw)) + x1, 0), size[1])
            w1 = min(max(int(np.ceil(F32(j + 1) * bw)) + x1, 0), size[1])
            if h1 > h0 and w1 > w0:
                out[(r, i, j)] = (int(roi[0]), h0, h1, w0, w1)
    return out


# ---- RoiAlign -------------------------------------------------------------------------------
ROIS4 = np.array(
    [
        [0.3, 0.6, 4.2, 5.1],
        [1.1, 0.2, 6.5, 3.3],
        [-1.5, -0.7, 2.2, 8.1],  # partly outside: samples beyond -1 or the size count 0
        [2.2, 2.2, 2.4, 2.3],  # tiny: one sample per bin (a zero grid with half_pixel)
        [9.0, 1.0, 14.0, 3.0],  # mostly outside
    ]
)


BATCH = np.array([0, 1, 1, 0, 1])


ROI_FORMS = [(10, None), (16, "half_pixel"), (16, "output_half_pixel")]


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ratio", [0, 2])
@pytest.mark.parametrize(("opset", "ctm"), ROI_FORMS, ids=["opset10", "half-pixel", "output-half-pixel"])
def test_roi_align(mode: str, ratio: int, opset: int, ctm: str | None) -> None:
    """float64 through onnxruntime; sampling_ratio 0 makes the grid size differ by region."""
    attrs = {
        "output_height": 2,
        "output_width": 3,
        "sampling_ratio": ratio,
        "spatial_scale": 0.9,
        "mode": mode,
    }
    if ctm is not None:
        attrs["coordinate_transformation_mode"] = ctm
    check("RoiAlign", [rnd(2, 3, 6, 7), ROIS4, BATCH], attrs, opset=opset, wrt=[0])


def test_roi_align_dynamic_and_float32() -> None:
    x = rnd(2, 3, 6, 7)
    for mode in ("avg", "max"):
        attrs = {"output_height": 3, "output_width": 2, "mode": mode}
        model = symbolic(
            node_model("RoiAlign", [x, ROIS4, BATCH], attrs=attrs, opset=16), {0: (0, 1, 2, 3), 1: (0,)}
        )
        check_model(model, [x, ROIS4, BATCH], wrt=[0])
        check("RoiAlign", [*f32(x, ROIS4), BATCH], attrs, opset=16, wrt=[0])


def test_roi_align_gives_regions_no_gradient() -> None:
    """Like torchvision's roi_align: asked for, the regions' gradient is zero."""
    x = rnd(2, 3, 6, 7)
    model = node_model("RoiAlign", [x, ROIS4, BATCH], attrs={"output_height": 2, "output_width": 2}, opset=16)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in1"])
    _, grads = testing.run_gradients(graphs, {"in0": x, "in1": ROIS4})
    np.testing.assert_array_equal(grads["in1"], 0.0)
    assert np.abs(grads["in0"]).sum() > 0


# ---- MaxUnpool ------------------------------------------------------------------------------
def _max_unpool_kernel() -> type:
    """onnx.reference lays the values out in the inferred shape before padding to output_shape;
    onnxruntime (and MaxPool's Indices) number positions in the output shape itself."""
    from onnx.reference.op_run import OpRun

    class MaxUnpool(OpRun):
        op_domain = ""

        def _run(self, X, indices, output_shape=None, kernel_shape=None, pads=None, strides=None):  # type: ignore[override]
            nsp = X.ndim - 2
            strides = strides or [1] * nsp
            pads = pads or [0] * (2 * nsp)
            if output_shape is None:
                spatial = [
                    (X.shape[2 + i] - 1) * strides[i] - pads[i] - pads[nsp + i] + kernel_shape[i]
                    for i in range(nsp)
                ]
                output_shape = [*X.shape[:2], *spatial]
            y = np.zeros(int(np.prod(output_shape)), dtype=X.dtype)
            y[indices.reshape(-1)] = X.reshape(-1)
            return (y.reshape(tuple(int(d) for d in output_shape)),)

    return MaxUnpool


@pytest.fixture
def fixed_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    precise = testing._precise_ops
    monkeypatch.setattr(testing, "_precise_ops", lambda: [*precise(), _max_unpool_kernel()])


UNPOOL_CASES = [
    # X (1, 2, 2, 2) from 2x2 windows of a (1, 2, 4, 4) tensor; indices flat over the output
    (
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        i64([[[[0, 3], [9, 15]], [[17, 18], [28, 31]]]]),
        None,
    ),
    # output_shape larger than inferred (5 x 5); indices repeat (overlapping windows)
    (
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        i64([[[[0, 6], [6, 24]], [[25, 31], [43, 43]]]]),
        i64([1, 2, 5, 5]),
    ),
]


@pytest.mark.usefixtures("fixed_reference")
@pytest.mark.parametrize("opset", [9, 11, 22])
@pytest.mark.parametrize(("attrs", "idx", "out_shape"), UNPOOL_CASES, ids=["plain", "output_shape"])
def test_max_unpool(opset: int, attrs: dict[str, Any], idx: np.ndarray, out_shape: np.ndarray | None) -> None:
    inputs = [rnd(1, 2, 2, 2), idx] + ([] if out_shape is None else [out_shape])
    x32 = [a.astype(F32) if a.dtype.kind == "f" else a for a in inputs]
    for backend, values in (("reference", inputs), ("onnxruntime", x32)):
        model = untyped_outputs_ranked(node_model("MaxUnpool", values, attrs=attrs, opset=opset), 4)
        check_feeds(model, {"in0": values[0]}, backend=backend)
    model = untyped_outputs_ranked(
        runtime_inputs(node_model("MaxUnpool", x32, attrs=attrs, opset=opset), "in1"), 4
    )
    check_feeds(model, {"in0": x32[0], "in1": idx})


def test_max_pool_then_unpool() -> None:
    """Overlapping windows pick an element twice: the gradient must count it once."""
    x = rng().permutation(25).reshape(1, 1, 5, 5).astype(F32)
    vi = helper.make_tensor_value_info
    pool = {"kernel_shape": [3, 3], "strides": [1, 1]}
    graph = helper.make_graph(
        [
            helper.make_node("MaxPool", ["x"], ["p", "i"], **pool),
            helper.make_node("MaxUnpool", ["p", "i"], ["y"], **pool),
        ],
        "g",
        [vi("x", TensorProto.FLOAT, [1, 1, 5, 5])],
        [vi("y", TensorProto.FLOAT, [1, 1, 5, 5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = ir_version_for(model.opset_import)
    cot = np.ones((1, 1, 5, 5), dtype=F32)
    y, _, res = gradients(model, {"x": x}, ["x"], cot)
    np.testing.assert_array_equal(res["x"], (y != 0).astype(F32))  # y = x where x is a window max
    check_feeds(model, {"x": x})
