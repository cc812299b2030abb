"""The default trainable set (what is left out and why) and tied weights (autodiff/params.py)."""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.params import TIE_MIN_SIZE, parameter_reasons, select_parameters
from onnxgrad.errors import InputError
from onnxgrad.testing import assert_allclose_scaled
from tests.autodiff.random_data import reseed, rng  # one generator per test (conftest.py)
from tests.models import make_model

F32 = np.float32


def rnd(*shape: int) -> np.ndarray:
    return rng().standard_normal(shape).astype(F32)


def reasons(nodes, inits, x_shape=("N", 8), y_shape=None):
    model = make_model(nodes, [("x", F32, list(x_shape))], [("y", F32, y_shape)], inits)
    return parameter_reasons(model)


# ---- one rule each ---------------------------------------------------------------------------------
def test_pow_exponent_is_left_out_and_the_base_kept():
    got = reasons(
        [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Pow", ["h", "p"], ["y"])],
        {"w": rnd(8), "p": np.array(3.0, F32)},
    )
    assert got == {"w": None, "p": "Pow exponent"}


def test_clip_bounds_and_integer_shapes():
    got = reasons(
        [
            helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
            helper.make_node("Reshape", ["c", "shape"], ["r"]),
            helper.make_node("ReduceSum", ["r", "axes"], ["y"]),
            helper.make_node("Identity", ["ids"], ["unused"]),
        ],
        {
            "lo": np.array(-1.0, F32),
            "hi": np.array(1.0, F32),
            "shape": np.array([-1, 4], np.int64),
            "axes": np.array([1], np.int64),
            "ids": np.array([1, 2], np.int32),
        },
    )
    assert got == {
        "lo": "Clip bound",
        "hi": "Clip bound",
        "shape": "Reshape shape (int64)",
        "axes": "axes (int64)",
        "ids": "integer (int32)",
    }


def test_epsilon_added_to_a_variance():
    # RMSNorm as the exporters write it: x / sqrt(mean(x ** 2) + eps) * weight; the epsilon has
    # shape [1] against a reduced last dim of 1, so only its usage tells it from a bias
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["v"]),
        helper.make_node("Sqrt", ["v"], ["s"]),
        helper.make_node("Div", ["x", "s"], ["n"]),
        helper.make_node("Mul", ["n", "weight"], ["y"]),
    ]
    got = reasons(
        nodes,
        {
            "two": np.array(2.0, F32),
            "axes": np.array([-1], np.int64),
            "eps": np.array([1e-6], F32),
            "weight": np.ones(8, F32),  # all ones at initialization: still a parameter
        },
    )
    assert got == {"two": "Pow exponent", "axes": "axes (int64)", "eps": "epsilon", "weight": None}


def test_masks():
    causal = np.triu(np.full((8, 8), -np.inf, F32), 1)
    keep = np.tril(np.ones((8, 8), F32))
    low = np.where(keep > 0, 0.0, np.finfo(F32).min).astype(F32)
    got = reasons(
        [
            helper.make_node("Add", ["x", "causal"], ["a"]),
            helper.make_node("Add", ["a", "low"], ["b"]),
            helper.make_node("Mul", ["b", "keep"], ["c"]),
            helper.make_node("Add", ["c", "bias"], ["y"]),
        ],
        {"causal": causal, "low": low, "keep": keep, "bias": rnd(8, 8)},
        x_shape=(8, 8),
    )
    assert got == {"causal": "additive mask", "low": "additive mask", "keep": "0/1 mask", "bias": None}


def test_scalar_constants_and_one_output_bias():
    # a 0-d value, or one value spread along a last dim of 8, is a constant; one value added to a
    # last dim of 1 is the bias of a one-output linear layer
    nodes = [
        helper.make_node("Mul", ["x", "half"], ["a"]),
        helper.make_node("Mul", ["a", "scale"], ["b"]),
        helper.make_node("MatMul", ["b", "w"], ["m"]),
        helper.make_node("Add", ["m", "b1"], ["y"]),
    ]
    got = reasons(
        nodes,
        {"half": np.array(0.5, F32), "scale": np.array([0.3], F32), "w": rnd(8, 1), "b1": rnd(1)},
        y_shape=["N", 1],
    )
    assert got == {"half": "scalar constant", "scale": "scalar constant", "w": None, "b1": None}


