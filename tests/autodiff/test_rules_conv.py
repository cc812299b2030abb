"""Gradient checks of the convolution rules (rules/conv.py): Conv, ConvTranspose, DeformConv and
CausalConvWithState, and a small Conv -> BatchNorm -> MaxPool -> Softmax network.

Each rule against float64 central finite differences: through onnxruntime where it has float64
kernels (DeformConv), else through onnx.reference on tiny shapes plus float32 onnxruntime checks;
and against torch autograd in float64 where torch has the op or its forward is a few lines of torch.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import onnxgrad.autodiff.rules.conv  # noqa: F401  (registers the rules until rules/__init__ imports it)
from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import assert_allclose_scaled, check_gradients, check_op, node_model
from tests.autodiff.conftest import (
    DECLARED,
    F32,
    check,
    check_model,
    declared_symbolic,
    dynamic_model,
    ensure_output_shape,
    f32,
    symbolic,
    versus_torch,
)
from tests.autodiff.random_data import pos, rnd, rng  # one generator per test (conftest.py)
from tests.models import ort_loads_opset

from .test_rules_linalg import torch_grads

REF = "reference"


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
@pytest.mark.parametrize(
    "dims", [None, {0: (0, 2, 3)}, {0: (0, 2, 3), 1: (2, 3)}], ids=["static", "symbolic", "kernel"]
)
def test_conv_transpose_output_shape(attrs: dict, torch_fn: Any, dims: Any) -> None:
    """onnx.reference places output_shape padding unlike onnxruntime (and the spec): float32 on
    onnxruntime against finite differences, and against torch with the equivalent explicit padding.
    With X's sizes (or the kernel's) symbolic the pads are computed at run time (were refused)."""
    x, w = rnd(1, 2, 3, 4), rnd(2, 3, 3, 3)
    model = declared_symbolic(node_model("ConvTranspose", f32(x, w), attrs=attrs), dims)
    check_model(model, f32(x, w))
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in1"])
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch_fn(tx, tw)
    cot = rng().standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(cot))
    feeds = {"in0": x.astype(F32), "in1": w.astype(F32)}
    out, grads = testing.run_gradients(graphs, feeds, {"out0": cot.astype(F32)})
    assert_allclose_scaled(out["out0"], ty.detach().numpy(), rtol=1e-4)
    assert_allclose_scaled(grads["in0"], tx.grad.numpy(), rtol=1e-4)  # type: ignore[union-attr]
    assert_allclose_scaled(grads["in1"], tw.grad.numpy(), rtol=1e-4)  # type: ignore[union-attr]


@DECLARED
def test_conv_transpose_versus_torch(dims: Any) -> None:
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
        dims=dims,
    )


def test_conv_transpose_dynamic_batch_and_size() -> None:
    """Every size unknown when building: dX is a Conv whose size follows at run time."""
    inputs = f32(rnd(2, 4, 3, 4), rnd(4, 3, 3, 2), rnd(6))
    check("ConvTranspose", inputs, {"group": 2, "strides": [2, 1], "pads": [1, 0, 0, 1]}, dynamic=True)
    check("ConvTranspose", inputs[:2], {"strides": [2, 2], "output_padding": [1, 1]}, dynamic=True)


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": [2, 2], "output_shape": [6, 8]},
        {"strides": [2, 3], "auto_pad": "SAME_UPPER", "output_padding": [1, 0]},
        {"strides": [2, 2], "auto_pad": "SAME_LOWER", "dilations": [1, 2]},
    ],
    ids=["output-shape", "same-upper", "same-lower"],
)
def test_conv_transpose_every_size_symbolic(attrs: dict) -> None:
    """Every dim of X and W symbolic (the kernel too): the adjoint Conv's pads at run time."""
    inputs = f32(rnd(1, 2, 3, 4), rnd(2, 3, 3, 3))
    model = node_model("ConvTranspose", inputs, attrs=attrs, dynamic=True)
    y = testing.run_model(node_model("ConvTranspose", inputs, attrs=attrs))(
        {"in0": inputs[0], "in1": inputs[1]}
    )["out0"]
    ensure_output_shape(model, y.shape, dynamic=True)
    check_model(model, inputs)


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
        rng().uniform(0.2, 1.0, (xs[0], og * kk, *out)) if mask else None,
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


