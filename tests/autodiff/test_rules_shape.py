"""Gradient rules of shape and data-movement ops (rules/shape.py).

Every check compares with float64 central finite differences (``onnxgrad.testing.check_op``);
``dynamic=True`` gives the float inputs symbolic dims, which exercises the run-time shape paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F
from onnx import helper

import onnxgrad
from onnxgrad.testing import check_gradients, check_op, node_model
from tests.autodiff.conftest import DECLARED, assert_ok, model, versus_torch
from tests.autodiff.random_data import rng  # one generator per test (conftest.py)
from tests.models import ort_loads_opset


def rand(*shape: int) -> np.ndarray:
    return rng().standard_normal(shape)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ---- reshapes and permutations ---------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("shape", "target"), [((2, 3, 4), (6, -1)), ((5,), (1, 5, 1)), ((2, 3), (0, 3))])
def test_reshape(shape, target, dynamic):
    check_op("Reshape", [rand(*shape), i64(*target)], dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_reshape_of_an_empty_tensor(dynamic):
    """(0, 3, 4) -> (3, 4, 0) with allowzero: dy goes back to X's shape, whose 0 is a size (the
    backward's Reshape once read it as "copy that dim" and onnxruntime refused it)."""
    x = rand(0, 3, 4)
    m = node_model("Reshape", [x, i64(3, 4, 0)], attrs={"allowzero": 1}, opset=14, dynamic=dynamic)
    grads = onnxgrad.gradients(m, {"in0": x}, {"out0": np.zeros((3, 4, 0))}, wrt=["in0"])
    assert grads["in0"].shape == (0, 3, 4)


def test_reshape_saves_only_a_shape():
    m = node_model("Reshape", [rand(2, 3, 4), i64(-1)], dynamic=True)
    graphs = onnxgrad.build_gradient(m, inputs_requiring_grad=["in0"])
    assert len(graphs.saved) == 1 and graphs.saved[0] != "in0"  # Shape(in0), not in0 itself
    static = onnxgrad.build_gradient(
        node_model("Reshape", [rand(2, 3), i64(-1)]), inputs_requiring_grad=["in0"]
    )
    assert static.saved == []


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dynamic", [False, True])
def test_flatten(axis, dynamic):
    check_op("Flatten", [rand(2, 3, 4)], attrs={"axis": axis}, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_squeeze_unsqueeze_opset_forms(dynamic):
    check_op("Squeeze", [rand(2, 1, 3, 1)], attrs={"axes": [1, -1]}, opset=11, dynamic=dynamic)
    check_op("Squeeze", [rand(2, 1, 3, 1), i64(-3)], opset=18, dynamic=dynamic)
    check_op("Squeeze", [rand(1, 3, 1)], opset=18)  # no axes: every size-1 dim
    check_op("Unsqueeze", [rand(2, 3)], attrs={"axes": [0, -1]}, opset=11, dynamic=dynamic)
    check_op("Unsqueeze", [rand(2, 3), i64(1, 3)], opset=13, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "perm"), [((2, 3), None), ((2, 3, 4), [2, 0, 1]), ((2, 3, 4, 5), [0, 2, 3, 1])]
)
def test_transpose(shape, perm, dynamic):
    attrs = {} if perm is None else {"perm": perm}
    check_op("Transpose", [rand(*shape)], attrs=attrs, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode, dynamic):
    check_op("DepthToSpace", [rand(2, 8, 2, 3)], attrs={"blocksize": 2, "mode": mode}, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_space_to_depth(dynamic):
    check_op("SpaceToDepth", [rand(2, 3, 4, 6)], attrs={"blocksize": 2}, dynamic=dynamic)


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_modes_at_opset_28(mode, dynamic, backend):
    """SpaceToDepth took a mode at opset 28: CRD is undone by DepthToSpace in CRD mode, not DCR."""
    if backend == "onnxruntime" and not ort_loads_opset(28):
        pytest.skip("this onnxruntime loads no opset 28")
    attrs = {"blocksize": 2, "mode": mode}
    check_op("SpaceToDepth", [rand(2, 3, 4, 6)], attrs=attrs, opset=28, dynamic=dynamic, backend=backend)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_at_opset_28(mode):
    if not ort_loads_opset(28):
        pytest.skip("this onnxruntime loads no opset 28")
    check_op("DepthToSpace", [rand(2, 8, 2, 3)], attrs={"blocksize": 2, "mode": mode}, opset=28)


# ---- joining and splitting -------------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shapes", "axis"),
    [
        ([(2, 3), (4, 3)], 0),
        ([(2, 3, 1), (2, 3, 4), (2, 3, 2)], -1),
        ([(2, 1, 3), (2, 5, 3)], 1),
        ([(3, 2)], 0),
    ],
)
def test_concat(shapes, axis, dynamic):
    check_op("Concat", [rand(*s) for s in shapes], attrs={"axis": axis}, dynamic=dynamic)


