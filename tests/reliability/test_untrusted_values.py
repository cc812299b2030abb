"""Untrusted models whose allocations come from values, not declared shapes: pads, scales, output
shapes and image shapes computed by small graphs or picked by an If, refused before anything is
built; and the other loading gaps: subgraph counts, control-flow arity, training information and
external data without a length.

The entry points run in a child process whose address space and CPU time are capped (see
``test_untrusted.py``): a model that slips through shows up as a killed child, not a dead session.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.errors import InputError, ModelError
from onnxgrad.model import Limits, check_model_safety, load_untrusted
from onnxgrad.model.fold import possible_values
from onnxgrad.model.graph import ir_version_for
from onnxgrad.model.limits import DEFAULT_MAX_SUBGRAPHS, default_limits
from onnxgrad.model.validate import check_structure
from tests.models import make_model
from tests.reliability._util import run_isolated

BIG = 1 << 40
LIMITS = Limits(max_tensor_bytes=16 << 30, max_total_bytes=16 << 30)  # the defaults on a large machine


def _i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _through_identity(
    node: onnx.NodeProto,
    inputs: list[tuple[str, Any, list[Any]]],
    consts: dict[str, np.ndarray],
    rank: int = 4,
) -> onnx.ModelProto:
    """y = node(...), where every constant ``c`` reaches the node as Identity(c0): ONNX shape
    inference (without data propagation) does not see its value, onnxgrad's folding does."""
    ids = [helper.make_node("Identity", [f"{k}0"], [k]) for k in consts]
    inits = {f"{k}0": v for k, v in consts.items()}
    return make_model([*ids, node], inputs, [("y", np.float32, ["?"] * rank)], inits)


def _pad() -> onnx.ModelProto:
    node = helper.make_node("Pad", ["x", "p"], ["y"])
    return _through_identity(node, [("x", np.float32, [2, 2])], {"p": _i64(0, 0, BIG >> 1, 0)}, rank=2)


def _pad_axes() -> onnx.ModelProto:
    node = helper.make_node("Pad", ["x", "p", "", "a"], ["y"])
    consts = {"p": _i64(1 << 36, 1 << 36), "a": _i64(-1)}
    return _through_identity(node, [("x", np.float32, ["N", 1 << 20])], consts, rank=2)


def _resize(scales: list[float], **attrs: Any) -> Callable[[], onnx.ModelProto]:
    def build() -> onnx.ModelProto:
        node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest", **attrs)
        consts = {"s": np.array(scales, np.float32)}
        return _through_identity(node, [("x", np.float32, [1, 1, 4, "W"])], consts)

    return build


def _upsample() -> onnx.ModelProto:
    node = helper.make_node("Upsample", ["x", "s"], ["y"], mode="nearest")
    model = _through_identity(
        node, [("x", np.float32, [1, 1, 4, 4])], {"s": np.array([1, 1, 2.0**19, 2.0**19])}
    )
    model.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(np.array([1, 1, 2**19, 2**19], np.float32), "s0")
    )
    model.opset_import[0].version = 9
    model.ir_version = 4
    return model


