"""Names reused across If branches (planted bugs 1 and 2 of issue 39).

1. ``unique_scope_names`` renames a value that a second branch defines again, and the If nested in
   that branch must read the renamed value. onnx writes a node's attributes sorted by name, so
   ``else_branch`` comes first: the branch renamed is ``then_branch``, and the nested If in it.
2. An input read only inside If branches is exempt from the check that inputs sharing a symbolic
   dimension agree, even when a ``Shape`` outside the branches reads it (a Shape reads no value).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.errors import InputError
from onnxgrad.model.graph import inputs_read_only_in_branches, unique_scope_names
from onnxgrad.testing import check_gradients
from tests.models import make_model


def _out(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.DOUBLE, [3])


def _nested_model() -> onnx.ModelProto:
    """y = If(c, then: v = x * W; If(d, v + v, -v), else: v = x + W; v * v)."""
    inner_then = helper.make_graph(
        [helper.make_node("Add", ["v", "v"], ["i1"])], "inner_then", [], [_out("i1")]
    )
    inner_else = helper.make_graph([helper.make_node("Neg", ["v"], ["i2"])], "inner_else", [], [_out("i2")])
    then = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "W"], ["v"]),
            helper.make_node("If", ["d"], ["t"], then_branch=inner_then, else_branch=inner_else),
        ],
        "then",
        [],
        [_out("t")],
    )
    other = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["v"]), helper.make_node("Mul", ["v", "v"], ["e"])],
        "else",
        [],
        [_out("e")],
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    assert [a.name for a in node.attribute] == ["else_branch", "then_branch"]  # onnx sorts them
    inputs = [("c", np.bool_, []), ("d", np.bool_, []), ("x", np.float64, [3])]
    return make_model([node], inputs, [("y", np.float64, [3])], {"W": np.array([0.5, -1.5, 2.0])})


def test_an_if_nested_in_the_branch_visited_second_reads_the_renamed_value():
    model = _nested_model()
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    assert unique_scope_names(renamed.graph) == {"v": ["v_2"]}
    branches = {a.name: a.g for a in renamed.graph.node[0].attribute}
    then = branches["then_branch"]
    assert [list(n.output) for n in then.node] == [["v_2"], ["t"]]
    inner = {a.name: a.g for a in then.node[1].attribute}
    assert list(inner["then_branch"].node[0].input) == ["v_2", "v_2"]
    assert list(inner["else_branch"].node[0].input) == ["v_2"]
    assert list(branches["else_branch"].node[0].output) == ["v"]  # the first definition keeps its name
    onnx.checker.check_model(renamed, full_check=True)


@pytest.mark.parametrize(("c", "d"), [(True, True), (True, False), (False, True)])
def test_the_renamed_model_computes_and_differentiates_as_the_original(c, d):
    model = _nested_model()
    x = np.array([1.0, -2.0, 0.25])
    feeds = {"c": np.array(c), "d": np.array(d), "x": x}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, feeds)
    result = onnxgrad.ForwardBackward(model).forward(feeds)
    np.testing.assert_allclose(result.outputs[0], want, rtol=1e-15)
    assert check_gradients(model, feeds).ok


# ---- 2: inputs read only by If branches ------------------------------------------------------------
def _mask_model() -> onnx.ModelProto:
    """ids [B, S] -> ids * W; mask [B, S] read by both branches (each as it likes) and by a Shape
    outside them: y = (ids * W) summed + If(c, sum(mask), mean(mask)) + size of mask's last dim."""
    then = helper.make_graph(
        [helper.make_node("ReduceSum", ["mask"], ["a"], keepdims=0)],
        "then",
        [],
        [helper.make_tensor_value_info("a", TensorProto.DOUBLE, [])],
    )
    other = helper.make_graph(
        [helper.make_node("ReduceMean", ["mask"], ["b"], keepdims=0)],
        "else",
        [],
        [helper.make_tensor_value_info("b", TensorProto.DOUBLE, [])],
    )
    nodes = [
        helper.make_node("Mul", ["ids", "W"], ["h"]),
        helper.make_node("ReduceSum", ["h"], ["s"], keepdims=0),
        helper.make_node("If", ["c"], ["m"], then_branch=then, else_branch=other),
        helper.make_node("Shape", ["mask"], ["shape"], start=-1),
        helper.make_node("Cast", ["shape"], ["len"], to=TensorProto.DOUBLE),
        helper.make_node("ReduceSum", ["len"], ["n"], keepdims=0),
        helper.make_node("Sum", ["s", "m", "n"], ["y"]),
    ]
    inputs = [("ids", np.float64, ["B", "S"]), ("mask", np.float64, ["B", "S"]), ("c", np.bool_, [])]
    return make_model(nodes, inputs, [("y", np.float64, [])], {"W": np.array([1.0, 2.0, 3.0])})


def test_an_input_read_only_by_branches_and_a_shape_is_exempt():
    model = _mask_model()
    assert inputs_read_only_in_branches(model.graph) == {"mask"}
    fb = onnxgrad.ForwardBackward(model)
    ids, mask = np.ones((2, 3)), np.ones((2, 5))  # S is 3 for ids, 5 for the mask: a past + new length
    result = fb.forward({"ids": ids, "mask": mask, "c": np.array(True)})
    assert float(result.outputs[0]) == pytest.approx(2 * 6 + 10 + 5)


def test_an_input_read_outside_the_branches_is_not_exempt():
    model = _mask_model()
    model.graph.node.append(helper.make_node("Identity", ["mask"], ["mask_copy"]))
    model.graph.output.append(helper.make_tensor_value_info("mask_copy", TensorProto.DOUBLE, ["B", "S"]))
    assert inputs_read_only_in_branches(model.graph) == set()
    fb = onnxgrad.ForwardBackward(model)
    with pytest.raises(InputError, match=r"dimension"):
        fb.forward({"ids": np.ones((2, 3)), "mask": np.ones((2, 5)), "c": np.array(True)})