def test_concat_with_constant_and_empty_pieces():
    check_op("Concat", [rand(2, 3), rand(2, 4)], attrs={"axis": 1}, constant=[0])
    check_op("Concat", [rand(2, 3), rand(0, 3), rand(1, 3)], attrs={"axis": 0})
    check_op("Concat", [rand(2, 3), rand(2, 2)], attrs={"axis": 1}, opset=4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_split_opset_forms(dynamic):
    x = rand(6, 4)
    check_op("Split", [x], attrs={"split": [1, 2, 3]}, n_outputs=3, opset=11, dynamic=dynamic)
    check_op("Split", [x], attrs={"axis": -1}, n_outputs=2, opset=11, dynamic=dynamic)
    check_op("Split", [x, i64(3, 1)], attrs={"axis": 1}, n_outputs=2, opset=13, dynamic=dynamic)
    check_op("Split", [x, i64(2, 4)], n_outputs=2, opset=18, dynamic=dynamic)
    check_op("Split", [x], attrs={"num_outputs": 3}, n_outputs=3, opset=18, dynamic=dynamic)
    check_op("Split", [rand(7, 2)], attrs={"num_outputs": 3}, n_outputs=3, opset=18)  # uneven


@pytest.mark.parametrize("dims", [[3, 4], ["n", 4]])
def test_split_with_unused_outputs_gets_zeros(dims):
    # Only piece 1 reaches an output: the others contribute zeros to dx.
    m = model(
        [
            helper.make_node("Split", ["x", "sizes"], ["a", "b", "c"], axis=0),
            helper.make_node("Neg", ["b"], ["y"]),
        ],
        [("x", np.float64, dims)],
        [("y", np.float64, None)],
        inits={"sizes": i64(1, 1, 1)},
    )
    x = rand(3, 4)
    assert_ok(check_gradients(m, {"x": x}))
    grads = onnxgrad.gradients(m, {"x": x}, {"y": np.ones((1, 4))}, wrt=["x"])
    np.testing.assert_array_equal(grads["x"], [[0] * 4, [-1] * 4, [0] * 4])


# ---- picking elements by position ------------------------------------------------------------
SLICES = [  # starts, ends, axes, steps
    ([1], [3], [0], None),  # unit steps with constant bounds: the Pad path
    ([0, -3], [2, 100], [0, -1], [1, 1]),  # negative start, clamped end
    ([-1], [-100], [1], [-1]),  # reversal with clamped end
    ([3, 0], [0, 5], [0, 1], [-2, 2]),  # negative and large steps
    ([1], [1], [0], None),  # empty
    ([0, 1, 1], [100, 3, -1], None, None),  # default axes
]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("starts", "ends", "axes", "steps"), SLICES)
def test_slice(starts, ends, axes, steps, dynamic):
    inputs = [
        rand(4, 5, 3),
        i64(*starts),
        i64(*ends),
        None if axes is None else i64(*axes),
        None if steps is None else i64(*steps),
    ]
    while inputs[-1] is None:
        inputs.pop()
    check_op("Slice", inputs, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_slice_opset9_attributes(dynamic):
    check_op(
        "Slice",
        [rand(4, 5)],
        attrs={"starts": [1, -4], "ends": [3, 100], "axes": [0, 1]},
        opset=9,
        dynamic=dynamic,
    )
    check_op("Slice", [rand(4, 5)], attrs={"starts": [1], "ends": [-1]}, opset=1)


def test_slice_bounds_computed_at_run_time():
    # starts/ends come from the data's shape: the rule replays them, no constant folding possible
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Div", ["s", "two"], ["half"]),
        helper.make_node("Slice", ["x", "half", "s", "axes", "steps"], ["y"]),
    ]
    m = model(
        nodes,
        [("x", np.float64, ["a", "b"])],
        [("y", np.float64, None)],
        inits={"two": i64(2), "axes": i64(0, 1), "steps": i64(1, 2)},
    )
    assert_ok(check_gradients(m, {"x": rand(5, 6)}))