@pytest.mark.parametrize(
    ("xs", "ws", "og", "attrs", "mask", "bias"),
    DEFORM_CASES,
    ids=["plain", "groups-geometry", "offset-groups"],
)
def test_deform_conv_symbolic_sizes(
    xs: tuple, ws: tuple, og: int, attrs: dict, mask: bool, bias: bool
) -> None:
    """N, H and W of X, offset and mask symbolic (a detector exported with dynamic image sizes):
    the sampling positions from the run-time sizes; were refused."""
    inputs = deform_inputs(xs, ws, og, attrs, mask, bias)
    dims = {i: (0, 2, 3) for i in (0, 2, 4) if inputs[i] is not None}
    model = declared_symbolic(
        node_model("DeformConv", inputs, attrs={**attrs, "offset_group": og}, opset=19), dims
    )
    check_model(model, inputs, wrt=[i for i, a in enumerate(inputs) if a is not None])


def test_deform_conv_needs_a_static_weight_shape() -> None:
    inputs = deform_inputs(*DEFORM_CASES[0])
    model = symbolic(node_model("DeformConv", inputs, opset=19), {1: (2, 3)})
    with pytest.raises(GradientNotImplementedError, match=r"DeformConv node .*static weight shape"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])


# ---- CausalConvWithState (opset 27) ---------------------------------------------------------
CAUSAL_CONV_CASES = [
    # (id, length, kernel, bias, past, activation)
    ("full", 5, 3, True, True, "silu"),
    ("no-bias-no-past", 5, 4, False, False, "none"),
    ("short-input", 2, 4, True, True, "swish"),
    ("past-only", 4, 2, False, True, "none"),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("outputs", [(0, 1), (0,), (1,)], ids=["both", "output", "present_state"])
@pytest.mark.parametrize(
    ("length", "k", "bias", "past", "act"),
    [c[1:] for c in CAUSAL_CONV_CASES],
    ids=[c[0] for c in CAUSAL_CONV_CASES],
)
def test_causal_conv_with_state(
    length: int, k: int, bias: bool, past: bool, act: str, outputs: tuple, dynamic: bool
) -> None:
    """float64 through onnx.reference (onnxruntime runs it in float32 only; onnx.reference takes the
    SiLU in float32, hence the wider step there), then float32 on onnxruntime at opsets 27 and 28,
    and float64 against torch (conv1d with groups, then silu). ``dynamic``: every dim symbolic, the
    kernel size too (the taps are then gathered at run time; was refused)."""
    inputs = [rnd(2, 3, length), rnd(3, 1, k), rnd(3) if bias else None, rnd(2, 3, k - 1) if past else None]
    while inputs[-1] is None:
        inputs.pop()
    names = ["out0", "out1"]
    runs = [(np.float64, "reference", 27), (np.float32, "onnxruntime", 27), (np.float32, "onnxruntime", 28)]
    for dtype, backend, opset in runs:
        if backend == "onnxruntime" and (dynamic or not ort_loads_opset(opset)):
            continue  # onnxruntime 1.32 runs the op by its function body, which needs static shapes
        ins = [None if a is None else a.astype(dtype) for a in inputs]
        model = node_model(
            "CausalConvWithState", ins, attrs={"activation": act}, n_outputs=2, opset=opset, dynamic=dynamic
        )
        feeds = {i.name: ins[int(i.name[2:])] for i in model.graph.input}
        wanted = [names[o] for o in outputs]
        graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds), outputs=wanted)
        tol = {"eps": 1e-3, "rtol": 1e-4, "atol": 5e-4} if backend == "reference" and act != "none" else {}
        result = check_gradients(model, feeds, graphs=graphs, backend=backend, **tol)
        assert result.ok, result.report()
        if dtype is np.float64:
            cot = {o: rng().standard_normal((2, 3, length) if o == "out0" else (2, 3, k - 1)) for o in wanted}
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
    # strided: the pads depend on the size, computed at run time (X padded in the backward)
    model = dynamic_model("Conv", inputs, {0: (0, 2, 3)}, attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]})
    check_model(model, inputs)