def _max_unpool() -> onnx.ModelProto:
    node = helper.make_node("MaxUnpool", ["x", "i", "s"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    inputs = [("x", np.float32, [1, 1, 2, 2]), ("i", np.int64, [1, 1, 2, 2])]
    return _through_identity(node, inputs, {"s": _i64(1, 1, 1 << 20, 1 << 20)})


def _center_crop_pad() -> onnx.ModelProto:
    node = helper.make_node("CenterCropPad", ["x", "s"], ["y"], axes=[0, 1])
    return _through_identity(node, [("x", np.float32, [2, 2])], {"s": _i64(1 << 20, 1 << 20)}, rank=2)


def _col2im(image: list[int], block: list[int]) -> Callable[[], onnx.ModelProto]:
    """Y = Col2Im(x * W): W trains, so the gradient builder reaches the Col2Im rule."""

    def build() -> onnx.ModelProto:
        nodes = [
            helper.make_node("Identity", ["im0"], ["im"]),
            helper.make_node("Identity", ["bl0"], ["bl"]),
            helper.make_node("Mul", ["x", "W"], ["xw"]),
            helper.make_node("Col2Im", ["xw", "im", "bl"], ["y"]),
        ]
        inits = {"im0": _i64(*image), "bl0": _i64(*block), "W": np.ones(1, np.float32)}
        return make_model(nodes, [("x", np.float32, [1, "CK", "L"])], [("y", np.float32, ["?"] * 4)], inits)

    return build


def _dft() -> onnx.ModelProto:
    node = helper.make_node("DFT", ["x", "n"], ["y"], axis=1)
    return _through_identity(node, [("x", np.float32, [1, 8, 1])], {"n": np.array(BIG, np.int64)}, rank=3)


def _window() -> onnx.ModelProto:
    node = helper.make_node("HannWindow", ["n"], ["y"])
    return _through_identity(node, [], {"n": np.array(BIG, np.int64)}, rank=1)


def _affine_grid() -> onnx.ModelProto:
    node = helper.make_node("AffineGrid", ["theta", "size"], ["y"])
    consts = {"size": _i64(1, 1, 1 << 20, 1 << 20)}
    return _through_identity(node, [("theta", np.float32, [1, 2, 3])], consts)


def _via(
    op: str,
    inputs: list[str],
    consts: dict[str, np.ndarray],
    x: list | None = None,
    opset: int = 18,
    **attrs: Any,
):
    """A builder of y = op(inputs), each constant through an Identity, x float32 of shape ``x``."""

    def build() -> onnx.ModelProto:
        node = helper.make_node(op, inputs, ["y"], **attrs)
        graph_inputs = [("x", np.float32, x)] if x is not None else []
        model = _through_identity(node, graph_inputs, consts, rank=len(x) if x else 1)
        model.opset_import[0].version = opset
        model.ir_version = ir_version_for(model.opset_import)
        return model

    return build


def _branch(name: str, value: np.ndarray) -> onnx.GraphProto:
    out = f"{name}_out"
    node = helper.make_node("Constant", [], [out], value=numpy_helper.from_array(value))
    return helper.make_graph([node], name, [], [helper.make_tensor_value_info(out, TensorProto.INT64, [1])])


def _if_shape(then: int, other: int, cond: bool | None = None) -> onnx.ModelProto:
    """y = ConstantOfShape(If(c, [then], [other])), ``c`` an input (None) or a constant."""
    nodes = [
        helper.make_node(
            "If",
            ["c"],
            ["s"],
            then_branch=_branch("then", _i64(then)),
            else_branch=_branch("else", _i64(other)),
        ),
        helper.make_node("ConstantOfShape", ["s"], ["y"]),
    ]
    inputs = [("c", np.bool_, [])] if cond is None else []
    if cond is not None:
        nodes.insert(
            0, helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(cond)))
        )
    return make_model(nodes, inputs, [("y", np.float32, ["?"])])