# ---- broadcasting and repetition -------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "target"), [((3, 1), (2, 3, 4)), ((4,), (3, 1)), ((2, 3), (2, 3)), ((1, 3), (1, 1))]
)
def test_expand(shape, target, dynamic):
    check_op("Expand", [rand(*shape), i64(*target)], dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "repeats"), [((2, 3), (2, 3)), ((2, 1, 3), (1, 4, 1)), ((3,), (1,)), ((2, 2), (3, 1))]
)
def test_tile(shape, repeats, dynamic):
    check_op("Tile", [rand(*shape), i64(*repeats)], dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "repeats"), [((2, 3), (2, 3)), ((2, 1, 3), (1, 4, 1)), ((3,), (1,)), ((2, 2), (3, 1))]
)
def test_tile_run_time_repeats(shape, repeats, dynamic):
    """Repeats fed as an input (not an initializer): read at run time, both x and r inputs."""
    dims = [f"d{i}" for i in range(len(shape))] if dynamic else list(shape)
    m = model(
        [helper.make_node("Tile", ["x", "r"], ["y"])],
        [("x", np.float64, dims), ("r", np.int64, [len(shape)])],
        [("y", np.float64, None)],
    )
    res = check_gradients(m, {"x": rand(*shape), "r": i64(*repeats)}, wrt=["x"])
    assert res.ok, res.report()


def test_tile_repeats_computed_in_the_graph():
    """Repeats made from another input's shape, as exporters write tile-to-batch."""
    nodes = [
        helper.make_node("Shape", ["b"], ["bs"], end=1),
        helper.make_node("Concat", ["bs", "one"], ["r"], axis=0),
        helper.make_node("Tile", ["x", "r"], ["y"]),
    ]
    m = model(
        nodes,
        [("x", np.float64, [1, 3]), ("b", np.float64, ["n", 2])],
        [("y", np.float64, None)],
        inits={"one": i64(1)},
    )
    res = check_gradients(m, {"x": rand(1, 3), "b": rand(4, 2)}, wrt=["x"])
    assert res.ok, res.report()


# ---- padding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("pads", [(1, 0, 2, 3), (0, -1, 1, 2), (-1, -2, 0, 0)])
def test_pad_constant(pads, dynamic):
    x = rand(3, 4)
    check_op("Pad", [x, i64(*pads)], dynamic=dynamic)
    check_op("Pad", [x, i64(*pads), np.array(0.5)], opset=11, dynamic=dynamic)  # d(value) too
    check_op("Pad", [x], attrs={"pads": list(pads), "value": 0.5}, opset=2, dynamic=dynamic)


def test_pad_axes_input_and_run_time_pads():
    check_op("Pad", [rand(2, 3, 4), i64(1, -1, 2, 0), None, i64(-1, 0)], opset=18, dynamic=True)
    # pads computed in the forward graph (from the data's shape)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Sub", ["s", "one"], ["p"]),
        helper.make_node("Concat", ["p", "zero"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["y"]),
    ]
    m = model(
        nodes,
        [("x", np.float64, ["a", "b"])],
        [("y", np.float64, None)],
        inits={"one": i64(1), "zero": i64(0, 0)},
    )
    assert_ok(check_gradients(m, {"x": rand(3, 2)}))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("mode", "opset"), [("reflect", 18), ("edge", 18), ("edge", 11), ("wrap", 19)])