@pytest.mark.parametrize("xs", [(2, 3, 8, 7), (1, 3, 5, 6)], ids=["8x7", "5x6"])
@pytest.mark.parametrize(
    "attrs",
    [
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        {"auto_pad": "SAME_LOWER", "strides": [2, 3]},  # onnxruntime: no dilations with SAME
        {"auto_pad": "SAME_UPPER", "strides": [3, 1], "group": 3},
    ],
    ids=["upper", "lower", "upper-grouped"],
)
def test_conv_same_strided_symbolic_sizes_equal_static(xs: tuple, attrs: dict) -> None:
    """SAME pads of strided axes computed from the run-time size (tf2onnx exports with dynamic
    H and W): the gradients of X, W and B equal those of the static model; were refused."""
    group = attrs.get("group", 1)
    inputs = f32(rnd(*xs), rnd(6, xs[1] // group, 3, 2), rnd(6))
    feeds = {f"in{i}": a for i, a in enumerate(inputs)}
    static = node_model("Conv", inputs, attrs=attrs)
    symbolic_model = dynamic_model("Conv", inputs, {0: (0, 2, 3)}, attrs=attrs)
    cot = rng().standard_normal(testing.run_model(static)(feeds)["out0"].shape).astype(F32)
    want = testing.run_gradients(
        build_gradient(static, inputs_requiring_grad=list(feeds)), feeds, {"out0": cot}
    )[1]
    got = testing.run_gradients(
        build_gradient(symbolic_model, inputs_requiring_grad=list(feeds)), feeds, {"out0": cot}
    )[1]
    for name in feeds:
        assert_allclose_scaled(got[name], want[name], rtol=1e-5, err_msg=name)
    check_model(symbolic_model, inputs)


@DECLARED
def test_conv_versus_torch(dims: Any) -> None:
    x, w, b = rnd(2, 4, 6, 5), rnd(6, 2, 3, 2), rnd(6)
    attrs = {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 0], "dilations": [1, 2]}
    versus_torch(
        "Conv",
        [x, w, b],
        attrs,
        lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
        backend="reference",
        dims=dims,
    )


@DECLARED
@pytest.mark.parametrize(
    ("xs", "ws", "stride", "pad"),
    [
        ((2, 3, 8, 6), (4, 3, 3, 3), 2, 1),  # 3x3 s2 p1 on even sizes: ResNet's downsampling
        ((1, 2, 10, 9), (3, 2, 7, 7), 2, 3),  # 7x7 s2 p3: its stem, odd and even
        ((2, 4, 6, 7), (4, 1, 3, 3), 2, 1),  # depthwise
        ((1, 2, 9, 8), (3, 2, 2, 2), 3, 1),
    ],
    ids=["3x3-s2-p1", "7x7-s2-p3", "depthwise", "2x2-s3-p1"],
)
def test_conv2d_strided_padded_versus_torch(xs: tuple, ws: tuple, stride: int, pad: int, dims: Any) -> None:
    """Strides that leave the last rows of the padded input unread: with H and W symbolic, dX
    once lost its last row and column (the ConvTranspose cropped the end pad, real rows included)."""
    group = xs[1] // ws[1]
    attrs = {"strides": [stride, stride], "pads": [pad] * 4, "group": group}
    versus_torch(
        "Conv",
        [rnd(*xs), rnd(*ws), rnd(ws[0])],
        attrs,
        lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=pad, groups=group),
        backend="reference",
        dims=dims,
    )


# (kernel, stride, (begin pad, end pad), dilation) of the 1-D sweep: every stride that leaves rows
# of the padded input unread, with and without an end pad, symmetric and not
SWEEP_1D = list(
    itertools.product((1, 2, 3), (1, 2, 3), ((0, 0), (1, 1), (2, 2), (0, 2), (2, 1), (1, 0)), (1, 2))
)


