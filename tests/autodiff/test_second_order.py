"""Second-order gradients: the backward graph is differentiated again (grad of grad).

For a model ``f`` we compose its forward and backward graphs into one model (``compose``) whose
inputs are ``f``'s inputs and the output cotangent, whose initializers are ``f``'s weights, and whose
outputs are ``f``'s outputs and gradients; ``check_gradients`` then compares onnxgrad's gradient of
that model (random cotangents on every output, so the second-order terms of every gradient) with
float64 finite differences.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.autodiff.compose import compose
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import check_gradients, run_gradients, run_model
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)

D = TensorProto.DOUBLE


def make(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, np.ndarray],
    weights: dict[str, np.ndarray],
    out_shape: list[int] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    """A float64 model reading ``inputs`` and initializers ``weights``, with one output ``y``."""
    graph = helper.make_graph(
        nodes,
        "f",
        [helper.make_tensor_value_info(k, D, list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info("y", D, out_shape)],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


def second_order(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], backend: str = "onnxruntime", **tol: float
) -> None:
    """Check the gradient of (outputs, first-order gradients) of ``model`` against finite differences."""
    inits = [i.name for i in model.graph.initializer if i.data_type == D]
    graphs = build_gradient(model, trainable=inits, inputs_requiring_grad=list(feeds))
    both = compose(graphs)
    cot = {graphs.grad_inputs["y"]: rnd(*run_model(model, backend)(feeds)["y"].shape)}
    # the composed model computes the same gradients as the two graphs
    _, first = run_gradients(graphs, feeds, {"y": cot[graphs.grad_inputs["y"]]}, backend=backend)
    out = run_model(both, backend)({**feeds, **cot})
    for w, name in graphs.grad_outputs.items():
        np.testing.assert_allclose(out[name], first[w], rtol=1e-12, atol=1e-12)
    res = check_gradients(both, {**feeds, **cot}, wrt=[*feeds, *cot, *inits], backend=backend, **tol)
    assert res.ok, res.report()


def unary_chain() -> tuple[onnx.ModelProto, dict]:
    """``y = tanh(x) * sigmoid(w) / (exp(x) + 2) + |x|^p``: unary ops, Mul, Div, Pow."""
    nodes = [
        helper.make_node("Tanh", ["x"], ["t"]),
        helper.make_node("Sigmoid", ["w"], ["s"]),
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Add", ["e", "two"], ["e2"]),
        helper.make_node("Mul", ["t", "s"], ["ts"]),
        helper.make_node("Div", ["ts", "e2"], ["q"]),
        helper.make_node("Abs", ["x"], ["ax"]),
        helper.make_node("Pow", ["ax", "p"], ["pw"]),
        helper.make_node("Add", ["q", "pw"], ["y"]),
    ]
    x = rnd(3, 4) + 0.1
    weights = {"w": rnd(4), "two": np.float64(2.0), "p": np.float64(2.5)}
    return make(nodes, {"x": x}, weights, [3, 4]), {"x": x}


def matmul_gemm() -> tuple[onnx.ModelProto, dict]:
    """``y = tanh(Gemm(x, W, b)) @ V``: products need a nonlinearity for nonzero second derivatives."""
    nodes = [
        helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1, alpha=0.7),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("MatMul", ["t", "V"], ["y"]),
    ]
    x = rnd(2, 3)
    return make(nodes, {"x": x}, {"W": rnd(4, 3), "b": rnd(4), "V": rnd(4, 2)}, [2, 2]), {"x": x}


def reductions(op: str) -> tuple[onnx.ModelProto, dict]:
    """``y = Reduce(x^3 * w, axes=[1]) ^ 2``."""
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["x2"]),
        helper.make_node("Mul", ["x2", "x"], ["x3"]),
        helper.make_node("Mul", ["x3", "w"], ["z"]),
        helper.make_node(op, ["z", "axes"], ["r"], keepdims=0),
        helper.make_node("Mul", ["r", "r"], ["y"]),
    ]
    x = rnd(3, 4)
    return make(nodes, {"x": x}, {"w": rnd(4), "axes": np.int64([1])}, [3]), {"x": x}


def softmax(op: str) -> tuple[onnx.ModelProto, dict]:
    """``y = Softmax(x * w) ^ 2`` (squared: its gradient then depends on the cotangent nonlinearly)."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["z"]),
        helper.make_node(op, ["z"], ["s"], axis=-1),
        helper.make_node("Mul", ["s", "s"], ["y"]),
    ]
    x = rnd(2, 5)
    return make(nodes, {"x": x}, {"w": rnd(5)}, [2, 5]), {"x": x}