def test_pad_reflect_edge_wrap(mode, opset, dynamic):
    pads = i64(2, 1, 1, 3)  # wrap and edge repeat elements: their gradients add up
    check_op("Pad", [rand(4, 5), pads], attrs={"mode": mode}, opset=opset, dynamic=dynamic)
    if mode != "wrap":
        check_op("Pad", [rand(4, 5)], attrs={"mode": mode, "pads": [2, 1, 1, 3]}, opset=2)


@DECLARED
@pytest.mark.parametrize(
    ("mode", "pads", "opset"),
    [
        ("constant", (0, 0, 1, 2, 0, 0, 2, 1), 18),
        ("constant", (0, 0, -1, 2, 0, 0, 1, -2), 18),  # negative pads crop
        ("reflect", (0, 0, 1, 2, 0, 0, 2, 1), 18),
        ("edge", (0, 0, 1, 2, 0, 0, 2, 1), 18),
        ("wrap", (0, 0, 1, 2, 0, 0, 2, 1), 19),
    ],
    ids=["constant", "crop", "reflect", "edge", "wrap"],
)
def test_pad_versus_torch(mode: str, pads: tuple, opset: int, dims) -> None:
    """F.pad with static and symbolic N, H and W: ONNX pads (begins, then ends) are torch's
    (W begin, W end, H begin, H end)."""
    torch_mode = {"edge": "replicate", "wrap": "circular"}.get(mode, mode)
    torch_pads = (pads[3], pads[7], pads[2], pads[6])
    versus_torch(
        "Pad",
        [rand(2, 3, 5, 6), i64(*pads)],
        {"mode": mode},
        lambda t, _: F.pad(t, torch_pads, mode=torch_mode),
        opset=opset,
        needs=[0],
        dims=dims,
    )


@DECLARED
@pytest.mark.parametrize(
    ("starts", "ends", "axes", "steps", "index"),
    [
        ([1, -5], [-1, 100], [2, 3], [1, 2], (slice(None), slice(None), slice(1, -1), slice(1, None, 2))),
        ([-1, 0], [-100, 3], [2, 1], [-1, 1], (slice(None), slice(0, 3), slice(None), slice(None))),
    ],
    ids=["clamped-strided", "reversed"],
)
def test_slice_versus_torch(starts, ends, axes, steps, index, dims) -> None:
    """Bounds past the ends and negative ones, static and symbolic dims; torch has no negative
    steps, so a reversal is a flip."""
    reverse = [a for a, st in zip(axes, steps) if st < 0]
    versus_torch(
        "Slice",
        [rand(2, 3, 5, 6), i64(*starts), i64(*ends), i64(*axes), i64(*steps)],
        {},
        lambda t, *_: (t.flip(reverse) if reverse else t)[index],
        needs=[0],
        dims=dims,
    )


# ---- ReverseSequence, CenterCropPad ----------------------------------------------------------
@pytest.mark.parametrize(("batch_axis", "time_axis"), [(1, 0), (0, 1)])
def test_reverse_sequence(batch_axis: int, time_axis: int) -> None:
    x = rand(4, 3, 2) if batch_axis == 1 else rand(3, 4, 2)
    lens = i64(4, 1, 2) if batch_axis == 1 else i64(1, 4, 3)
    attrs = {"batch_axis": batch_axis, "time_axis": time_axis}
    check_op("ReverseSequence", [x, lens], attrs=attrs, opset=10)
    check_op("ReverseSequence", [x, lens], attrs=attrs, opset=10, dynamic=True)


@pytest.mark.parametrize(
    ("shape", "target", "axes"),
    [((5, 4), (3, 7), None), ((2, 5, 6), (4, 3), [1, 2]), ((2, 5, 6), (8,), [-2]), ((3, 4), (3, 4), None)],
)
def test_center_crop_pad(shape: tuple[int, ...], target: tuple[int, ...], axes: list[int] | None) -> None:
    attrs = {} if axes is None else {"axes": axes}
    check_op("CenterCropPad", [rand(*shape), i64(*target)], attrs=attrs)
    check_op("CenterCropPad", [rand(*shape), i64(*target)], attrs=attrs, dynamic=True)
