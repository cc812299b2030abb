"""What ``onnxgrad.model.fold`` knows before running, at its edges: the values either If branch
gives (``possible_values``), which initializers count, which nodes are evaluated, the sizes kept,
and the combinations a node is evaluated for."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.model.fold import MAX_ELEMENTS, combinations, known_values, possible_values
from onnxgrad.model.graph import ValueInfo


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value)))


def _graph(nodes, inputs=(), inits=(), outputs=("y",)) -> onnx.GraphProto:
    outs = [helper.make_tensor_value_info(o, TensorProto.INT64, None) for o in outputs]
    return helper.make_graph(nodes, "g", list(inputs), outs, initializer=list(inits))


def _branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.INT64, None)])


def _if(cond: str, then: onnx.GraphProto, other: onnx.GraphProto, out: str = "s") -> onnx.NodeProto:
    return helper.make_node("If", [cond], [out], then_branch=then, else_branch=other)


def _options(values: dict, name: str) -> list:
    return sorted(v.tolist() for v in values.get(name, []))


def test_a_constant_condition_picks_its_branch_and_an_unknown_one_both():
    then = _branch("then", [_const("a", np.array([3]))], "a")
    other = _branch("else", [_const("b", np.array([4]))], "b")
    for cond, want in [(True, [[3]]), (False, [[4]]), (None, [[3], [4]])]:
        nodes = [_if("c", then, other), helper.make_node("Add", ["s", "one"], ["y"])]
        if cond is not None:
            nodes.insert(0, _const("c", np.array([cond])))  # a 1-element condition of rank 1
        values = possible_values(_graph(nodes, inits=[numpy_helper.from_array(np.array([1]), "one")]), {}, 18)
        assert _options(values, "s") == want
        assert _options(values, "y") == [[v[0] + 1] for v in want]  # followed after the If


def test_branches_see_shapes_opset_and_nested_ifs():
    """Each branch reads the static shape of an outer input, squeezes with an axes input (opset
    13 and later) and nests an If of its own."""
    inner = _if(
        "d",
        _branch("it", [_const("p", np.array([5]))], "p"),
        _branch("ie", [_const("q", np.array([6]))], "q"),
        "n",
    )
    then = _branch(
        "then",
        [
            helper.make_node("Shape", ["x"], ["sx"]),
            helper.make_node("Squeeze", ["sx", "zero"], ["t"]),
            helper.make_node("Unsqueeze", ["t", "zero"], ["t1"]),
        ],
        "t1",
    )
    then.initializer.append(numpy_helper.from_array(np.array([0]), "zero"))
    other = _branch("else", [inner], "n")
    nodes = [_if("c", then, other)]
    shapes = {"x": ValueInfo("x", TensorProto.FLOAT, (7,))}
    values = possible_values(_graph(nodes), shapes, 18)
    assert _options(values, "s") == [[5], [6], [7]]
    assert _options(possible_values(_graph(nodes), shapes, 18, max_options=1), "s") == [[6]]  # else first


def test_at_most_max_options_flow_on():
    then = _branch("then", [_const("a", np.array([3]))], "a")
    other = _branch("else", [_const("b", np.array([4]))], "b")
    nodes = [_if("c", then, other), helper.make_node("Add", ["s", "s2"], ["y"]), _if("c2", then, other, "s2")]
    nodes = [nodes[0], nodes[2], nodes[1]]
    values = possible_values(_graph(nodes), {}, 18)
    assert _options(values, "y") == [[6], [7], [8]]  # 3+3, 3+4 (and 4+3), 4+4
    assert len(possible_values(_graph(nodes), {}, 18, max_options=2)["y"]) == 2


def test_combinations_are_capped_and_never_none():
    options = {"a": [np.array(1), np.array(2)], "b": [np.array(3)]}
    assert [sorted(c) for c in combinations(["a", "b", "z"], options)] == [["a", "b"]] * 2
    assert len(list(combinations(["a"], options, limit=1))) == 1
    assert list(combinations(["z"], options)) == [{}]
    assert len(list(combinations(["a"], options, limit=0))) == 1


def test_which_initializers_count():
    declared = helper.make_tensor_value_info("fed", TensorProto.INT64, [1])
    inits = [
        numpy_helper.from_array(np.array([1]), "fed"),  # also an input: the caller may feed it
        numpy_helper.from_array(np.arange(MAX_ELEMENTS), "full"),  # exactly the largest followed
        numpy_helper.from_array(np.arange(MAX_ELEMENTS + 1), "big"),
        numpy_helper.from_array(np.array(["text"], dtype=object), "words"),
        numpy_helper.from_array(np.array([2]), "last"),
    ]
    graph = _graph([], inputs=[declared], inits=inits)
    assert set(known_values(graph, {}, 18)) == {"full", "last"}
    assert set(known_values(graph, {}, 18, overridable=True)) == {"fed", "full", "last"}
    assert set(possible_values(graph, {}, 18)) == {"full", "last"}
    assert set(possible_values(graph, {}, 18, overridable=True)) == {"fed", "full", "last"}


def test_a_subgraph_input_hides_the_outer_value_of_its_name():
    inner = _graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        inputs=[helper.make_tensor_value_info("x", TensorProto.INT64, [1])],
    )
    assert "y" not in known_values(inner, {}, 18, {"x": np.array([1])})
    assert "y" not in possible_values(inner, {}, 18, {"x": [np.array([1])]})


def test_which_nodes_are_evaluated_and_kept():
    nodes = [
        _const("a", np.array([1])),
        helper.make_node("Identity", ["a"], ["std"], domain="ai.onnx"),
        helper.make_node("Identity", ["a"], ["custom"], domain="my.domain"),
        helper.make_node("Reshape", ["a", "bad"], ["broken"]),  # numpy refuses: not known, no crash
        helper.make_node("Identity", ["a"], ["after"]),
        helper.make_node("ConstantOfShape", ["n64"], ["full"]),
        helper.make_node("Range", ["zero", "n65", "one"], ["big"]),
        _const("f", np.array([1.0])),
        _const("z", np.array([0.0])),
        helper.make_node("Div", ["f", "z"], ["inf"]),  # numpy's warning silenced
    ]
    inits = {"bad": np.array([5]), "n64": np.array([MAX_ELEMENTS]), "n65": np.array(MAX_ELEMENTS + 1)}
    inits.update(zero=np.array(0), one=np.array(1))
    graph = _graph(nodes, inits=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = known_values(graph, {}, 18)
        options = possible_values(graph, {}, 18)
    for found in (values, {k: v[0] for k, v in options.items()}):
        assert {"std", "after", "full", "inf"} <= set(found)
        assert not {"custom", "broken", "big"} & set(found)
        assert found["full"].shape == (MAX_ELEMENTS,) and np.isinf(found["inf"]).all()