def test_rotary_tables_and_usage_through_casts_and_views():
    # RoPE's cos and sin tables as the exporters fold them, [1, 1, T, D]: position 0 is cos 0 = 1
    # and sin 0 = 0; a scalar read through Identity (a torch "lifted tensor") then Where
    positions = np.arange(8)[:, None] * (1.0 / 10000 ** (np.arange(4) / 4))[None, :]
    angles = np.concatenate([positions, positions], axis=-1)[None, None].astype(F32)
    nodes = [
        helper.make_node("Mul", ["x", "cos"], ["a"]),
        helper.make_node("Mul", ["x", "sin"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Mul", ["c", "gain"], ["d"]),
        helper.make_node("Identity", ["zero"], ["z"]),
        helper.make_node("IsNaN", ["d"], ["nan"]),
        helper.make_node("Where", ["nan", "z", "d"], ["e"]),
        helper.make_node("Cast", ["w64"], ["w"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("Reshape", ["e", "shape"], ["f"]),
        helper.make_node("MatMul", ["f", "wt"], ["y"]),
    ]
    gain = np.tanh(rnd(1, 1, 8, 8))  # values in [-1, 1] too, but no constant first row: a weight
    inits = {
        "cos": np.cos(angles),
        "sin": np.sin(angles),
        "gain": gain,
        "zero": np.array(0.0, F32),
        "w64": rnd(8, 8).astype(np.float64),
        "shape": np.array([-1, 8], np.int64),
        "mask": np.ones(3, bool),
    }
    got = reasons(nodes, inits, x_shape=(2, 1, 8, 8))
    assert got == {
        "cos": "rotary position table",
        "sin": "rotary position table",
        "gain": None,
        "zero": "scalar constant",
        "w64": None,
        "shape": "Reshape shape (int64)",
        "mask": "not floating-point (bool)",
    }


def test_batch_norm_running_statistics_and_dropout_ratio():
    nodes = [
        helper.make_node("BatchNormalization", ["x", "s", "b", "mean", "var"], ["n"]),
        helper.make_node("Dropout", ["n", "ratio"], ["y"]),
    ]
    inits = {"s": rnd(3), "b": rnd(3), "mean": rnd(3), "var": np.ones(3, F32), "ratio": np.array(0.1, F32)}
    model = make_model(nodes, [("x", F32, ["N", 3, 4])], [("y", F32, None)], inits)
    assert parameter_reasons(model) == {
        "s": None,
        "b": None,
        "mean": "BatchNormalization running mean",
        "var": "BatchNormalization running variance",
        "ratio": "Dropout ratio",
    }


def test_one_read_as_a_weight_makes_a_parameter():
    # the TorchScript exporter aliases equal initializers: a BatchNormalization's running variance
    # (ones) read through Identity of its weight (ones at initialization)
    nodes = [
        helper.make_node("Identity", ["s"], ["var"]),
        helper.make_node("BatchNormalization", ["x", "s", "b", "mean", "var"], ["y"]),
    ]
    inits = {"s": np.ones(3, F32), "b": np.zeros(3, F32), "mean": np.zeros(3, F32)}
    model = make_model(nodes, [("x", F32, ["N", 3, 4])], [("y", F32, None)], inits)
    assert parameter_reasons(model) == {"s": None, "b": None, "mean": "BatchNormalization running mean"}


def test_torch_buffers_marked_by_the_exporter():
    model = make_model(
        [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "buf"], ["y"])],
        [("x", F32, ["N", 8])],
        [("y", F32, None)],
        {"w": rnd(8), "buf": rnd(8)},
    )
    entry = model.graph.initializer[1].metadata_props.add()  # as torch.onnx.export(dynamo=True) writes it
    entry.key, entry.value = "pkg.torch.export.graph_signature.InputSpec.kind", "BUFFER"
    assert parameter_reasons(model) == {"w": None, "buf": "torch buffer"}


def test_constants_get_no_gradient_by_default_and_can_be_named():
    # x ** p with x < 0: the gradient with respect to the exponent is NaN (log of a negative)
    model = make_model(
        [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Pow", ["h", "p"], ["y"])],
        [("x", F32, ["N", 4])],
        [("y", F32, ["N", 4])],
        {"w": np.array([1.0, -1.0, 2.0, -2.0], F32), "p": np.array(2.0, F32)},
    )
    feeds = {"x": np.ones((3, 4), F32)}
    got = onnxgrad.gradients(model, feeds)
    assert set(got) == {"w"}
    np.testing.assert_allclose(got["w"], 3 * 2 * np.array([1.0, -1.0, 2.0, -2.0]))
    assert onnxgrad.build_gradient(model).trainable == ["w"]
    assert onnxgrad.ForwardBackward(model).graphs.trainable == ["w"]
    named = onnxgrad.gradients(model, feeds, wrt=["w", "p"])  # explicit: any float initializer
    assert np.isnan(named["p"])
    assert onnxgrad.build_gradient(model, trainable=["p"]).trainable == ["p"]
    with pytest.raises(InputError, match="trainable name 'nope' is not an initializer of the model"):
        onnxgrad.build_gradient(model, trainable=["nope"])


# ---- tied weights ----------------------------------------------------------------------------------
D_IN, D_OUT = 16, 32  # 512 values: enough to be tied


def tied_model(w: np.ndarray, w_t: np.ndarray, extra: dict | None = None) -> onnx.ModelProto:
    """y = x @ W + Gemm(x, W_T, transB=1): one parameter, stored as W and as its transpose."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("Gemm", ["x", "W_T"], ["b"], transB=1),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    return make_model(
        nodes, [("x", F32, ["N", D_IN])], [("y", F32, ["N", D_OUT])], {"W": w, "W_T": w_t, **(extra or {})}
    )


def torch_grad(w: np.ndarray, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    W = torch.tensor(w, requires_grad=True)
    X = torch.tensor(x)
    y = X @ W + X @ W.T.T  # the same parameter used twice: torch sums both gradients
    y.backward(torch.tensor(dy))
    return W.grad.numpy()


def test_transposed_copy_is_one_parameter():
    w = rnd(D_IN, D_OUT)
    model = tied_model(w, np.ascontiguousarray(w.T))
    x, dy = rnd(5, D_IN), rnd(5, D_OUT)
    graphs = onnxgrad.build_gradient(model)
    assert graphs.trainable == ["W"]
    assert [(t.name, t.source, t.how) for t in graphs.ties] == [("W_T", "W", "transpose [1, 0]")]
    fb = onnxgrad.ForwardBackward(model)
    grads = fb.forward({"x": x}).backward({"y": dy})
    assert list(grads) == ["W"] and list(fb.parameters) == ["W"]
    assert_allclose_scaled(grads["W"], torch_grad(w, x, dy), rtol=1e-5)
    # to_onnx gives back both initializers, the copy computed from the current parameter
    fb.set_parameters({"W": 2 * w})
    out = fb.to_onnx()
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    np.testing.assert_array_equal(inits["W_T"], 2 * w.T)
    assert not any(n.name.startswith("onnxgrad_tie_") for n in out.graph.node)
    assert len(out.graph.node) == len(model.graph.node)


def test_tie_weights_false_trains_them_apart():
    w = rnd(D_IN, D_OUT)
    model = tied_model(w, np.ascontiguousarray(w.T))
    x, dy = rnd(5, D_IN), rnd(5, D_OUT)
    fb = onnxgrad.ForwardBackward(model, tie_weights=False)
    grads = fb.forward({"x": x}).backward({"y": dy})
    assert list(grads) == ["W", "W_T"]
    assert_allclose_scaled(grads["W"], x.T @ dy, rtol=1e-5)
    assert_allclose_scaled(grads["W_T"], dy.T @ x, rtol=1e-5)
    assert_allclose_scaled(grads["W"] + grads["W_T"].T, torch_grad(w, x, dy), rtol=1e-5)
    assert onnxgrad.build_gradient(model, tie_weights=False).trainable == ["W", "W_T"]


def test_tied_weights_in_onnx_module():
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    w = rnd(D_IN, D_OUT)
    model = tied_model(w, np.ascontiguousarray(w.T))
    x, dy = rnd(5, D_IN), rnd(5, D_OUT)
    module = OnnxModule(model)
    assert [n for n, _ in module.named_parameters()] == ["W"]
    assert [(t.name, t.source) for t in module.tied] == [("W_T", "W")]
    module(torch.tensor(x)).backward(torch.tensor(dy))
    assert_allclose_scaled(module.W.grad.numpy(), torch_grad(w, x, dy), rtol=1e-5)
    with torch.no_grad():
        module.W.mul_(3)
    inits = {i.name: numpy_helper.to_array(i) for i in module.to_onnx().graph.initializer}
    np.testing.assert_array_equal(inits["W_T"], 3 * w.T)
    again = pickle.loads(pickle.dumps(module))
    np.testing.assert_array_equal(numpy_helper.to_array(again.to_onnx().graph.initializer[-1]), 3 * w.T)
    assert "ONNX 'W_T' <- transpose [1, 0] of 'W' (tied)" in repr(module)
    apart = OnnxModule(model, tie_weights=False)
    assert [n for n, _ in apart.named_parameters()] == ["W", "W_T"]


def test_naming_either_copy_trains_the_group():
    w = rnd(D_IN, D_OUT)
    model = tied_model(w, np.ascontiguousarray(w.T))
    assert onnxgrad.build_gradient(model, trainable=["W_T"]).trainable == ["W_T"]  # W computed from it
    assert onnxgrad.build_gradient(model, trainable=["W", "W_T"]).trainable == ["W"]
    # named initializers get their own gradients in gradients()
    got = onnxgrad.gradients(model, {"x": rnd(2, D_IN)}, wrt=["W", "W_T"])
    assert set(got) == {"W", "W_T"}


def test_cast_copy_is_one_parameter():
    # a float16 copy of a float32 weight (what a mixed-precision export stores): computed from the
    # float32 one, never the other way (the float16 values lose bits)
    w = rnd(D_IN, D_OUT)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("Cast", ["W16"], ["w16"], to=onnx.TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w16"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    inits = {"W16": w.astype(np.float16), "W": w}
    model = make_model(nodes, [("x", F32, ["N", D_IN])], [("y", F32, None)], inits)
    selection = select_parameters(model)
    assert selection.trainable == ["W"]
    assert [(t.name, t.source, t.how) for t in selection.ties] == [("W16", "W", "cast to float16")]


def test_no_ties_for_small_or_constant_tensors():
    # zero biases and ones weights (LayerNorm at initialization) are equal by accident, and so may be
    # small tensors
    n = TIE_MIN_SIZE
    nodes = [
        helper.make_node("Add", ["x", "zeros_a"], ["a"]),
        helper.make_node("Add", ["a", "zeros_b"], ["b"]),
        helper.make_node("Mul", ["b", "ones_a"], ["c"]),
        helper.make_node("Mul", ["c", "ones_b"], ["d"]),
        helper.make_node("Add", ["d", "big_a"], ["e"]),
        helper.make_node("Add", ["e", "big_b"], ["y"]),
        helper.make_node("Add", ["x2", "small_a"], ["f"]),
        helper.make_node("Add", ["f", "small_b"], ["y2"]),
    ]
    small, big = rnd(n - 1), rnd(n)
    inits = {
        "zeros_a": np.zeros(n, F32),
        "zeros_b": np.zeros(n, F32),
        "ones_a": np.ones(n, F32),
        "ones_b": np.ones(n, F32),
        "big_a": big,
        "big_b": big.copy(),
        "small_a": small,
        "small_b": small.copy(),
    }
    model = make_model(
        nodes, [("x", F32, ["N", n]), ("x2", F32, ["N", n - 1])], [("y", F32, None), ("y2", F32, None)], inits
    )
    selection = select_parameters(model)
    assert [(t.name, t.source, t.how) for t in selection.ties] == [("big_b", "big_a", "identical")]
    assert "big_b" not in selection.trainable and "small_b" in selection.trainable


def test_graph_inputs_and_left_out_initializers_are_not_tied():
    w = rnd(D_IN, D_OUT)
    model = tied_model(w, np.ascontiguousarray(w.T))
    model.graph.input.append(helper.make_tensor_value_info("W_T", onnx.TensorProto.FLOAT, [D_OUT, D_IN]))
    assert select_parameters(model).ties == []  # W_T may be fed at run time


# ---- what torch knows and ONNX forgets -------------------------------------------------------------
def embedding_model(fx_node: str | None) -> onnx.ModelProto:
    model = make_model(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)],
        [("ids", np.int64, ["N"])],
        [("y", F32, ["N", 4])],
        {"table": rnd(6, 4)},
    )
    if fx_node is not None:  # what torch.onnx.export(dynamo=True) writes on the node
        entry = model.graph.node[0].metadata_props.add()
        entry.key, entry.value = "pkg.torch.onnx.fx_node", fx_node
    return model


def test_embedding_padding_row_gets_no_gradient():
    ids = np.array([0, 1, 1, 3], np.int64)
    fx = (
        "%embedding : [num_users=1] = call_function[target=torch.ops.aten.embedding.default]"
        "(args = (%p_emb_weight, %ids, {}), kwargs = {{}})"
    )
    expected = np.zeros((6, 4), F32)
    np.add.at(expected, ids, 1.0)
    for node, zero_row in ((fx.format(1), 1), (fx.format(-1), None), (None, None)):
        got = onnxgrad.gradients(embedding_model(node), {"ids": ids})["table"]
        want = expected.copy()
        if zero_row is not None:
            want[zero_row] = 0
        np.testing.assert_array_equal(got, want)


def test_transposes_of_any_rank_either_way():
    a = rnd(4, 8, 16)
    b = np.ascontiguousarray(a.transpose(1, 2, 0))
    nodes = [
        helper.make_node("Mul", ["x", "a"], ["p"]),
        helper.make_node("Transpose", ["b"], ["bt"], perm=[2, 0, 1]),
        helper.make_node("Mul", ["p", "bt"], ["y"]),
    ]
    model = make_model(nodes, [("x", F32, [4, 8, 16])], [("y", F32, [4, 8, 16])], {"a": a, "b": b})
    for named, other, value in (("a", "b", b), ("b", "a", a)):
        selection = select_parameters(model, trainable=[named])
        assert selection.trainable == [named]
        (tie,) = selection.ties
        assert (tie.source, tie.name) == (named, other)
        source = {"a": a, "b": b}[named]
        np.testing.assert_array_equal(tie.compute(source), value)
    x = rnd(4, 8, 16)
    grads = onnxgrad.ForwardBackward(model).forward({"x": x}).backward()
    np.testing.assert_allclose(grads["a"], 2 * x * a, rtol=1e-5)  # y = x * a * a


# ---- broadcast copies (constant folding expands a parameter into a larger initializer) ------------
def broadcast_model(a: np.ndarray, b: np.ndarray, gather: bool) -> onnx.ModelProto:
    """y = x * B + A[ids] (``gather``) or x * B + A: the parameter A, and B folded from it."""
    use = (
        helper.make_node("Gather", ["A", "ids"], ["g"])
        if gather
        else helper.make_node("Identity", ["A"], ["g"])
    )
    nodes = [use, helper.make_node("Mul", ["x", "B"], ["m"]), helper.make_node("Add", ["m", "g"], ["y"])]
    inputs = [("x", F32, list(b.shape))] + ([("ids", np.int64, list(b.shape[:-1]))] if gather else [])
    return make_model(nodes, inputs, [("y", F32, list(b.shape))], {"A": a, "B": b})


reseed("test_params.py BROADCASTS")  # the cases below draw at import: from a generator of their own
BROADCASTS = {
    # BERT: token_type_embeddings row 0, repeated for every token of every sequence
    "row": (
        rnd(2, 32),
        lambda t: t[0].expand(2, 8, 32),
        "rows 0:1 then reshape [1, 1, 32] then expand to [2, 8, 32]",
    ),
    # BART: the position rows of the sequence, repeated over the batch
    "rows": (
        rnd(12, 32),
        lambda t: t[2:10].expand(2, 8, 32),
        "rows 2:10 then reshape [1, 8, 32] then expand to [2, 8, 32]",
    ),
    # ViT: cls_token (1x1x32), repeated over the batch
    "whole": (rnd(1, 1, 32), lambda t: t.expand(2, 1, 32), "expand to [2, 1, 32]"),
}


@pytest.mark.parametrize("form", list(BROADCASTS))
def test_broadcast_copy_is_one_parameter(form):
    torch = pytest.importorskip("torch")
    a, fold, how = BROADCASTS[form]
    b = fold(torch.tensor(a)).numpy().copy()
    gather = a.ndim == 2
    model = broadcast_model(a, b, gather)
    selection = select_parameters(model)
    assert [(t.name, t.source, t.how) for t in selection.ties] == [("B", "A", how)]
    assert selection.trainable == ["A"]
    x, dy = rnd(*b.shape), rnd(*b.shape)
    feeds = {"x": x}
    ids = rng().integers(0, a.shape[0], b.shape[:-1])
    if gather:
        feeds["ids"] = ids
    fb = onnxgrad.ForwardBackward(model)
    grads = fb.forward(feeds).backward({"y": dy})
    assert list(grads) == ["A"]
    # torch: the folded copy is computed from the parameter; its gradient sums over the copies
    A = torch.tensor(a, requires_grad=True)
    y = torch.tensor(x) * fold(A) + (A[torch.tensor(ids)] if gather else A)
    y.backward(torch.tensor(dy))
    assert_allclose_scaled(grads["A"], A.grad.numpy(), rtol=1e-5)
    # to_onnx writes the copy back, computed from the current parameter, and no tie node is left
    fb.set_parameters({"A": 2 * a})
    out = fb.to_onnx()
    got = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    np.testing.assert_array_equal(got["B"], 2 * b)
    assert not any(n.name.startswith("onnxgrad_tie_") for n in out.graph.node)
    assert list(onnxgrad.ForwardBackward(model, tie_weights=False).parameters) == ["A", "B"]


def test_no_broadcast_tie_by_accident():
    table = rnd(12, 32)
    block = np.broadcast_to(table[2:10], (2, 8, 32))
    few = np.tile(np.arange(8, dtype=F32), 4)  # a row of 8 distinct values
    with_few = np.concatenate([few[None], rnd(11, 32)])
    one_differs = block.copy()
    one_differs[1, 3, 5] += 1
    cases = {
        "few distinct values": (with_few, np.broadcast_to(with_few[0], (2, 8, 32))),
        "one copy differs": (table, one_differs),
        "not larger (a plain slice)": (table, table[2:10][None]),
        "another type": (table, block.astype(np.float64)),
        "all equal": (np.ones((12, 32), F32), np.ones((2, 8, 32), F32)),
    }
    for case, (a, b) in cases.items():
        model = broadcast_model(a, np.ascontiguousarray(b), gather=False)
        ties = select_parameters(model, trainable=["A", "B"]).ties
        if case == "another type":  # a broadcast still, of a core of its own type (see below)
            assert [(t.source, t.made) for t in ties] == [("B_core", True)], case
        else:
            assert ties == [], case
    # the same block, exact: tied (the cases above fail one condition each)
    assert len(select_parameters(broadcast_model(table, block.copy(), gather=False)).ties) == 1


def test_broadcast_of_a_parameter_the_exporter_folded_away():
    # ViT's dynamo export stores cls_token (1x1x32) only expanded over the batch, as 'B' (2x1x32):
    # its core becomes the parameter, B_core
    core = rnd(1, 1, 32)
    b = np.broadcast_to(core, (2, 1, 32)).copy()
    model = make_model(
        [helper.make_node("Mul", ["x", "B"], ["y"])],
        [("x", F32, [2, 1, 32])],
        [("y", F32, [2, 1, 32])],
        {"B": b},
    )
    fb = onnxgrad.ForwardBackward(model)
    assert list(fb.parameters) == ["B_core"]
    np.testing.assert_array_equal(fb.parameters["B_core"], core)
    x, dy = rnd(2, 1, 32), rnd(2, 1, 32)
    grads = fb.forward({"x": x}).backward({"y": dy})
    assert_allclose_scaled(grads["B_core"], (x * dy).sum(0, keepdims=True), rtol=1e-5)
    fb.set_parameters({"B_core": 3 * core})
    out = fb.to_onnx()
    got = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    assert list(got) == ["B"]
    np.testing.assert_array_equal(got["B"], 3 * b)


def test_made_core_with_dropout_in_the_model():
    # a model that follows the training flag builds its inference graphs again from the untied model
    core = rnd(1, 1, 32)
    b = np.broadcast_to(core, (2, 4, 32)).copy()
    nodes = [helper.make_node("Mul", ["x", "B"], ["m"]), helper.make_node("Dropout", ["m"], ["y"])]
    model = make_model(nodes, [("x", F32, [2, 4, 32])], [("y", F32, [2, 4, 32])], {"B": b})
    fb = onnxgrad.ForwardBackward(model)
    assert list(fb.parameters) == ["B_core"]
    fb.set_parameters({"B_core": 2 * core})
    got = {i.name: numpy_helper.to_array(i) for i in fb.to_onnx().graph.initializer}
    np.testing.assert_array_equal(got["B"], 2 * b)
    assert "B_core" not in got


def test_tie_candidates_are_pairs_whose_extremes_match():
    """Only pairs whose minimum and maximum agree (through a cast) are compared element by element:
    a transposed copy and a float16 copy are candidates, independent weights of one shape are not."""
    from onnxgrad.autodiff.ties import _candidate_pairs

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    arrays = {
        "W": w,
        "WT": w.T.copy(),
        "W16": w.astype(np.float16),
        **{f"other{k}": rng.standard_normal((6, 4)).astype(np.float32) for k in range(5)},
    }
    extremes = {n: (a.min(), a.max()) for n, a in arrays.items()}
    pairs = _candidate_pairs(list(arrays), extremes)
    # W16 -> W is no candidate: float16 extremes widened to float32 are not W's (the cast lost bits)
    assert pairs == [("W", "WT"), ("W", "W16"), ("WT", "W"), ("WT", "W16")]
