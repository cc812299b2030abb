"""Gradient rules of the resampling ops (rules/resample/): Resize, Upsample, GridSample, Col2Im,
AffineGrid.

onnxruntime has no float64 Resize, Upsample or Col2Im kernel: those are checked against float64
finite differences through onnx.reference (tiny shapes, scales whose coordinates onnx.reference and
onnxruntime compute alike), and against onnxruntime in float32 exactly: Resize is linear, so its
Jacobian read from onnxruntime's forward must be the transpose of what the backward applies, for
every mode, including those where onnx.reference differs from onnxruntime. GridSample runs in
float64 on onnxruntime from opset 20. Resize, GridSample and Col2Im are also compared with torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.autodiff.rules import resample  # noqa: F401  (registers the rules until rules/__init__ does)
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import (
    assert_allclose_scaled,
    check_gradients,
    check_op,
    node_model,
    run_gradients,
    run_model,
)
from tests.autodiff.conftest import DECLARED, declared_symbolic
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)

F32 = np.float32


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=F32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], **kw: Any) -> None:
    result = check_gradients(model, feeds, wrt=list(feeds), **kw)
    assert result.ok, result.report()


def resize_model(
    x: np.ndarray, attrs: dict[str, Any], opset: int, roi=None, scales=None, sizes=None
) -> onnx.ModelProto:
    """A Resize node in the input layout of its opset; roi, scales and sizes are initializers."""
    if opset == 10:
        inputs = [x, scales]
    else:
        if opset == 11 and roi is None:
            roi = np.zeros(0, dtype=F32)  # roi is not optional before opset 13
        if opset < 13 and scales is None:
            scales = np.zeros(0, dtype=F32)
        inputs = [x, roi, scales] + ([sizes] if sizes is not None else [])
    return node_model("Resize", inputs, attrs=attrs, opset=opset, constant=range(1, 4))


def check_adjoint(model: onnx.ModelProto, x: np.ndarray, extra: dict[str, np.ndarray] | None = None) -> None:
    """For a linear model of one input whose axis 0 is not resized: dX of random cotangents equals
    A^T cot exactly, A (the Jacobian of one item) read from onnxruntime's forward in float32, with the
    basis of the item's inputs stacked on axis 0 (so one run of each graph checks everything).
    ``extra``: feeds of the other inputs (run-time scales, sizes, roi)."""
    size = int(np.prod(x.shape[1:]))
    basis = np.eye(size, dtype=x.dtype).reshape(size, *x.shape[1:])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    if model.graph.output[0].type.tensor_type.shape.dim:
        model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    feeds = {"in0": basis, **(extra or {})}
    out = run_model(graphs.forward)(feeds)["out0"]
    jac = out.reshape(size, -1).T.astype(np.float64)  # (outputs of one item, inputs of one item)
    cot = rng().standard_normal(out.shape).astype(x.dtype)
    _, res = testing.run_gradients(graphs, feeds, {"out0": cot})
    expected = cot.reshape(size, -1).astype(np.float64) @ jac
    assert_allclose_scaled(res["in0"].reshape(size, -1), expected, rtol=1e-5)


def gradients(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], backend: testing.Backend
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Output 0, a random cotangent and the gradients of every input."""
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds))
    out = run_model(graphs.forward, backend)(feeds)["out0"]
    cot = rng().standard_normal(out.shape)
    _, res = testing.run_gradients(graphs, feeds, {"out0": cot}, backend)
    return out, cot, res


def versus_torch(
    model: onnx.ModelProto,
    inputs: list[np.ndarray],
    fn: Callable[..., torch.Tensor],
    backend: testing.Backend,
) -> None:
    feeds = {f"in{i}": a for i, a in enumerate(inputs)}
    y, cot, ours = gradients(model, feeds, backend)
    ts = [torch.tensor(a, requires_grad=True) for a in inputs]
    ty = fn(*ts)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-9, atol=1e-12)
    ty.backward(torch.tensor(cot))
    for i, t in enumerate(ts):
        np.testing.assert_allclose(ours[f"in{i}"], t.grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=f"in{i}")