def _if_in_loop() -> onnx.ModelProto:
    """A Loop body computing ConstantOfShape(Mul(If(...), [2**20])): the If is nested, its result
    goes through arithmetic, and a branch holds the large value only multiplied out."""
    branch_if = helper.make_node(
        "If", ["c"], ["s"], then_branch=_branch("then", _i64(1)), else_branch=_branch("else", _i64(1 << 20))
    )
    body = helper.make_graph(
        [
            branch_if,
            helper.make_node("Mul", ["s", "k"], ["s2"]),
            helper.make_node("ConstantOfShape", ["s2"], ["big"]),
            helper.make_node("ReduceSum", ["big"], ["t"], keepdims=0),
            helper.make_node("Add", ["v", "t"], ["v2"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v2", TensorProto.FLOAT, []),
        ],
        initializer=[numpy_helper.from_array(_i64(1 << 20), "k")],
    )
    loop = helper.make_node("Loop", ["n", "", "v0"], ["y"], body=body)
    return make_model(
        [loop], [("n", np.int64, []), ("c", np.bool_, []), ("v0", np.float32, [])], [("y", np.float32, [])]
    )


TIB4 = r"of float32: 4\.0 TiB, over the limit"
SHAPE = "would create a tensor of shape"
VALUE_SHAPES: dict[str, tuple[Callable[[], onnx.ModelProto], str]] = {
    # case: (model, what the message says)
    "Pad with pads through Identity": (_pad, rf"a Pad node {SHAPE} \[549755813890, 2\] of float32"),
    "Pad on an axis through Identity": (_pad_axes, rf"a Pad node {SHAPE} \[1, 137440002048\]"),
    "Resize with scales": (
        _resize([1, 1, 2**19, 2**19]),
        rf"a Resize node {SHAPE} \[1, 1, 2097152, 524288\]",
    ),
    "Resize with scales on axes": (
        _resize([2**19, 2**19], axes=[2, 3]),
        rf"a Resize node {SHAPE} \[1, 1, 2097152, 524288\]",
    ),
    "Upsample with scales": (_upsample, rf"an Upsample node {SHAPE} \[1, 1, 2097152, 2097152\]"),
    "MaxUnpool output_shape": (_max_unpool, rf"a MaxUnpool node {SHAPE} \[1, 1, 1048576, 1048576\] {TIB4}"),
    "CenterCropPad": (_center_crop_pad, rf"a CenterCropPad node {SHAPE} \[1048576, 1048576\] {TIB4}"),
    "Col2Im image_shape": (
        _col2im([1 << 20, 1 << 20], [2, 2]),
        rf"a Col2Im node {SHAPE} \[1, 1, 1048576, 1048576\] {TIB4}",
    ),
    "Col2Im gradient table": (
        _col2im([1 << 15, 1 << 15], [1 << 14, 1 << 14]),
        rf"a Col2Im node's gradient \(its table of patch positions\) {SHAPE} \[2, 268435456, 268468225\] "
        "of int64",
    ),
    "DFT length": (_dft, rf"a DFT node {SHAPE} \[1099511627776, 2\]"),
    "HannWindow size": (_window, rf"a HannWindow node {SHAPE} \[1099511627776\] of float32"),
    "AffineGrid size": (_affine_grid, rf"an AffineGrid node {SHAPE} \[1, 1048576, 1048576, 2\]"),
    "Tile through Identity": (
        _via("Tile", ["x", "r"], {"r": _i64(1 << 19, 1 << 20)}, x=[2, 4]),
        rf"a Tile node {SHAPE} \[8, 524288, 1048576\] of float32: 16\.0 TiB",
    ),
    "Expand through Identity": (
        _via("Expand", ["x", "s"], {"s": _i64(1 << 20, -1, 1 << 20)}, x=[1, 1, 1]),
        rf"an Expand node {SHAPE} \[1048576, 1048576\] of float32",
    ),
    "Reshape through Identity": (
        _via("Reshape", ["x", "s"], {"s": _i64(0, 1 << 20, 1 << 20)}, x=[1, 1, 1]),
        rf"a Reshape node {SHAPE} \[1048576, 1048576\] of float32",
    ),
    "Range through Identity": (
        _via("Range", ["a", "b", "d"], {"a": np.array(5), "b": np.array(BIG + 5), "d": np.array(2)}),
        rf"a Range node {SHAPE} \[549755813888\] of float32",
    ),
    "OneHot through Identity": (
        _via(
            "OneHot",
            ["i", "n", "v"],
            {"i": _i64(1, 2), "n": _i64(BIG), "v": np.array([0.0, 1.0], np.float32)},
        ),
        rf"an OneHot node {SHAPE} \[2, 1099511627776\]",
    ),
    "ConstantOfShape of int64 through Identity": (
        _via("ConstantOfShape", ["s"], {"s": _i64(1 << 20, 1 << 20)}, value=numpy_helper.from_array(_i64(7))),
        rf"a ConstantOfShape node {SHAPE} \[1048576, 1048576\] of int64: 8\.0 TiB",
    ),
    "Resize sizes through Identity": (
        _via("Resize", ["x", "", "", "s"], {"s": _i64(1, 1, 1 << 20, 1 << 20)}, x=[1, 1, 4, 4]),
        rf"a Resize node {SHAPE} \[1, 1, 1048576, 1048576\] of float32",
    ),
    "Resize sizes on axes through Identity": (
        _via("Resize", ["x", "", "", "s"], {"s": _i64(1 << 20, 1 << 20)}, x=[1, 3, 4, 4], axes=[2, 3]),
        rf"a Resize node {SHAPE} \[1, 3, 1048576, 1048576\] of float32",
    ),
    "Resize 10 with scales second": (
        _via(
            "Resize",
            ["x", "s"],
            {"s": np.array([1, 1, 2.0**19, 2.0**19], np.float32)},
            x=[1, 1, 4, 4],
            opset=10,
        ),
        rf"a Resize node {SHAPE} \[1, 1, 2097152, 2097152\] of float32",
    ),
    "ConstantOfShape fed by an If": (
        lambda: _if_shape(4, BIG),
        rf"a ConstantOfShape node {SHAPE} \[{BIG}\] {TIB4}",
    ),
    "ConstantOfShape fed by an If's then branch": (lambda: _if_shape(BIG, 4), rf"{SHAPE} \[{BIG}\] {TIB4}"),
    "ConstantOfShape of an If chosen by a constant": (
        lambda: _if_shape(BIG, 4, cond=True),
        rf"{SHAPE} \[{BIG}\] {TIB4}",
    ),
    "an If in a Loop body, multiplied": (
        _if_in_loop,
        rf"a ConstantOfShape node in the 'body' graph of node '' {SHAPE} \[{BIG}\]",
    ),
}


@pytest.mark.parametrize("case", list(VALUE_SHAPES))
def test_validator_refuses_sizes_that_values_give(case):
    build, message = VALUE_SHAPES[case]
    with pytest.raises(ModelError, match=message) as info:
        check_model_safety(build(), limits=LIMITS)
    assert "corrupt or hostile" in str(info.value) and "ONNXGRAD_MAX_TENSOR_BYTES" in str(info.value)


SMALL = {
    "Pad": lambda: _through_identity(
        helper.make_node("Pad", ["x", "p"], ["y"]),
        [("x", np.float32, [2, 2])],
        {"p": _i64(1, 1, 1, 1)},
        rank=2,
    ),
    "Resize": _resize([1, 1, 2, 2]),
    "Col2Im": _col2im([4, 4], [2, 2]),
    "If whose constant condition picks the small branch": lambda: _if_shape(BIG, 4, cond=False),
    "If with two small branches": lambda: _if_shape(3, 4),
}


@pytest.mark.parametrize("case", list(SMALL))
def test_validator_accepts_the_same_ops_at_ordinary_sizes(case):
    check_model_safety(SMALL[case](), limits=LIMITS)


def test_possible_values_follow_both_branches_unless_the_condition_is_known():
    graph = _if_shape(3, 4).graph
    assert sorted(v.tolist() for v in possible_values(graph, {}, 18)["s"]) == [[3], [4]]
    assert [v.tolist() for v in possible_values(_if_shape(3, 4, cond=False).graph, {}, 18)["s"]] == [[4]]
    assert [v.tolist() for v in possible_values(_if_shape(3, 3).graph, {}, 18)["s"]] == [[3]]  # once
    assert len(possible_values(graph, {}, 18, max_options=1)["s"]) == 1


def test_col2im_with_a_block_larger_than_its_image_is_refused():
    with pytest.raises(ModelError, match=r"block_shape \[8, 2\] that does not fit its padded image \[4, 4\]"):
        check_model_safety(_col2im([4, 4], [8, 2])())
    with pytest.raises(ModelError, match=r"image_shape \[4, 4\] and block_shape \[0, 2\]"):
        check_model_safety(_col2im([4, 4], [0, 2])())


# ---- the entry points, in a child with little memory and CPU time ------------------------------------------
_CHILD = """
import resource, onnx
resource.setrlimit(resource.RLIMIT_CPU, (30, 31))  # a runaway computation is killed
import onnxgrad
from onnxgrad.compat import OrtGradientForwardBackward
from onnxgrad.errors import ModelError
for data in {models!r}:
    model = onnx.load_from_string(data)
    for name, build in [
        ("build_gradient", lambda: onnxgrad.build_gradient(model)),
        ("ForwardBackward", lambda: onnxgrad.ForwardBackward(model)),
        ("gradients", lambda: onnxgrad.gradients(model, {{}})),
        ("OrtGradientForwardBackward", lambda: OrtGradientForwardBackward(model)),
    ]:
        try:
            build()
            print(name, "accepted the model")
        except Exception as exc:
            print(name, type(exc).__name__, str(exc).replace(chr(10), " "))
"""


def test_entry_points_refuse_sizes_that_values_give_quickly_in_little_memory():
    cases = list(VALUE_SHAPES)
    models = [VALUE_SHAPES[c][0]().SerializeToString() for c in cases]
    result = run_isolated(_CHILD.format(models=models), timeout=300, max_bytes=3 << 30)
    assert not result.timed_out and not result.crashed, (
        f"the child was killed ({result.returncode}): out of memory or CPU time\n{result.stderr[-2000:]}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 4 * len(cases), result.stdout
    for k, case in enumerate(cases):
        for line in lines[4 * k : 4 * k + 4]:
            assert " ModelError " in line and "would create a tensor of shape" in line, (case, line)


# ---- subgraphs --------------------------------------------------------------------------------------------
def _if_tree(depth: int) -> onnx.ModelProto:
    """An If whose two branches each hold an If, ``depth`` levels: 2**(depth+1) - 2 subgraphs."""
    count = [0]

    def branch(level: int) -> onnx.GraphProto:
        count[0] += 1
        out = f"o{count[0]}"
        if level == 0:
            node = helper.make_node("Identity", ["x"], [out])
        else:
            node = helper.make_node(
                "If", ["c"], [out], then_branch=branch(level - 1), else_branch=branch(level - 1)
            )
        return helper.make_graph(
            [node], f"g{count[0]}", [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2])]
        )

    top = helper.make_node("If", ["c"], ["y"], then_branch=branch(depth - 1), else_branch=branch(depth - 1))
    return make_model([top], [("c", np.bool_, []), ("x", np.float32, [2])], [("y", np.float32, [2])])


def test_the_number_of_subgraphs_is_bounded(monkeypatch):
    hostile = _if_tree(13).SerializeToString()  # 16,382 subgraphs in about 1 MB
    assert len(hostile) < 2 << 20
    message = (
        rf"the model holds more than {DEFAULT_MAX_SUBGRAPHS} subgraphs \(If branches, Loop and Scan bodies\)"
    )
    with pytest.raises(ModelError, match=message):
        load_untrusted(hostile)
    with pytest.raises(ModelError, match=message):
        onnxgrad.build_gradient(onnx.load_from_string(hostile))
    ordinary = _if_tree(3)  # 14 subgraphs
    load_untrusted(ordinary)
    check_model_safety(ordinary, limits=Limits(max_subgraphs=14))
    with pytest.raises(
        ModelError, match=r"more than 13 subgraphs.*Limits\(max_subgraphs=\.\.\.\).*ONNXGRAD_MAX_SUBGRAPHS"
    ):
        check_model_safety(ordinary, limits=Limits(max_subgraphs=13))
    monkeypatch.setenv("ONNXGRAD_MAX_SUBGRAPHS", "13")
    assert default_limits().max_subgraphs == 13
    with pytest.raises(ModelError, match=r"more than 13 subgraphs"):
        load_untrusted(ordinary)
    monkeypatch.setenv("ONNXGRAD_MAX_SUBGRAPHS", "0")
    with pytest.raises(
        InputError, match=r"ONNXGRAD_MAX_SUBGRAPHS='0' must be a positive number of subgraphs"
    ):
        default_limits()


def test_subgraphs_of_functions_and_training_information_count():
    branchy = _if_tree(2)  # 6 subgraphs
    function = helper.make_function(
        "local", "f", ["c", "x"], ["y"], list(branchy.graph.node), [helper.make_opsetid("", 18)]
    )
    model = make_model(
        [helper.make_node("f", ["c", "x"], ["y"], domain="local")],
        [("c", np.bool_, []), ("x", np.float32, [2])],
        [("y", np.float32, [2])],
    )
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    check_model_safety(model, limits=Limits(max_subgraphs=6))
    with pytest.raises(ModelError, match=r"more than 5 subgraphs"):
        check_model_safety(model, limits=Limits(max_subgraphs=5))
    model.training_info.add().algorithm.CopyFrom(branchy.graph)  # the graph itself and its 6
    check_model_safety(model, limits=Limits(max_subgraphs=13))
    with pytest.raises(ModelError, match=r"more than 12 subgraphs"):
        check_model_safety(model, limits=Limits(max_subgraphs=12))


# ---- control flow whose subgraphs do not fit the node ----------------------------------------------------
def _vi(name: str, dtype: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _scan(num_scan_inputs: int, **attrs: Any) -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "e"], ["s2"]), helper.make_node("Identity", ["s2"], ["o"])],
        "body",
        [_vi("s", TensorProto.FLOAT, [2]), _vi("e", TensorProto.FLOAT, [2])],
        [_vi("s2", TensorProto.FLOAT, [2]), _vi("o", TensorProto.FLOAT, [2])],
    )
    node = helper.make_node(
        "Scan", ["W", "xs"], ["sf", "os"], body=body, num_scan_inputs=num_scan_inputs, **attrs
    )
    outputs = [("sf", np.float32, [2]), ("os", np.float32, [3, 2])]
    return make_model([node], [("xs", np.float32, [3, 2])], outputs, {"W": np.ones(2, np.float32)})


