"""Sequence ops: gradients pass through SequenceConstruct/At/Insert/Erase, Split/ConcatFromSequence."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
import onnxgrad.autodiff.rules.control_flow  # registers the rules (until rules/__init__ lists them)
import onnxgrad.autodiff.rules.sequence
from onnxgrad.autodiff.engine import check_graphs
from onnxgrad.testing import check_gradients, run_model
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)
from tests.models import make_model

F64 = TensorProto.DOUBLE


def node(op: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, **attrs)


def ints(value) -> np.ndarray:
    return np.array(value, dtype=np.int64)


def check(model: onnx.ModelProto, feeds: dict) -> onnxgrad.GradientGraphs:
    """Gradients of every input match finite differences; both graphs pass the ONNX checker; the
    forward computes what the model computes."""
    graphs = onnxgrad.build_gradient(model, inputs_requiring_grad=list(feeds))
    check_graphs(graphs)
    result = check_gradients(model, feeds, wrt=list(feeds), graphs=graphs)
    assert result.ok, result.report()
    want, got = run_model(model)(feeds), run_model(graphs.forward)(feeds)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    return graphs


@pytest.mark.parametrize("dynamic", [False, True])
def test_construct_then_concat(dynamic):
    # elements of equal static size split back in equal chunks; of unknown sizes, at saved sizes
    b_shape = [2, "K"] if dynamic else [2, 3]
    model = make_model(
        [
            node("Tanh", ["a"], ["ta"]),
            node("SequenceConstruct", ["ta", "b", "a"], ["S"]),
            node("ConcatFromSequence", ["S"], ["y"], axis=1),
        ],
        [("a", np.float64, [2, 3]), ("b", np.float64, b_shape)],
        [("y", np.float64, [2, None])],
    )
    graphs = check(model, {"a": rng().standard_normal((2, 3)), "b": rng().standard_normal((2, 3))})
    assert any("shapes" in s for s in graphs.saved) == dynamic


def test_construct_then_stack():
    model = make_model(
        [
            node("SequenceConstruct", ["a", "b"], ["S"]),
            node("ConcatFromSequence", ["S"], ["y"], axis=-1, new_axis=1),
            node("Sin", ["y"], ["z"]),
        ],
        [("a", np.float64, [2, 3]), ("b", np.float64, [2, 3])],
        [("z", np.float64, [2, 3, 2])],
    )
    check(model, {"a": rng().standard_normal((2, 3)), "b": rng().standard_normal((2, 3))})


@pytest.mark.parametrize("opset", [15, 18])
def test_split_then_sequence_at(opset):
    # what the forward adds for the backward (lengths, element shapes) stays within the model's opset
    model = make_model(
        [
            node("SplitToSequence", ["x", "sizes"], ["S"], axis=1),
            node("SequenceAt", ["S", "one"], ["u"]),
            node("SequenceAt", ["S", "last"], ["v"]),
            node("SequenceAt", ["S", "one"], ["w"]),
            node("Mul", ["u", "w"], ["uw"]),
            node("ReduceSum", ["v"], ["vs"], keepdims=0),
        ],
        [("x", np.float64, [2, 6])],
        [("uw", np.float64, [2, 2]), ("vs", np.float64, [])],
        {"sizes": ints([1, 2, 3]), "one": ints(1), "last": ints(-1)},
        opset=opset,
    )
    graphs = check(model, {"x": rng().standard_normal((2, 6))})
    assert all(imp.version == opset for imp in graphs.forward.opset_import)


def test_split_insert_erase_stack():
    model = make_model(
        [
            node("SplitToSequence", ["x"], ["S"], axis=0, keepdims=0),
            node("Exp", ["t"], ["et"]),
            node("SequenceInsert", ["S", "et", "before_last"], ["S2"]),
            node("SequenceInsert", ["S2", "t"], ["S3"]),  # appended
            node("SequenceErase", ["S3", "first"], ["S4"]),
            node("SequenceErase", ["S4"], ["S5"]),  # the last one
            node("ConcatFromSequence", ["S5"], ["y"], axis=0, new_axis=1),
        ],
        [("x", np.float64, [3, 4]), ("t", np.float64, [4])],
        [("y", np.float64, [None, 4])],
        {"before_last": ints(-1), "first": ints(0)},
    )
    check(model, {"x": rng().standard_normal((3, 4)), "t": rng().standard_normal(4)})


def test_sequence_position_from_data():
    # a position computed at run time, int32 and negative: normalised with the saved length
    model = make_model(
        [
            node("SplitToSequence", ["x"], ["S"], axis=0),
            node("Shape", ["x"], ["shape"]),
            node("Cast", ["shape"], ["shape32"], to=TensorProto.INT32),
            node("Gather", ["shape32", "zero"], ["rows"]),
            node("Neg", ["rows"], ["first"]),  # -rows: the first element
            node("SequenceAt", ["S", "first"], ["y"]),
        ],
        [("x", np.float64, ["N", 2])],
        [("y", np.float64, [1, 2])],
        {"zero": np.array(0, np.int32)},
    )
    check(model, {"x": rng().standard_normal((3, 2))})


def test_sequence_read_inside_a_loop():
    # y = sum_i S[i] * W with S = split(x): S is captured by the body, its gradient accumulated
    body = helper.make_graph(
        [
            node("SequenceAt", ["S", "i"], ["row"]),
            node("Mul", ["row", "W"], ["rw"]),
            node("Add", ["acc", "rw"], ["acc_out"]),
            node("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc", F64, [1, 3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", F64, [1, 3]),
        ],
    )
    model = make_model(
        [
            node("SplitToSequence", ["x"], ["S"], axis=0),
            node("SequenceLength", ["S"], ["n"]),
            node("Loop", ["n", "", "acc0"], ["y"], body=body),
        ],
        [("x", np.float64, [4, 3]), ("W", np.float64, [3]), ("acc0", np.float64, [1, 3])],
        [("y", np.float64, [1, 3])],
    )
    check(
        model,
        {"x": rnd(4, 3), "W": rnd(3), "acc0": rnd(1, 3)},
    )


def test_sequence_length_stops_the_gradient():
    model = make_model(
        [
            node("SplitToSequence", ["x"], ["S"], axis=0),
            node("SequenceLength", ["S"], ["n"]),
            node("Cast", ["n"], ["nf"], to=F64),
            node("Mul", ["x", "nf"], ["y"]),
        ],
        [("x", np.float64, [3, 2])],
        [("y", np.float64, [3, 2])],
    )
    x = rng().standard_normal((3, 2))
    got = onnxgrad.gradients(model, {"x": x}, wrt=["x"])
    np.testing.assert_array_equal(got["x"], np.full((3, 2), 3.0))
    assert onnxgrad.supported_ops()["SequenceLength"] == "zero"
