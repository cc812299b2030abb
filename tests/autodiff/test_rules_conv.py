"""Gradient checks of the convolution-like and region pooling rules (rules/conv.py, rules/pool.py).

ConvTranspose, DeformConv, LpPool, GlobalLpPool, MaxRoiPool and RoiAlign, against float64 central
finite differences: through onnxruntime where it has float64 kernels (DeformConv, RoiAlign), else
through onnx.reference on tiny shapes (with the kernels below where onnx.reference lacks the op or
disagrees with onnxruntime) plus float32 onnxruntime checks; and against torch autograd in float64
where torch has the op or its forward is a few lines of torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx.reference.op_run import OpRun

import onnxgrad.autodiff.rules.conv  # noqa: F401  (registers the rules until rules/__init__ imports it)
from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import check_gradients, node_model
from tests.models import ort_loads_opset

from .test_rules_linalg import ensure_output_shape, torch_grads

RNG = np.random.default_rng(11)
F32 = np.float32
REF = "reference"


def rnd(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def f32(*arrays: np.ndarray | None) -> list[np.ndarray | None]:
    return [None if a is None else a.astype(F32) for a in arrays]


def check(
    op: str,
    inputs: Sequence[np.ndarray | None],
    attrs: dict[str, Any],
    *,
    opset: int = 18,
    wrt: Sequence[int] | None = None,
    backend: testing.Backend = "onnxruntime",
    dynamic: bool = False,
    **tol: Any,
) -> None:
    """Finite-difference check of the gradients of the inputs ``wrt`` (default: every float one);
    ``dynamic`` makes every dim of every float input symbolic."""
    model = node_model(op, inputs, attrs=attrs, opset=opset, dynamic=dynamic)
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    if not model.graph.output[0].type.tensor_type.HasField("shape"):  # inference gave up
        y = testing.run_model(node_model(op, inputs, attrs=attrs, opset=opset), backend)(feeds)["out0"]
        ensure_output_shape(model, y.shape, dynamic)
    names = list(feeds) if wrt is None else [f"in{i}" for i in wrt]
    result = check_gradients(model, feeds, wrt=names, backend=backend, **tol)
    assert result.ok, result.report()


# ---- onnx.reference kernels: missing (GlobalLpPool, MaxRoiPool) or padding-unaware (LpPool) ----
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
        np.testing.assert_allclose(
            ours, testing.run_model(model)(feeds)["out0"], rtol=1e-5, atol=1e-6, err_msg=op
        )


# ---- ConvTranspose --------------------------------------------------------------------------
CT_CASES = [
    # (x shape, w shape, attrs)
    ((2, 3, 4), (3, 2, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 1], "pads": [1, 0, 0, 1]}),
    (
        (2, 4, 3, 3),
        (4, 3, 2, 2),
        {"group": 2, "strides": [2, 2], "output_padding": [1, 0], "dilations": [1, 2]},
    ),
    (
        (1, 3, 3, 3),
        (3, 1, 3, 3),
        {"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    ),
    ((1, 2, 2, 3, 2), (2, 2, 2, 2, 2), {"strides": [2, 1, 2], "pads": [0, 1, 0, 1, 0, 1]}),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 3, 4), (2, 3, 3, 3), {"strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 3, 3), (2, 2, 2, 3), {"strides": [2, 2], "auto_pad": "VALID", "kernel_shape": [2, 3]}),
]
CT_IDS = ["1d", "2d", "group-dilation-outpad", "depthwise", "3d", "same-upper", "same-lower", "valid"]


@pytest.mark.parametrize(("xs", "ws", "attrs"), CT_CASES, ids=CT_IDS)
def test_conv_transpose(xs: tuple, ws: tuple, attrs: dict) -> None:
    """float64 on onnx.reference (no float64 ConvTranspose in onnxruntime), float32 on onnxruntime."""
    inputs = [rnd(*xs), rnd(*ws), rnd(ws[1] * attrs.get("group", 1))]
    check("ConvTranspose", inputs, attrs, backend=REF)
    check("ConvTranspose", f32(*inputs), attrs, opset=11)
    check("ConvTranspose", f32(*inputs[:2]), attrs, opset=22)


def test_conv_transpose_opset1() -> None:
    inputs = f32(rnd(1, 2, 3, 4), rnd(2, 3, 3, 2), rnd(3))
    check(
        "ConvTranspose", inputs, {"strides": [2, 1], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}, opset=1
    )


@pytest.mark.parametrize(
    ("attrs", "torch_fn"),
    [
        # total padding 1 goes to the beginning (onnxruntime): torch's padding 1 on both sides
        # and output_padding 1 at the end
        (
            {"strides": [2, 2], "output_shape": [6, 8]},
            lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
        ),
        # SAME_UPPER puts it at the end: no padding, then the last row and column cropped
        (
            {"strides": [2, 2], "output_shape": [6, 8], "auto_pad": "SAME_UPPER"},
            lambda x, w: F.conv_transpose2d(x, w, stride=2)[..., :6, :8],
        ),
        (
            {"strides": [2, 2], "output_shape": [5, 7]},
            lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1),
        ),
    ],
    ids=["notset", "same-upper", "even-total"],
)
def test_conv_transpose_output_shape(attrs: dict, torch_fn: Any) -> None:
    """onnx.reference places output_shape padding unlike onnxruntime (and the spec): float32 on
    onnxruntime against finite differences, and against torch with the equivalent explicit padding."""
    x, w = rnd(1, 2, 3, 4), rnd(2, 3, 3, 3)
    check("ConvTranspose", f32(x, w), attrs)
    model = node_model("ConvTranspose", f32(x, w), attrs=attrs)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in1"])
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch_fn(tx, tw)
    cot = RNG.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(cot))
    feeds = {"in0": x.astype(F32), "in1": w.astype(F32)}
    out, grads = testing.run_gradients(graphs, feeds, {"out0": cot.astype(F32)})
    np.testing.assert_allclose(out["out0"], ty.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["in0"], tx.grad.numpy(), rtol=1e-4, atol=1e-5)  # type: ignore[union-attr]
    np.testing.assert_allclose(grads["in1"], tw.grad.numpy(), rtol=1e-4, atol=1e-5)  # type: ignore[union-attr]


def test_conv_transpose_versus_torch() -> None:
    x, w, b = rnd(2, 4, 3, 4), rnd(4, 3, 3, 2), rnd(6)
    attrs = {
        "group": 2,
        "strides": [2, 1],
        "pads": [1, 0, 1, 0],
        "dilations": [1, 2],
        "output_padding": [1, 0],
    }
    torch_grads(
        "ConvTranspose",
        [x, w, b],
        attrs,
        lambda x, w, b: F.conv_transpose2d(
            x, w, b, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2)
        ),
        backend=REF,
    )


def test_conv_transpose_dynamic_batch_and_size() -> None:
    """Every size unknown when building: dX is a Conv whose size follows at run time."""
    inputs = f32(rnd(2, 4, 3, 4), rnd(4, 3, 3, 2), rnd(6))
    check("ConvTranspose", inputs, {"group": 2, "strides": [2, 1], "pads": [1, 0, 0, 1]}, dynamic=True)
    check("ConvTranspose", inputs[:2], {"strides": [2, 2], "output_padding": [1, 1]}, dynamic=True)


def test_conv_transpose_output_shape_needs_static_sizes() -> None:
    attrs = {"strides": [2, 2], "output_shape": [6, 8]}
    model = node_model("ConvTranspose", f32(rnd(1, 2, 3, 4), rnd(2, 3, 3, 3)), attrs=attrs, dynamic=True)
    ensure_output_shape(model, (1, 3, 6, 8), dynamic=True)
    with pytest.raises(GradientNotImplementedError, match=r"ConvTranspose node .*output_shape"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])


def symbolic(model: onnx.ModelProto, dims: dict[int, Sequence[int]]) -> onnx.ModelProto:
    """Make dims ``dims[i]`` of input ``in{i}`` symbolic (the others stay static)."""
    for inp in model.graph.input:
        for j in dims.get(int(inp.name[2:]), ()):
            inp.type.tensor_type.shape.dim[j].dim_param = f"{inp.name}_d{j}"
    return model


def check_model(
    model: onnx.ModelProto, inputs: Sequence[np.ndarray | None], wrt: Sequence[int], **kw: Any
) -> None:
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    result = check_gradients(model, feeds, wrt=[f"in{i}" for i in wrt], **kw)
    assert result.ok, result.report()


# ---- LpPool and GlobalLpPool ----------------------------------------------------------------
def signed(*shape: int) -> np.ndarray:
    """|x| in [0.3, 1.5] with random signs: away from the kink of |x| (p = 1)."""
    return RNG.uniform(0.3, 1.5, shape) * RNG.choice([-1.0, 1.0], shape)


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


def test_lp_pool_versus_torch(kernels: None) -> None:
    x = rnd(2, 3, 7, 6)
    attrs = {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "p": 2}
    torch_grads(
        "LpPool", [x], attrs, lambda t: F.lp_pool2d(t, 2, (3, 2), stride=2, ceil_mode=True), backend=REF
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


def test_lp_pool_needs_static_spatial_sizes() -> None:
    model = symbolic(node_model("LpPool", f32(rnd(1, 2, 4, 4)), attrs={"kernel_shape": [2, 2]}), {0: (2, 3)})
    with pytest.raises(GradientNotImplementedError, match=r"LpPool node .*static spatial sizes"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])


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


# ---- DeformConv -----------------------------------------------------------------------------
DEFORM_CASES = [
    # (x shape, w shape, offset_group, attrs, mask, bias)
    ((1, 2, 5, 5), (3, 2, 2, 2), 1, {}, False, False),
    (
        (2, 4, 6, 5),
        (4, 2, 3, 2),
        2,
        {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]},
        True,
        True,
    ),
    ((1, 3, 4, 6), (2, 3, 3, 3), 3, {"pads": [1, 1, 1, 1]}, True, False),
]


def deform_inputs(
    xs: tuple, ws: tuple, og: int, attrs: dict, mask: bool, bias: bool
) -> list[np.ndarray | None]:
    kernel = ws[2:]
    s, d = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    pads = attrs.get("pads", [0, 0, 0, 0])
    out = [(xs[2 + i] + pads[i] + pads[2 + i] - (kernel[i] - 1) * d[i] - 1) // s[i] + 1 for i in range(2)]
    kk = math.prod(kernel)
    offset = 1.5 * rnd(xs[0], og * kk * 2, *out)  # some samples land outside X
    return [
        rnd(*xs),
        rnd(*ws),
        offset,
        rnd(ws[0]) if bias else None,
        RNG.uniform(0.2, 1.0, (xs[0], og * kk, *out)) if mask else None,
    ]


@pytest.mark.parametrize(
    ("xs", "ws", "og", "attrs", "mask", "bias"),
    DEFORM_CASES,
    ids=["plain", "groups-geometry", "offset-groups"],
)
def test_deform_conv(xs: tuple, ws: tuple, og: int, attrs: dict, mask: bool, bias: bool) -> None:
    """float64 through onnxruntime: X, W, offset, B and mask."""
    inputs = deform_inputs(xs, ws, og, attrs, mask, bias)
    check("DeformConv", inputs, {**attrs, "offset_group": og}, opset=19)


def test_deform_conv_opset22() -> None:
    xs, ws, og, attrs, mask, bias = DEFORM_CASES[1]
    check("DeformConv", deform_inputs(xs, ws, og, attrs, mask, bias), {**attrs, "offset_group": og}, opset=22)


def test_deform_conv_dynamic_batch() -> None:
    xs, ws, og, attrs, mask, bias = DEFORM_CASES[1]
    inputs = deform_inputs(xs, ws, og, attrs, mask, bias)
    model = symbolic(
        node_model("DeformConv", inputs, attrs={**attrs, "offset_group": og}, opset=19),
        {0: (0,), 2: (0,), 4: (0,)},
    )
    check_model(model, inputs, wrt=[0, 1, 2, 3, 4])


def torch_deform_conv(x, w, offset, b, mask, strides, pads, dilations, group, og):  # type: ignore[no-untyped-def]
    """DeformConv with torch's grid_sample (bilinear, zeros outside, align_corners: pixel units)."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh, ow = offset.shape[2:]
    off = offset.reshape(n, og, kh, kw, 2, oh, ow)
    ky = torch.arange(kh, dtype=x.dtype)[:, None, None, None] * dilations[0]
    kx = torch.arange(kw, dtype=x.dtype)[None, :, None, None] * dilations[1]
    oy = torch.arange(oh, dtype=x.dtype)[None, None, :, None] * strides[0] - pads[0]
    ox = torch.arange(ow, dtype=x.dtype)[None, None, None, :] * strides[1] - pads[1]
    py, px = ky + oy + off[:, :, :, :, 0], kx + ox + off[:, :, :, :, 1]  # (n, og, kh, kw, oh, ow)
    grid = torch.stack([px / (wd - 1) * 2 - 1, py / (h - 1) * 2 - 1], dim=-1).reshape(
        n * og, kh * kw * oh, ow, 2
    )
    samples = F.grid_sample(
        x.reshape(n * og, c // og, h, wd), grid, mode="bilinear", padding_mode="zeros", align_corners=True
    )
    samples = samples.reshape(n, og, c // og, kh, kw, oh, ow)
    if mask is not None:
        samples = samples * mask.reshape(n, og, 1, kh, kw, oh, ow)
    cols = samples.reshape(n, group, cg, kh, kw, oh, ow)
    y = torch.einsum("gmcab,ngcabij->ngmij", w.reshape(group, m // group, cg, kh, kw), cols).reshape(
        n, m, oh, ow
    )
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def test_deform_conv_versus_torch() -> None:
    xs, ws, og, attrs, mask, bias = DEFORM_CASES[1]
    inputs = deform_inputs(xs, ws, og, attrs, mask, bias)
    torch_grads(
        "DeformConv",
        inputs,
        {**attrs, "offset_group": og},
        lambda *t: torch_deform_conv(
            *t, attrs["strides"], attrs["pads"], attrs["dilations"], attrs["group"], og
        ),
        opset=19,
        rtol=1e-7,
    )


def test_deform_conv_needs_static_sizes() -> None:
    inputs = deform_inputs(*DEFORM_CASES[0])
    model = symbolic(node_model("DeformConv", inputs, opset=19), {0: (2, 3)})
    with pytest.raises(GradientNotImplementedError, match=r"DeformConv node .*static spatial sizes"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])


# ---- CausalConvWithState (opset 27) ----------------------------------------------------------
CAUSAL_CONV_CASES = [
    # (id, length, kernel, bias, past, activation)
    ("full", 5, 3, True, True, "silu"),
    ("no-bias-no-past", 5, 4, False, False, "none"),
    ("short-input", 2, 4, True, True, "swish"),
    ("past-only", 4, 2, False, True, "none"),
]


@pytest.mark.parametrize("outputs", [(0, 1), (0,), (1,)], ids=["both", "output", "present_state"])
@pytest.mark.parametrize(
    ("length", "k", "bias", "past", "act"),
    [c[1:] for c in CAUSAL_CONV_CASES],
    ids=[c[0] for c in CAUSAL_CONV_CASES],
)
def test_causal_conv_with_state(
    length: int, k: int, bias: bool, past: bool, act: str, outputs: tuple
) -> None:
    """float64 through onnx.reference (onnxruntime runs it in float32 only; onnx.reference takes the
    SiLU in float32, hence the wider step there), then float32 on onnxruntime at opsets 27 and 28,
    and float64 against torch (conv1d with groups, then silu)."""
    inputs = [rnd(2, 3, length), rnd(3, 1, k), rnd(3) if bias else None, rnd(2, 3, k - 1) if past else None]
    while inputs[-1] is None:
        inputs.pop()
    names = ["out0", "out1"]
    runs = [(np.float64, "reference", 27), (np.float32, "onnxruntime", 27), (np.float32, "onnxruntime", 28)]
    for dtype, backend, opset in runs:
        if backend == "onnxruntime" and not ort_loads_opset(opset):
            continue
        ins = [None if a is None else a.astype(dtype) for a in inputs]
        model = node_model("CausalConvWithState", ins, attrs={"activation": act}, n_outputs=2, opset=opset)
        feeds = {i.name: ins[int(i.name[2:])] for i in model.graph.input}
        wanted = [names[o] for o in outputs]
        graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds), outputs=wanted)
        tol = {"eps": 1e-3, "rtol": 1e-4, "atol": 5e-4} if backend == "reference" and act != "none" else {}
        result = check_gradients(model, feeds, graphs=graphs, backend=backend, **tol)
        assert result.ok, result.report()
        if dtype is np.float64:
            cot = {o: RNG.standard_normal((2, 3, length) if o == "out0" else (2, 3, k - 1)) for o in wanted}
            _, ours = testing.run_gradients(graphs, feeds, cot, backend="reference")
            ts = {name: torch.tensor(a, requires_grad=True) for name, a in feeds.items()}
            state = ts["in3"] if "in3" in ts else torch.zeros(2, 3, k - 1, dtype=torch.float64)
            padded = torch.cat([state, ts["in0"]], dim=2)
            y = F.conv1d(padded, ts["in1"], ts.get("in2"), groups=3)
            y = F.silu(y) if act != "none" else y
            loss = sum(
                (t * torch.tensor(cot[o])).sum()
                for o, t in (("out0", y), ("out1", padded[:, :, -(k - 1) :]))
                if o in cot
            )
            loss.backward()  # type: ignore[union-attr]
            for name, t in ts.items():
                want = np.zeros(t.shape) if t.grad is None else t.grad.numpy()
                np.testing.assert_allclose(ours[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