def _loop(body_inputs: int) -> onnx.ModelProto:
    inputs = [
        _vi("i", TensorProto.INT64, []),
        _vi("cin", TensorProto.BOOL, []),
        _vi("v", TensorProto.FLOAT, [2]),
    ]
    body = helper.make_graph(
        [helper.make_node("Identity", ["cin"], ["cout"]), helper.make_node("Identity", ["v"], ["v2"])],
        "body",
        inputs[:body_inputs],
        [_vi("cout", TensorProto.BOOL, []), _vi("v2", TensorProto.FLOAT, [2])],
    )
    node = helper.make_node("Loop", ["n", "", "W"], ["y"], body=body)
    return make_model([node], [("n", np.int64, [])], [("y", np.float32, [2])], {"W": np.ones(2, np.float32)})


def _if_outputs(n_then: int) -> onnx.ModelProto:
    then = helper.make_graph(
        [helper.make_node("Identity", ["W"], [f"t{k}"]) for k in range(n_then)],
        "then",
        [],
        [_vi(f"t{k}", TensorProto.FLOAT, [2]) for k in range(n_then)],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["e"])], "else", [], [_vi("e", TensorProto.FLOAT, [2])]
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    return make_model([node], [("c", np.bool_, [])], [("y", np.float32, [2])], {"W": np.ones(2, np.float32)})


