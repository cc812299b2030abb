"""Values fixed by constants and static shapes (``onnxgrad.model.fold``): what shape inference and
the gradient rules learn from them, and what stays unknown."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.fold import MAX_ELEMENTS, known_values
from onnxgrad.model.graph import ValueInfo, ir_version_for
from onnxgrad.model.infer import infer_value_infos
from onnxgrad.testing import assert_allclose_scaled


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value)))


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, initializer=list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version_for(m.opset_import)
    return m


def _reshape_by_mod_chain():
    """torch's MultiheadAttention pattern: Reshape(x + w, Concat(Shape(x)[:(-1 + 3) % 3], [3, 4]))
    keeps the first two dims and splits the last, then Gather picks along axis 0."""
    w = np.random.default_rng(0).standard_normal((1, 1, 12)).astype(np.float32)
    nodes = [
        _const("minus1", np.array([-1], np.int64)),
        _const("three", np.array([3], np.int64)),
        helper.make_node("Add", ["minus1", "three"], ["two_raw"]),
        helper.make_node("Mod", ["two_raw", "three"], ["two"]),
        helper.make_node("Shape", ["x"], ["xshape"]),
        _const("zero", np.array([0], np.int64)),
        helper.make_node("Slice", ["xshape", "zero", "two"], ["lead"]),
        _const("split", np.array([3, 4], np.int64)),
        helper.make_node("Concat", ["lead", "split"], ["target"], axis=0),
        helper.make_node("Add", ["x", "w"], ["xw"]),
        helper.make_node("Reshape", ["xw", "target"], ["r"]),
        _const("idx", np.array(1, np.int64)),
        helper.make_node("Gather", ["r", "idx"], ["y"], axis=0, name="pick"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, None])
    return _model(nodes, [x], [y], [numpy_helper.from_array(w, "w")])


def test_rank_from_a_constant_chain_onnx_does_not_follow():
    m = _reshape_by_mod_chain()
    before = m.SerializeToString()
    infos = infer_value_infos(m)
    assert m.SerializeToString() == before  # folded in the copy inference works on, not in the model
    assert infos["two"].shape == (1,)
    assert infos["r"].shape == ("a", "b", 3, 4)
    assert infos["y"].rank == 3
    x = np.random.default_rng(1).standard_normal((2, 3, 12)).astype(np.float32)
    gy = np.random.default_rng(2).standard_normal((3, 3, 4)).astype(np.float32)
    got = onnxgrad.gradients(m, {"x": x}, {"y": gy}, wrt=["w", "x"])
    dr = np.zeros((2, 3, 3, 4), np.float32)
    dr[1] = gy
    np.testing.assert_allclose(got["x"], dr.reshape(2, 3, 12), rtol=1e-6)
    assert_allclose_scaled(got["w"], dr.reshape(2, 3, 12).sum((0, 1), keepdims=True), rtol=1e-6)


def test_computed_axes_are_copied_into_the_backward_not_saved():
    graphs = onnxgrad.build_gradient(_reshape_by_mod_chain())
    assert "two" not in graphs.saved and "target" not in graphs.saved


def test_truly_unknown_rank_keeps_its_error():
    """A shape fed at run time: nothing fixes the rank of the Reshape, so Gather refuses."""
    nodes = [
        helper.make_node("Reshape", ["w", "s"], ["r"]),
        _const("idx", np.array(0, np.int64)),
        helper.make_node("Gather", ["r", "idx"], ["y"], axis=0, name="pick"),
    ]
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])
    w = numpy_helper.from_array(np.ones((2, 6), np.float32), "w")
    with pytest.raises(GradientNotImplementedError) as err:
        onnxgrad.build_gradient(_model(nodes, [s], [y], [w]))
    assert str(err.value) == (
        "Gather 'pick': the rank of input 'r' must be known; it is the output of node '' (op 'Reshape', "
        "domain 'ai.onnx'), whose output rank shape inference could not tell"
    )


def test_overridable_initializer_is_not_a_constant():
    """An initializer also declared as an input may be fed another value: not known."""
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [helper.make_node("Unsqueeze", ["axes", "axes"], ["u"])]
    graph = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("u", TensorProto.INT64, None)],
        initializer=[axes],
    )
    assert "u" not in known_values(graph, {}, 17)
    graph.ClearField("input")
    assert known_values(graph, {}, 17)["u"].tolist() == [[0]]


def _eval(node: onnx.NodeProto, opset: int = 17, **inputs) -> np.ndarray | None:
    nodes = [_const(k, v) for k, v in inputs.items()] + [node]
    graph = helper.make_graph(nodes, "g", [], [])
    return known_values(graph, {}, opset).get(node.output[0])


def _n(op: str, *inputs: str, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), ["y"], **attrs)


A = np.array
SEVENS = numpy_helper.from_array(A([7], np.int64))


@pytest.mark.parametrize(
    ("node", "inputs", "want"),
    [
        (_n("Div", "a", "b"), {"a": A([-7, 7]), "b": A([2, -2])}, [-3, -3]),
        (_n("Mod", "a", "b"), {"a": A([-1, 5]), "b": A([3, 3])}, [2, 2]),
        (_n("Mod", "a", "b", fmod=1), {"a": A([-1.5, 5.0]), "b": A([1.0, 3.0])}, [-0.5, 2.0]),
        (
            _n("Slice", "a", "s", "e", "ax", "st"),
            {"a": np.arange(5), "s": A([-1]), "e": A([-100]), "ax": A([0]), "st": A([-2])},
            [4, 2, 0],
        ),
        (_n("Slice", "a", "s", "e"), {"a": np.arange(5), "s": A([1]), "e": A([2**62])}, [1, 2, 3, 4]),
        (_n("Range", "a", "b", "c"), {"a": A(1), "b": A(8), "c": A(3)}, [1, 4, 7]),
        (_n("Where", "c", "a", "b"), {"c": A([True, False]), "a": A([1, 2]), "b": A([3, 4])}, [1, 4]),
        (_n("ConstantOfShape", "a", value=SEVENS), {"a": A([2])}, [7, 7]),
        (_n("Gather", "a", "i", axis=0), {"a": A([5, 6, 7]), "i": A([-1, 0])}, [7, 5]),
        (_n("Squeeze", "a", "ax"), {"a": A([[3]]), "ax": A([0])}, [3]),
        (_n("ReduceProd", "a", keepdims=0), {"a": A([2, 3, 4])}, 24),
    ],
)
def test_evaluated_like_onnx(node, inputs, want):
    got = _eval(node, **inputs)
    assert got is not None
    assert got.tolist() == want


def test_what_stays_unknown():
    big = helper.make_node("ConstantOfShape", ["s"], ["y"])
    assert _eval(big, s=np.array([MAX_ELEMENTS + 1])) is None  # too large to follow
    assert _eval(helper.make_node("Div", ["a", "b"], ["y"]), a=np.array([1]), b=np.array([0])) is None
    assert _eval(helper.make_node("Gather", ["a", "i"], ["y"]), a=np.array([1, 2]), i=np.array([2])) is None
    shape = helper.make_node("Shape", ["x"], ["y"])
    graph = helper.make_graph([shape], "g", [], [])
    assert known_values(graph, {"x": ValueInfo("x", TensorProto.FLOAT, ("n", 3))}, 17) == {}
    assert known_values(graph, {"x": ValueInfo("x", TensorProto.FLOAT, (2, 3))}, 17)["y"].tolist() == [2, 3]


def test_folded_inside_subgraphs_with_outer_constants():
    """An If branch reshapes with a shape computed from a constant of the enclosing graph."""
    branch_nodes = [
        helper.make_node("Add", ["minus1", "three"], ["two_raw"]),
        helper.make_node("Mod", ["two_raw", "three"], ["two"]),
        helper.make_node("Concat", ["two", "three"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
    ]
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, None)
    then = helper.make_graph(branch_nodes, "then", [], [out])
    other = helper.make_graph(
        [helper.make_node("Reshape", ["x", "six"], ["r2"])],
        "else",
        [],
        [helper.make_tensor_value_info("r2", TensorProto.FLOAT, None)],
    )
    nodes = [
        _const("minus1", np.array([-1], np.int64)),
        _const("three", np.array([3], np.int64)),
        _const("six", np.array([2, 3], np.int64)),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
    ]
    m = _model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])])
    infos = infer_value_infos(m)
    assert infos["r"].shape == (2, 3)
    assert infos["y"].rank == 2


def test_second_round_uses_inferred_static_shapes():
    """Shape of an intermediate value, static only once inference has run, then Mod: ONNX data
    propagation stops at Mod, so the first round leaves the Reshape's rank unknown; the second
    folds the chain from the inferred shape."""
    nodes = [
        helper.make_node("Add", ["x", "w"], ["xw"]),
        helper.make_node("Shape", ["xw"], ["s"]),
        helper.make_node("Shape", ["xw"], ["cols"], start=1),  # [4]
        _const("three", np.array([3], np.int64)),
        helper.make_node("Mod", ["cols", "three"], ["end"]),  # 4 % 3 = 1
        _const("zero", np.array([0], np.int64)),
        helper.make_node("Slice", ["s", "zero", "end"], ["rows"]),  # [6]
        _const("split", np.array([2, 2], np.int64)),
        helper.make_node("Concat", ["rows", "split"], ["target"], axis=0),
        helper.make_node("Reshape", ["xw", "target"], ["r"]),
        _const("idx", np.array(1, np.int64)),
        helper.make_node("Gather", ["r", "idx"], ["y"], axis=0),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])
    w = numpy_helper.from_array(np.ones((6, 4), np.float32), "w")
    m = _model(nodes, [x], [y], [w])
    assert infer_value_infos(m)["r"].shape == (6, 2, 2)
    gy = np.arange(4, dtype=np.float32).reshape(2, 2)
    got = onnxgrad.gradients(m, {"x": np.zeros((6, 4), np.float32)}, {"y": gy}, wrt=["w"])
    want = np.zeros((6, 4), np.float32)
    want[1] = gy.reshape(-1)
    np.testing.assert_array_equal(got["w"], want)
