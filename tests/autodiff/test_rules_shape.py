"""Gradient rules of shape and data-movement ops, and of ops that stop gradients.

Every check compares with float64 central finite differences (``onnxgrad.testing.check_op``);
``dynamic=True`` gives the float inputs symbolic dims, which exercises the run-time shape paths.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import check_gradients, check_op, node_model
from tests.models import ort_loads_opset

RNG = np.random.default_rng(0)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def away_from(x: np.ndarray, points: list[float], gap: float = 0.05) -> np.ndarray:
    """``x`` with values near ``points`` (kinks) pushed away, so finite differences are exact."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


def model(nodes, inputs, outputs, inits=(), opset: int = 18):
    """A model from nodes, (name, dtype, shape) inputs and outputs, and numpy initializers."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "m",
        [vi(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s) for n, t, s in inputs],
        [vi(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s) for n, t, s in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version_for(m.opset_import)
    return onnx.shape_inference.infer_shapes(m)  # types the outputs left open


def assert_ok(result) -> None:
    assert result.ok, result.report()


# ---- reshapes and permutations ---------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("shape", "target"), [((2, 3, 4), (6, -1)), ((5,), (1, 5, 1)), ((2, 3), (0, 3))])
def test_reshape(shape, target, dynamic):
    check_op("Reshape", [rand(*shape), i64(*target)], dynamic=dynamic)


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


# ---- joining and splitting --------------------------------------------------------------------
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


# ---- picking elements by position --------------------------------------------------------------
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


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "indices", "axis"),
    [
        ((5, 3), np.array([0, 2, 2, 4]), 0),  # duplicates add up
        ((5, 3), np.array([[1, -1], [0, 1]]), 1),  # 2-D and negative indices
        ((2, 4, 3), np.array([3, -4, 0]), -2),
        ((2, 4, 3), np.array(2), 1),  # scalar index drops the axis
        ((2, 4, 3), np.array([[0, 2], [2, 2]], dtype=np.int32), -1),
    ],
)
def test_gather(shape, indices, axis, dynamic):
    check_op("Gather", [rand(*shape), indices], attrs={"axis": axis}, dynamic=dynamic)


def test_gather_with_indices_from_an_input():
    # Token ids fed at run time (an embedding lookup), negative ones included.
    m = model(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        [("ids", np.int64, [2, 3])],
        [("y", np.float64, None)],
        inits={"table": rand(6, 4)},
    )
    assert_ok(check_gradients(m, {"ids": np.array([[0, 5, -1], [2, 2, 0]])}))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "indices"),
    [
        ((4, 3), np.array([[0], [3], [0]])),  # rows, one repeated
        ((4, 3, 2), np.array([[1, 2], [-1, 0], [1, 2]])),  # (row, col) pairs, negative, repeated
        ((3, 2), np.array([[[2, 1]], [[0, 0]]])),  # single elements, batched index shape
    ],
)
def test_gather_nd(shape, indices, dynamic):
    check_op("GatherND", [rand(*shape), indices], dynamic=dynamic)


def test_gather_nd_batch_dims_is_refused():
    m = node_model("GatherND", [rand(2, 3), np.array([[1], [0]])], attrs={"batch_dims": 1})
    with pytest.raises(GradientNotImplementedError, match="batch_dims"):
        onnxgrad.build_gradient(m, inputs_requiring_grad=["in0"])


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "indices", "axis"),
    [
        ((3, 4), np.array([[0, 2, 2], [1, 1, 0], [0, 0, 0]]), 1),
        ((3, 4), np.array([[2, 0, 1, -1], [2, 2, 2, 0]]), 0),
        ((2, 3, 2), np.array([[[1], [0]], [[2], [-3]]]), -2),
    ],
)
def test_gather_elements(shape, indices, axis, dynamic):
    check_op("GatherElements", [rand(*shape), indices], attrs={"axis": axis}, dynamic=dynamic)


# ---- broadcasting, selection, clamping, casts --------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "target"), [((3, 1), (2, 3, 4)), ((4,), (3, 1)), ((2, 3), (2, 3)), ((1, 3), (1, 1))]
)
def test_expand(shape, target, dynamic):
    check_op("Expand", [rand(*shape), i64(*target)], dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("cshape", "ashape", "bshape"),
    [((2, 3), (2, 3), (2, 3)), ((2, 3), (3,), (2, 1)), ((4, 1, 3), (1, 2, 1), ())],
)
def test_where(cshape, ashape, bshape, dynamic):
    cond = RNG.random(cshape) > 0.5
    check_op("Where", [cond, rand(*ashape), rand(*bshape)], dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_clip_bounds_as_inputs(dynamic):
    x = away_from(rand(3, 5) * 2, [-0.5, 0.7])
    lo, hi = np.array(-0.5), np.array(0.7)
    check_op("Clip", [x, lo, hi], opset=18, dynamic=dynamic)  # grads for x, min and max
    # onnxruntime has no float64 kernel for Clip before opset 12
    check_op("Clip", [x, lo, hi], opset=11, constant=[1, 2], dynamic=dynamic, backend="reference")
    check_op("Clip", [x, lo], opset=13, dynamic=dynamic)
    check_op("Clip", [x, None, hi], opset=13, dynamic=dynamic)
    check_op("Clip", [x], opset=13, dynamic=dynamic)


def test_clip_attributes_and_inclusive_bounds():
    x = away_from(rand(4, 3) * 2, [-0.5, 0.7])
    check_op("Clip", [x], attrs={"min": -0.5, "max": 0.7}, opset=6, backend="reference")
    check_op("Clip", [x], attrs={"max": 0.7}, opset=6, backend="reference")
    # at x == min or max the gradient passes (as torch.clamp): check it directly
    m = node_model("Clip", [np.array([-1.0, 0.0, 1.0]), np.array(0.0), np.array(1.0)], constant=[1, 2])
    got = onnxgrad.gradients(m, {"in0": np.array([-1.0, 0.0, 1.0])}, {"out0": np.ones(3)}, wrt=["in0"])
    np.testing.assert_array_equal(got["in0"], [0.0, 1.0, 1.0])


@pytest.mark.parametrize("dynamic", [False, True])
def test_cast(dynamic):
    check_op(
        "Cast",
        [rand(3, 4)],
        attrs={"to": TensorProto.FLOAT},
        output_dtypes=[np.float32],
        dynamic=dynamic,
        eps=1e-2,
        rtol=1e-4,
        atol=1e-5,
    )
    check_op("Cast", [rand(3)], attrs={"to": TensorProto.DOUBLE}, dynamic=dynamic)
    check_op("CastLike", [rand(3, 2), np.zeros(1, np.float64)], constant=[1], opset=15)


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


# ---- padding -----------------------------------------------------------------------------------
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


# ---- ops that stop gradients -------------------------------------------------------------------
def test_nondifferentiable_ops_in_the_path():
    # y = Where(x > 0, x, zeros(shape(x))) + x * Floor(x) * Cast(ArgMax(x)) ; the stopped ops
    # (Shape, ConstantOfShape, Greater, Floor, ArgMax) contribute no gradient.
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node(
            "ConstantOfShape", ["s"], ["z"], value=numpy_helper.from_array(np.zeros(1, np.float64))
        ),
        helper.make_node("Greater", ["x", "z"], ["pos"]),
        helper.make_node("Where", ["pos", "x", "z"], ["relu"]),
        helper.make_node("Floor", ["x"], ["fl"]),
        helper.make_node("ArgMax", ["x"], ["am"], axis=1, keepdims=1),
        helper.make_node("Cast", ["am"], ["amf"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x", "fl"], ["t"]),
        helper.make_node("Mul", ["t", "amf"], ["u"]),
        helper.make_node("Add", ["relu", "u"], ["y"]),
    ]
    m = model(nodes, [("x", np.float64, ["n", 4])], [("y", np.float64, None)])
    x = away_from(away_from(rand(3, 4) * 3, [0.0]), [-2.0, -1.0, 1.0, 2.0])
    assert_ok(check_gradients(m, {"x": x}))
    got = onnxgrad.gradients(m, {"x": x}, {"y": np.ones_like(x)}, wrt=["x"])
    am = np.argmax(x, axis=1)[:, None]
    np.testing.assert_allclose(got["x"], (x > 0) + np.floor(x) * am)


def test_nondiff_declarations():
    ops = onnxgrad.supported_ops()
    for op in (
        "Shape",
        "Size",
        "ConstantOfShape",
        "Equal",
        "ArgMax",
        "Floor",
        "Round",
        "NonZero",
        "RandomNormalLike",
        "BitwiseAnd",
        "Range",
        "OneHot",
        "IsNaN",
    ):
        assert ops[op] == "zero", op
    for op in ("Reshape", "Slice", "Gather", "Pad", "Tile", "Clip", "Where", "DepthToSpace"):
        assert ops[op] == "rule", op