CONTROL_FLOW: dict[str, tuple[Callable[[], onnx.ModelProto], str]] = {
    "Scan scanning more inputs than it has": (
        lambda: _scan(5),
        r"a Scan node has num_scan_inputs=5 with 2 inputs",
    ),
    "Scan scanning none": (lambda: _scan(0), r"num_scan_inputs=0"),
    "Scan with too many input axes": (
        lambda: _scan(1, scan_input_axes=[0, 0]),
        r"a Scan node gives 2 scan_input_axes for 1 values",
    ),
    "Loop body without the carried value": (
        lambda: _loop(2),
        r"a Loop node: its 'body' graph has 2 inputs where",
    ),
    "If branch with two outputs for one": (
        lambda: _if_outputs(2),
        r"an If node: its 'then_branch' graph has 2 outputs",
    ),
}


@pytest.mark.parametrize("case", list(CONTROL_FLOW))
def test_control_flow_that_does_not_fit_its_subgraphs_is_refused(case):
    build, message = CONTROL_FLOW[case]
    with pytest.raises(ModelError, match=message):
        check_structure(build())
    for entry in (onnxgrad.build_gradient, onnxgrad.ForwardBackward):
        with pytest.raises(ModelError, match=message):
            entry(build())


def test_control_flow_that_fits_is_accepted():
    for model in (_scan(1), _loop(3), _if_outputs(1)):
        check_structure(model)
        onnxgrad.build_gradient(model)