@DECLARED
def test_conv1d_sweep_versus_torch(dims: Any) -> None:
    """Conv1d over kernels, strides, pads and dilations, on lengths 8 and 9 (every remainder of
    strides 2 and 3 but one), against torch in float64: one model holds a Conv per configuration.
    With the lengths symbolic, 129 of 648 such configurations once got a wrong dX, all with a
    stride of 2 or more and an end pad; with them static, none."""
    nodes, inputs, outputs, inits, feeds, cots, want = [], [], [], [], {}, {}, {}
    for i, ((k, s, (pb, pe), d), length) in enumerate(itertools.product(SWEEP_1D, (8, 9))):
        x, w = rnd(2, 2, length, dtype=F32), rnd(3, 2, k, dtype=F32)
        tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        ty = F.conv1d(F.pad(tx, (pb, pe)), torch.tensor(w, dtype=torch.float64), stride=s, dilation=d)
        cot = rnd(*ty.shape, dtype=F32)
        ty.backward(torch.tensor(cot, dtype=torch.float64))
        attrs = {"strides": [s], "pads": [pb, pe], "dilations": [d]}
        nodes.append(
            helper.make_node(
                "Conv", [f"x{i}", f"w{i}"], [f"y{i}"], name=f"{k, s, pb, pe, d, length}", **attrs
            )
        )
        shape = [f"n{i}", 2, f"t{i}"] if dims else list(x.shape)
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, shape))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        feeds[f"x{i}"], cots[f"y{i}"], want[f"x{i}"] = x, cot, tx.grad.numpy()  # type: ignore[union-attr]
    model = helper.make_model(
        helper.make_graph(nodes, "sweep", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    model.ir_version = 9
    graphs = build_gradient(
        onnx.shape_inference.infer_shapes(model), trainable=[], inputs_requiring_grad=list(feeds)
    )
    _, ours = testing.run_gradients(graphs, feeds, cots)
    wrong = [
        n.name for n in nodes if not np.allclose(ours[n.input[0]], want[n.input[0]], rtol=1e-4, atol=1e-5)
    ]
    assert not wrong, f"{len(wrong)} of {len(nodes)} wrong (kernel, stride, pads, dilation, length): {wrong}"


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


# ---- Conv weight gradient by im2col (rules/conv.py: _unfolded_weight_grad) ---------------------
UNFOLD_CASES = [
    # (x shape, w shape, torch conv2d keywords): kernels of <= 9 positions, or 25 over one channel
    ((4, 3, 9, 8), (5, 3, 3, 3), {"padding": 1}),
    ((4, 3, 9, 8), (5, 3, 3, 3), {"stride": 2, "padding": 1, "dilation": 2}),
    ((3, 4, 6, 7), (6, 4, 1, 1), {}),  # 1x1 at stride 1: X is its own patches
    ((3, 4, 6, 7), (6, 4, 1, 1), {"stride": 2}),
    ((5, 1, 12, 12), (6, 1, 5, 5), {"padding": 2}),  # the first layer of the anchor CNN, smaller
    ((2, 2, 7, 6), (3, 2, 2, 3), {"stride": (2, 1), "padding": (1, 0)}),
]


def _conv_model(xs: tuple, ws: tuple, kw: dict, batch: str | None = None) -> Any:
    pads = kw.get("padding", 0)
    pads = [pads, pads] if isinstance(pads, int) else list(pads)
    attrs = {
        "strides": list(np.broadcast_to(kw.get("stride", 1), 2)),
        "dilations": list(np.broadcast_to(kw.get("dilation", 1), 2)),
        "pads": pads + pads,
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch or xs[0], *xs[1:]])
    ys = F.conv2d(torch.zeros(xs), torch.zeros(ws), **kw).shape
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
        "conv",
        [x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch or ys[0], *ys[1:]])],
        [numpy_helper.from_array(rnd(*ws, dtype=F32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _one_hot_convs(graphs: Any) -> list:
    """The backward's Conv nodes that unfold X: they read X itself, where the Conv form reads X
    with batch and channels swapped (a Transpose)."""
    nodes = graphs.backward.graph.node
    transposed = {o for n in nodes if n.op_type == "Transpose" for o in n.output}
    return [n for n in nodes if n.op_type == "Conv" and n.input[0] not in transposed]


@pytest.mark.parametrize(("xs", "ws", "kw"), UNFOLD_CASES)
@pytest.mark.parametrize("batch", [None, "N"])
def test_conv_weight_grad_by_im2col_equals_torch(xs: tuple, ws: tuple, kw: dict, batch: str | None) -> None:
    """float32 weight gradients by im2col against torch's in float64, static and symbolic batch;
    the unfolding Conv is there unless the patches are X itself."""
    import onnxgrad

    model = _conv_model(xs, ws, kw, batch)
    fb = onnxgrad.ForwardBackward(model)
    plain = ws[2:] == (1, 1) and kw.get("stride", 1) == 1
    assert len(_one_hot_convs(fb.graphs)) == (0 if plain else 1)
    assert "Transpose" in {n.op_type for n in fb.graphs.backward.graph.node}  # P^T of the batched product
    x = rnd(*xs, dtype=F32)
    w = numpy_helper.to_array(model.graph.initializer[0]).copy()
    y = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), **kw)
    dy = rnd(*y.shape, dtype=F32)
    grads = fb.forward({"x": x}).backward({"y": dy})
    want = torch.nn.grad.conv2d_weight(
        torch.from_numpy(x).double(), w.shape, torch.from_numpy(dy).double(), **kw
    ).numpy()
    assert_allclose_scaled(np.asarray(grads["w"]), want, rtol=2e-6)


@pytest.mark.parametrize(
    ("xs", "ws", "dtype"),
    [
        ((2, 6, 10, 10), (4, 6, 5, 5), F32),  # 25 positions over 6 channels: the Conv form
        ((2, 3, 9, 8), (5, 3, 3, 3), np.float64),  # float64: the Conv form (no unfolding needed)
    ],
)
def test_conv_weight_grad_keeps_the_conv_form(xs: tuple, ws: tuple, dtype: Any) -> None:
    """Larger kernels over several channels (slower by im2col) and float64 keep the Conv of X with
    dY as its kernel."""
    inputs = [rnd(*xs, dtype=dtype), rnd(*ws, dtype=dtype)]
    graphs = build_gradient(node_model("Conv", inputs, attrs={}), inputs_requiring_grad=["in0", "in1"])
    assert not _one_hot_convs(graphs)


def test_conv_weight_grad_by_im2col_when_dy_has_no_declared_shape() -> None:
    """Conv -> Relu -> Conv: the first Conv's dY is the ReLU mask times a ConvTranspose, a value
    with no declared shape; its weight gradient still takes the im2col form (the forward output's
    shape is dY's) and equals torch's."""
    import onnxgrad

    xs, w1s, w2s = (3, 2, 8, 7), (4, 2, 3, 3), (5, 4, 3, 3)
    w1, w2 = rnd(*w1s, dtype=F32), rnd(*w2s, dtype=F32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1]),
        ],
        "two_convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *xs[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", w2s[0], *xs[2:]])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    fb = onnxgrad.ForwardBackward(model)
    assert len(_one_hot_convs(fb.graphs)) == 2
    x, dy = rnd(*xs, dtype=F32), rnd(xs[0], w2s[0], *xs[2:], dtype=F32)
    grads = fb.forward({"x": x}).backward({"y": dy})
    tx, t1, t2 = (torch.from_numpy(a).double().requires_grad_() for a in (x, w1, w2))
    F.conv2d(torch.relu(F.conv2d(tx, t1, padding=1)), t2, padding=1).backward(torch.from_numpy(dy).double())
    assert_allclose_scaled(np.asarray(grads["w1"]), t1.grad.numpy(), rtol=2e-6)
    assert_allclose_scaled(np.asarray(grads["w2"]), t2.grad.numpy(), rtol=2e-6)
