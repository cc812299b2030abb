"""The engine: graph structure, what is saved, accumulation, stopping, zero gradients, errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxgrad
from onnxgrad.autodiff.engine import check_graphs
from onnxgrad.errors import GradientNotImplementedError, InputError, ModelError
from onnxgrad.testing import assert_allclose_scaled, check_gradients
from tests.autodiff.random_data import rng  # one generator per test (conftest.py)
from tests.models import make_model, mlp, numpy_mlp_grads


def test_graphs_are_plain_onnx_that_onnxruntime_loads():
    graphs = onnxgrad.build_gradient(mlp())
    check_graphs(graphs)  # onnx.checker with full_check on both
    for proto in (graphs.forward, graphs.backward):
        assert 8 <= proto.ir_version <= 13
        assert all(o.version <= 26 for o in proto.opset_import)
    # trainable initializers are inputs of the forward graph (new values need no rebuild)
    fwd_inputs = [i.name for i in graphs.forward.graph.input]
    assert fwd_inputs == ["x", "W1", "b1", "W2", "b2"]
    assert graphs.trainable == ["W1", "b1", "W2", "b2"]


def test_forward_keeps_exactly_what_the_backward_reads():
    graphs = onnxgrad.build_gradient(mlp())
    # Gemm needs its other operand, Relu its output (which fc2 saves anyway), Sigmoid its output.
    assert sorted(graphs.saved) == ["W2", "r", "x", "y"]
    bwd_inputs = {i.name for i in graphs.backward.graph.input}
    assert bwd_inputs == set(graphs.saved) | set(graphs.grad_inputs.values())
    read = {i for n in graphs.backward.graph.node for i in n.input}
    assert set(graphs.saved) <= read
    # outputs of the forward: the user output plus saved values that are not inputs
    fwd_outputs = [o.name for o in graphs.forward.graph.output]
    assert fwd_outputs == ["y", "r"]


def test_mlp_gradients_match_numpy_reference():
    model = mlp()
    x = rng().standard_normal((6, 4))
    dy = rng().standard_normal((6, 3))
    got = onnxgrad.gradients(model, {"x": x}, {"y": dy}, wrt=["W1", "b1", "W2", "b2", "x"])
    want = numpy_mlp_grads(model, x, dy)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12)
        assert got[k].dtype == np.float64


def test_value_used_several_times_sums_gradients():
    # y = x * x + x  ->  dy/dx = 2x + 1
    model = make_model(
        [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Add", ["sq", "x"], ["y"])],
        [("x", np.float64, [3])],
        [("y", np.float64, [3])],
    )
    x = np.array([1.0, -2.0, 0.5])
    got = onnxgrad.gradients(model, {"x": x}, wrt=["x"])
    np.testing.assert_allclose(got["x"], 2 * x + 1)


def test_one_gradient_value_shared_by_two_inputs():
    # d(Relu(a + b))/da and /db are the same value: both outputs must name it validly.
    model = make_model(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        [("a", np.float64, [3]), ("b", np.float64, [3])],
        [("y", np.float64, [3])],
    )
    a, b = np.array([1.0, -2.0, 0.5]), np.array([0.5, 0.5, -1.0])
    got = onnxgrad.gradients(model, {"a": a, "b": b}, wrt=["a", "b"])
    np.testing.assert_array_equal(got["a"], (a + b > 0).astype(float))
    np.testing.assert_array_equal(got["b"], got["a"])


def test_tied_initializers_get_the_sum():
    # One weight used by two nodes directly and through an Identity (as TorchScript export ties).
    w = rng().standard_normal((3, 3))
    model = make_model(
        [
            helper.make_node("Identity", ["W"], ["W_tied"]),
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("MatMul", ["h", "W_tied"], ["y"]),
        ],
        [("x", np.float64, [2, 3])],
        [("y", np.float64, [2, 3])],
        {"W": w},
    )
    x = rng().standard_normal((2, 3))
    got = onnxgrad.gradients(model, {"x": x})
    h = x @ w
    dy = np.ones((2, 3))
    np.testing.assert_allclose(got["W"], x.T @ (dy @ w.T) + h.T @ dy, rtol=1e-12)


def test_unused_trainable_gets_zero_gradient_of_its_shape():
    model = make_model(
        [helper.make_node("Mul", ["x", "a"], ["y"])],
        [("x", np.float32, ["N", 2])],
        [("y", np.float32, ["N", 2])],
        {"a": np.ones(2, np.float32), "unused": np.ones((4, 5), np.float32)},
    )
    got = onnxgrad.gradients(model, {"x": np.ones((3, 2), np.float32)})
    assert got["unused"].shape == (4, 5) and got["unused"].dtype == np.float32
    assert not got["unused"].any()
    np.testing.assert_allclose(got["a"], [3.0, 3.0])


def test_outputs_without_a_gradient_count_as_zero():
    model = make_model(
        [helper.make_node("Mul", ["x", "a"], ["y1"]), helper.make_node("Mul", ["x", "b"], ["y2"])],
        [("x", np.float64, [2])],
        [("y1", np.float64, [2]), ("y2", np.float64, [2])],
        {"a": np.array([2.0, 3.0]), "b": np.array([5.0, 7.0])},
    )
    x = np.array([1.0, 2.0])
    fb = onnxgrad.ForwardBackward(model)
    grads = fb.forward({"x": x}).backward({"y1": np.ones(2)})
    np.testing.assert_allclose(grads["a"], x)
    np.testing.assert_allclose(grads["b"], 0.0)
    # outputs= restricts which outputs take a gradient at all
    graphs = onnxgrad.build_gradient(model, outputs=["y2"])
    assert list(graphs.grad_inputs) == ["y2"]


def test_integer_and_shape_paths_stop_the_gradient():
    # Reshape's shape comes from Shape(x) (int64): no gradient flows there, and none is needed.
    model = make_model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("Reshape", ["e", "s"], ["y"]),
        ],
        [("x", np.float64, ["N", 3])],
        [("y", np.float64, ["N", 3])],
    )
    x = rng().standard_normal((2, 3))
    got = onnxgrad.gradients(model, {"x": x}, wrt=["x"])
    np.testing.assert_allclose(got["x"], np.exp(x))


def test_missing_rule_names_node_op_domain_opset_and_path():
    model = make_model(
        [
            helper.make_node("Exp", ["x"], ["e"], name="exp"),
            helper.make_node("Foo", ["e"], ["f"], name="mystery", domain="my.domain"),
            helper.make_node("Tanh", ["f"], ["y"], name="tanh"),
        ],
        [("x", np.float32, [2])],
        [("y", np.float32, [2])],
    )
    model.opset_import.append(helper.make_opsetid("my.domain", 3))
    with pytest.raises(GradientNotImplementedError) as err:
        onnxgrad.build_gradient(model, inputs_requiring_grad=["x"])
    msg = str(err.value)
    assert "'mystery'" in msg and "'Foo'" in msg and "'my.domain'" in msg and "opset 3" in msg
    assert "mystery (Foo) -> tanh (Tanh) -> output 'y'" in msg


def test_bad_arguments_raise_input_errors():
    model = mlp()
    with pytest.raises(InputError, match="'nope' is not an initializer"):
        onnxgrad.build_gradient(model, trainable=["nope"])
    with pytest.raises(InputError, match="'W1' is not an input"):
        onnxgrad.build_gradient(model, inputs_requiring_grad=["W1"])
    with pytest.raises(InputError, match="'zz' is not an output"):
        onnxgrad.build_gradient(model, outputs=["zz"])
    ints = make_model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [6])],
        {"shape": np.array([6], np.int64)},
    )
    with pytest.raises(InputError, match="only floating-point initializers can be trained"):
        onnxgrad.build_gradient(ints, trainable=["shape"])
    assert onnxgrad.build_gradient(ints).trainable == []


def test_malformed_models_raise_model_errors(tmp_path):
    with pytest.raises(ModelError, match="not a valid ONNX file"):
        onnxgrad.build_gradient(b"\x08\x07garbage-bytes\xff\xff")
    with pytest.raises(ModelError, match="does not exist"):
        onnxgrad.build_gradient(str(tmp_path / "missing.onnx"))
    path = tmp_path / "truncated.onnx"
    path.write_bytes(mlp().SerializeToString()[:50])
    with pytest.raises(ModelError):
        onnxgrad.build_gradient(str(path))


def test_cycle_and_undefined_value_are_model_errors():
    cyc = make_model(
        [helper.make_node("Exp", ["b"], ["a"]), helper.make_node("Exp", ["a"], ["b"])],
        [("x", np.float32, [2])],
        [("a", np.float32, [2])],
    )
    with pytest.raises(ModelError):
        onnxgrad.build_gradient(cyc, inputs_requiring_grad=["x"])


def test_unsorted_graph_is_accepted():
    model = mlp()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    x = rng().standard_normal((2, 4))
    got = onnxgrad.gradients(model, {"x": x}, wrt=["W1"])
    want = numpy_mlp_grads(mlp(), x, np.ones((2, 3)))
    np.testing.assert_allclose(got["W1"], want["W1"], rtol=1e-10)


def test_symbolic_broadcast_is_undone_at_run_time():
    # b has a symbolic dim that may or may not broadcast: decided when the graph runs.
    model = make_model(
        [helper.make_node("Mul", ["a", "b"], ["y"])],
        [("a", np.float64, ["N", "M"]), ("b", np.float64, ["K", "M"])],
        [("y", np.float64, ["N", "M"])],
    )
    a = rng().standard_normal((4, 3))
    for b in (rng().standard_normal((1, 3)), rng().standard_normal((4, 3))):
        res = check_gradients(model, {"a": a, "b": b}, wrt=["a", "b"])
        assert res.ok, res.report()
        assert res.analytic["b"].shape == b.shape


@pytest.mark.parametrize(
    ("shape", "bias", "by_matmul"),
    [
        (["N", "S", 5], [5], True),  # unknown leading size: a matrix-vector product
        (["N", 3, 5], [3, 5], True),  # more than one kept axis
        ([64, 80, 5], [5], True),  # 25600 elements
        ([2, 3, 5], [5], False),  # small: one ReduceSum
    ],
    ids=["symbolic", "two-kept-axes", "large-static", "small-static"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_gradient_sums_leading_axes(shape, bias, by_matmul, dtype):
    """The gradient of a broadcast bias sums dY over the leading axes, as ones @ dY when it pays."""
    model = make_model(
        [helper.make_node("Add", ["x", "b"], ["y"])],
        [("x", dtype, shape), ("b", dtype, bias)],
        [("y", dtype, shape)],
    )
    graphs = onnxgrad.build_gradient(model, inputs_requiring_grad=["b"])
    ops = [n.op_type for n in graphs.backward.graph.node]
    assert ("MatMul" in ops) == by_matmul and ("ReduceSum" in ops) != by_matmul
    dims = [d if isinstance(d, int) else {"N": 6, "S": 7}[d] for d in shape]
    x, b, dy = (rng().standard_normal(d).astype(dtype) for d in (dims, bias, dims))
    res = onnxgrad.gradients(model, {"x": x, "b": b}, {"y": dy}, wrt=["b"])
    want = dy.astype(np.float64).reshape(-1, *bias).sum(axis=0)
    # float32: sums of up to 42 terms of magnitude 1 that cancel to any size: a bound relative to
    # the largest sum, not to each
    assert_allclose_scaled(res["b"], want, rtol=1e-5 if dtype == np.float32 else 1e-12)
    assert res["b"].dtype == dtype and res["b"].shape == tuple(bias)


def test_save_writes_both_graphs(tmp_path):
    graphs = onnxgrad.build_gradient(mlp())
    paths = graphs.save(tmp_path / "new")  # the folder is created
    assert paths == [str(tmp_path / "new" / "forward.onnx"), str(tmp_path / "new" / "backward.onnx")]
    for p, proto in zip(paths, (graphs.forward, graphs.backward)):
        loaded = onnx.load(p)
        onnx.checker.check_model(loaded, full_check=True)
        assert loaded == proto  # exactly what was built


def test_supported_ops_lists_first_wave():
    ops = onnxgrad.supported_ops()
    for op in ["Add", "Mul", "MatMul", "Gemm", "Relu", "Sigmoid", "Tanh", "Exp"]:
        assert ops[op] in ("rule", "formula")


def test_views_of_saved_or_fed_values_are_made_again_not_saved():
    """x -> Reshape (run-time shape) -> Reshape (fixed shape) -> MatMul W: the backward reads x
    itself, fed by the caller, and reshapes it again; Flatten of a saved value likewise."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Reshape", ["x", "s"], ["x1"]),
        helper.make_node("Reshape", ["x1", "rows"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),  # saved: its gradient reads it
        helper.make_node("Flatten", ["t"], ["f"], axis=1),
        helper.make_node("MatMul", ["f", "V"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("x", np.float64, ["N", 2, 3])],
        [("y", np.float64, ["N", 2])],
        {"rows": np.array([-1, 3]), "W": rng().standard_normal((3, 4)), "V": rng().standard_normal((4, 2))},
    )
    graphs = onnxgrad.build_gradient(model, inputs_requiring_grad=["x"])
    assert "x" in graphs.saved and "t" in graphs.saved
    assert not {"x1", "x2", "f"} & set(graphs.saved)
    res = check_gradients(model, {"x": rng().standard_normal((2, 2, 3))}, wrt=["x", "W", "V"])
    assert res.ok, res.report()


def test_bias_gradients_share_one_ones_vector():
    """Both biases of the MLP (batch N) are summed by ones(N) @ dY: one ones vector for both."""
    model = mlp()
    ops = [n.op_type for n in onnxgrad.build_gradient(model).backward.graph.node]
    assert ops.count("ConstantOfShape") == 1 and ops.count("MatMul") == 2 and "ReduceSum" not in ops
    x = rng().standard_normal((3, 4))
    got = onnxgrad.gradients(model, {"x": x}, wrt=["b1", "b2"])
    want = numpy_mlp_grads(model, x, np.ones((3, 3)))
    for name in ("b1", "b2"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, err_msg=name)


@pytest.mark.parametrize(("opset", "ir"), [(13, 8), (18, 8), (21, 10), (23, 11)])
def test_ir_version_follows_the_opset(opset, ir):
    from onnxgrad.model.graph import ir_version_for

    assert ir_version_for([helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]) == ir
    assert ir_version_for([helper.make_opsetid("ai.onnx", opset)]) == ir