def _node_of(model: onnx.ModelProto) -> onnx.NodeProto:
    return model.graph.node[0]


def _edited(build: Callable[[], onnx.ModelProto], edit: Callable[[onnx.ModelProto], None]) -> onnx.ModelProto:
    model = build()
    edit(model)
    return model


def _body(model: onnx.ModelProto) -> onnx.GraphProto:
    return next(a.g for a in _node_of(model).attribute if a.name == "body")


def _scan8(state_scanned: bool = False) -> onnx.ModelProto:
    """Scan 8: the sequence lengths first (absent), W carried, xs scanned (or both scanned)."""
    model = _scan(2 if state_scanned else 1)
    _node_of(model).input.insert(0, "")
    if state_scanned:
        del _node_of(model).output[0]
        del _body(model).output[0]
    model.opset_import[0].version = 8
    model.ir_version = 3
    return model


NODE = "a Scan node"
ARITY: dict[str, tuple[onnx.ModelProto, str]] = {
    "Loop body with an extra output": (
        _edited(lambda: _loop(3), lambda m: _body(m).output.append(_vi("extra", TensorProto.FLOAT, [2]))),
        "a Loop node: its 'body' graph has 3 outputs where the node needs 2: the file is corrupt",
    ),
    "Loop with one input": (
        _edited(lambda: _loop(3), lambda m: _node_of(m).input.__delitem__(slice(1, None))),
        "a Loop node has 1 inputs and 1 outputs: a Loop takes a trip count, a condition and its N carried "
        "values, and gives back at least those N: the file is corrupt",
    ),
    "Loop giving back fewer than it carries": (
        _edited(
            lambda: _loop(3),
            lambda m: (
                _node_of(m).input.append("W"),
                _body(m).input.append(_vi("v3", TensorProto.FLOAT, [2])),
            ),
        ),
        "a Loop node has 4 inputs and 1 outputs",
    ),
    "Scan body with an extra input": (
        _edited(lambda: _scan(1), lambda m: _body(m).input.append(_vi("z", TensorProto.FLOAT, [2]))),
        f"{NODE}: its 'body' graph has 3 inputs where the node needs 2: the file is corrupt",
    ),
    "Scan body with an extra output": (
        _edited(lambda: _scan(1), lambda m: _body(m).output.append(_vi("z", TensorProto.FLOAT, [2]))),
        f"{NODE}: its 'body' graph has 3 outputs where the node needs 2: the file is corrupt",
    ),
    "Scan scanning more than its inputs": (
        _scan(3),
        f"{NODE} has num_scan_inputs=3 with 2 inputs and 2 outputs: a Scan scans between 1 and all of its "
        "inputs, and gives back at least its state values: the file is corrupt",
    ),
    "Scan giving back less than its state": (
        _edited(
            lambda: _scan(1),
            lambda m: (
                _node_of(m).output.__delitem__(slice(0, None)),
                _body(m).output.__delitem__(slice(0, None)),
            ),
        ),
        f"{NODE} has num_scan_inputs=1 with 2 inputs and 0 outputs",
    ),
    "Scan with two input directions for one": (
        _scan(1, scan_input_directions=[0, 0]),
        f"{NODE} gives 2 scan_input_directions for 1 values: the file is corrupt",
    ),
    "Scan with two output axes for one": (
        _scan(1, scan_output_axes=[0, 0]),
        f"{NODE} gives 2 scan_output_axes for 1 values: the file is corrupt",
    ),
    "Scan with two output directions for one": (
        _scan(1, scan_output_directions=[0, 0]),
        f"{NODE} gives 2 scan_output_directions for 1 values: the file is corrupt",
    ),
    "Scan 9 read as Scan 8": (
        _edited(_scan8, lambda m: m.opset_import.__getitem__(0).__setattr__("version", 9)),
        f"{NODE}: its 'body' graph has 2 inputs where the node needs 3",
    ),
    "If without an else branch": (
        _edited(lambda: _if_outputs(1), lambda m: _node_of(m).attribute.__delitem__(0)),
        "an If node has no 'else_branch' graph: the file is corrupt",
    ),
    "an empty graph": (
        _edited(
            lambda: _if_outputs(1),
            lambda m: (m.graph.node.__delitem__(slice(0, None)), m.graph.output.__delitem__(slice(0, None))),
        ),
        "the model has an empty graph: it is not a valid ONNX file",
    ),
}