# ---- Resize: float64 finite differences (onnx.reference) ----------------------------------------
FD_CASES = [
    {"mode": "linear"},
    {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
    {"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
    {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
    {"mode": "cubic"},
    {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5},
    *(
        {"mode": "nearest", "nearest_mode": m}
        for m in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
    ),
    {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
]


@pytest.mark.parametrize("attrs", FD_CASES, ids=lambda a: "-".join(str(v) for v in a.values()))
def test_resize_finite_differences(attrs: dict[str, Any]) -> None:
    """Up by 2 on H and down by 2 on W (3x4 -> 6x2): coordinates exact in float32 and float64.
    Scales at opset 13, sizes at opset 18 (and the opset 11 layout, with its required roi)."""
    x = rnd(1, 2, 3, 4)
    check(resize_model(x, attrs, 13, scales=f32(1, 1, 2, 0.5)), {"in0": x}, backend="reference")
    check(resize_model(x, attrs, 18, sizes=i64(1, 2, 6, 2)), {"in0": x}, backend="reference")
    if attrs["mode"] != "cubic":
        check(resize_model(x, attrs, 11, scales=f32(1, 1, 2, 0.5)), {"in0": x}, backend="reference")


def test_resize_finite_differences_opset_19_crop_axes() -> None:
    x = rnd(1, 1, 3, 4)
    attrs = {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}
    check(resize_model(x, attrs, 19, sizes=i64(1, 1, 6, 2)), {"in0": x}, backend="reference")
    crop = {
        "mode": "linear",
        "coordinate_transformation_mode": "tf_crop_and_resize",
        "extrapolation_value": 3.0,
    }
    roi = f32(0, 0, -0.5, 0.25, 1, 1, 1.5, 0.75)  # reaches outside the input on H
    check(resize_model(x, crop, 13, roi=roi, sizes=i64(1, 1, 5, 3)), {"in0": x}, backend="reference")
    # axes (opset 18): the last two of a 3-D tensor (onnx.reference rejects negative axes)
    x3 = rnd(2, 3, 4)
    model = node_model(
        "Resize", [x3, None, f32(2, 0.5)], attrs={"mode": "linear", "axes": [1, 2]}, opset=18, constant=[2]
    )
    check(model, {"in0": x3}, backend="reference")


# ---- Resize: exact adjoint of onnxruntime's forward (float32) -----------------------------------
TRANSFORMS = [
    "half_pixel",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
    "half_pixel_symmetric",
]
SCALES = [f32(1, 1, 1.7, 0.55), f32(1, 1, 0.6, 3), f32(1, 1, 0.25, 1.5)]
ROI = f32(0, 0, 0.1, -0.2, 1, 1, 0.8, 1.3)


def _resize_models(x: np.ndarray, transform: str, mode: str) -> Iterator[onnx.ModelProto]:
    """Opset-19 Resize models of ``x`` for every nearest mode (``mode="nearest"``) and every scale of
    SCALES, with the roi that ``tf_crop_and_resize`` reads."""
    nearest = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"] if mode == "nearest" else [None]
    for nearest_mode in nearest:
        for scales in SCALES:
            if transform == "half_pixel_symmetric" and nearest_mode == "round_prefer_floor":
                continue  # onnxruntime breaks exact ties of this transform differently (see report)
            attrs = {"mode": mode, "coordinate_transformation_mode": transform, "nearest_mode": nearest_mode}
            roi = ROI if transform == "tf_crop_and_resize" else None
            yield resize_model(x, attrs, 19, roi=roi, scales=scales)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_matches_onnxruntime(transform: str, mode: str) -> None:
    x = rnd(2, 1, 5, 4, dtype=F32)
    for model in _resize_models(x, transform, mode):
        check_adjoint(model, x)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_antialias_matches_onnxruntime(transform: str, mode: str) -> None:
    x = rnd(2, 1, 9, 7, dtype=F32)
    roi = ROI if transform == "tf_crop_and_resize" else None
    for exclude in (0, 1):
        for scales in (f32(1, 1, 0.5, 0.4), f32(1, 1, 0.3, 1.5)):
            attrs = {
                "mode": mode,
                "coordinate_transformation_mode": transform,
                "antialias": 1,
                "exclude_outside": exclude,
            }
            check_adjoint(
                resize_model(
                    x, attrs, 18 if transform != "half_pixel_symmetric" else 19, roi=roi, scales=scales
                ),
                x,
            )


def test_resize_other_forms_match_onnxruntime() -> None:
    x = rnd(2, 1, 5, 4, dtype=F32)
    # opset 10: asymmetric coordinates; nearest truncates up, rounds up (ceil) down
    for mode in ("nearest", "linear"):
        for scales in (f32(1, 1, 1.7, 2.5), f32(1, 1, 0.6, 0.75)):
            check_adjoint(resize_model(x, {"mode": mode}, 10, scales=scales), x)
    # opset 11 tf_half_pixel_for_nn; sizes; keep_aspect_ratio_policy
    check_adjoint(
        resize_model(
            x, {"coordinate_transformation_mode": "tf_half_pixel_for_nn"}, 11, scales=f32(1, 1, 1.5, 0.7)
        ),
        x,
    )
    check_adjoint(resize_model(x, {"mode": "linear", "axes": [2, 3]}, 18, sizes=i64(7, 3)), x)
    for policy in ("not_larger", "not_smaller"):
        attrs = {"mode": "linear", "keep_aspect_ratio_policy": policy, "axes": [2, 3]}
        check_adjoint(resize_model(x, attrs, 18, sizes=i64(8, 3)), x)
    # negative axes (onnxruntime ignores them in keep_aspect_ratio_policy, so without one)
    check_adjoint(resize_model(x, {"mode": "cubic", "axes": [-1, -2]}, 18, sizes=i64(3, 8)), x)
    # 5-D (trilinear) and 3-D inputs
    x5 = rnd(2, 1, 3, 4, 2, dtype=F32)
    check_adjoint(resize_model(x5, {"mode": "linear"}, 18, scales=f32(1, 1, 1.5, 0.5, 2)), x5)
    x2 = rnd(2, 4, 3, dtype=F32)
    check_adjoint(resize_model(x2, {"mode": "linear", "axes": [1, 2]}, 18, scales=f32(1.5, 2)), x2)


def test_resize_axes_that_keep_their_size() -> None:
    """onnxruntime copies X when no dim changes size (whatever the scales), copies antialiased axes
    that keep their size, and maps nearest axes of scale 1 to themselves even with a roi."""
    x = rnd(2, 1, 5, 4, dtype=F32)
    for scales in (f32(1, 1, 1.1, 1.1), f32(1, 1, 1.1, 2), f32(1, 1, 1, 2)):
        check_adjoint(resize_model(x, {"mode": "linear"}, 18, scales=scales), x)
        check_adjoint(resize_model(x, {"mode": "linear", "antialias": 1}, 18, scales=scales), x)
    crop = {"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize"}
    check_adjoint(resize_model(x, crop, 18, roi=ROI, scales=f32(1, 1, 1, 2)), x)
    model = resize_model(x, {"mode": "linear"}, 18, scales=f32(1, 1, 1.1, 1.1))
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    assert [node.op_type for node in graphs.backward.graph.node] == ["Identity"]


def test_upsample() -> None:
    """Upsample-7 (scales attribute) and -9 (scales input); onnx.reference cannot run them."""
    x = rnd(2, 1, 3, 4, dtype=F32)
    for mode in ("nearest", "linear"):
        attrs = {"mode": mode, "scales": [1.0, 1.0, 2.0, 1.5]}
        check_adjoint(node_model("Upsample", [x], attrs=attrs, opset=7), x)
        check_adjoint(
            node_model("Upsample", [x, f32(1, 1, 2.5, 3)], attrs={"mode": mode}, opset=9, constant=[1]), x
        )


def test_resize_symbolic_batch_and_channels() -> None:
    """Only the resized dims need to be static."""
    x = rnd(2, 3, 4, 5, dtype=F32)
    model = resize_model(x, {"mode": "linear"}, 18, scales=f32(1, 1, 1.5, 0.6))
    for j in (0, 1):
        model.graph.input[0].type.tensor_type.shape.dim[j].dim_param = f"d{j}"
    check_adjoint(model, x)


def test_resize_refuses_negative_axes_with_aspect_policy() -> None:
    x = rnd(1, 1, 5, 4)
    attrs = {"mode": "linear", "keep_aspect_ratio_policy": "not_larger", "axes": [-2, -1]}
    with pytest.raises(GradientNotImplementedError, match="ignores negative axes"):
        build_gradient(
            resize_model(x, attrs, 18, sizes=i64(8, 3)), trainable=[], inputs_requiring_grad=["in0"]
        )


def test_resize_saves_nothing() -> None:
    """The taps are constants of the backward: nothing of the forward is read."""
    x = rnd(1, 1, 3, 4)
    model = resize_model(x, {"mode": "cubic"}, 18, scales=f32(1, 1, 2, 0.5))
    assert build_gradient(model, trainable=[], inputs_requiring_grad=["in0"]).saved == []


# ---- Resize: scales, sizes and roi known only at run time ---------------------------------------
def run_time(model: onnx.ModelProto, dynamic: bool = False) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model with its non-empty roi, scales and sizes initializers made graph inputs (their
    values returned as feeds); ``dynamic``: every dim of X and Y symbolic too."""
    feeds, keep = {}, []
    for t in model.graph.initializer:
        value = onnx.numpy_helper.to_array(t)
        if t.name != "in0" and value.size:
            feeds[t.name] = value
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    if dynamic:
        for name, value in (("x", model.graph.input[0]), ("y", model.graph.output[0])):
            for i, d in enumerate(value.type.tensor_type.shape.dim):
                d.dim_param = f"{name}{i}"
    return model, feeds


def check_run_time(model_feeds: tuple[onnx.ModelProto, dict[str, np.ndarray]], x: np.ndarray) -> None:
    check_adjoint(model_feeds[0], x, model_feeds[1])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_run_time_scales_match_onnxruntime(transform: str, mode: str, dynamic: bool) -> None:
    """Scales (and roi) fed at run time: the interpolation matrices are built by the backward from
    them, and must be the transpose of onnxruntime's forward for every mode and transformation."""
    x = rnd(2, 1, 5, 4, dtype=F32)
    for static in _resize_models(x, transform, mode):
        model, feeds = run_time(static, dynamic)
        check_adjoint(model, x, feeds)


def test_resize_run_time_other_forms_match_onnxruntime() -> None:
    x = rnd(2, 1, 5, 4, dtype=F32)
    # sizes at run time, with axes, aspect policies and negative axes
    check_run_time(run_time(resize_model(x, {"mode": "linear", "axes": [2, 3]}, 18, sizes=i64(7, 3))), x)
    for policy in ("not_larger", "not_smaller"):
        attrs = {"mode": "linear", "keep_aspect_ratio_policy": policy, "axes": [2, 3]}
        model, feeds = run_time(resize_model(x, attrs, 18, sizes=i64(8, 3)), dynamic=True)
        check_adjoint(model, x, feeds)
    model, feeds = run_time(resize_model(x, {"mode": "cubic", "axes": [-1, -2]}, 18, sizes=i64(3, 8)))
    check_adjoint(model, x, feeds)
    for nearest in ("round_prefer_floor", "floor"):
        attrs = {"nearest_mode": nearest, "axes": [2, 3]}
        model, feeds = run_time(resize_model(x, attrs, 18, sizes=i64(9, 2)), dynamic=True)
        check_adjoint(model, x, feeds)
    # opset 10 and Upsample-9 (nearest truncates up, rounds up down), 5-D and 3-D inputs
    for mode in ("nearest", "linear"):
        for scales in (f32(1, 1, 1.7, 2.5), f32(1, 1, 0.6, 0.75)):
            check_run_time(run_time(resize_model(x, {"mode": mode}, 10, scales=scales)), x)
            if scales.min() >= 1:  # Upsample only scales up
                upsample = node_model("Upsample", [x, scales], attrs={"mode": mode}, opset=9, constant=[1])
                check_run_time(run_time(upsample), x)
    x5 = rnd(2, 1, 3, 4, 2, dtype=F32)
    check_run_time(
        run_time(resize_model(x5, {"mode": "linear"}, 18, scales=f32(1, 1, 1.5, 0.5, 2)), True), x5
    )
    x2 = rnd(2, 4, 3, dtype=F32)
    model = resize_model(x2, {"mode": "linear", "axes": [1, 2]}, 18, scales=f32(1.5, 2))
    check_run_time(run_time(model), x2)
    # no dim changes size: onnxruntime copies X whatever the scales; a roi at run time
    for scales in (f32(1, 1, 1.1, 1.1), f32(1, 1, 1.1, 2), f32(1, 1, 1, 2)):
        check_run_time(run_time(resize_model(x, {"mode": "cubic"}, 18, scales=scales)), x)
    crop = {"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize"}
    check_run_time(run_time(resize_model(x, crop, 18, roi=ROI, scales=f32(1, 1, 1, 2))), x)


TF_NN_SCALES = [f32(1, 1, 1.5, 0.7), f32(1, 1, 0.6, 2.5), f32(1, 1, 1.7, 1), f32(1, 1, 1, 0.5)]


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_run_time_tf_half_pixel_for_nn_matches_onnxruntime(opset: int, nearest_mode: str) -> None:
    """tf_half_pixel_for_nn ((i + 1/2) / scale, then the nearest mode) with scales then sizes fed at
    run time, static and symbolic dims; scales of 1 on one resized axis (onnxruntime copies it)."""
    x = rnd(2, 1, 5, 4, dtype=F32)
    attrs = {"coordinate_transformation_mode": "tf_half_pixel_for_nn", "nearest_mode": nearest_mode}
    for dynamic in (False, True):
        for scales in TF_NN_SCALES:
            check_run_time(run_time(resize_model(x, attrs, opset, scales=scales), dynamic), x)
        for sizes in (i64(20, 1, 7, 3), i64(20, 1, 3, 10)):  # check_adjoint's batch: 1 * 5 * 4
            check_run_time(run_time(resize_model(x, attrs, opset, sizes=sizes), dynamic), x)


def test_resize_computed_scales_tf_half_pixel_for_nn_matches_onnxruntime() -> None:
    """Scales computed in the graph, Concat(ones, hw) with hw a graph input: the rule reads them at
    run time too."""
    x = rnd(2, 1, 5, 4, dtype=F32)
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Constant", [], ["ones"], value=onnx.numpy_helper.from_array(f32(1, 1), "ones")),
        helper.make_node("Concat", ["ones", "hw"], ["scales"], axis=0),
        helper.make_node(
            "Resize",
            ["in0", "", "scales"],
            ["out0"],
            mode="nearest",
            coordinate_transformation_mode="tf_half_pixel_for_nn",
        ),
    ]
    inputs = [vi("in0", onnx.TensorProto.FLOAT, list(x.shape)), vi("hw", onnx.TensorProto.FLOAT, [2])]
    graph = helper.make_graph(
        nodes, "computed", inputs, [vi("out0", onnx.TensorProto.FLOAT, ["n", 1, "h", "w"])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = testing.ir_version_for(model.opset_import)
    for hw in (f32(1.5, 0.7), f32(0.6, 2.5), f32(1.7, 1)):
        check_adjoint(model, x, {"hw": hw})


def test_resize_constant_scales_symbolic_resized_dims() -> None:
    """Constant scales, resized dims unknown when building: the taps come at run time."""
    x = rnd(2, 1, 5, 4, dtype=F32)
    model = resize_model(x, {"mode": "linear"}, 18, scales=f32(1, 1, 1.7, 0.55))
    for i, d in enumerate(model.graph.input[0].type.tensor_type.shape.dim):
        d.dim_param = f"x{i}"
    check_adjoint(model, x)


@pytest.mark.parametrize("attrs", FD_CASES, ids=lambda a: "-".join(str(v) for v in a.values()))
def test_resize_run_time_finite_differences(attrs: dict[str, Any]) -> None:
    """float64 through onnx.reference, scales then sizes fed at run time, X with symbolic dims."""
    x = rnd(1, 2, 3, 4)
    for model, feeds in (
        run_time(resize_model(x, attrs, 13, scales=f32(1, 1, 2, 0.5)), dynamic=True),
        run_time(resize_model(x, attrs, 18, sizes=i64(1, 2, 6, 2)), dynamic=True),
    ):
        result = check_gradients(model, {"in0": x, **feeds}, wrt=["in0"], backend="reference")
        assert result.ok, result.report()


def test_resize_sizes_computed_from_another_tensor() -> None:
    """The export pattern of feature pyramids: sizes = Shape(x)[:2] ++ Shape(skip)[2:], nearest,
    symbolic dims; gradients of x (and of skip, which the sum also reads), float64 finite differences."""
    vi = helper.make_tensor_value_info
    dims = ["n", "c"]
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"], end=2),
        helper.make_node("Shape", ["skip"], ["ss"], start=2),
        helper.make_node("Concat", ["sx", "ss"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["up"], mode="nearest"),
        helper.make_node("Add", ["up", "skip"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fpn",
        [
            vi("x", onnx.TensorProto.DOUBLE, [*dims, "h", "w"]),
            vi("skip", onnx.TensorProto.DOUBLE, [*dims, "H", "W"]),
        ],
        [vi("y", onnx.TensorProto.DOUBLE, [*dims, "H", "W"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = testing.ir_version_for(model.opset_import)
    check(model, {"x": rnd(2, 3, 3, 4), "skip": rnd(2, 3, 6, 8)}, backend="reference")


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_run_time_antialias_matches_onnxruntime(transform: str, mode: str) -> None:
    """Antialiased filters from run-time scales (windows of run-time width): the transpose of
    onnxruntime's forward, symbolic dims too; axes keeping their size are copied."""
    x = rnd(2, 1, 9, 7, dtype=F32)
    roi = ROI if transform == "tf_crop_and_resize" else None
    opset = 18 if transform != "half_pixel_symmetric" else 19
    for exclude in (0, 1):
        for scales in (f32(1, 1, 0.5, 0.4), f32(1, 1, 0.3, 1.5), f32(1, 1, 1.1, 0.6)):
            attrs = {
                "mode": mode,
                "coordinate_transformation_mode": transform,
                "antialias": 1,
                "exclude_outside": exclude,
            }
            for dynamic in (False, True):
                check_run_time(run_time(resize_model(x, attrs, opset, roi=roi, scales=scales), dynamic), x)


EXACT_SIZES = ((8, 3), (2, 12))  # from 4 x 6: scales 2 and 1/2, coordinates exact in float32
ALIGNED_SIZES = ((7, 11), (7, 3))  # (in - 1) / (out - 1) = 1/2 or 5/2: exact too


@pytest.mark.parametrize(
    ("attrs", "fn", "sizes"),
    [
        (
            {"mode": "linear"},
            lambda x, s: F.interpolate(x, size=s, mode="bilinear", align_corners=False),
            EXACT_SIZES,
        ),
        (
            {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
            lambda x, s: F.interpolate(x, size=s, mode="bilinear", align_corners=True),
            ALIGNED_SIZES,
        ),
        (
            {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
            lambda x, s: F.interpolate(x, size=s, mode="nearest"),
            EXACT_SIZES,
        ),
        (
            {"mode": "nearest", "nearest_mode": "round_prefer_ceil"},
            lambda x, s: F.interpolate(x, size=s, mode="nearest-exact"),
            EXACT_SIZES,
        ),
        (
            {"mode": "cubic"},
            lambda x, s: F.interpolate(x, size=s, mode="bicubic", align_corners=False),
            EXACT_SIZES,
        ),
    ],
    ids=["bilinear", "bilinear-align", "nearest", "nearest-exact", "bicubic"],
)
@DECLARED
def test_resize_versus_torch(
    attrs: dict[str, Any], fn: Callable[..., torch.Tensor], sizes: tuple, dims: Any
) -> None:
    """Constant sizes, X static or with symbolic N, H and W (the taps are then computed at run time)."""
    x = rnd(2, 2, 4, 6)
    for size in sizes:
        model = declared_symbolic(resize_model(x, attrs, 18, sizes=i64(2, 2, *size)), dims)
        versus_torch(model, [x], lambda t, s=size: fn(t, s), backend="reference")


# ---- GridSample ---------------------------------------------------------------------------------
def grid_inputs(n_spatial: int, dtype: Any = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """X (2, 2, 4, 5[, 3]) and a grid reaching past the borders (for the padding modes)."""
    x = rnd(2, 2, 4, 5, 3, dtype=dtype)[..., : 3 if n_spatial == 3 else 1]
    x = x[..., 0] if n_spatial == 2 else x
    grid = rng().uniform(-1.4, 1.4, (2, 3, 2, *(() if n_spatial == 2 else (2,)), n_spatial)).astype(dtype)
    return np.ascontiguousarray(x), grid


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize(("align", "opset"), [(0, 20), (1, 22)])
def test_grid_sample(mode: str, padding: str, align: int, opset: int) -> None:
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    x, grid = grid_inputs(2)
    check(node_model("GridSample", [x, grid], attrs=attrs, opset=opset), {"in0": x, "in1": grid})


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_symbolic_sizes(padding: str) -> None:
    x, grid = grid_inputs(2)
    attrs = {"mode": "linear", "padding_mode": padding, "align_corners": 0}
    check(node_model("GridSample", [x, grid], attrs=attrs, opset=22, dynamic=True), {"in0": x, "in1": grid})


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_volumetric(padding: str) -> None:
    x, grid = grid_inputs(3)
    for mode in ("linear", "nearest"):
        attrs = {"mode": mode, "padding_mode": padding, "align_corners": 0}
        check(node_model("GridSample", [x, grid], attrs=attrs, opset=22), {"in0": x, "in1": grid})


def test_grid_sample_opset_16_float32() -> None:
    """Opset 16 names the mode bilinear; onnxruntime runs it in float32 only."""
    x, grid = grid_inputs(2, F32)
    for mode, padding in (("bilinear", "zeros"), ("bilinear", "reflection"), ("nearest", "border")):
        attrs = {"mode": mode, "padding_mode": padding, "align_corners": 1}
        check(node_model("GridSample", [x, grid], attrs=attrs, opset=16), {"in0": x, "in1": grid})


def test_grid_sample_saves_only_what_it_reads() -> None:
    """dX reads the grid, not X; d grid reads X too."""
    x, grid = grid_inputs(2)
    model = node_model("GridSample", [x, grid], attrs={"mode": "linear"}, opset=20)
    assert "in0" not in build_gradient(model, trainable=[], inputs_requiring_grad=["in0"]).saved
    assert {"in0", "in1"} <= set(build_gradient(model, trainable=[], inputs_requiring_grad=["in1"]).saved)


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize(("align", "opset"), [(0, 20), (1, 22)])
def test_grid_sample_cubic(padding: str, align: int, opset: int) -> None:
    """4 x 4 taps per output, each padded on its own (the coordinate is not clipped)."""
    attrs = {"mode": "cubic", "padding_mode": padding, "align_corners": align}
    x, grid = grid_inputs(2)
    check(node_model("GridSample", [x, grid], attrs=attrs, opset=opset), {"in0": x, "in1": grid})
    model = node_model("GridSample", [x, grid], attrs=attrs, opset=opset, dynamic=True)
    check(model, {"in0": x, "in1": grid})


def test_grid_sample_bicubic_opset_16_float32() -> None:
    x, grid = grid_inputs(2, F32)
    for padding in ("zeros", "border", "reflection"):
        attrs = {"mode": "bicubic", "padding_mode": padding, "align_corners": 0}
        check(node_model("GridSample", [x, grid], attrs=attrs, opset=16), {"in0": x, "in1": grid})


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_versus_torch(mode: str, padding: str, align: bool) -> None:
    x, grid = grid_inputs(2)
    attrs = {
        "mode": {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode),
        "padding_mode": padding,
        "align_corners": int(align),
    }
    model = node_model("GridSample", [x, grid], attrs=attrs, opset=22)
    versus_torch(
        model,
        [x, grid],
        lambda t, gr: F.grid_sample(t, gr, mode=mode, padding_mode=padding, align_corners=align),
        backend="onnxruntime",
    )


# ---- Col2Im -------------------------------------------------------------------------------------
COL2IM_CASES = [
    ({}, (5, 6), (2, 3)),
    ({"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 0, 2]}, (5, 6), (2, 2)),
    ({"strides": [2, 2], "pads": [1, 1, 1, 1]}, (4, 5), (3, 3)),
]


def col2im_input(
    attrs: dict[str, Any], image: tuple[int, int], block: tuple[int, int], dtype: Any
) -> np.ndarray:
    k = len(image)
    s, d = attrs.get("strides", [1] * k), attrs.get("dilations", [1] * k)
    p = attrs.get("pads", [0] * 2 * k)
    blocks = [(image[i] + p[i] + p[k + i] - d[i] * (block[i] - 1) - 1) // s[i] + 1 for i in range(k)]
    return rnd(2, 3 * int(np.prod(block)), int(np.prod(blocks)), dtype=dtype)


@pytest.mark.parametrize(("attrs", "image", "block"), COL2IM_CASES)
def test_col2im(attrs: dict[str, Any], image: tuple[int, int], block: tuple[int, int]) -> None:
    x = col2im_input(attrs, image, block, np.float64)
    check(node_model("Col2Im", [x, i64(*image), i64(*block)], attrs=attrs), {"in0": x}, backend="reference")
    x32 = x.astype(F32)
    check(node_model("Col2Im", [x32, i64(*image), i64(*block)], attrs=attrs), {"in0": x32})


def test_col2im_versus_torch() -> None:
    attrs, image, block = COL2IM_CASES[1]
    x = col2im_input(attrs, image, block, np.float64)
    model = node_model("Col2Im", [x, i64(*image), i64(*block)], attrs=attrs)
    pads = attrs["pads"]

    # torch pads symmetrically: pad the image by (begin, end) = (1, 0) and (0, 2) by hand, then crop
    def fold(t: torch.Tensor) -> torch.Tensor:
        full = (image[0] + pads[0] + pads[2], image[1] + pads[1] + pads[3])
        y = F.fold(t, full, block, dilation=attrs["dilations"], stride=attrs["strides"])
        return y[:, :, pads[0] : pads[0] + image[0], pads[1] : pads[1] + image[1]]

    versus_torch(model, [x], fold, backend="reference")


@pytest.mark.parametrize("which", [(1,), (2,), (1, 2)], ids=["image", "block", "both"])
@pytest.mark.parametrize(("attrs", "image", "block"), COL2IM_CASES)
def test_col2im_run_time_shapes(
    attrs: dict[str, Any], image: tuple[int, int], block: tuple[int, int], which: tuple[int, ...]
) -> None:
    """image_shape and/or block_shape fed at run time: the patch table is built by the backward."""
    for dtype, backend in ((np.float64, "reference"), (F32, "onnxruntime")):
        x = col2im_input(attrs, image, block, dtype)
        model = node_model("Col2Im", [x, i64(*image), i64(*block)], attrs=attrs)
        feeds = {"in0": x}
        for i in which:
            init = next(t for t in model.graph.initializer if t.name == f"in{i}")
            model.graph.initializer.remove(init)
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, [2]))
            feeds[init.name] = onnx.numpy_helper.to_array(init)
        result = check_gradients(model, feeds, wrt=["in0"], backend=backend)
        assert result.ok, result.report()


# ---- AffineGrid ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("size", [[2, 3, 4, 5], [2, 1, 3, 2, 4]])
def test_affine_grid(align_corners: int, size: list[int], dynamic: bool) -> None:
    """``dynamic``: theta's dims symbolic, k read from ``size`` (was refused)."""
    k = len(size) - 2
    theta = rnd(2, k, k + 1)
    attrs = {"align_corners": align_corners}
    check_op("AffineGrid", [theta, np.int64(size)], attrs=attrs, opset=20, dynamic=dynamic)
    # and against torch
    model = node_model("AffineGrid", [theta, np.int64(size)], attrs=attrs, opset=20, dynamic=dynamic)
    graphs = build_gradient(model, inputs_requiring_grad=["in0"])
    cot = rnd(*size[:1], *size[2:], k)
    _, grads = run_gradients(graphs, {"in0": theta}, {"out0": cot})
    tt = torch.tensor(theta, requires_grad=True)
    grid = F.affine_grid(tt, size, align_corners=bool(align_corners))
    (grid * torch.tensor(cot)).sum().backward()
    np.testing.assert_allclose(grads["in0"], tt.grad.numpy(), rtol=1e-10, atol=1e-12)