def layer_norm() -> tuple[onnx.ModelProto, dict]:
    """LayerNormalization (its Mean and InvStdDev outputs are float32: neither onnxruntime nor
    onnx.reference has a float64 ``stash_type``, so this case takes a larger finite-difference step)."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1, epsilon=1e-3),
        helper.make_node("Tanh", ["n"], ["y"]),
    ]
    x = rnd(2, 3, 4)
    return make(nodes, {"x": x}, {"scale": rnd(4), "bias": rnd(4)}, [2, 3, 4]), {"x": x}


def batch_norm() -> tuple[onnx.ModelProto, dict]:
    """Inference BatchNormalization; the running mean and variance are trainable too."""
    nodes = [
        helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["n"], epsilon=1e-3),
        helper.make_node("Tanh", ["n"], ["y"]),
    ]
    x = rnd(2, 3, 2, 2)
    weights = {"scale": rnd(3), "bias": rnd(3), "mean": rnd(3), "var": rng().uniform(0.5, 1.5, 3)}
    return make(nodes, {"x": x}, weights, [2, 3, 2, 2]), {"x": x}


def conv() -> tuple[onnx.ModelProto, dict]:
    nodes = [
        helper.make_node("Conv", ["x", "W", "b"], ["c"], pads=[1, 0, 1, 0], strides=[1, 2]),
        helper.make_node("Tanh", ["c"], ["y"]),
    ]
    x = rnd(1, 2, 3, 4)
    return make(nodes, {"x": x}, {"W": rnd(2, 2, 2, 2), "b": rnd(2)}, [1, 2, 4, 2]), {"x": x}


CASES = {
    "elementwise": (unary_chain, "onnxruntime"),
    "matmul_gemm": (matmul_gemm, "onnxruntime"),
    "reduce_sum": (lambda: reductions("ReduceSum"), "onnxruntime"),
    "reduce_mean": (lambda: reductions("ReduceMean"), "onnxruntime"),
    "reduce_max": (lambda: reductions("ReduceMax"), "onnxruntime"),
    "softmax": (lambda: softmax("Softmax"), "onnxruntime"),
    "log_softmax": (lambda: softmax("LogSoftmax"), "onnxruntime"),
    "layer_norm": (layer_norm, "onnxruntime"),
    "batch_norm": (batch_norm, "onnxruntime"),
    "conv": (conv, "reference"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_second_order(case: str) -> None:
    factory, backend = CASES[case]
    model, feeds = factory()
    tol = {"eps": 1e-3, "rtol": 1e-3, "atol": 1e-4} if case == "layer_norm" else {"rtol": 1e-5, "atol": 1e-6}
    second_order(model, feeds, backend=backend, **tol)


def test_hessian_vector_product() -> None:
    """``d/dx <grad f(x), v>`` is ``H v``: for ``f = sum(x^3)`` that is ``6 x v``."""
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["x2"]),
        helper.make_node("Mul", ["x2", "x"], ["x3"]),
        helper.make_node("ReduceSum", ["x3"], ["y"], keepdims=0),
    ]
    x = rnd(5)
    graphs = build_gradient(make(nodes, {"x": x}, {}, []), inputs_requiring_grad=["x"])
    both = compose(graphs)
    gx = graphs.grad_outputs["x"]
    hv_graphs = build_gradient(both, inputs_requiring_grad=["x"], outputs=[gx])
    v = rnd(5)
    _, hv = run_gradients(hv_graphs, {"x": x, graphs.grad_inputs["y"]: np.array(1.0)}, {gx: v})
    np.testing.assert_allclose(hv["x"], 6 * x * v, rtol=1e-12)