@pytest.mark.parametrize("case", list(ARITY))
def test_control_flow_arity_messages(case):
    model, message = ARITY[case]
    with pytest.raises(ModelError, match=re.escape(message)):
        check_structure(model)


def _loop_scanning_only() -> onnx.ModelProto:
    """A Loop carrying nothing: its body gives the condition and one scanned value."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cin"], ["cout"]),
            helper.make_node("Cast", ["i"], ["v"], to=TensorProto.FLOAT),
        ],
        "body",
        [_vi("i", TensorProto.INT64, []), _vi("cin", TensorProto.BOOL, [])],
        [_vi("cout", TensorProto.BOOL, []), _vi("v", TensorProto.FLOAT, [])],
    )
    node = helper.make_node("Loop", ["n", ""], ["y"], body=body)
    return make_model([node], [("n", np.int64, [])], [("y", np.float32, ["N"])])


def test_control_flow_at_the_edges_is_accepted():
    for model in (
        _scan8(),  # the sequence lengths first
        _scan8(state_scanned=True),  # no state: every input scanned
        _edited(
            lambda: _scan(1), lambda m: (_node_of(m).output.__delitem__(1), _body(m).output.__delitem__(1))
        ),
        _loop_scanning_only(),  # nothing carried, y scanned
        _edited(lambda: _scan(1), lambda m: m.graph.node[0].__setattr__("domain", "ai.onnx")),
    ):
        check_structure(model)
    dotted = _edited(lambda: _scan(5), lambda m: m.graph.node[0].__setattr__("domain", "ai.onnx"))
    with pytest.raises(ModelError, match="num_scan_inputs=5"):
        check_structure(dotted)


# ---- training information and external data ----------------------------------------------------------------
def _external(location: str, name: str = "T") -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


def _with_training_info(tensor: TensorProto) -> onnx.ModelProto:
    model = make_model(
        [helper.make_node("Mul", ["x", "W"], ["y"])],
        [("x", np.float32, [4])],
        [("y", np.float32, [4])],
        {"W": np.ones(4, np.float32)},
    )
    graph = helper.make_graph(
        [helper.make_node("Identity", [tensor.name], ["o"])],
        "algorithm",
        [],
        [_vi("o", TensorProto.FLOAT, [4])],
        initializer=[tensor],
    )
    model.training_info.add().algorithm.CopyFrom(graph)
    return model


def test_training_information_tensors_are_checked(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_with_training_info(_external("/etc/passwd")).SerializeToString())
    where = r"initializer 'T' in the algorithm graph of training_info\[0\]"
    message = rf"{where} is stored in '/etc/passwd', an absolute path"
    with pytest.raises(ModelError, match=message):
        load_untrusted(str(path))
    with pytest.raises(ModelError, match=message):
        onnxgrad.ForwardBackward(str(path))
    huge = TensorProto(name="T", data_type=TensorProto.FLOAT, dims=[BIG], raw_data=b"\0" * 16)
    with pytest.raises(ModelError, match=rf"{where} declares shape \[1099511627776\]"):
        load_untrusted(_with_training_info(huge).SerializeToString())


def test_external_data_without_a_length_must_fill_the_rest_of_its_file(tmp_path):
    (tmp_path / "w.bin").write_bytes(
        np.arange(8, dtype=np.float32).tobytes()
    )  # 32 bytes, the tensor needs 16
    model = make_model(
        [helper.make_node("Mul", ["x", "W"], ["y"])], [("x", np.float32, [4])], [("y", np.float32, [4])]
    )
    model.graph.initializer.append(_external("w.bin", "W"))
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    message = (
        r"initializer 'W' gives no length for its external data, and 'w.bin' holds 32 bytes from offset 0 "
        "where the tensor needs 16"
    )
    for load in (load_untrusted, onnxgrad.ForwardBackward):
        with pytest.raises(ModelError, match=message):
            load(str(path))
    entry = model.graph.initializer[0].external_data.add()
    entry.key, entry.value = "offset", "16"  # the second half: exactly the rest of the file
    path.write_bytes(model.SerializeToString())
    np.testing.assert_array_equal(
        numpy_helper.to_array(load_untrusted(str(path)).graph.initializer[0]), [4, 5, 6, 7]
    )
